"""n-best lists, sampling and teacher-forced scoring agree with each other and with greedy/beam
search, on every kind of model."""

from __future__ import annotations

import pytest
import torch

from nmt.data.tokenizer import EOS, PAD
from nmt.kernels import Kernels
from nmt.decoding.scoring import log_probs as _log_probs
from nmt.decoding.search import _sampler, beam_search, greedy_search, length_penalty, sample_search, score_pairs
from tests.test_models import VOCAB, batch, build

MODELS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer", "hybrid_transformer_luong"]
LIMITS = {"max_len_a": 1.0, "max_len_b": 5}


def padded(token_lists: list[list[int]]) -> torch.Tensor:
    """Targets followed by EOS, PAD-padded: what ``score_pairs`` takes."""
    tgt = torch.full((len(token_lists), max(map(len, token_lists)) + 1), PAD)
    for i, tokens in enumerate(token_lists):
        tgt[i, : len(tokens) + 1] = torch.tensor([*tokens, EOS])
    return tgt


@pytest.mark.parametrize("name", MODELS)
def test_the_score_of_a_greedy_output_is_the_score_greedy_search_gave(name):
    model = build(name)
    src, src_mask, _ = batch(lengths=(7, 5, 3, 6))
    greedy = greedy_search(model, src, src_mask, **LIMITS)
    per_token = score_pairs(model, src, src_mask, padded(greedy.tokens))
    torch.testing.assert_close(per_token.sum(1), greedy.scores, atol=1e-4, rtol=1e-4)
    assert (per_token[padded(greedy.tokens) == PAD] == 0).all()


@pytest.mark.parametrize("name", ["lstm_luong", "transformer"])
def test_nbest_lists_are_ranked_scored_hypotheses_headed_by_the_best(name):
    model = build(name)
    src, src_mask, _ = batch(lengths=(7, 5, 3))
    one = beam_search(model, src, src_mask, beam_size=4, **LIMITS)
    hyps = beam_search(model, src, src_mask, beam_size=4, nbest=3, **LIMITS)
    assert hyps.tokens == one.tokens and torch.equal(hyps.scores, one.scores) and one.nbest is None
    for i, ranked in enumerate(hyps.nbest):
        assert len(ranked) == 3 and ranked[0] == (hyps.tokens[i], hyps.scores[i].item())
        assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
        assert len({tuple(t) for t, _ in ranked}) == 3
        # Each score is the hypothesis' log-probability under the model over the GNMT penalty.
        tokens = [t for t, _ in ranked]
        logprob = score_pairs(model, src[i : i + 1].expand(3, -1), src_mask[i : i + 1].expand(3, -1), padded(tokens)).sum(1)
        lengths = torch.tensor([len(t) + 1 for t in tokens])
        torch.testing.assert_close(torch.tensor([s for _, s in ranked]), logprob / length_penalty(lengths, 0.6),
                                   atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="nbest=5: must be between 1 and the beam size"):
        beam_search(model, src, src_mask, beam_size=4, nbest=5)


def test_nbest_of_a_sentence_does_not_depend_on_its_batch():
    model = build("transformer")
    src, src_mask, _ = batch(lengths=(8, 5, 2))
    together = beam_search(model, src, src_mask, beam_size=3, nbest=3, need_attn=True, **LIMITS)
    for i in range(3):
        n = int(src_mask[i].sum())
        alone = beam_search(model, src[i : i + 1, :n], src_mask[i : i + 1, :n], beam_size=3, nbest=3, **LIMITS)
        assert [t for t, _ in alone.nbest[0]] == [t for t, _ in together.nbest[i]]
        torch.testing.assert_close(torch.tensor([s for _, s in alone.nbest[0]]),
                                   torch.tensor([s for _, s in together.nbest[i]]), atol=1e-5, rtol=1e-5)
        assert together.attn[i].shape[0] == len(together.tokens[i]) + 1


@pytest.mark.parametrize("name", MODELS)
def test_sampling_near_zero_temperature_is_greedy_and_a_seed_repeats(name):
    model = build(name)
    src, src_mask, _ = batch(lengths=(7, 5, 3, 6))
    greedy = greedy_search(model, src, src_mask, **LIMITS)
    for kwargs in ({"temperature": 1e-8}, {"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-9}):
        assert sample_search(model, src, src_mask, **kwargs, **LIMITS).tokens == greedy.tokens, kwargs
    a = sample_search(model, src, src_mask, seed=3, **LIMITS)
    assert sample_search(model, src, src_mask, seed=3, **LIMITS).tokens == a.tokens
    assert a.tokens != greedy.tokens  # an untrained model's distribution is flat: samples differ
    assert sample_search(model, src, src_mask, seed=4, **LIMITS).tokens != a.tokens
    # Scores are the model's log-probabilities of the drawn tokens.
    torch.testing.assert_close(score_pairs(model, src, src_mask, padded(a.tokens)).sum(1), a.scores, atol=1e-4, rtol=1e-4)


def test_top_k_and_top_p_restrict_the_draws():
    torch.manual_seed(0)
    x = _log_probs(torch.randn(4, VOCAB) * 3, VOCAB, Kernels())
    rows = x.repeat(500, 1)
    probs = x.softmax(-1)  # PAD and BOS are never drawn: the rest renormalised
    order = probs.argsort(dim=1, descending=True)
    g = torch.Generator().manual_seed(0)
    drawn = _sampler(1.0, 3, 1.0, g)(rows).view(500, 4)
    for r in range(4):
        assert set(drawn[:, r].tolist()) == set(order[r, :3].tolist())
    nucleus_mass = 0.6
    drawn = _sampler(1.0, 0, nucleus_mass, g)(rows).view(500, 4)
    for r in range(4):
        mass_before = probs[r, order[r]].cumsum(0) - probs[r, order[r]]
        nucleus = set(order[r, mass_before < nucleus_mass].tolist())
        assert set(drawn[:, r].tolist()) <= nucleus and len(set(drawn[:, r].tolist())) == len(nucleus)
    with pytest.raises(ValueError, match="top_p=0"):
        sample_search(build("lstm"), *batch()[:2], top_p=0)
