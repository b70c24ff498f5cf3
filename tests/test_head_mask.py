"""Head masks and pruning (``nmt.models.head_mask``, Michel et al. 2019): a mask of ones changes
nothing; a pruned model computes what the masked model computes, in teacher forcing, greedy and
beam search, step by step and on fixed shapes; bad masks and head lists are refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from nmt.decoding.search import beam_search, greedy_search
from nmt.models import head_mask
from tests.test_fixed_beam import assert_same_search
from tests.test_models import batch, build

# heads dropped by kind and layer (the tiny models have 2 layers of 2 heads)
DROPPED = {"encoder": [[0], []], "decoder": [[], [1]], "cross": [[1], [0]]}


def searches(model, src, src_mask) -> list:
    return [search(model, src, src_mask, engine=engine, **options)
            for search, options in ((greedy_search, {}), (beam_search, {"beam_size": 3, "nbest": 2}))
            for engine in ("loop", "graphs")]


def masks_dropping(model, dropped) -> dict[str, list[torch.Tensor]]:
    masks = head_mask.ones_mask(model)
    for kind, layers in dropped.items():
        for mask, heads in zip(masks[kind], layers):
            mask[heads] = 0.0
    return masks


@pytest.mark.parametrize("name", ["transformer", "transformer_post_learned", "hybrid_transformer_luong"])
def test_a_mask_of_ones_changes_nothing(name):
    model = build(name)
    src, src_mask, tgt_in = batch()
    with torch.no_grad():
        logits, found = model(src, src_mask, tgt_in), searches(model, src, src_mask)
        head_mask.set_head_mask(model, head_mask.ones_mask(model))
        assert torch.equal(model(src, src_mask, tgt_in), logits)
        for before, after in zip(found, searches(model, src, src_mask)):
            assert after.tokens == before.tokens
            assert torch.equal(after.scores, before.scores)


@pytest.mark.parametrize("name", ["transformer", "transformer_rope_local"])
def test_a_pruned_model_computes_what_the_masked_model_does(name):
    masked = build(name)
    src, src_mask, tgt_in = batch(lengths=(9, 2, 5, 3))
    head_mask.set_head_mask(masked, masks_dropping(masked, DROPPED))
    pruned = copy.deepcopy(masked)
    head_mask.set_head_mask(pruned, None)
    head_mask.prune(pruned, {kind: [[h for h in range(2) if h not in heads] for heads in layers]
                             for kind, layers in DROPPED.items()})
    assert head_mask.head_counts(pruned) == {"encoder": [1, 2], "decoder": [2, 1], "cross": [1, 1]}
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in masked.parameters())
    with torch.no_grad():
        torch.testing.assert_close(pruned(src, src_mask, tgt_in), masked(src, src_mask, tgt_in), atol=1e-5, rtol=0)
        for want, got in zip(searches(masked, src, src_mask), searches(pruned, src, src_mask)):
            assert_same_search(want, got)


def test_a_pruned_config_builds_the_pruned_model():
    """The config a pruned checkpoint carries builds the same shapes, and its weights load."""
    from nmt.models.transformer import TransformerDecoder, TransformerEncoder

    model = build("transformer")
    head_mask.prune(model, {"encoder": [[1], [0, 1]], "cross": [[0, 1], [0]]})
    enc, dec = model.encoder, model.decoder
    counts = head_mask.head_counts(model)
    config = head_mask.pruned_config({"encoder": {}, "decoder": {}}, counts)
    assert config == {"encoder": {"self_heads": [1, 2]}, "decoder": {"self_heads": [2, 2], "cross_heads": [2, 1]}}
    sizes = dict(hidden_size=enc.layers[0].self_attn.q_proj.in_features, num_layers=2, num_heads=2, ff_size=32)
    TransformerEncoder(enc.embed.num_embeddings, **sizes, **config["encoder"]).load_state_dict(enc.state_dict())
    TransformerDecoder(dec.embed.num_embeddings, **sizes, **config["decoder"]).load_state_dict(dec.state_dict())


def test_bad_masks_and_head_lists_are_refused_in_one_line():
    model = build("transformer")
    with pytest.raises(ValueError, match=r"^head mask of cross layer 1: shape \(3,\), the layer has 2 heads$"):
        head_mask.set_head_mask(model, {"cross": [torch.ones(2), torch.ones(3)]})
    with pytest.raises(ValueError, match=r"^heads to keep: \[\] is not an increasing list of heads from 0 to 1$"):
        head_mask.prune(model, {"encoder": [[], [0]]})
    with pytest.raises(ValueError, match=r"^self_heads=\[1, 3\]: one head count per layer \(2\), each from 1 to num_heads \(2\)$"):
        from nmt.models.transformer import TransformerEncoder

        TransformerEncoder(10, hidden_size=8, num_layers=2, num_heads=2, ff_size=8, self_heads=[1, 3])
    with pytest.raises(ValueError, match=r"^a RNNEncoder and a RNNDecoder: no attention heads"):
        head_mask.attentions(build("lstm_luong"))


def test_formats_with_the_same_heads_in_every_layer_refuse_a_pruned_model():
    from nmt.data.tokenizer import Tokenizer
    from nmt.exporters import ctranslate2, huggingface

    model = build("transformer")
    assert head_mask.pruned_keys(model) == []
    head_mask.prune(model, {"cross": [[0, 1], [1]]})
    assert head_mask.pruned_keys(model) == ["model.decoder.cross_heads"]
    with pytest.raises(ValueError, match=r"^model.decoder.cross_heads: attention heads pruned \(fewer in some layers "
                                         r"than others\); no transformers class expresses it"):
        huggingface.model_class(model, {})
    with pytest.raises(ValueError, match=r"^model.decoder.cross_heads: attention heads pruned .*; CTranslate2's Transformer"):
        ctranslate2.build_spec(model, Tokenizer.__new__(Tokenizer), Tokenizer.__new__(Tokenizer))
