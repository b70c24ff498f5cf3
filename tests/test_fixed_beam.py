"""Beam search on fixed shapes (``nmt.decoding.fixed_beam``): the loop's hypotheses, scores and
n-best lists for every model, prefixes and caps included; no read of the device inside a step; one
graph per step; captured steps kept per batch shape and retired when the weights change."""

from __future__ import annotations

import copy

import pytest
import torch

from nmt.decoding import fixed_beam
from nmt.decoding.search import beam_search, greedy_search
from nmt.decoding.settings import SearchSettings
from nmt.specials import PAD
from tests.test_models import VARIANTS, batch, build

LENGTHS = (9, 2, 5, 3)


def assert_same_search(loop, fixed) -> None:
    assert fixed.tokens == loop.tokens
    torch.testing.assert_close(fixed.scores, loop.scores, atol=1e-5, rtol=1e-5)
    if loop.nbest is not None:
        assert [[tokens for tokens, _ in entries] for entries in fixed.nbest] == \
               [[tokens for tokens, _ in entries] for entries in loop.nbest]
        for a, b in zip(fixed.nbest, loop.nbest):
            torch.testing.assert_close(torch.tensor([s for _, s in a]), torch.tensor([s for _, s in b]), atol=1e-5, rtol=1e-5)


# every model variant: a few in the default tier, the others in the slow one
DEFAULT = ("lstm", "lstm_bahdanau", "lstm_luong", "transformer", "transformer_rope_local", "hybrid_transformer_luong")
ALL = [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow) for name in VARIANTS]


@pytest.mark.parametrize(("name", "engine"), [*((name, "graphs") if name in DEFAULT else
                                                pytest.param(name, "graphs", marks=pytest.mark.slow) for name in VARIANTS),
                                              *((name, "fixed") for name in ("lstm", "transformer_rope_local"))])
def test_fixed_shapes_find_the_loops_hypotheses(name, engine):
    """Every model, n-best lists of 3 from beams of 4, sentences of different caps (they stop at
    different steps); ``graphs`` pads the batch to 4 x 12 sources and 16-step caches."""
    model = build(name)
    src, src_mask, _ = batch(lengths=LENGTHS)
    loop = beam_search(model, src, src_mask, beam_size=4, nbest=3, engine="loop")
    assert_same_search(loop, beam_search(model, src, src_mask, beam_size=4, nbest=3, engine=engine))


@pytest.mark.parametrize("name", ALL)
def test_greedy_search_on_fixed_shapes_is_the_loops(name):
    """Greedy search on fixed shapes (beam search with one beam, no length penalty): the loop's
    tokens and log-probs, also with validation's per-sentence caps and with prefixes."""
    model = build(name)
    src, src_mask, _ = batch(lengths=LENGTHS)
    options = {"max_len": torch.tensor([12, 3, 6, 4]), "prefix": torch.tensor([[7, 8], [5, PAD], [PAD, PAD], [6, 6]])}
    for chosen in ({}, options):
        loop = greedy_search(model, src, src_mask, engine="loop", **chosen)
        assert_same_search(loop, greedy_search(model, src, src_mask, engine="graphs", **chosen))


@pytest.mark.parametrize("name", ["transformer", "lstm_luong"])
def test_prefixes_and_per_sentence_caps_as_the_loop(name):
    model = build(name)
    src, src_mask, _ = batch(lengths=LENGTHS)
    prefix = torch.tensor([[7, 8, 9], [5, PAD, PAD], [PAD, PAD, PAD], [6, 6, PAD]])
    caps = torch.tensor([12, 3, 6, 4])
    for engine in ("fixed", "graphs"):
        for options in ({"prefix": prefix}, {"max_len": caps}, {"prefix": prefix, "max_len": caps, "alpha": 0.0}):
            loop = beam_search(model, src, src_mask, beam_size=3, engine="loop", **options)
            assert_same_search(loop, beam_search(model, src, src_mask, beam_size=3, engine=engine, **options))
    forced = beam_search(model, src, src_mask, beam_size=3, engine="graphs", prefix=prefix)
    assert forced.tokens[0][:3] == [7, 8, 9] and forced.tokens[1][:1] == [5] and forced.tokens[3][:2] == [6, 6]


