"""Beam search on fixed shapes (``nmt.decoding.fixed_beam``): the loop's hypotheses, scores and
n-best lists for every model, prefixes and caps included; no read of the device inside a step; one
graph per step; captured steps kept per batch shape and retired when the weights change."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.utils._python_dispatch

from nmt.decoding import fixed_beam, search
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

    def spy(self, parity, reads=None, state=None):
        steps.append([t.data_ptr() for t in (self.b.history, self.b.best_tokens, self.b.prev)]
                     + ([] if self.b.states is None else [c["k"].data_ptr() for s in self.b.states for c in s["cache"]]))
        step(self, parity, reads, state)

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


@pytest.mark.parametrize("name", ["lstm_luong", *(pytest.param(name, marks=pytest.mark.slow)
                                                  for name in ("transformer", "transformer_rope_local", "lstm_bahdanau", "lstm"))])
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

    def keep_first(self, parity, reads=None, state=None):
        step(self, parity, reads, state)
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


class HostReadsRefused(torch.utils._python_dispatch.TorchDispatchMode):
    """A replayed step may not read a value to the host: a real capture refuses it (and a graph
    would replay the value read at capture)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        return func(*args, **(kwargs or {}))


def places(b) -> dict[str, torch.Tensor]:
    """Every tensor a step of the search ``b`` reads or writes, by where it sits in ``b``."""
    found = {}

    def walk(name, tree):
        if isinstance(tree, torch.Tensor):
            found[name] = tree
        elif isinstance(tree, dict):
            for key, value in tree.items():
                walk(f"{name}.{key}", value)
        elif isinstance(tree, (list, tuple)):
            for i, value in enumerate(tree):
                walk(f"{name}[{i}]", value)

    for name in ("memory", "prefix", "caps", "searching", "t", "prev", "beam_scores", "history", "best_scores",
                 "best_tokens", "num_finished", "states"):
        walk(name, getattr(b, name))
    return found


