"""nmt.training.trainable: ``module.freeze`` and ``module.lora`` in tiny training runs. Frozen
parameters stay bit for bit and hold no optimizer state; a LoRA run trains its adapters alone,
saves them, resumes exactly, and its release file (adapters merged) computes the adapted model;
bad values are refused in one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pytorch_lightning import Callback

import nmt.training.builders
from nmt.checkpoints.files import CheckpointError, atomic_save, model_state
from nmt.checkpoints.loading import load_checkpoint
from nmt.export import export_release
from nmt.models.lora import LoRASettings, add_adapters, is_adapter
from nmt.train import train
from nmt.training.builders import instantiate_model
from tests.conftest import compose_train

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed")

STEPS = ["trainer.max_epochs=-1", "trainer.max_steps=3", "trainer.limit_val_batches=0", "test=false",
         "optimizer.lr=0.01", "scheduler.warmup_steps=1"]
LORA = ["module.lora.rank=2", "module.lora.alpha=4", "module.lora.targets=[q,k,v,out]"]


class AtStart(Callback):
    """The model's weights and the optimizer's parameters when training starts."""

    def on_train_start(self, trainer, module) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        self.optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        self.names = {id(p): name for name, p in module.model.named_parameters()}


def run(tmp_path: Path, monkeypatch, overrides: list[str]) -> tuple[Path, AtStart]:
    seen = AtStart()
    cfg = compose_train(tmp_path, [*STEPS, *overrides], model="transformer")
    original = nmt.training.builders.instantiate_group
    monkeypatch.setattr(nmt.training.builders, "instantiate_group",
                        lambda group: [*original(group), seen] if group is cfg.get("callbacks") else original(group))
    train(cfg)
    monkeypatch.setattr(nmt.training.builders, "instantiate_group", original)
    return Path(cfg.paths.output_dir), seen


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_lora_run_trains_its_adapters_alone_and_exports_them_merged(tmp_path, monkeypatch):
    """Only the adapters change (every other weight bit for bit) and only they have Adam's moments;
    the checkpoint holds them; its release file holds the merged weights and no adapter, and gives
    the adapter model's logits (1e-5, fp32)."""
    out, seen = run(tmp_path, monkeypatch, LORA)
    ckpt = load(out / "checkpoints" / "last.ckpt")
    state = model_state(ckpt, adapters="kept")
    adapters = sorted(k for k in state if is_adapter(k))
    assert len(adapters) == 2 * (2 * 4 + 2 * 8)  # A and B: 2 encoder layers x 4 targets, 2 decoder layers x 8
    for name, before in seen.weights.items():
        if is_adapter(name):
            continue
        assert torch.equal(state[name], before), name  # the base model, bit for bit
    assert all(not torch.equal(state[k], seen.weights[k]) for k in adapters if ".lora_B." in k)  # B left zero
    assert sorted(seen.names[i] for i in seen.optimized) == adapters
    assert len(ckpt["optimizer_states"][0]["state"]) == len(adapters)

    release = tmp_path / "model.pt"
    export_release(out / "checkpoints" / "last.ckpt", release)
    assert not any(is_adapter(k) for k in load(release)["state_dict"])
    plain = load_checkpoint(release).model
    adapted = instantiate_model(ckpt["run_config"]["model"]).eval()
    add_adapters(adapted, LoRASettings.from_config(ckpt["run_config"]["module"]["lora"]))
    adapted.load_state_dict(state)
    src = torch.randint(4, plain.src_vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(4, plain.tgt_vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    want = adapted(src, src != 0, tgt)
    torch.testing.assert_close(plain(src, src != 0, tgt), want, atol=1e-5, rtol=0)
    base = instantiate_model(ckpt["run_config"]["model"]).eval()
    base.load_state_dict({k: v for k, v in state.items() if not is_adapter(k)})
    assert (base(src, src != 0, tgt) - want).abs().max() > 1e-4  # the adapters trained something
    torch.testing.assert_close(load_checkpoint(out / "checkpoints" / "last.ckpt").model(src, src != 0, tgt), want,
                               atol=1e-5, rtol=0)  # a training checkpoint translates merged too


@pytest.mark.parametrize("parts", [["embeddings"], ["embeddings", "encoder"]])
def test_frozen_parts_stay_bit_for_bit_and_hold_no_optimizer_state(tmp_path, monkeypatch, parts):
    out, seen = run(tmp_path, monkeypatch, [f"module.freeze=[{','.join(parts)}]"])
    state = model_state(load(out / "checkpoints" / "last.ckpt"))
    frozen = {"embed", "out."} | ({"encoder."} if "encoder" in parts else set())
    changed = {name for name, before in seen.weights.items() if not torch.equal(state[name], before)}
    for name in seen.weights:
        if any(part in name for part in frozen):
            assert name not in changed, name
    assert any(name.startswith("decoder.layers") for name in changed)  # the rest trains
    assert ("encoder.layers.0.ff.0.weight" in changed) == ("encoder" not in parts)
    names = {seen.names[i] for i in seen.optimized}
    assert not any(any(part in name for part in frozen) for name in names) and names
    assert len(load(out / "checkpoints" / "last.ckpt")["optimizer_states"][0]["state"]) == len(names)


RESUMED = ["trainer.deterministic=true", "model.dropout=0.3", "module.lora.dropout=0.2", "scheduler.total_steps=4"]


def test_a_lora_run_resumes_exactly(tmp_path, monkeypatch):
    """Stopped at step 2 and resumed, a LoRA run (dropout on the adapters too) ends with the
    weights, adapters and optimizer state of an uninterrupted one, bit for bit."""
    whole, _ = run(tmp_path / "whole", monkeypatch, [*LORA, *RESUMED, "trainer.max_steps=4"])
    first, _ = run(tmp_path / "first", monkeypatch, [*LORA, *RESUMED, "trainer.max_steps=2"])
    resumed, _ = run(tmp_path / "resumed", monkeypatch, [*LORA, *RESUMED, "trainer.max_steps=4",
                                                         f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"])
    a, b = load(whole / "checkpoints" / "last.ckpt"), load(resumed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 4 and a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for p, q in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(p[k], q[k]) for k in p)


@pytest.mark.parametrize("overrides, message", [
    (["module.freeze=[ffn]"], r"^module.freeze=\['ffn'\]: a list of embeddings, encoder, decoder \(e.g. "
                              r"\[embeddings, encoder\]\), or \[\]$"),
    (["module.freeze=[encoder,decoder]"], r"^module.freeze=\['encoder', 'decoder'\]: nothing of the model is left "
                                          r"to train$"),
    (["module.lora.rank=-2"], r"^module.lora.rank=-2: a whole number from 1 to 1024"),
    (["module.lora.rank=4", "module.lora.targets=[query]"], r"^module.lora.targets=\['query'\]: a list of q, k, v, out"),
])
def test_bad_values_are_refused_in_one_line_naming_the_key(tmp_path, overrides, message):
    cfg = compose_train(tmp_path, overrides, model="transformer")
    with pytest.raises(Exception) as refused:
        train(cfg)
    error = refused.value.__cause__ if type(refused.value).__name__ == "InstantiationException" else refused.value
    assert isinstance(error, ValueError) and "\n" not in str(error)
    assert re.match(message, str(error)), str(error)


def test_a_files_lora_config_is_checked_before_its_adapters_are_merged(tmp_path, monkeypatch):
    """A checkpoint whose ``module.lora`` is not one nmt writes, or whose adapters have no LoRA
    config, is refused in one line naming the file and the key."""
    out, _ = run(tmp_path, monkeypatch, [*LORA, "trainer.max_steps=1"])
    ckpt = load(out / "checkpoints" / "last.ckpt")
    for change, message in (({"rank": 10**9}, r"module.lora.rank=1000000000: a whole number from 1 to 1024"),
                            ({"rank": 2, "alpha": 2, "code": "x"}, r"module.lora.code: not a LoRA setting"),
                            ({"rank": 0}, r"holds LoRA adapters \(lora_A, lora_B\) but its run config sets no "
                                          r"module.lora rank")):
        bad = tmp_path / "bad.ckpt"
        atomic_save({**ckpt, "run_config": {**ckpt["run_config"], "module": {**ckpt["run_config"]["module"],
                                                                             "lora": change}}}, bad)
        with pytest.raises(CheckpointError, match=f"^{bad}: {message}") as refused:
            load_checkpoint(bad)
        assert "\n" not in str(refused.value)


def test_the_loss_kernel_computes_no_gradient_for_a_frozen_output_layer():
    """With the output layer frozen the fused loss returns no weight gradient (no (V, H) matmul),
    and the decoder states' gradient is the one it computes when the layer trains."""
    from nmt.kernels.loss import output_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(12, 8, generator=g), torch.randn(50, 8, generator=g)
    target = torch.randint(4, 50, (12,), generator=g)
    grads = []
    for trains in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trains)
        output_cross_entropy(h, w, target, 0.1, not_targets=(0, 2))[0].backward()
        grads.append((h.grad, w.grad))
    assert grads[1][1] is None and grads[0][1] is not None
    assert torch.equal(grads[0][0], grads[1][0])
