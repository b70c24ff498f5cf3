"""The self-attention patterns (``nmt.models.attention_patterns``): each equals full attention
where it should (a window that covers the sentence, every block, identity projections), equals
its own definition written as a dense mask, reads only the keys it claims to, keeps a decoder's
key/value cache bounded, and refuses bad options in one line naming the key. The model-level
parities (decoding step by step equals the teacher-forced pass, padding changes nothing, both
kernel modes, gradient checkpointing) run over ``tests/test_models.VARIANTS``, which holds a
Transformer per pattern."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.models.attention_patterns import BlockSparse, Local, LowRank, make_pattern
from tests.test_models import batch, build

N, HEADS, T, D = 3, 2, 23, 8
LENGTHS = torch.tensor([23, 17, 5])


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, HEADS, T, D, generator=g) for _ in range(3)]


VALID = torch.arange(T)[None] < LENGTHS[:, None]


def dense(q, k, v, allowed, valid=VALID):
    """The definition: every score computed, the pattern applied as a mask (a padded query reads itself)."""
    i, j = torch.arange(q.size(2))[:, None], torch.arange(k.size(2))[None]
    return sdpa(q, k, v, allowed(i, j) & (valid[:, None, None, :] | (i == j)[None, None]))


def real(x, valid=VALID):
    """The outputs at real positions (padded ones are never read)."""
    return x.transpose(1, 2)[valid]


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("window,global_tokens", [(1, 0), (3, 0), (7, 0), (2, 3), (4, 1), (3, 10)])
def test_local_equals_its_dense_mask(causal, window, global_tokens):
    q, k, v = qkv()
    pattern = Local(window, global_tokens)
    out = pattern(sdpa, q, k, v, VALID, causal)
    torch.testing.assert_close(real(out), real(dense(q, k, v, lambda i, j: pattern.allowed(i, j, causal))))


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_a_window_covering_the_sentence_is_full_attention(causal):
    q, k, v = qkv(1)
    full = dense(q, k, v, lambda i, j: j <= i if causal else torch.ones_like(i - j, dtype=torch.bool))
    for pattern in (Local(T), Local(T + 5), Local(T, 4)):
        torch.testing.assert_close(real(pattern(sdpa, q, k, v, VALID, causal)), real(full))


def test_block_sparse_with_every_block_is_full_attention():
    q, k, v = qkv(2)
    full = sdpa(q, k, v, VALID[:, None, None, :])
    for block, global_blocks in ((4, 0), (5, 1), (23, 0)):
        out = BlockSparse(block, global_blocks, random_blocks=T)(sdpa, q, k, v, VALID, False)
        torch.testing.assert_close(real(out), real(full))


@pytest.mark.parametrize("block,global_blocks,random_blocks", [(4, 1, 1), (5, 0, 2), (3, 2, 1), (8, 1, 0)])
def test_block_sparse_equals_its_dense_mask(block, global_blocks, random_blocks):
    """Per sentence, from the blocks of its own length: its neighbours, the global blocks and its
    random blocks; the global blocks read everything."""
    q, k, v = qkv(3)
    pattern = BlockSparse(block, global_blocks, random_blocks)
    out = pattern(sdpa, q, k, v, VALID, False)
    blk = torch.arange(T) // block
    for s, length in enumerate(LENGTHS.tolist()):
        count = -(-length // block)
        idx, used = pattern.table(count)
        reads = torch.zeros(blk.max() + 1, blk.max() + 1, dtype=torch.bool)
        for qb in range(count):
            reads[qb, idx[qb][used[qb]]] = True
        reads[:global_blocks] = True
        assert (reads[:count, :count].sum(1) < count).any() or random_blocks + 3 + global_blocks >= count
        one = slice(s, s + 1)
        ref = dense(q[one], k[one], v[one], lambda i, j: reads[blk[i[:, 0]]][:, blk[j[0]]], VALID[one])
        torch.testing.assert_close(real(out[one], VALID[one]), real(ref, VALID[one]))


def test_low_rank_with_identity_projections_is_full_attention():
    q, k, v = qkv(4)
    pattern = LowRank(rank=T + 9, max_len=64)
    with torch.no_grad():
        pattern.e.copy_(torch.eye(T + 9, 64))
        pattern.f.copy_(torch.eye(T + 9, 64))
    torch.testing.assert_close(real(pattern(sdpa, q, k, v, VALID, False)), real(sdpa(q, k, v, VALID[:, None, None, :])))


@pytest.mark.parametrize("pattern", [BlockSparse(3, 1, 1), LowRank(8, 64), Local(2, 2)], ids=["block_sparse", "low_rank", "local_global"])
def test_a_sentence_reads_the_same_alone_and_in_a_padded_batch(pattern):
    q, k, v = qkv(5)
    out = pattern(sdpa, q, k, v, VALID, False)
    n = int(LENGTHS[1])
    alone = pattern(sdpa, q[1:2, :, :n], k[1:2, :, :n], v[1:2, :, :n], None, False)
    torch.testing.assert_close(out[1:2, :, :n], alone)


@pytest.mark.parametrize("pattern,most", [(Local(4), 3 * 4), (Local(4, 2), 3 * 4 + 2), (BlockSparse(8, 1, 2), (3 + 1 + 2) * 8),
                                          (LowRank(16, 4096), 16)], ids=["local", "local_global", "block_sparse", "low_rank"])
def test_a_pattern_computes_only_the_scores_it_keeps(pattern, most):
    """At 1,000 tokens every attention call but the global rows' reads at most ``most`` keys per
    query: the work is O(n * most), not a dense matrix with a mask."""
    n = 1000
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    calls = []

    def recording(q, k, v, mask):
        calls.append((q.size(2), k.size(2)))
        return sdpa(q, k, v, mask)

    pattern(recording, q, k, v, None, False)
    scores = sum(t * s for t, s in calls)
    globals_ = getattr(pattern, "global_tokens", 0) or getattr(pattern, "global_blocks", 0) * getattr(pattern, "block_size", 0)
    assert scores <= n * most + globals_ * n
    assert scores < n * n / 10


@pytest.mark.parametrize("name,most", [("transformer_rope_local", 2 + 1), ("transformer_local_global", 2 + 1 + 1)])
def test_the_decoder_cache_keeps_what_later_queries_read(name, most):
    """``local``: the last window + 1 keys; ``local_global``: also the first ``global_tokens``."""
    model = build(name)
    src, src_mask, _ = batch()
    memory = model.decoder.prepare_memory(model.encode(src, src_mask))
    state = model.decoder.init_state(memory)
    prev = torch.full((src.size(0),), 1)
    for _ in range(12):
        logits, state, _ = model.decoder.decode_step(prev, memory, state)
        prev = logits.argmax(-1)
        assert all(c["k"].size(2) <= most for c in state["cache"])
    assert state["cache"][0]["k"].size(2) == most


@pytest.mark.parametrize("part,options,message", [
    ("encoder", {"attention": "sparse"}, "model.encoder.attention=sparse: unknown pattern; choose one of full, local, local_global, block_sparse, low_rank"),
    ("encoder", {"attention": "local"}, "model.encoder.attention=local needs model.encoder.window: set it to an integer >= 1"),
    ("encoder", {"attention": "local", "window": 0}, "model.encoder.window=0: must be an integer from 1 to the model's max_len (64)"),
    ("decoder", {"attention": "local", "window": -2}, "model.decoder.window=-2: must be an integer from 1 to the model's max_len (64)"),
    ("encoder", {"attention": "low_rank", "rank": 65}, "model.encoder.rank=65: must be an integer from 1 to the model's max_len (64)"),
    ("encoder", {"attention": "block_sparse", "block_size": 4, "random_blocks": -1},
     "model.encoder.random_blocks=-1: must be an integer from 0 to the model's max_len (64)"),
    ("encoder", {"attention": "local", "window": 4, "rank": 8},
     "model.encoder.rank=8: the local pattern does not take it (it takes window); set model.encoder.rank=null or choose the pattern that uses it"),
    ("encoder", {"attention": "full", "block_size": 8},
     "model.encoder.block_size=8: the full pattern does not take it (it takes no options); set model.encoder.block_size=null or choose the pattern that uses it"),
    ("decoder", {"attention": "low_rank", "rank": 8},
     "model.decoder.attention=low_rank: encoder only (its projection mixes every position, so a query would read the future; use local or local_global in the decoder)"),
    ("decoder", {"attention": "block_sparse", "block_size": 8},
     "model.decoder.attention=block_sparse: encoder only (its random blocks read ahead of a query; use local or local_global in the decoder)"),
])
def test_bad_options_are_refused_in_one_line(part, options, message):
    attention = options.pop("attention")
    with pytest.raises(ValueError) as info:
        make_pattern(part, attention, 64, **options)
    assert str(info.value) == message


def test_a_config_from_before_the_attention_key_keeps_its_window():
    """Saved runs set ``window`` alone: that is the local pattern."""
    assert isinstance(make_pattern("encoder", None, 64, window=3), Local)
    assert make_pattern("encoder", None, 64, window=None) is None
    assert make_pattern("encoder", None, 64, window=3, global_tokens=2).name == "local_global"


def test_low_rank_trains_its_projections():
    model = build("transformer_low_rank").train()
    src, src_mask, tgt_in = batch()
    model(src, src_mask, tgt_in).logsumexp(-1).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith(("pattern.e", "pattern.f"))]
    assert len(grads) == 2 * len(model.encoder.layers) and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_the_cost_fit_reads_the_exponent_and_the_crossover():
    from nmt.bench.attention_cost import crossover, exponent

    full = [{"n": n, "t": 1e-9 * n**2} for n in (64, 128, 256, 512, 1024)]
    linear = [{"n": n, "t": 3e-7 * n} for n in (64, 128, 256, 512, 1024)]
    assert exponent(full, "t", from_n=64) == pytest.approx(2.0)
    assert exponent(linear, "t", from_n=256) == pytest.approx(1.0)
    assert crossover(linear, full, "t") == 512  # 3e-7 n < 1e-9 n^2 from n = 300 on
    assert crossover(full, [{"n": r["n"], "t": r["t"] / 2} for r in full], "t") is None  # never faster
    flaky = [{"n": 64, "t": 0}, {"n": 128, "t": 1}, *linear[2:]]  # faster at 64 but not at 128: counts from 512
    assert crossover(flaky, full, "t") == 512


@pytest.mark.parametrize("name", ["transformer_rope_local", "transformer_local_global", "transformer_block_sparse", "transformer_low_rank"])
def test_patterns_train_under_bf16_autocast(name):
    """The blocked and projected paths keep bf16 where autocast puts it: logits within bf16's
    precision of fp32's, and a backward pass that reaches every weight."""
    model = build(name).train()
    src, src_mask, tgt_in = batch()
    reference = model(src, src_mask, tgt_in)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, src_mask, tgt_in)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.06, rtol=0.05)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