@pytest.mark.slow  # a counted decoding of a trained model: the slow tier
def test_the_host_reads_the_device_every_few_steps_not_every_step():
    """The loop reads the device about four times a step; the fixed search once every
    ``CHECK_EVERY`` steps, plus its few reads before and after the steps. Its buffers keep their
    addresses from step to step (what a CUDA graph replays)."""
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(9, 9, 9, 9))
    options = {"beam_size": 4, "max_len_a": 3.0, "max_len_b": 10, "alpha": 0.0}  # 37 steps at most
    steps = []
    step = fixed_beam._Step.__call__

    def spy(self, parity, state=None):
        steps.append([t.data_ptr() for t in (self.b.history, self.b.best_tokens, self.b.prev)]
                     + ([] if self.b.states is None else [c["k"].data_ptr() for s in self.b.states for c in s["cache"]]))
        step(self, parity, state)

    reads = {}
    for engine in ("loop", "fixed"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(fixed_beam._Step, "__call__", spy)
                beam_search(model, src, src_mask, engine=engine, **options)
        reads[engine] = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    n = len(steps)
    assert n > 2 * fixed_beam.CHECK_EVERY
    assert all(ptrs == steps[1] for ptrs in steps[2:])
    assert reads["fixed"] <= n // fixed_beam.CHECK_EVERY + 4
    assert reads["loop"] >= 3 * n


@pytest.mark.parametrize("name", ["transformer", "lstm_luong", *(pytest.param(name, marks=pytest.mark.slow)
                                                                 for name in ("transformer_rope_local", "lstm_bahdanau", "lstm"))])
def test_a_step_is_one_graph(name):
    """A step traces into one graph (``fullgraph``): no read of a value to the host, no shape that
    depends on one: what a CUDA graph captures (with the kernels a GPU uses), and it computes the
    eager step's values."""
    model = build(name).set_kernels("reference")
    src, src_mask, _ = batch(lengths=LENGTHS)
    found = {}

    class Stop(Exception):
        pass

    step = fixed_beam._Step.__call__

    def keep_first(self, parity, state=None):
        step(self, parity, state)
        found["step"] = self
        raise Stop

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stop):
        patch.setattr(fixed_beam._Step, "__call__", keep_first)
        beam_search(model, src, src_mask, beam_size=4, engine="fixed")
    first = found["step"]
    buffers = [first.b.history, first.b.best_tokens, first.b.best_scores, first.b.beam_scores, first.b.prev,
               first.b.searching, first.b.num_finished, first.b.t, *tensors(first.b.states)]
    before = [x.clone() for x in buffers]
    torch._dynamo.reset()
    compiled = torch.compile(lambda: step(first, 1), fullgraph=True, backend="aot_eager")  # step 1: states[1] -> [0]
    with torch.no_grad():
        compiled()
        traced = [x.clone() for x in buffers]
        for x, value in zip(buffers, before):  # the same step again, eagerly, from the same values
            x.copy_(value)
        step(first, 1)
    torch._dynamo.reset()
    assert int(first.b.t) == 2
    for x, y in zip(buffers, traced):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [x for part in tree for x in tensors(part)] if isinstance(tree, (list, tuple)) else []


def simulate_capture(monkeypatch) -> list:
    """CUDA graph capture simulated on the CPU: the step itself stands for its replay."""
    captures = []
    monkeypatch.setattr(fixed_beam, "_captures", lambda device: True)
    monkeypatch.setattr(fixed_beam, "_Stream", lambda device: type("Side", (), {"run": lambda self, fn: fn()})())
    monkeypatch.setattr(fixed_beam, "_captured", lambda step, side, kept: captures.append(step) or step)
    return captures


def test_captured_steps_are_kept_per_shape_and_retired_when_the_weights_change(monkeypatch):
    """With capture simulated on the CPU: a step is captured once per padded batch shape and copy of
    the state it reads, after ``WARMUP_STEPS`` eager steps, and replayed for every later batch of that
    shape with the loop's results; a change of the weights in place retires the captures."""
    captures = simulate_capture(monkeypatch)
    model = build("transformer")
    options = {"beam_size": 3, "nbest": 2, "max_len_a": 2.0, "max_len_b": 6}
    batches = [batch(lengths=lengths, seed=seed)[:2] for lengths, seed in (((9, 7, 6), 0), ((8, 9, 5), 1), ((3, 2), 2))]
    for src, src_mask in batches:
        assert_same_search(beam_search(model, src, src_mask, engine="loop", **options),
                           beam_search(model, src, src_mask, engine="graphs", **options))
    # 3 x 9 and 3 x 9 padded to 3 x 12, 24 steps: one shape; 2 x 3 another; two graphs each (the steps
    # that read the first copy of the decoder's state and those that read the second)
    assert len(captures) == 4
    assert [shape[:3] for shape in fixed_beam.kept_shapes(model)] == [(3, 12, 24), (2, 3, 12)]
    with torch.no_grad():
        model.decoder.out.weight.mul_(1.5)
    src, src_mask = batches[0]
    assert_same_search(beam_search(model, src, src_mask, engine="loop", **options),
                       beam_search(model, src, src_mask, engine="graphs", **options))
    assert len(captures) == 6 and len(fixed_beam.kept_shapes(model)) == 1
    copy.deepcopy(model)  # a model with captured searches still copies (they are kept beside it)


