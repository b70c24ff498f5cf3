"""Beam search against brute force: on a vocabulary of 6 (3 tokens besides EOS can be generated)
and outputs of at most 4 tokens, EOS included, every one of the 40 possible outputs is scored; a
beam wide enough to hold every candidate returns the best by score / length penalty, and its
n-best list is the exact ranking. Greedy search follows the most probable token at each step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from nmt.decoding.search import beam_search, greedy_search, length_penalty
from nmt.specials import BOS, EOS, PAD, UNK
from nmt.training.builders import instantiate_model
from tests.conftest import CONF_DIR, heads

VOCAB = 6
CAP = 4  # tokens, EOS included: max_len_a=0, max_len_b=CAP
WORDS = [UNK, 4, 5]  # what can be generated besides EOS (PAD and BOS never are)
OUTPUTS = [list(words) for n in range(CAP) for words in itertools.product(WORDS, repeat=n)]  # 1 + 3 + 9 + 27
WIDE = len(OUTPUTS)  # at least every step's number of candidates: a beam that prunes nothing


MODELS = ["lstm_luong", "transformer"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """A model of width 8 from its preset, every weight drawn from N(0, 1) (fixed seed): large
    enough that the next-token distribution changes clearly with the source and the prefix."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={request.param}", "model.emb_size=8", "model.hidden_size=8",
                                          "model.dropout=0.0", *heads(request.param)])
    with open_dict(cfg):
        cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = VOCAB  # a joint vocabulary: the Transformer ties them
    model = instantiate_model(cfg.model).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.normal_()
    return model


SOURCES = torch.tensor([[4, 5, 4, 5], [5, 5, UNK, PAD], [4, PAD, PAD, PAD]])  # three sentences, padded
MASK = SOURCES != PAD


@torch.no_grad()
def log_probs(model, i: int) -> list[float]:
    """Sentence ``i``'s log-probability of each of ``OUTPUTS`` followed by EOS, teacher-forced
    through the model's forward pass (a softmax over the real vocabulary)."""
    tgt_in = torch.full((len(OUTPUTS), CAP), PAD)
    tgt_out = torch.full((len(OUTPUTS), CAP), PAD)
    for row, out in enumerate(OUTPUTS):
        tgt_in[row, : len(out) + 1] = torch.tensor([BOS, *out])
        tgt_out[row, : len(out) + 1] = torch.tensor([*out, EOS])
    src, mask = SOURCES[i : i + 1].expand(len(OUTPUTS), -1), MASK[i : i + 1].expand(len(OUTPUTS), -1)
    x = torch.log_softmax(model(src, mask, tgt_in)[..., :VOCAB].float(), -1)
    x = x.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1).masked_fill(tgt_out == PAD, 0.0)
    return x.sum(1).tolist()


def ranking(model, i: int, alpha: float) -> list[tuple[list[int], float]]:
    """Every possible output for sentence ``i`` with its length-normalised score, best first."""
    penalties = [float(length_penalty(torch.tensor(len(out) + 1), alpha)) for out in OUTPUTS]
    scored = [(out, lp / pen) for out, lp, pen in zip(OUTPUTS, log_probs(model, i), penalties)]
    return sorted(scored, key=lambda pair: -pair[1])


def search(model, alpha: float, nbest: int = 1):
    return beam_search(model, SOURCES, MASK, beam_size=WIDE, alpha=alpha, max_len_a=0, max_len_b=CAP, nbest=nbest)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_beam_that_prunes_nothing_finds_the_best_output_and_ranks_them_all(model, alpha):
    hyps = search(model, alpha, nbest=WIDE)
    for i in range(len(SOURCES)):
        truth = ranking(model, i, alpha)
        assert hyps.tokens[i] == truth[0][0]
        assert float(hyps.scores[i]) == pytest.approx(truth[0][1], abs=1e-4)
        assert [out for out, _ in hyps.nbest[i]] == [out for out, _ in truth]
        assert [score for _, score in hyps.nbest[i]] == pytest.approx([score for _, score in truth], abs=1e-4)


@pytest.mark.parametrize("alpha", [0.6, 2.0])
@pytest.mark.parametrize("nbest", [1, 5])
def test_a_short_nbest_list_is_the_head_of_the_ranking(model, alpha, nbest):
    """With nbest below the beam, the search may stop early (no live hypothesis can still beat
    the last of the n best): what it returns is still the exact head of the ranking."""
    hyps = search(model, alpha, nbest)
    for i in range(len(SOURCES)):
        head = ranking(model, i, alpha)[:nbest]
        assert hyps.tokens[i] == head[0][0]
        if nbest > 1:
            assert [out for out, _ in hyps.nbest[i]] == [out for out, _ in head]


def test_a_stronger_length_penalty_never_picks_a_shorter_output(model):
    """Over every candidate (a beam wide enough), dividing negative log-probs by a penalty that
    grows with length can only favour longer outputs: alpha 2's best is never shorter than alpha
    0's; and the two rank the outputs differently on this fixture (so the tests above separate
    the penalties)."""
    plain, strong = (search(model, alpha, WIDE) for alpha in (0.0, 2.0))
    assert all(len(b) >= len(a) for a, b in zip(plain.tokens, strong.tokens))
    assert plain.nbest != strong.nbest


@torch.no_grad()
def next_log_probs(model, i: int, prefix: list[int]) -> torch.Tensor:
    """Sentence ``i``'s next-token log-probabilities after ``prefix``, teacher-forced."""
    logits = model(SOURCES[i : i + 1], MASK[i : i + 1], torch.tensor([[BOS, *prefix]]))[0, -1, :VOCAB]
    x = torch.log_softmax(logits.float(), -1)
    x[[PAD, BOS]] = float("-inf")
    return x


def test_greedy_follows_the_most_probable_token_and_reports_its_log_prob(model):
    hyps = greedy_search(model, SOURCES, MASK, max_len_a=0, max_len_b=CAP)
    for i in range(len(SOURCES)):
        prefix, score = [], 0.0
        while True:
            x = next_log_probs(model, i, prefix)
            token = int(x.argmax()) if len(prefix) < CAP - 1 else EOS  # EOS is forced at the cap
            score += float(x[token])
            if token == EOS:
                break
            prefix.append(token)
        assert hyps.tokens[i] == prefix
        assert float(hyps.scores[i]) == pytest.approx(score, abs=1e-4)
        assert score == pytest.approx(log_probs(model, i)[OUTPUTS.index(prefix)], abs=1e-4)
