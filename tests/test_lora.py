"""nmt.models.lora: low-rank adapters (Hu et al. 2021) on a Transformer's attention projections:
fresh adapters compute the base model exactly, merged weights compute the adapted model, each
target adapts its own block of rows, bad settings and adapters of a damaged file are refused in
one line naming the key."""

from __future__ import annotations

import copy

import pytest
import torch

from nmt.checkpoints.marian import model_config
from nmt.models.lora import TARGETS, LoRALinear, LoRASettings, add_adapters, merge_adapters, merged_state
from nmt.training.builders import instantiate_model

SIZES = {"d_model": 32, "dropout": 0.0, "pre_norm": True, "positions": "fairseq", "max_position_embeddings": 64,
         "attention_dropout": 0.0, "activation_dropout": 0.0, "activation": "relu", "encoder_layers": 2,
         "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48,
         "decoder_ffn_dim": 40}


def model(seed: int = 0) -> torch.nn.Module:
    """A tiny Transformer as an imported M2M100 is built (shared embeddings, a logits bias)."""
    torch.manual_seed(seed)
    return instantiate_model(model_config(SIZES, 60, 60, shared=True, tied=True)).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, 60, (3, 7), generator=g), torch.randint(4, 60, (3, 5), generator=g)
    src[0, 5:] = 0  # padding
    return src, src != 0, tgt