def test_a_failed_capture_runs_the_steps_eagerly_and_is_not_tried_again_for_its_shape(monkeypatch, caplog):
    tries = []

    def refuse(step, side, kept):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    simulate_capture(monkeypatch)
    monkeypatch.setattr(fixed_beam, "_captured", refuse)
    model = build("transformer")
    src, src_mask, _ = batch(lengths=LENGTHS)
    for _ in range(2):
        assert_same_search(beam_search(model, src, src_mask, engine="loop"), beam_search(model, src, src_mask, engine="graphs"))
    assert "a CUDA graph could not capture them (operation not permitted when stream is capturing)" in caplog.text
    assert len(tries) == 1 and fixed_beam.kept_shapes(model) == []


def test_auto_loops_on_a_cpu_and_attention_or_too_few_positions_run_the_loop(monkeypatch):
    made = []
    monkeypatch.setattr(fixed_beam, "_Step", lambda *args: made.append(args) or (_ for _ in ()).throw(AssertionError))
    model = build("transformer")
    src, src_mask, _ = batch(lengths=LENGTHS)
    beam_search(model, src, src_mask)  # auto, on a CPU
    beam_search(model, src, src_mask, engine="graphs", need_attn=True)
    short = build("transformer")
    short.decoder.embed_tokens.max_len = 12  # positions for 12 steps; the first sentence may take 13
    try:
        beam_search(short, src, src_mask, engine="fixed", max_len_a=0.5, max_len_b=9)
    except ValueError as error:  # the loop's refusal, if a hypothesis reaches position 12
        assert "exceeds the model's max_len 12" in str(error)
    assert made == []


def test_huggingface_scoring_runs_the_loop_and_says_why(monkeypatch, caplog):
    """``scoring=huggingface`` on ``engine=fixed`` or ``graphs``: the loop's hypotheses (the fixed
    shapes rank with the GNMT penalty only), no step built on fixed shapes, the reason logged."""
    import logging

    from nmt.decoding import search

    made = []
    monkeypatch.setattr(fixed_beam, "_Step", lambda *args: made.append(args) or (_ for _ in ()).throw(AssertionError))
    search._log_once.cache_clear()
    model = build("transformer")
    src, src_mask, _ = batch(lengths=LENGTHS)
    options = {"beam_size": 4, "alpha": 1.0, "scoring": "huggingface"}
    loop = beam_search(model, src, src_mask, engine="loop", **options)
    with caplog.at_level(logging.INFO, logger="nmt.decoding.search"):
        for engine in ("fixed", "graphs"):
            assert_same_search(loop, beam_search(model, src, src_mask, engine=engine, **options))
    assert made == [] and "beam search with scoring=huggingface runs on the loop engine" in caplog.text


def test_an_unknown_engine_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^decoding.engine='gpu': choose one of auto, loop, fixed, graphs$"):
        SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search", "engine": "gpu"})
    model = build("transformer")
    with pytest.raises(ValueError, match=r"^decoding.engine='gpu'"):
        beam_search(model, *batch()[:2], engine="gpu")


def test_kept_searches_copy_the_callers_tensors_and_are_released(monkeypatch):
    """A kept search holds copies of a batch's memory, so the next batch of its shape is copied into
    them, not into the tensors an earlier caller passed; ``release`` (after a validation) drops them."""
    simulate_capture(monkeypatch)
    model = build("transformer")
    first, second = batch(lengths=(8, 8, 8, 8), seed=0)[:2], batch(lengths=(8, 8, 8, 8), seed=1)[:2]
    kept_mask = first[1].clone()
    beam_search(model, *first, engine="graphs")
    beam_search(model, *second, engine="graphs")
    assert torch.equal(first[1], kept_mask) and len(fixed_beam.kept_shapes(model)) == 1
    fixed_beam.release(model)
    assert fixed_beam.kept_shapes(model) == []


def test_sources_are_padded_within_the_encoders_positions():
    """A source of 10 tokens for an encoder with 10 positions stays 10 wide (its bucket, 12, would
    not fit) and decodes as the loop does."""
    model = build("transformer")
    model.encoder.embed_tokens.max_len = 10
    src, src_mask, _ = batch(lengths=(10, 4))
    assert_same_search(beam_search(model, src, src_mask, engine="loop"), beam_search(model, src, src_mask, engine="graphs"))


def test_a_model_made_in_inference_mode_is_captured(monkeypatch):
    simulate_capture(monkeypatch)
    with torch.inference_mode():
        model = build("transformer")
        src, src_mask, _ = batch(lengths=LENGTHS)
        assert_same_search(beam_search(model, src, src_mask, engine="loop"), beam_search(model, src, src_mask, engine="graphs"))
    assert len(fixed_beam.kept_shapes(model)) == 1
