"""The constraint automaton (nmt.decoding.constraint_automaton): phrases found where they overlap
themselves or each other, phrases that begin others, a phrase given twice; and the constrained
search on a stand-in model whose preferred output is known, so each case's answer is known."""

from __future__ import annotations

import pytest
import torch

from nmt.decoding.constrained import constrained_beam_search
from nmt.decoding.constraint_automaton import ConstraintAutomata
from nmt.kernels import Kernels
from nmt.specials import EOS, PAD
from tests.test_constrained import baseline, occurrences

VOCAB = 20
A, B, C, D = 5, 6, 7, 8


def walk(phrases: list[tuple[int, ...]], tokens: list[int]) -> list[tuple[list[int], int, set[int], bool]]:
    """After each token: the counts of the distinct phrases, the tokens met (the bank), the tokens
    wanted next, and whether the token ended a phrase still to write."""
    automata = ConstraintAutomata([phrases], torch.device("cpu"))
    sent = torch.zeros(1, dtype=torch.long)
    node, count = automata.start((1,))
    out = []
    for token in tokens:
        node, count, met = automata.advance(sent, node, count, torch.tensor([token]))
        wanted, real, _ = automata.wanted(sent, node, count)
        out.append((count[0].tolist(), int(automata.tokens_met(sent, node, count)), set(wanted[real].tolist()),
                    bool(met)))
    return out


def test_a_phrase_that_overlaps_itself_is_found():
    """'a a b' inside 'a a a b': the third 'a' falls back to the longest suffix that begins the
    phrase ('a a'), not to nothing."""
    steps = walk([(A, A, B)], [A, A, A, B])
    assert [s[0] for s in steps] == [[0], [0], [0], [1]]
    assert [s[1] for s in steps] == [1, 2, 2, 3]
    assert [s[2] for s in steps] == [{A}, {B}, {B}, set()]
    assert [s[3] for s in steps] == [False, False, False, True]
    assert walk([(A, B, A, C)], [A, B, A, B, A, C])[-1][0] == [1]  # 'a b a c' inside 'a b a b a c'
    assert walk([(A, A, B)], [A, C, A, A, B])[-1][0] == [1]  # broken off by 'c', then met


def test_a_phrase_that_begins_another_and_phrases_inside_others():
    steps = walk([(A, B), (A, B, C)], [A, B, C])
    assert [s[0] for s in steps] == [[0, 0], [1, 0], [1, 1]]
    assert [s[1] for s in steps] == [1, 4, 5]  # "a b" met, and 2 tokens into "a b c": the shared tokens count for each
    assert steps[1][2] == {C} and steps[1][3]  # 'a b' met, 'c' still wanted
    assert walk([(A, B, C), (B,)], [A, B, C])[-1][0] == [1, 1]  # a phrase inside another
    assert walk([(A, B), (B, C)], [A, B, C])[-1][0] == [1, 1]  # two phrases sharing a token


def test_a_phrase_given_twice_must_be_written_twice():
    steps = walk([(A, B), (C,), (A, B)], [A, B, D, A, B, A, B])
    assert [s[0] for s in steps] == [[0, 0], [1, 0], [1, 0], [1, 0], [2, 0], [2, 0], [2, 0]]
    assert [s[3] for s in steps] == [False, True, False, False, True, False, False]  # the third is no longer wanted
    assert steps[4][2] == {C} and steps[4][1] == 4


