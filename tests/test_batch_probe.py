"""data.max_tokens=auto (nmt.training.batch_probe): the search for the largest batch that fits, the
probe's step leaving weights and random streams as they were, and how auto resolves per device."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import open_dict

from nmt.train import accumulate_to_tokens, resolve_batches
from nmt.training.batch_probe import HEADROOM, largest_fitting, probe_max_tokens, training_step_of
from nmt.training.lit_module import TranslationModule
from tests.test_models import build


@pytest.mark.parametrize("limit, expected", [(37_000, 36_864), (2_500, 2_048), (4_096, 4_096), (10**9, 1 << 20)])
def test_search_finds_the_largest_multiple_that_fits(limit, expected):
    found, tries = largest_fitting(lambda tokens: tokens <= limit)
    assert found == expected
    assert all(ok == (tokens <= limit) for tokens, ok in tries)
    assert all(tokens % 1024 == 0 and tokens <= 1 << 20 for tokens, _ in tries)
    assert len(tries) <= 2 * 10 + 2  # doubling, then halving the gap: logarithmic


def test_nothing_fits_is_refused_naming_what_to_change():
    def step(tokens: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(RuntimeError, match=r"^data.max_tokens=auto: not even a batch of 1024 tokens of the longest "
                                           r"training pair fits this GPU's free memory; set data.max_tokens"):
        probe_max_tokens(step, torch.device("cpu"))


def test_probe_keeps_headroom_warms_the_chosen_size_and_restores_the_random_streams():
    calls = []

    def step(tokens: int) -> None:
        calls.append(tokens)
        torch.rand(3)  # the step draws (dropout) ...
        if tokens > 20_000:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    found = probe_max_tokens(step, torch.device("cpu"))
    assert torch.equal(torch.rand(2), expected)  # ... and the run's stream is where it was
    assert found["largest_fitting"] == 19_456 and found["max_tokens"] == int(19_456 * (1 - HEADROOM)) // 8 * 8
    assert calls[-1] == found["max_tokens"]  # the last step ran at the size the run trains on


@pytest.mark.parametrize("name", ["transformer", "lstm_luong"])
def test_probe_step_trains_nothing(name):
    model = build(name).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam))
    step = training_step_of(model, functools.partial(torch.optim.Adam), lambda batch: module.loss(batch)[0], (9, 11),
                            (40, 40), torch.device("cpu"), "bf16-mixed")
    step(1024)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_auto_on_a_cpu_is_a_fixed_batch_and_on_several_gpus_is_refused(cfg_train):
    cfg = cfg_train(["data.max_tokens=auto"])
    assert resolve_batches(cfg) is False
    assert cfg.data.max_tokens == 4096 and cfg.data.shapes == "exact"
    cfg = cfg_train(["data.max_tokens=auto", "trainer.accelerator=gpu", "trainer.devices=2"])
    with pytest.raises(ValueError, match=r"^data.max_tokens=auto probes one GPU, and each process of a multi-GPU run"):
        resolve_batches(cfg)
    cfg = cfg_train(["trainer.accelerator=gpu"])
    with open_dict(cfg):
        cfg.data.shapes = "auto"
    assert resolve_batches(cfg) is False and cfg.data.shapes == "buckets"


def test_tokens_per_update_sets_the_accumulation_for_the_batch_and_processes(cfg_train, monkeypatch, caplog):
    cfg = cfg_train(["tokens_per_update=25000", "data.max_tokens=8192"])
    accumulate_to_tokens(cfg)
    assert cfg.trainer.accumulate_grad_batches == 3
    cfg = cfg_train(["tokens_per_update=25000", "data.max_tokens=6000", "trainer.devices=2"])
    with caplog.at_level("INFO", logger="nmt.train"):
        accumulate_to_tokens(cfg)
    assert cfg.trainer.accumulate_grad_batches == 2  # 2 processes x 2 batches x 6,000 tokens
    assert "tokens_per_update=25000: 2 batch(es) of 6000 tokens on 2 process(es) per optimizer step (24000 tokens)" \
        in caplog.text
    import lightning_fabric.accelerators.cuda
    import pytorch_lightning.accelerators.cuda

    for module in (lightning_fabric.accelerators.cuda, pytorch_lightning.accelerators.cuda):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: 8)  # a machine that shows 8 GPUs
    for devices in ("auto", "-1", "[0,1,2,3,4,5,6,7]", "'0,1,2,3,4,5,6,7'"):
        cfg = cfg_train(["tokens_per_update=25000", "data.max_tokens=3125", "trainer.accelerator=gpu",
                         f"trainer.devices={devices}"])
        accumulate_to_tokens(cfg)
        assert cfg.trainer.accumulate_grad_batches == 1, devices  # 8 processes x 3,125 tokens: the recipe's 25k
    cfg = cfg_train(["tokens_per_update=25000", "data.max_tokens=3125", "trainer.accelerator=gpu", "trainer.devices=4",
                     "trainer.num_nodes=2"])
    accumulate_to_tokens(cfg)
    assert cfg.trainer.accumulate_grad_batches == 1
    for bad in ("0", "abc", "True"):
        cfg = cfg_train([f"tokens_per_update={bad}"])
        with pytest.raises(ValueError, match=rf"^tokens_per_update={bad}: a positive number of tokens per optimizer step"):
            resolve_batches(cfg)
    cfg = cfg_train(["tf32=maybe"])
    with pytest.raises(ValueError, match=r"^tf32=maybe: true \(TF32 matmuls for fp32 on GPUs\) or false$"):
        resolve_batches(cfg)


def test_the_probed_batch_cuts_the_training_batches(cfg_train, monkeypatch):
    """train()'s wiring of the probe, on the CPU with out-of-memory simulated above 600 tokens: the
    probe runs real training steps of the longest pair, and the data module then cuts its batches to
    the size found (both sides as long as the longest pair's bucket)."""
    import nmt.train as train_module
    from nmt.training.builders import build_datamodule, build_model, build_module
    from nmt.training.batch_probe import probe_max_tokens as real_probe

    cfg = cfg_train(["data.shapes=buckets"], model="transformer")
    datamodule = build_datamodule(cfg.data)
    datamodule.setup("fit")
    model = build_model(cfg, datamodule.src_vocab.vocab_size, datamodule.tgt_vocab.vocab_size)
    module = build_module(cfg, model)
    seen = []

    def probe(step, device):
        def limited(tokens):
            seen.append(tokens)
            if tokens > 600:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            step(tokens)
        return real_probe(limited, device)

    monkeypatch.setattr(train_module, "probe_max_tokens", probe)
    monkeypatch.setattr("nmt.training.batch_probe.RESOLUTION", 128, raising=True)
    found = train_module.fit_batch_to_device(cfg, model, module, datamodule, torch.device("cpu"))
    longest = int(datamodule.datasets["train"].lengths().max())
    assert found["widths"][0] == found["widths"][1] >= longest
    assert cfg.data.max_tokens == found["max_tokens"] == datamodule.max_tokens and found["max_tokens"] <= 600 * 0.9
    assert all(b["src"].numel() <= found["max_tokens"] or b["src"].size(0) == 1 for b in datamodule.train_dataloader())


def test_a_probed_batch_above_tokens_per_update_is_cut_to_it(cfg_train, monkeypatch):
    import nmt.train as train_module
    from nmt.training.builders import build_datamodule, build_model, build_module

    cfg = cfg_train(["tokens_per_update=300"], model="transformer")
    datamodule = build_datamodule(cfg.data)
    datamodule.setup("fit")
    model = build_model(cfg, datamodule.src_vocab.vocab_size, datamodule.tgt_vocab.vocab_size)
    monkeypatch.setattr(train_module, "probe_max_tokens",
                        lambda step, device: {"max_tokens": 4096, "largest_fitting": 4608, "tries": [[4608, True]]})
    found = train_module.fit_batch_to_device(cfg, model, build_module(cfg, model), datamodule, torch.device("cpu"))
    assert found["max_tokens"] == 296 == cfg.data.max_tokens and found["capped_by"] == "tokens_per_update"
    train_module.accumulate_to_tokens(cfg)
    assert cfg.trainer.accumulate_grad_batches == 1