def settings(**changes) -> LoRASettings:
    return LoRASettings.from_config({"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "k", "v", "out"]} | changes)


def trained(m: torch.nn.Module, seed: int = 2) -> None:
    """Adapters as after training: every B drawn (at the scale training gives them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_fresh_adapters_give_the_base_models_logits_exactly():
    base = model()
    adapted = copy.deepcopy(base)
    assert add_adapters(adapted, settings()) == 2 * 4 + 2 * 8  # encoder: 4 targets a layer; decoder: self and cross
    src, mask, tgt = batch()
    assert torch.equal(adapted(src, mask, tgt), base(src, mask, tgt))


def test_merged_weights_give_the_adapted_models_logits():
    """``merged_state`` (what files give every reader) and ``merge_adapters`` (in place) both give a
    plain Transformer computing the adapted model, within fp32 rounding."""
    adapted = model()
    add_adapters(adapted, settings(targets=["q", "v", "cross.k", "encoder.out"]))
    trained(adapted)
    src, mask, tgt = batch()
    want = adapted(src, mask, tgt)
    plain = model(seed=5)  # other weights, all replaced by the merged ones
    plain.load_state_dict(merged_state(adapted.state_dict(), 2.0, 4))
    torch.testing.assert_close(plain(src, mask, tgt), want, atol=1e-5, rtol=0)
    assert (plain(src, mask, tgt) - model()(src, mask, tgt)).abs().max() > 1e-2  # the adapters changed it
    merged = merge_adapters(copy.deepcopy(adapted))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    torch.testing.assert_close(merged(src, mask, tgt), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("target, rows", [("k", slice(0, 32)), ("v", slice(32, 64))])
def test_a_key_or_value_adapter_changes_its_half_of_the_fused_projection(target, rows):
    """Keys and values share ``kv_proj`` (keys in its first half of rows): ``k`` and ``v`` each adapt
    their own half, the other stays the base weight, bit for bit."""
    adapted = model()
    add_adapters(adapted, settings(targets=[f"encoder.{target}"]))
    trained(adapted)
    name = "encoder.layers.0.self_attn.kv_proj.weight"
    before, after = model().state_dict()[name], merged_state(adapted.state_dict(), 2.0, 4)[name]
    other = slice(32, 64) if target == "k" else slice(0, 32)
    assert torch.equal(after[other], before[other]) and not torch.equal(after[rows], before[rows])
    untouched = "decoder.layers.0.self_attn.kv_proj.weight"
    assert torch.equal(merged_state(adapted.state_dict(), 2.0, 4)[untouched], model().state_dict()[untouched])


def test_the_adapters_train_as_the_paper_says():
    """A starts random and B zero; the update of a weight is scale * B A (its gradient reaches B
    first: at step 0 dL/dA = 0, as B is zero)."""
    adapted = model()
    add_adapters(adapted, settings(targets=["q"]))
    layer = adapted.encoder.layers[0].self_attn.q_proj
    assert layer.lora_A["q"].abs().sum() > 0 and torch.count_nonzero(layer.lora_B["q"]) == 0
    src, mask, tgt = batch()
    adapted.train()
    adapted(src, mask, tgt).logsumexp(-1).mean().backward()
    assert torch.count_nonzero(layer.lora_A["q"].grad) == 0 and torch.count_nonzero(layer.lora_B["q"].grad) > 0


@pytest.mark.parametrize("config, message", [
    ({"rank": -1}, r"^module.lora.rank=-1: a whole number from 1 to 1024 \(0 or null: no adapters\)$"),
    ({"rank": 2.5}, r"^module.lora.rank=2.5: a whole number"),
    ({"rank": 4096}, r"^module.lora.rank=4096: a whole number from 1 to 1024"),
    ({"rank": 4, "alpha": 0}, r"^module.lora.alpha=0: a number above 0 \(the update is scaled by alpha / rank\)$"),
    ({"rank": 4, "alpha": float("inf")}, r"^module.lora.alpha=inf: a number above 0"),
    ({"rank": 4, "dropout": 1.0}, r"^module.lora.dropout=1.0: a probability from 0 to below 1$"),
    ({"rank": 4, "targets": ["q", "ff"]}, r"^module.lora.targets=\['q', 'ff'\]: a list of q, k, v, out \(every "
                                          r"attention\) or <kind>.<part> with kind encoder, decoder, cross"),
    ({"rank": 4, "targets": "q"}, r"^module.lora.targets=q: a list of"),
    ({"rank": 4, "scale": 2}, r"^module.lora.scale: not a LoRA setting \(rank, alpha, dropout, targets\)$"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message) as refused:
        LoRASettings.from_config(config)
    assert "\n" not in str(refused.value)


def test_no_rank_is_no_adapters_and_every_target_name_is_known():
    assert LoRASettings.from_config({"rank": 0}) is None and LoRASettings.from_config({"rank": None}) is None
    assert LoRASettings.from_config({"rank": 8}).scale == 1.0  # alpha null: alpha = rank
    assert set(TARGETS) == {"q", "k", "v", "out"} | {f"{k}.{p}" for k in ("encoder", "decoder", "cross")
                                                     for p in ("q", "k", "v", "out")}


def test_adapters_on_a_model_without_transformer_attention_are_refused():
    from nmt.models.base import Seq2Seq
    from nmt.models.rnn import RNNDecoder, RNNEncoder

    rnn = Seq2Seq(RNNEncoder(30, 8, 8), RNNDecoder(30, 8, 8), 30, 30, 8)
    with pytest.raises(ValueError, match=r"^module.lora: adapters go on Transformer attention; a RNNEncoder and a "
                                         r"RNNDecoder: no attention heads"):
        add_adapters(rnn, settings())


def test_adapters_that_do_not_fit_their_weight_are_refused_naming_them():
    adapted = model()
    add_adapters(adapted, settings(targets=["q"]))
    state = adapted.state_dict()
    with pytest.raises(ValueError, match=r"^encoder.layers.0.self_attn.q_proj.lora_\*.q: A \(4, 32\), B \(32, 4\); "
                                         r"the adapter of rank 8 of a \(32, 32\) weight is A \(8, 32\) and B \(32, 8\)$"):
        merged_state(state, 1.0, 8)  # a file saying rank 8 for adapters of rank 4
    broken = {k: v for k, v in state.items() if k != "encoder.layers.1.self_attn.q_proj.lora_B.q"}
    with pytest.raises(ValueError, match=r"^encoder.layers.1.self_attn.q_proj.lora_\*.q: A \(4, 32\); "):
        merged_state(broken, 2.0, 4)
    with pytest.raises(ValueError, match=r"^decoder.out.lora_\*: adapters of out, which holds no q projection weight$"):
        merged_state({**state, "decoder.out.lora_A.q": torch.zeros(4, 32)}, 2.0, 4)
