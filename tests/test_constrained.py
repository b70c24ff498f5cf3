"""Lexically constrained beam search (nmt.decoding.constrained): the batched search equals the
search one sentence at a time (scripts/constraints_benchmark.py's baseline) where phrases do not
overlap; every phrase appears, for every model; the bank allocation; translate.py's constraints=
file and its one-line errors."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nmt.decoding.constrained import allocate, check_constraints, constrained_beam_search
from nmt.decoding.search import beam_search, score_pairs
from tests.conftest import ROOT, compose_train, translate_here
from tests.test_models import VOCAB, batch, build
from tests.test_prefixes import assert_refused_before_output

PRESETS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer", "hybrid_lstm_transformer"]
spec = importlib.util.spec_from_file_location("constraints_benchmark", ROOT / "scripts" / "constraints_benchmark.py")
baseline = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # a dataclass needs its module listed
spec.loader.exec_module(baseline)


def occurrences(tokens: list[int], phrase: tuple[int, ...]) -> int:
    return sum(tuple(tokens[i : i + len(phrase)]) == phrase for i in range(len(tokens) - len(phrase) + 1))


def holds_all(tokens: list[int], phrases: list[tuple[int, ...]]) -> bool:
    """Every phrase, as often as it is given (occurrences may overlap)."""
    return all(occurrences(tokens, p) >= phrases.count(p) for p in phrases)


def disjoint_phrases(rng: random.Random, sentences: int) -> list[list[tuple[int, ...]]]:
    """0-3 phrases of 1-3 tokens a sentence, no token twice in a sentence's phrases."""
    out = []
    for _ in range(sentences):
        pool, phrases = rng.sample(range(4, VOCAB), 9), []
        for _ in range(rng.randint(0, 3)):
            size = rng.randint(1, 3)
            phrases.append(tuple(pool[:size]))
            pool = pool[size:]
        out.append(phrases)
    return out


@pytest.mark.parametrize("name", ["lstm_bahdanau", "transformer", "hybrid_lstm_transformer"])
def test_the_batch_finds_what_one_sentence_at_a_time_finds(name):
    """Random batches, beams, n-best sizes, caps and whole-word rules; phrases that do not overlap
    (there the baseline tracks them right): the same hypotheses and scores."""
    model = build(name)
    rng = random.Random(1)
    for trial in range(8):
        lengths = tuple(rng.randint(2, 9) for _ in range(rng.randint(1, 6)))
        src, src_mask, _ = batch(lengths, seed=trial)
        constraints = disjoint_phrases(rng, len(lengths))
        continuation = None
        if trial % 2:
            continuation = torch.zeros(VOCAB, dtype=torch.bool)
            continuation[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(trial))[:15]] = True
            continuation[:4] = False
        k = rng.randint(1, 5)
        options = dict(beam_size=k, nbest=rng.randint(1, k), max_len_b=rng.randint(6, 12), continuation=continuation)
        ours = constrained_beam_search(model, src, src_mask, constraints, **options)
        ref = baseline.sentence_at_a_time(model, src, src_mask, constraints, **options)
        assert ours.tokens == ref.tokens, (trial, constraints)
        torch.testing.assert_close(ours.scores.float(), ref.scores.float(), atol=1e-4, rtol=1e-4)
        if options["nbest"] > 1:
            assert [[t for t, _ in r] for r in ours.nbest] == [[t for t, _ in r] for r in ref.nbest], trial
            for a, b in zip(ours.nbest, ref.nbest):
                assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-4)