class Scripted:
    """A model with the ``Seq2Seq`` decoding interface that prefers a given output: at step t its
    sentence's t-th script token (EOS after the script) by far, then every other token, lower
    ids first. Source i starts with token 4 + i; the memory holds each source's script, and a
    state row reads memory row ``row // (rows / memory rows)``, as the models do."""

    def __init__(self, scripts: list[list[int]]) -> None:
        self.tgt_vocab_size, self.kernels = VOCAB, Kernels()
        width = max(map(len, scripts)) + 1
        self.scripts = torch.tensor([s + [EOS] * (width - len(s)) for s in scripts])

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"script": self.scripts[src[:, 0] - 4]}

    def init_state(self, memory: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"t": torch.zeros(memory["script"].size(0), dtype=torch.long)}

    def decode_step(self, prev, memory, state, need_attn=False):
        script = memory["script"].repeat_interleave(prev.size(0) // memory["script"].size(0), 0)
        want = script.gather(1, state["t"].clamp(max=script.size(1) - 1).unsqueeze(1))
        logits = (-0.5 * torch.arange(VOCAB, dtype=torch.float)).expand(prev.size(0), VOCAB).scatter(1, want, 20.0)
        return logits, {"t": state["t"] + 1}, None


CASES = [  # (script, phrases, the output found one sentence at a time, or None where it is the script)
    ([A, A, A, B], [(A, A, B)], "misses it"),
    ([A, B, C, D], [(A, B), (A, B, C)], "misses it"),
    ([A, B, C, D], [(A, B, C), (A, B)], None),
    ([C, A, B, D], [(A, B), (B, D)], None),
    ([A, B, D, C], [(A, B), (A, B)], "twice"),
    ([D, A, C], [(A,), (A,), (A,)], "three times"),
]


@pytest.mark.parametrize("script, phrases, note", CASES)
def test_the_search_writes_what_the_model_prefers_when_it_holds_the_phrases(script, phrases, note):
    """Where the preferred output holds every phrase, the search returns it; where a phrase is
    given more often than it holds, every output holds it that often. The batch mixes the case with
    a sentence without constraints (and the search one sentence at a time misses the overlaps)."""
    model = Scripted([script, [D, C]])
    src = torch.tensor([[4] * 6, [5, 5, 5, PAD, PAD, PAD]])
    options = dict(beam_size=4, max_len_b=10, nbest=2)
    hyps = constrained_beam_search(model, src, src != PAD, [phrases, []], **options)
    assert hyps.tokens[1] == [D, C]
    for tokens, _ in hyps.nbest[0]:
        assert all(occurrences(tokens, p) >= phrases.count(p) for p in phrases), tokens
    holds = all(occurrences(script, p) >= phrases.count(p) for p in phrases)
    assert (hyps.tokens[0] == script) == holds
    if note == "misses it":
        assert baseline.sentence_at_a_time(model, src, src != PAD, [phrases, []], **options).tokens[0] != script


def test_a_sentence_no_hypothesis_can_finish_keeps_its_best_beam_with_a_warning(caplog):
    """Both phrases continue a word (the whole-word rule forbids writing one right after the
    other) and the cap leaves room for only the two and EOS: no hypothesis can end, so the
    sentence's best live one is returned, as one sentence at a time returns it."""
    model = Scripted([[D, C], [D, C]])
    src = torch.tensor([[4, 4], [5, 5]])
    continuation = torch.zeros(VOCAB, dtype=torch.bool)
    continuation[[A, B]] = True
    options = dict(beam_size=3, max_len_a=0.0, max_len_b=3, continuation=continuation)
    constraints = [[(A,), (B,)], [(D,)]]
    with caplog.at_level("WARNING", logger="nmt.decoding.constrained"):
        hyps = constrained_beam_search(model, src, src != PAD, constraints, **options)
    ref = baseline.sentence_at_a_time(model, src, src != PAD, constraints, **options)
    assert hyps.tokens == ref.tokens and hyps.tokens[1] == [D, C]
    torch.testing.assert_close(hyps.scores, ref.scores)
    assert "no hypothesis of sentence 0 holds all 2 constraints within the cap of 3 tokens" in caplog.text


@pytest.mark.parametrize("phrases", [[(A,), (A, B)], [(A, B), (A,)]])
def test_a_word_that_goes_on_into_a_longer_phrase_is_not_a_met_phrase(phrases):
    """Phrases "hu" = [A] and "hus" = [A, B], B a piece that continues a word: after A, B is
    allowed (it leads into "hus"), and "hu" then counts only where it stands as a word, in either
    order of the phrases."""
    script = [A, B, D, A, C]
    model = Scripted([script])
    src = torch.tensor([[4, 4, 4]])
    continuation = torch.zeros(VOCAB, dtype=torch.bool)
    continuation[B] = True
    hyps = constrained_beam_search(model, src, src != PAD, [phrases], beam_size=3, continuation=continuation)
    assert hyps.tokens[0] == script
    short = constrained_beam_search(Scripted([[A, B, D]]), src, src != PAD, [phrases], beam_size=3,
                                    continuation=continuation)
    tokens = short.tokens[0]  # "hus" only: "hu" must be added as a word of its own
    assert occurrences(tokens, (A, B)) >= 1 and any(tokens[i] == A and (i + 1 == len(tokens) or tokens[i + 1] != B)
                                                    for i in range(len(tokens))), tokens
