"""The loss of an optimizer step is normalised by the target tokens of the whole update (fairseq's
rule), not averaged per micro-batch: 2 processes (gloo) accumulating 2 micro-batches each, and
one process accumulating all 4, give the gradients of the plain sum of the 4 batches' token
losses over their tokens, to 1e-6 in fp32."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import pytorch_lightning as L
import torch
from torch.utils.data import DataLoader

from nmt.data.tokenizer import BOS, EOS, PAD
from nmt.training.builders import build_model, build_module
from tests.conftest import compose_train

VOCAB = 24
SIZES = [(6, 2, 3), (2, 14, 15), (5, 3, 2), (1, 18, 20)]  # (sentences, source, target length): short and long batches


def batch_of(rows: int, src_len: int, tgt_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(4, VOCAB, (rows, n), generator=g)  # noqa: E731
    src, tgt = words(src_len), words(tgt_len)
    src = torch.cat([src, torch.full((rows, 1), EOS)], 1)
    src[0, -2:] = torch.tensor([EOS, PAD])  # padding inside the batch too
    tgt_in = torch.cat([torch.full((rows, 1), BOS), tgt], 1)
    tgt_out = torch.cat([tgt, torch.full((rows, 1), EOS)], 1)
    return {"src": src, "src_mask": src != PAD, "tgt_in": tgt_in, "tgt_out": tgt_out, "ids": torch.arange(rows),
            "num_src_tokens": int((src != PAD).sum()), "num_tgt_tokens": int((tgt_out != PAD).sum())}


BATCHES = [batch_of(*size, seed=i) for i, size in enumerate(SIZES)]


class Recording(torch.optim.SGD):
    """SGD with learning rate 0 that saves the gradients of its first step (rank 0)."""

    def __init__(self, params, out: str, lr: float = 0.0) -> None:
        super().__init__(params, lr=lr)
        self.out = out

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not Path(self.out).exists() and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            torch.save([p.grad.clone() for group in self.param_groups for p in group["params"]], self.out)
        return loss


class Batches(L.LightningDataModule):
    """The micro-batches of one optimizer step: all 4 on one process, 2 each on two."""

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        mine = BATCHES[rank * len(BATCHES) // world:(rank + 1) * len(BATCHES) // world]
        return DataLoader(mine, batch_size=None, shuffle=False)


def module_of(tmp_path: Path, out: Path):
    cfg = compose_train(tmp_path, ["model.dropout=0.0", "test=false"], model="transformer")
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, VOCAB)
    module = build_module(cfg, model)
    module.optimizer = functools.partial(Recording, out=str(out))
    module.scheduler = None
    return module


def gradients_of(tmp_path: Path, devices: int, accumulate: int) -> list[torch.Tensor]:
    out = tmp_path / f"grads_{devices}x{accumulate}.pt"
    module = module_of(tmp_path / f"run{devices}", out)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                        accumulate_grad_batches=accumulate, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, use_distributed_sampler=False, precision="32-true")
    trainer.fit(module, datamodule=Batches())
    return torch.load(out, weights_only=True)


def reference_gradients(tmp_path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """By hand: the 4 batches' label-smoothed token losses summed over their target tokens, divided
    by all of them; and the mean of the per-batch means (the old rule), for contrast."""
    module = module_of(tmp_path / "ref", tmp_path / "unused.pt")
    params = [p for p in module.parameters()]
    total = sum(b["num_tgt_tokens"] for b in BATCHES)
    per_token = sum(module.losses(b)[0] * b["num_tgt_tokens"] for b in BATCHES) / total
    by_tokens = torch.autograd.grad(per_token, params)
    per_batch = sum(module.losses(b)[0] for b in BATCHES) / len(BATCHES)
    by_batches = torch.autograd.grad(per_batch, params)
    return list(by_tokens), list(by_batches)


@pytest.mark.slow  # processes of their own (gloo): the slow tier
def test_two_processes_accumulating_two_batches_equal_one_process_and_the_token_sum(tmp_path):
    by_tokens, by_batches = reference_gradients(tmp_path)
    assert max((a - b).abs().max() for a, b in zip(by_tokens, by_batches)) > 1e-4  # the two rules differ here
    one = gradients_of(tmp_path, devices=1, accumulate=4)
    two = gradients_of(tmp_path, devices=2, accumulate=2)
    for name, grads in (("one process, accumulation 4", one), ("two processes, accumulation 2", two)):
        worst = max((a - b).abs().max().item() for a, b in zip(grads, by_tokens))
        assert worst < 1e-6, (name, worst)


def test_one_process_accumulating_batches_gets_the_token_normalised_gradients(tmp_path):
    by_tokens, _ = reference_gradients(tmp_path)
    grads = gradients_of(tmp_path, devices=1, accumulate=4)
    assert max((a - b).abs().max().item() for a, b in zip(grads, by_tokens)) < 1e-6
