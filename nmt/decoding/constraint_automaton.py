"""Where a hypothesis stands with its sentence's constraint phrases, as tensors: an Aho-Corasick
automaton (Aho and Corasick 1975) per sentence, built once on the host and padded into one batch.

A hypothesis's state is a node of its sentence's trie of phrases (the longest suffix of its output
that begins a phrase) and how often it has written each phrase (capped at the times it is asked
for). A token follows the node's failure chain (the node, its longest proper suffix in the trie,
..., the root) to the first node with a child on that token, so a phrase is found wherever it
ends, also where it overlaps itself or another phrase ("a a b" inside "a a a b") or begins a
longer one ("a b" and "a b c"); each time a phrase ends, its count rises. Every function takes the hypotheses'
sentences ``sent`` and their state of any one shape, and never reads the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

Phrase = tuple[int, ...]


def _trie(phrases: list[Phrase]) -> tuple[list[Phrase], list[int], dict[Phrase, int], list[dict[int, int]], list[int]]:
    """A sentence's distinct phrases and how often each is asked for; its trie: each node's string
    (-> node; the root, (), first, parents before children), children (token -> node) and failure
    link (the node of the string's longest proper suffix in the trie)."""
    distinct = list(dict.fromkeys(phrases))
    required = [phrases.count(p) for p in distinct]
    nodes: dict[Phrase, int] = {(): 0}
    children: list[dict[int, int]] = [{}]
    for phrase in distinct:
        for depth in range(1, len(phrase) + 1):
            if phrase[:depth] not in nodes:
                nodes[phrase[:depth]] = len(children)
                children[nodes[phrase[: depth - 1]]][phrase[depth - 1]] = len(children)
                children.append({})
    fail = [0] * len(children)
    for s in sorted(nodes, key=len)[1:]:  # breadth first
        if len(s) > 1:
            f, token = fail[nodes[s[:-1]]], s[-1]
            while token not in children[f] and f != 0:
                f = fail[f]
            fail[nodes[s]] = children[f].get(token, 0)
    return distinct, required, nodes, children, fail


class ConstraintAutomata:
    """The automata of a batch's sentences (``constraints[i]``: sentence i's phrases, a phrase given
    twice must be written twice), padded to N nodes, C distinct phrases, failure chains of L nodes
    and D children a node; padding phrases are asked for 0 times. ``length``, ``required`` (B, C);
    ``depth``, ``fail`` (B, N); ``chain`` (B, N, L): a node, its failure, ..., the root (then the root again);
    ``children``, ``child_tokens`` (B, N, D): 0 and -1 where none (the root is no one's child);
    ``ends`` (B, N, C): phrase c ends the node's string; ``on_path`` (B, N, C): the node's string
    begins phrase c (or is it). ``max_tokens``: the most constraint tokens a sentence has."""

    def __init__(self, constraints: list[list[Phrase]], device: torch.device) -> None:
        built = [_trie(phrases) for phrases in constraints]
        n = max(len(b[3]) for b in built)
        c = max(1, max(len(b[0]) for b in built))
        depth_max = max(len(s) for b in built for s in b[2])
        d = max(1, max(len(ch) for b in built for ch in b[3]))
        rows: dict[str, list] = {key: [] for key in ("length", "required", "depth", "fail", "children", "child_tokens",
                                                     "ends", "on_path")}
        for distinct, required, nodes, children, fail in built:
            strings = list(nodes)
            pad = c - len(distinct)
            rows["length"].append([len(p) for p in distinct] + [0] * pad)
            rows["required"].append(required + [0] * pad)
            rows["depth"].append([len(s) for s in strings] + [0] * (n - len(strings)))
            terminal = {nodes[phrase]: p for p, phrase in enumerate(distinct)}
            ends, on_path = [[False] * c for _ in strings], [[False] * c for _ in strings]
            for string in sorted(nodes, key=len)[1:]:  # a node's failure is shorter: its phrases are known
                v = nodes[string]
                ends[v] = list(ends[fail[v]])
                if v in terminal:
                    ends[v][terminal[v]] = True
            for p, phrase in enumerate(distinct):
                v = 0
                on_path[0][p] = True
                for token in phrase:
                    v = children[v][token]
                    on_path[v][p] = True
            blank = n - len(strings)
            rows["fail"].append(fail + [0] * blank)
            rows["ends"].append(ends + [[False] * c] * blank)
            rows["on_path"].append(on_path + [[False] * c] * blank)
            rows["children"].append([list(ch.values()) + [0] * (d - len(ch)) for ch in children] + [[0] * d] * blank)
            rows["child_tokens"].append([list(ch) + [-1] * (d - len(ch)) for ch in children] + [[-1] * d] * blank)
        for key, value in rows.items():
            setattr(self, key, torch.tensor(value, dtype=torch.bool if key in ("ends", "on_path") else torch.long,
                                            device=device))
        links = [torch.arange(n, device=device).expand(len(constraints), n)]
        for _ in range(depth_max):  # the root's failure is the root
            links.append(self.fail.gather(1, links[-1]))
        self.chain = torch.stack(links, -1)
        self.max_tokens = int(max(sum(len(p) for p in phrases) for phrases in constraints))

    def start(self, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The state before any token: the root and no phrase written, ``shape`` + (C,)."""
        device = self.depth.device
        return (torch.zeros(shape, dtype=torch.long, device=device),
                torch.zeros((*shape, self.required.size(1)), dtype=torch.long, device=device))

    def unmet(self, sent: Tensor, count: Tensor) -> Tensor:
        """(..., C) bools: the phrases still to write."""
        return count < self.required[sent]

    def anchor(self, sent: Tensor, node: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """The node a hypothesis is inside a phrase from: the deepest of its failure chain that
        begins an unmet phrase (the root when it is inside none), and whether there is one (some
        phrase unmet)."""
        chain = self.chain[sent, node]  # (..., L)
        unmet = self.unmet(sent, count).unsqueeze(-2)  # (..., 1, C)
        begins = self.on_path[sent.unsqueeze(-1), chain] & (self.depth[sent.unsqueeze(-1), chain].unsqueeze(-1)
                                                              < self.length[sent].unsqueeze(-2))
        open_ = (begins & unmet).any(-1)  # (..., L)
        first = open_.to(torch.uint8).argmax(-1, keepdim=True)  # the deepest such node (chains run deepest first)
        return chain.gather(-1, first).squeeze(-1), open_.any(-1)

    def tokens_met(self, sent: Tensor, node: Tensor, count: Tensor) -> Tensor:
        """The bank of a hypothesis (Post and Vilar 2018): constraint tokens written, those of the
        phrases met and those of the one it is inside."""
        anchor, inside = self.anchor(sent, node, count)
        return (self.length[sent] * count).sum(-1) + torch.where(inside, self.depth[sent, anchor], 0)

    def wanted(self, sent: Tensor, node: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The tokens that advance a hypothesis towards an unmet phrase, (..., D) with (..., D)
        bools for the real ones: the next tokens of the phrase(s) it is inside, or the first
        tokens of the unmet phrases; and (...,) whether they go on from inside a phrase (not
        from the root)."""
        anchor, inside = self.anchor(sent, node, count)
        kids = self.children[sent, anchor]  # (..., D)
        leads = (self.on_path[sent.unsqueeze(-1), kids] & self.unmet(sent, count).unsqueeze(-2)).any(-1)
        tokens = self.child_tokens[sent, anchor]
        return tokens, inside.unsqueeze(-1) & (tokens >= 0) & leads, inside & (anchor != 0)

    def advance(self, sent: Tensor, node: Tensor, count: Tensor, token: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state after ``token``: node, counts, and whether it ended a phrase still to write
        (the whole-word rule then wants the next token to start a word)."""
        chain = self.chain[sent, node]  # (..., L)
        hit = self.child_tokens[sent.unsqueeze(-1), chain] == token[..., None, None]  # (..., L, D)
        found = hit.any(-1)  # (..., L)
        level = found.to(torch.uint8).argmax(-1, keepdim=True)  # the deepest node with a child on it
        child = (self.children[sent.unsqueeze(-1), chain] * hit).sum(-1).gather(-1, level).squeeze(-1)
        node = torch.where(found.any(-1), child, 0)
        written = torch.minimum(count + self.ends[sent, node].long(), self.required[sent])
        return node, written, (written > count).any(-1)