class Reads(TorchDispatchMode):
    """Counts the host's reads of a device value (``aten::_local_scalar_dense``: ``int()``,
    ``float()``, ``bool()`` of a tensor, also inside an operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_device_is_read_once_a_step_not_per_candidate():
    """The batched search reads one value a step (to stop); one sentence at a time reads every
    candidate's score."""
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(9, 7, 9, 5))
    constraints = [[(5, 6)], [(7,), (9, 10)], [], [(11,)]]
    steps, decode_step = [], model.decode_step

    def counted(*args, **kwargs):
        steps.append(1)
        return decode_step(*args, **kwargs)

    reads, counts = {}, {}
    for search in (constrained_beam_search, baseline.sentence_at_a_time):
        steps.clear()
        with pytest.MonkeyPatch.context() as patch, Reads() as spy:
            patch.setattr(model, "decode_step", counted)
            search(model, src, src_mask, constraints, beam_size=4, max_len_b=6)
        reads[search], counts[search] = spy.count, len(steps)
    assert counts[constrained_beam_search] > 5 and reads[constrained_beam_search] <= counts[constrained_beam_search] + 1
    assert reads[baseline.sentence_at_a_time] >= 8 * counts[baseline.sentence_at_a_time]


@pytest.mark.parametrize("name", PRESETS)
def test_every_constraint_appears_in_the_output_of_every_model(name):
    """Phrases from few tokens, so they overlap, repeat and begin one another."""
    model = build(name)
    src, src_mask, _ = batch()
    rng = random.Random(0)
    for trial in range(3):
        constraints = [[tuple(rng.randrange(4, 8) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
                       for _ in range(src.size(0))]
        hyps = constrained_beam_search(model, src, src_mask, constraints, beam_size=4, max_len_b=12, nbest=2)
        for tokens, cons, ranked in zip(hyps.tokens, constraints, hyps.nbest):
            assert holds_all(tokens, cons), (tokens, cons)
            assert all(holds_all(t, cons) for t, _ in ranked) and ranked[0][0] == tokens
        # the score is the model's log-prob of the output over the length penalty
        tgt = torch.zeros(src.size(0), max(len(t) for t in hyps.tokens) + 1, dtype=torch.long)
        for i, t in enumerate(hyps.tokens):
            tgt[i, : len(t) + 1] = torch.tensor([*t, 3])
        logprob = score_pairs(model, src, src_mask, tgt).sum(1)
        penalty = ((5.0 + torch.tensor([len(t) + 1 for t in hyps.tokens]).float()) / 6.0) ** 0.6
        torch.testing.assert_close(hyps.scores.float(), logprob / penalty, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["lstm_bahdanau", "transformer"])
def test_without_constraints_it_finds_what_beam_search_finds_or_better(name):
    model = build(name)
    src, src_mask, _ = batch()
    free = beam_search(model, src, src_mask, beam_size=4, max_len_b=8)
    ours = constrained_beam_search(model, src, src_mask, [[], [], []], beam_size=4, max_len_b=8)
    assert all(a >= b - 1e-4 for a, b in zip(ours.scores.tolist(), free.scores.tolist()))


@pytest.mark.parametrize("name", ["lstm_bahdanau", "transformer"])
def test_huggingface_scoring_without_constraints_is_beam_search(name):
    """``scoring=huggingface`` and no constraints: beam search's hypotheses, scores and n-best lists
    (transformers' rules: |Y| ** alpha, the EOS forced at the cap scoring 0, only an EOS among the K
    best candidates ending, its stopping rule) over length penalties, beams and early stopping."""
    model = build(name)
    for seed in range(3):
        src, src_mask, _ = batch((9, 4, 7, 2, 6), seed=seed)
        for alpha, early, k, nbest, cap in [(1.0, False, 4, 1, 8), (0.6, True, 3, 2, 10), (2.0, "never", 5, 3, 6),
                                            (0.0, False, 2, 2, 12)]:
            options = dict(beam_size=k, alpha=alpha, max_len_b=cap, nbest=nbest, scoring="huggingface",
                           early_stopping=early)
            free = beam_search(model, src, src_mask, engine="loop", **options)
            ours = constrained_beam_search(model, src, src_mask, [[]] * 5, **options)
            assert ours.tokens == free.tokens, (seed, alpha, early)
            torch.testing.assert_close(ours.scores, free.scores, atol=1e-5, rtol=1e-5)
            if nbest > 1:
                assert [[t for t, _ in r] for r in ours.nbest] == [[t for t, _ in r] for r in free.nbest]


def test_huggingface_scoring_holds_the_constraints_and_ranks_by_length_to_alpha():
    """With constraints and ``scoring=huggingface``: every phrase appears, and an output ended
    before its cap scores its log-prob over (its tokens + EOS) ** alpha."""
    model = build("transformer")
    src, src_mask, _ = batch()
    constraints = [[(5, 6)], [(7,), (9,)], [(11,)]]
    for alpha in (0.5, 1.5):
        hyps = constrained_beam_search(model, src, src_mask, constraints, beam_size=4, alpha=alpha, max_len_b=12,
                                       scoring="huggingface")
        tgt = torch.zeros(src.size(0), max(len(t) for t in hyps.tokens) + 1, dtype=torch.long)
        for i, t in enumerate(hyps.tokens):
            tgt[i, : len(t) + 1] = torch.tensor([*t, 3])
        logprob = score_pairs(model, src, src_mask, tgt).sum(1)
        caps = (1.5 * src_mask.sum(1) + 12).long().tolist()
        for i, (tokens, cons) in enumerate(zip(hyps.tokens, constraints)):
            assert holds_all(tokens, cons), (tokens, cons)
            if len(tokens) + 1 < caps[i]:
                assert float(hyps.scores[i]) == pytest.approx(float(logprob[i]) / (len(tokens) + 1) ** alpha, abs=1e-4)
    with pytest.raises(ValueError, match=r"^decoding.scoring='fairseq': choose one of gnmt, huggingface$"):
        constrained_beam_search(model, src, src_mask, constraints, scoring="fairseq")


def kept(banks: list[int], k: int, valid: list[bool] | None = None) -> list[int]:
    valid = [True] * len(banks) if valid is None else valid
    mask = allocate(torch.tensor([banks]), torch.tensor([valid]), k, max(banks) + 1)[0]
    return mask.nonzero().flatten().tolist()


def test_banks_share_the_beam_and_pass_on_what_they_cannot_fill():
    assert kept([0, 0, 0, 1, 2], 3) == [0, 3, 4]   # one place per bank
    assert kept([0, 0, 0, 0, 2], 4) == [0, 1, 2, 4]  # two banks of two; the top bank has one: its place passes on
    assert kept([1, 1], 5) == [0, 1]
    assert kept([0, 0, 1, 1, 2, 2, 2], 4) == [0, 2, 4, 5]  # 4 places over 3 banks: the highest gets the extra one
    assert kept([0, 3, 0, 3, 1], 2, [True, False, True, True, False]) == [0, 3]  # invalid ones hold no place
    rng = random.Random(0)
    for _ in range(300):  # the rule of the search one sentence at a time
        banks, k = [rng.randrange(5) for _ in range(rng.randint(1, 12))], rng.randint(1, 6)
        assert kept(banks, k) == baseline._allocate(banks, k), (banks, k)


def test_constraints_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="an empty constraint"):
        check_constraints([(5,), ()], 10)
    with pytest.raises(ValueError, match="the constraints hold 10 target tokens, but the translation is capped at 10"):
        check_constraints([(5,) * 4, (6,) * 6], 10)


LINES = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:6]
REFS = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()[:6]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from nmt.train import train

    cfg = compose_train(tmp_path_factory.mktemp("constraints"), ["trainer.max_epochs=2", "test=false"], model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def test_translate_writes_every_constraint_of_its_line(ckpt, tmp_path, capsys):
    src, cons = tmp_path / "in.txt", tmp_path / "constraints.txt"
    src.write_text("\n".join(LINES) + "\n")
    phrases = [[r.split()[-1], r.split()[0]] if i % 2 else [" ".join(r.split()[1:3])] for i, r in enumerate(REFS)]
    phrases[2] = []
    cons.write_text("\n".join("\t".join(p) for p in phrases) + "\n")
    result = translate_here(capsys, f"ckpt={ckpt}", f"input={src}", f"constraints={cons}", "decoding.beam_size=4")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = result.stdout.splitlines()
    assert len(rows) == 6
    for row, wanted in zip(rows, phrases):
        assert all(f" {p} " in f" {row} " for p in wanted), (row, wanted)


@pytest.mark.parametrize("content, message", [
    ("a\n", "constraints={f}: 1 lines, but input={i} has 6"),
    ("\n\nfa\t\n\n\n\n", "constraints={f}, line 3: an empty constraint (phrases are separated by tabs)"),
    ("\nda ÆØÅ\n\n\n\n\n", "constraints={f}, line 2: 'da ÆØÅ' holds characters the target vocabulary lacks"),
    (" ".join(["fa"] * 300) + "\n\n\n\n\n\n", "constraints={f}, line 1: the constraints hold "),
])
def test_bad_constraints_are_one_line_naming_the_line_and_write_nothing(ckpt, tmp_path, capsys, content, message):
    assert_refused_before_output(ckpt, tmp_path, capsys, "constraints", content, message, LINES)


def test_the_server_takes_constraints_and_prefixes_per_sentence(ckpt):
    from fastapi.testclient import TestClient

    from nmt.serve.app import create_app, load
    from tests.conftest import serve_cfg

    cfg = serve_cfg(ckpt, "batching.process=false")
    phrase = REFS[0].split()[1]
    with TestClient(create_app(load(cfg), cfg)) as client:
        body = client.post("/translate", json={"text": LINES[:2], "constraints": [[phrase], []], "beam_size": 3}).json()
        assert f" {phrase} " in f" {body['translations'][0]['text']} "
        start = " ".join(REFS[1].split()[:2])
        body = client.post("/translate", json={"text": LINES[:2], "prefix": ["", start]}).json()
        assert body["translations"][1]["text"].startswith(start)
        for request, status, message in [
            ({"constraints": [["fa"]]}, 400, '"constraints" must be a list of 2 lists of phrases, one per sentence'),
            ({"prefix": "fa"}, 400, '"prefix" must be a list of 2 strings, one per sentence ("" for none)'),
            ({"prefix": ["", ""], "constraints": [[], []]}, 400, '"prefix" and "constraints": give one of the two'),
            ({"constraints": [[""], []]}, 400, '"constraints", sentence 0: an empty constraint'),
            ({"constraints": [["x"] * 11, []]}, 413, "sentence 0 has 11 constraints; the limit is 10"),
            ({"prefix": ["", "ÆØÅ"]}, 400, '"prefix", sentence 1: \'ÆØÅ\' holds characters the target vocabulary lacks'),
            ({"prefix": ["", "\ud800"]}, 400, "prefix 1: not valid Unicode"),
            ({"constraints": [["a", "\udfff"], []]}, 400, "constraint 1 of sentence 0: not valid Unicode"),
        ]:
            answer = client.post("/translate", content=json.dumps({"text": LINES[:2], **request}),  # ASCII escapes
                                 headers={"Content-Type": "application/json"})
            assert answer.status_code == status and answer.json()["error"].startswith(message), answer.json()


def test_a_constraint_is_met_only_as_whole_words():
    """With ``continuation``, the token after a met phrase starts a word: here only UNK starts
    one, so each phrase is followed by UNK or ends the output."""
    model = build("transformer")
    src, src_mask, _ = batch()
    continuation = torch.ones(VOCAB, dtype=torch.bool)
    continuation[:4] = False  # PAD, UNK, BOS, EOS
    constraints = [[(7, 8)], [(9,)], [(11,)]]
    hyps = constrained_beam_search(model, src, src_mask, constraints, beam_size=3, continuation=continuation)
    for tokens, (phrase,) in zip(hyps.tokens, constraints):
        ends = [i + len(phrase) for i in range(len(tokens)) if tuple(tokens[i : i + len(phrase)]) == phrase]
        assert ends and all(end == len(tokens) or tokens[end] == 1 for end in ends), tokens