def same_tree(tree):
    """``tree``'s containers rebuilt around the same tensors: what a later assignment into them leaves alone."""
    if isinstance(tree, dict):
        return {key: same_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(same_tree(value) for value in tree)
    return tree


def simulate_capture(monkeypatch, self_check: bool = False) -> list:
    """CUDA graph capture simulated on the CPU, faithful where the real thing is fragile: a capture
    records the search's tensors and their addresses and runs nothing (a real one records kernels);
    each replay first checks that every tensor of the search is still the one captured, at its
    address (a batch assigned to an attribute instead of copied into the captured tensor fails
    here), then runs the step on the tensors captured (what a replay reads), refusing host reads.
    ``self_check``: whether the search's self-check against the loop runs (off, a test of the fixed
    shapes would compare the loop with itself)."""
    captures = []
    monkeypatch.setattr(fixed_beam, "_captures", lambda device: True)
    monkeypatch.setattr(fixed_beam, "_Stream", lambda device: type("Side", (), {"run": lambda self, fn: fn()})())
    if not self_check:
        monkeypatch.setattr(search, "CHECKED_SEARCHES", 0)

    def capture(step, side, kept):
        owner = step.func  # the search's _Step
        b = owner.b
        captured = dataclasses.replace(b, memory=same_tree(b.memory), states=same_tree(b.states))
        addresses = {name: x.data_ptr() for name, x in places(b).items()}

        def replay():
            now = {name: x.data_ptr() for name, x in places(owner.b).items()}
            moved = [name for name in addresses if now.get(name) != addresses[name]]
            assert not moved and now.keys() == addresses.keys(), \
                f"a replay reads {moved or sorted(now.keys() ^ addresses.keys())} where they were captured, not where they are now"
            live, owner.b = owner.b, captured
            try:
                with HostReadsRefused():
                    step()
            finally:
                owner.b = live

        captures.append(step)
        return replay

    monkeypatch.setattr(fixed_beam, "_captured", capture)
    return captures


def test_captured_steps_are_kept_per_shape_and_retired_when_the_weights_change(monkeypatch):
    """With capture simulated on the CPU: a step is captured once per padded batch shape, copy of
    the state it reads and bucket of cache positions it reads, after ``WARMUP_STEPS`` eager steps,
    and replayed for every later batch of that shape with the loop's results; a change of the
    weights in place retires the captures."""
    captures = simulate_capture(monkeypatch)
    model = build("transformer")
    options = {"beam_size": 3, "nbest": 2, "max_len_a": 2.0, "max_len_b": 6}
    batches = [batch(lengths=lengths, seed=seed)[:2] for lengths, seed in (((9, 7, 6), 0), ((8, 9, 5), 1), ((3, 2), 2))]
    for src, src_mask in batches:
        assert_same_search(beam_search(model, src, src_mask, engine="loop", **options),
                           beam_search(model, src, src_mask, engine="graphs", **options))
    # 3 x 9 and 3 x 9 padded to 3 x 12, 24 steps: one shape, whose steps read 16 positions of the cache
    # and then 24; 2 x 3 another (12 steps: 12 positions); a graph for each copy of the decoder's state
    # the step reads and each count of positions
    assert [step.args for step in captures] == [(1, 16), (0, 16), (0, 24), (1, 24), (1, 12), (0, 12)]
    assert [shape[:3] for shape in fixed_beam.kept_shapes(model)] == [(3, 12, 24), (2, 3, 12)]
    with torch.no_grad():
        model.decoder.out.weight.mul_(1.5)
    src, src_mask = batches[0]
    assert_same_search(beam_search(model, src, src_mask, engine="loop", **options),
                       beam_search(model, src, src_mask, engine="graphs", **options))
    assert len(captures) > 6 and len(fixed_beam.kept_shapes(model)) == 1
    copy.deepcopy(model)  # a model with captured searches still copies (they are kept beside it)


@pytest.mark.parametrize("name", ["transformer", "lstm_luong"])
def test_a_replay_reads_the_captured_tensors_and_a_result_outlives_the_next_search(monkeypatch, name):
    """Two batches of one padded shape, sentences of different lengths (padded masks) and different
    prefixes, replayed in turn from one capture: each search gives the loop's results, which stay so
    after the next search of that shape (nothing returned is a view of the kept tensors), and no
    caller's tensor is written by a later search (the kept search holds copies)."""
    captures = simulate_capture(monkeypatch)
    model = build(name)
    options = {"beam_size": 3, "nbest": 2}
    first, second = batch(lengths=(8, 5, 7, 3), seed=0)[:2], batch(lengths=(6, 8, 2, 4), seed=1)[:2]
    prefixes = torch.tensor([[7, 8], [5, PAD], [PAD, PAD], [6, 6]]), torch.tensor([[9, PAD], [PAD, PAD], [4, 5], [8, PAD]])
    masks = [first[1].clone(), second[1].clone()]
    loops = [beam_search(model, *pair, engine="loop", prefix=p, **options) for pair, p in zip((first, second), prefixes)]
    held = []
    for _ in range(2):  # the second round restarts the kept search twice more
        for pair, p in zip((first, second), prefixes):
            held.append(beam_search(model, *pair, engine="graphs", prefix=p, **options))
    for loop, result in zip(loops * 2, held):
        assert_same_search(loop, result)
    assert torch.equal(first[1], masks[0]) and torch.equal(second[1], masks[1])
    assert len(fixed_beam.kept_shapes(model)) == 1 and captures and fixed_beam.restarts(model) == 3


def test_the_simulated_replay_refuses_a_host_read(monkeypatch):
    """A step that reads a value to the host (here the step number, to index with) cannot be
    captured: the simulated replay refuses it as a capture would."""
    simulate_capture(monkeypatch)
    model = build("transformer")
    step = fixed_beam._Step.__call__

    def reads_t(self, parity, reads=None, state=None):
        int(self.b.t)
        step(self, parity, reads, state)

    monkeypatch.setattr(fixed_beam._Step, "__call__", reads_t)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        beam_search(model, *batch(lengths=LENGTHS)[:2], engine="graphs")


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


def test_kept_searches_are_bounded_in_bytes_and_released(monkeypatch, caplog):
    """Kept searches are the most recently used ones within ``graph_cache_mb`` of their tensors; a
    search over the budget alone runs eagerly (no capture, logged); ``release`` drops them."""
    captures = simulate_capture(monkeypatch)
    model = build("transformer")
    small, large = batch(lengths=(8, 5, 7, 3))[:2], batch(lengths=(20, 15))[:2]
    beam_search(model, *small, engine="graphs")
    one = fixed_beam.kept_bytes(model)
    beam_search(model, *large, engine="graphs")
    two = fixed_beam.kept_bytes(model)
    assert len(fixed_beam.kept_shapes(model)) == 2 and two > one > 0
    fixed_beam.release(model)
    mb = (two - one + one // 2) / (1 << 20)  # room for the large search, not for both
    for pair in (small, large):
        beam_search(model, *pair, engine="graphs", graph_cache_mb=mb)
    assert [shape[:2] for shape in fixed_beam.kept_shapes(model)] == [(2, 20)] and fixed_beam.kept_bytes(model) == two - one
    fixed_beam.release(model)
    assert fixed_beam.kept_shapes(model) == [] and fixed_beam.kept_bytes(model) == 0
    count = len(captures)
    with caplog.at_level(logging.INFO, logger="nmt.decoding.fixed_beam"):
        assert_same_search(beam_search(model, *small, engine="loop"), beam_search(model, *small, engine="graphs",
                                                                                   graph_cache_mb=one / 2 / (1 << 20)))
    assert len(captures) == count and fixed_beam.kept_shapes(model) == []
    assert "search eagerly: over decoding.graph_cache_mb=" in caplog.text


def test_a_step_reads_the_cache_positions_filled_to_their_bucket(monkeypatch):
    """Step t attends over (and reorders) the first ``read_positions(t)`` positions of the cache, a
    power of two from 16, not its whole capacity, and the search stays the loop's."""
    from nmt.models.transformer import DecoderLayer

    seen = []
    attend = DecoderLayer._self

    def spy(self, x, cache, offset, weights=None):
        if isinstance(offset, torch.Tensor):
            seen.append((int(offset[0]), cache["k"].size(2)))
        return attend(self, x, cache, offset, weights)

    monkeypatch.setattr(DecoderLayer, "_self", spy)
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(9, 7, 6))
    options = {"beam_size": 3, "max_len_a": 3.0, "max_len_b": 10, "alpha": 0.0}  # 37 steps at most
    loop = beam_search(model, src, src_mask, engine="loop", **options)
    assert_same_search(loop, beam_search(model, src, src_mask, engine="fixed", **options))
    capacity = seen[0][1]  # step 0 reads the whole cache (it makes the state's copies)
    assert capacity == 37 and max(t for t, _ in seen) >= 16
    assert all(size == fixed_beam.read_positions(t, capacity) for t, size in seen if t > 0)
    assert {size for t, size in seen if t > 0} == {16, 32, 37}
    assert [fixed_beam.read_positions(t, 100) for t in (1, 15, 16, 31, 32, 64, 99)] == [16, 16, 32, 32, 64, 100, 100]


def test_a_source_longer_than_the_encoders_positions_is_refused():
    model = build("transformer")
    model.encoder.embed_tokens.max_len = 10
    src, src_mask, _ = batch(lengths=(11, 4))
    for graphs in (False, True):
        with pytest.raises(ValueError, match=r"^a source of 11 tokens: the encoder has positions for 10; shorten or "
                                             r"split it \(translate.py and nmt-serve cut sources at the model's max_src_len\)$"):
            fixed_beam.fixed_beam_search(model, src, src_mask, 2, 0.6, 1.5, 10, graphs=graphs)


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


def test_the_fixed_shapes_check_themselves_against_the_loop_and_fall_back_for_good(monkeypatch, caplog):
    """On a GPU (capture simulated), a model's first fixed-shape searches also run the loop, until
    one has replayed a kept capture: right captured steps agree and the fixed shapes then run
    alone; a captured step that feeds back a wrong token (7, whatever it chose) differs on the
    first search: one warning, the loop's hypotheses, and the loop for that model from then on."""
    simulate_capture(monkeypatch, self_check=True)
    first, second = batch(lengths=(8, 5, 7, 3), seed=0)[:2], batch(lengths=(6, 8, 2, 4), seed=1)[:2]
    model = build("transformer")
    loops = [beam_search(model, *pair, engine="loop") for pair in (first, second, first)]
    for pair, loop in zip((first, second, first), loops):
        assert_same_search(loop, beam_search(model, *pair, engine="graphs"))
    check = search._CHECKS[model]
    assert (check.searches, check.replayed, search.fell_back(model)) == (2, True, False)  # the third ran alone

    right = fixed_beam._captured

    def feeds_seven(step, side, kept):
        replay = right(step, side, kept)

        def wrong():
            replay()
            step.func.b.prev.fill_(7)
        return wrong

    monkeypatch.setattr(fixed_beam, "_captured", feeds_seven)
    model = build("transformer")
    with caplog.at_level(logging.WARNING, logger="nmt.decoding.search"):
        assert_same_search(loops[0], beam_search(model, *first, engine="graphs"))
        monkeypatch.setattr(search, "fixed_beam_search", lambda *args, **kwargs: pytest.fail("the fixed shapes ran"))
        assert_same_search(loops[1], beam_search(model, *second, engine="graphs"))
        assert greedy_search(model, *first, engine="fixed").tokens == greedy_search(model, *first, engine="loop").tokens
    assert search.fell_back(model) and fixed_beam.kept_shapes(model) == []
    assert [r.getMessage() for r in caplog.records] == [
        "decoding.engine=graphs: the fixed-shape search differs from the loop on 100% of a checked batch's 4 sentences "
        "(tolerance 20%); this model decodes with the loop engine from here on"]
