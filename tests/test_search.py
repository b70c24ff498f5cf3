"""Greedy and beam search on every model: beam 1 is greedy, batching changes nothing, and beam
search finds at least as good a hypothesis as greedy under the model."""

from __future__ import annotations

import pytest
import torch

from nmt.decoding import search as decoding
from nmt.bench.decoding import NoCache
from nmt.data.tokenizer import EOS
from nmt.decoding.scoring import best_possible
from nmt.decoding.search import beam_search, greedy_search, length_penalty
from tests.test_models import VARIANTS, batch, build, kernels  # noqa: F401  (kernels: each test in both modes)


def assert_beam_one_is_greedy(model, src, src_mask):
    greedy = greedy_search(model, src, src_mask, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, src_mask, beam_size=1, alpha=0.0, max_len_a=1.0, max_len_b=5)
    assert beam.tokens == greedy.tokens
    torch.testing.assert_close(beam.scores, greedy.scores, atol=1e-4, rtol=1e-4)


def assert_batched_equals_alone(model, search, src, src_mask):
    together = search(model, src, src_mask)
    for i in range(src.size(0)):
        n = int(src_mask[i].sum())
        alone = search(model, src[i : i + 1, :n], src_mask[i : i + 1, :n])
        assert alone.tokens[0] == together.tokens[i]
        torch.testing.assert_close(alone.scores[0], together.scores[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_beam_size_one_equals_greedy(name):
    assert_beam_one_is_greedy(build(name), *batch()[:2])


@pytest.mark.parametrize("name", ["lstm_bahdanau", "transformer"])
def test_padding_rows_of_the_vocabulary_are_never_generated(name):
    """A vocabulary of 37 gets 40 output rows; even when the 3 padding rows score highest,
    decoding only ever picks real ids."""
    model = build(name, vocab=37)
    assert model.decoder.out.weight.shape[0] == 40
    decode_step = model.decode_step

    def padding_wins(*args, **kwargs):
        logits, state, attn = decode_step(*args, **kwargs)
        return logits.index_fill(-1, torch.arange(37, 40), 100.0), state, attn

    model.decode_step = padding_wins
    src, src_mask, _ = batch()
    for search in (greedy_search, beam_search):
        hyps = search(model, src.clamp(max=36), src_mask, max_len_a=1.0, max_len_b=5)
        assert all(t < 37 for tokens in hyps.tokens for t in tokens)
        assert all(len(tokens) > 0 for tokens in hyps.tokens)  # real tokens, not an early stop


@pytest.mark.parametrize("name", ["lstm_luong", "transformer", "hybrid_transformer_luong"])
@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_batched_decoding_equals_one_by_one(name, search):
    assert_batched_equals_alone(build(name), search, *batch(lengths=(8, 5, 2))[:2])


def test_beam_search_drops_finished_sentences_without_changing_any_result():
    """Sentences end at different steps (their length caps differ), leave the batch, and every
    sentence still gets what it gets alone: tokens, score and attention."""
    model = build("lstm_bahdanau")
    src, src_mask, _ = batch(lengths=(9, 2, 5, 3))
    rows = []
    original = model.decode_step

    def spy(prev, *args, **kwargs):
        rows.append(prev.size(0))
        return original(prev, *args, **kwargs)

    model.decode_step = spy
    together = beam_search(model, src, src_mask, beam_size=3, max_len_a=1.0, max_len_b=1, need_attn=True)
    assert rows[0] == 12 and rows[-1] == 3 and rows == sorted(rows, reverse=True)  # the batch shrinks
    model.decode_step = original
    for i in range(src.size(0)):
        n = int(src_mask[i].sum())
        alone = beam_search(model, src[i : i + 1, :n], src_mask[i : i + 1, :n], beam_size=3, max_len_a=1.0,
                            max_len_b=1, need_attn=True)
        assert alone.tokens[0] == together.tokens[i]
        torch.testing.assert_close(alone.scores[0], together.scores[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.attn[0], together.attn[i][:, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["lstm_bahdanau", "transformer"])
def test_beam_finds_a_hypothesis_at_least_as_probable_as_greedy(name):
    model = build(name)
    src, src_mask, _ = batch(lengths=(6, 4))
    greedy = greedy_search(model, src, src_mask)
    beam = beam_search(model, src, src_mask, beam_size=4, alpha=0.0)
    assert (beam.scores >= greedy.scores - 1e-4).all()


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_output_length_is_capped_and_attention_returned(search):
    model = build("lstm_bahdanau")
    src, src_mask, _ = batch(lengths=(6, 3))
    hyps = search(model, src, src_mask, max_len_a=0.0, max_len_b=4, need_attn=True)
    assert all(len(t) <= 3 for t in hyps.tokens)  # 4 steps, the last one EOS
    for tokens, attn, n in zip(hyps.tokens, hyps.attn, src_mask.sum(1).tolist()):
        assert attn.shape == (len(tokens) + 1, src.size(1))
        torch.testing.assert_close(attn.sum(-1), torch.ones(len(tokens) + 1))
        assert attn[:, n:].abs().sum() == 0


def test_models_without_attention_return_none():
    model = build("lstm")
    src, src_mask, _ = batch()
    assert greedy_search(model, src, src_mask, need_attn=True).attn is None
    assert beam_search(model, src, src_mask, need_attn=True).attn is None


def test_length_penalty_is_gnmt():
    assert length_penalty(torch.tensor(1), 0.0).item() == 1.0
    assert abs(length_penalty(torch.tensor(7), 1.0).item() - 2.0) < 1e-6


@pytest.mark.parametrize("vocab", [37, 64, 300, 1000, 8003])
def test_chunked_candidates_equal_a_top_k_over_every_score(vocab, kernels):
    """Beam search's chunked top-k returns the same scores and indices as a top-k over all
    K * W scores, also with beams at -inf (the first step: with 300 ids fewer finite chunks than
    candidates) and a sentence whose rows are masked to EOS."""
    from nmt.data.tokenizer import EOS
    from nmt.decoding.scoring import log_probs as _log_probs, top_candidates as _top_candidates
    from nmt.kernels import Kernels

    gen = torch.Generator().manual_seed(vocab)
    n, k = 7, 5
    logits = torch.randn(n * k, vocab + 5, generator=gen) * 4
    x = _log_probs(logits, vocab, Kernels(kernels))
    capped = x[3 * k : 4 * k]  # one sentence at its length cap: only EOS may follow
    capped.masked_fill_(torch.arange(x.size(1)) != EOS, float("-inf"))
    beam_scores = torch.randn(n, k, generator=gen) * 10
    beam_scores[0, 1:] = float("-inf")
    top, idx = _top_candidates(x, beam_scores, 2 * k)
    full = (beam_scores.unsqueeze(-1) + x.view(n, k, -1)).view(n, -1)
    ref_top, ref_idx = full.topk(2 * k, dim=1)
    torch.testing.assert_close(top, ref_top, atol=0, rtol=0)
    finite = ref_top > float("-inf")
    assert torch.equal(idx[finite], ref_idx[finite])


@pytest.mark.parametrize("vocab, width, dtype", [(100, 104, torch.bfloat16), (128, 128, torch.bfloat16), (128, 128, torch.float32), (128, 136, torch.float32)])
def test_log_probs_are_a_log_softmax_over_the_real_vocabulary(vocab, width, dtype, kernels):
    """Padded or not, bf16 or fp32 (normalised in place): a log-softmax over the first ``vocab``
    logits, with PAD, BOS and the columns past the vocabulary at -inf."""
    from nmt.data.tokenizer import BOS, PAD
    from nmt.decoding.scoring import log_probs as _log_probs
    from nmt.kernels import Kernels

    logits = torch.randn(4, width, dtype=dtype) * 5
    ref = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    x = _log_probs(logits, vocab, Kernels(kernels))
    assert x.shape == (4, -(-vocab // 64) * 64) and x.dtype == torch.float32
    assert torch.isinf(x[:, vocab:]).all() and torch.isinf(x[:, PAD]).all() and torch.isinf(x[:, BOS]).all()
    keep = [i for i in range(vocab) if i not in (PAD, BOS)]
    torch.testing.assert_close(x[:, keep], ref[:, keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [600, 128])
def test_large_vocabulary_beam_search_agrees_with_greedy_and_batching(vocab):
    """With 600 target ids beam search takes the chunked candidate path (and 128, a multiple of
    the chunk, normalises the logits in place): beam 1 still equals greedy, and a batch decodes
    as its sentences do alone."""
    model = build("transformer", vocab=vocab)
    src, src_mask, _ = batch(lengths=(8, 5, 2))
    assert_beam_one_is_greedy(model, src, src_mask)
    assert_batched_equals_alone(model, beam_search, src, src_mask)


def test_fp64_model_decodes():
    """Scores stay fp32 whatever the model's dtype (an fp64 model once failed in beam search)."""
    model = build("lstm_luong").double()
    src, src_mask, _ = batch()
    greedy = greedy_search(model, src, src_mask, max_len_a=1.0, max_len_b=5)
    beam1 = beam_search(model, src, src_mask, beam_size=1, alpha=0.0, max_len_a=1.0, max_len_b=5)
    assert beam1.tokens == greedy.tokens and beam1.scores.dtype == torch.float32


def test_a_sentence_capped_at_one_token_next_to_a_long_one():
    """A sentence whose cap is reached at the first step ends there with EOS (its other
    candidates are -inf and may point at the vocabulary's padding columns), while the other one
    decodes as it does alone."""
    model = build("transformer", vocab=600)
    src, src_mask, _ = batch(lengths=(8, 1))
    together = beam_search(model, src, src_mask, max_len_a=0.5, max_len_b=1)
    assert together.tokens[1] == []
    alone = beam_search(model, src[:1], src_mask[:1], max_len_a=0.5, max_len_b=1)
    assert alone.tokens[0] == together.tokens[0]


@pytest.mark.parametrize("alpha", [0.0, 0.6, -0.5])
def test_beam_search_stops_a_sentence_no_live_hypothesis_can_improve_on_without_changing_it(alpha, monkeypatch):
    """The bound on what a live hypothesis can still reach saves steps; searching on until
    beam_size hypotheses have ended finds the same hypotheses."""
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(8, 5, 2, 6))
    steps = []
    decode_step = model.decode_step

    def eos_likely(*args, **kwargs):  # hypotheses end early, some long before the cap
        steps.append(1)
        logits, state, attn = decode_step(*args, **kwargs)
        return logits.index_add(-1, torch.tensor([EOS]), torch.full((logits.size(0), 1), 1.0)), state, attn

    model.decode_step = eos_likely
    kwargs = {"beam_size": 3, "alpha": alpha, "max_len_a": 2.0, "max_len_b": 6}
    bounded = beam_search(model, src, src_mask, **kwargs)
    bounded_steps, steps[:] = len(steps), []
    monkeypatch.setattr(decoding, "best_possible", lambda score, *_: torch.full_like(score, float("inf")))
    exhaustive = beam_search(model, src, src_mask, **kwargs)
    assert bounded.tokens == exhaustive.tokens
    torch.testing.assert_close(bounded.scores, exhaustive.scores)
    assert bounded_steps < len(steps), (bounded_steps, len(steps))


def test_best_possible_score_of_a_live_hypothesis():
    score, max_len = torch.tensor([-3.0]), torch.tensor([10])
    # alpha > 0: the longest ending divides by the largest penalty; alpha < 0: the shortest
    assert best_possible(score, 4, max_len, 1.0).item() == pytest.approx(-3.0 / ((5 + 10) / 6))
    assert best_possible(score, 4, max_len, -1.0).item() == pytest.approx(-3.0 / ((5 + 6) / 6) ** -1)
    assert best_possible(score, 4, max_len, 0.0).item() == -3.0


def test_beam_search_with_the_key_value_cache_equals_rerunning_the_prefix():
    """Beams reorder the cache's rows and sentences leave the batch, and the search still finds
    what re-running the decoder over the prefix finds (``nmt.bench.decoding.NoCache``)."""
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(9, 4, 2, 6))
    cached = beam_search(model, src, src_mask, beam_size=4, max_len_a=1.0, max_len_b=3)
    rerun = beam_search(NoCache(model), src, src_mask, beam_size=4, max_len_a=1.0, max_len_b=3)
    assert cached.tokens == rerun.tokens
    torch.testing.assert_close(cached.scores, rerun.scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_per_sentence_caps_stop_each_sentence_below_the_source_cap(search):
    """Validation's caps (from the references) end a sentence at its own cap; a cap above the
    source-length one changes nothing for its sentence."""
    model = build("transformer", vocab=600)
    src, src_mask, _ = batch(lengths=(6, 3))
    free = search(model, src, src_mask, max_len_a=1.0, max_len_b=8)
    capped = search(model, src, src_mask, max_len_a=1.0, max_len_b=8, max_len=torch.tensor([2, 100]))
    assert len(capped.tokens[0]) <= 1 and capped.tokens[1] == free.tokens[1]
    if search is greedy_search:
        assert capped.tokens[0] == free.tokens[0][:1]


def test_validation_caps_hypotheses_by_the_reference_and_the_test_never_sees_it():
    from types import SimpleNamespace

    from nmt.decoding.search import Hypotheses
    from nmt.training.lit_module import TranslationModule

    calls = []

    def search(model, src, src_mask, **options):
        calls.append(options)
        return Hypotheses([[5]] * src.size(0), torch.zeros(src.size(0)))

    module = TranslationModule(torch.nn.Linear(2, 2), optimizer=None, val_decoding=search, test_decoding=search)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(tgt_vocab=SimpleNamespace(
        decode_batch=lambda tokens: ["x"] * len(tokens))))
    tgt_out = torch.tensor([[7, 8, 9, EOS], [7, EOS, 0, 0]])  # references of 3 and 1 tokens, then PAD
    batch_ = {"src": torch.ones(2, 3, dtype=torch.long), "src_mask": torch.ones(2, 3, dtype=torch.bool),
              "tgt_out": tgt_out, "ids": torch.tensor([0, 1])}
    try:
        module._decode(batch_, "val")
        module._decode(batch_, "test")
    finally:
        module._trainer = None
    assert calls[0]["max_len"].tolist() == [int(1.5 * 3 + 5) + 1, int(1.5 * 1 + 5) + 1]  # tokens + EOS
    assert "max_len" not in calls[1]


def test_huggingface_scoring_settings_and_their_refusals():
    """``decoding.scoring``/``early_stopping`` are read, refused in one line when unknown, and a
    ``null`` scoring becomes the model's (an imported folder's ``huggingface``) or ``gnmt``."""
    from nmt.decoding.settings import SearchSettings

    beam = {"_target_": "nmt.decoding.search.beam_search"}
    chosen = SearchSettings.from_config({**beam, "scoring": "huggingface", "early_stopping": "never", "alpha": 2.0})
    assert (chosen.scoring, chosen.early_stopping) == ("huggingface", "never")
    assert chosen.for_model(0.6, "gnmt").scoring == "huggingface"  # the user's choice stays
    plain = SearchSettings.from_config(beam)
    assert (plain.for_model(1.0, "huggingface", True).scoring, plain.for_model(1.0, "huggingface", True).alpha,
            plain.for_model(1.0, "huggingface", True).early_stopping) == ("huggingface", 1.0, True)
    assert plain.for_model(None).scoring == "gnmt" and plain.for_model(None, "huggingface", "sometimes").early_stopping is False
    with pytest.raises(ValueError, match=r"^decoding.scoring='hf': choose one of gnmt, huggingface \(null: the model's\)$"):
        SearchSettings.from_config({**beam, "scoring": "hf"})
    with pytest.raises(ValueError, match=r"^decoding.early_stopping=1: choose false, true or never$"):
        SearchSettings.from_config({**beam, "early_stopping": 1})
    with pytest.raises(ValueError, match=r"^decoding.scoring: not an option of greedy search"):
        SearchSettings.from_config({"_target_": "nmt.decoding.search.greedy_search", "scoring": "gnmt"})


def test_graph_cache_mb_is_read_bounded_and_reaches_the_search():
    """``decoding.graph_cache_mb`` (beam and greedy) reaches the search every front end builds
    (translate.py, nmt-serve, validation: ``search_of``); a negative budget is refused in one line."""
    from nmt.decoding.search import search_of
    from nmt.decoding.settings import GRAPH_CACHE_MB, SearchSettings

    for target in ("beam_search", "greedy_search"):
        settings = SearchSettings.from_config({"_target_": f"nmt.decoding.search.{target}", "graph_cache_mb": 64})
        assert settings.graph_cache_mb == 64 and search_of(settings).keywords["graph_cache_mb"] == 64
        assert settings.as_config()["graph_cache_mb"] == 64
    assert search_of(SearchSettings.from_config(None)).keywords["graph_cache_mb"] == GRAPH_CACHE_MB == 2048
    with pytest.raises(ValueError, match=r"^decoding.graph_cache_mb=-1: must be from 0.0 to 1,048,576.0$"):
        SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search", "graph_cache_mb": -1})
