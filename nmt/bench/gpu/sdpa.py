"""Part 4 of the GPU check: the attention (SDPA) backends. A Transformer forward/backward with
``sdpa_kernel`` restricted to one backend at a time, SDPA alone per kind of call the model makes
(padding mask, causal, none), and the attention kernels the torch profiler saw in one training step."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from nmt.bench.gpu.check import Check, first_line
from nmt.bench.measure import sync, to_device
from nmt.training.builders import build_model, build_module

ATTENTION_NAMES = re.compile(r"flash|fmha|attention|sdpa|mem_eff|efficient", re.IGNORECASE)
SDPA_OPS = [(r"flash_attention", "FLASH_ATTENTION"), (r"efficient_attention", "EFFICIENT_ATTENTION"),
            (r"cudnn_attention", "CUDNN_ATTENTION"), (r"attention_math", "MATH")]  # aten op names -> backend


def sdpa(check: Check, result: dict[str, Any]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = check.preset_config("transformer", "sdpa", ["kernels=reference"])
    dm = check.datamodule()
    torch.manual_seed(0)
    module = build_module(cfg, build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)).to(check.device)
    batch = to_device(next(iter(dm.train_dataloader())), check.device)
    autocast = check.autocast()
    names = [n for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH") if hasattr(SDPBackend, n)]
    model_runs = result["model_forward_backward"] = {}
    for name in names:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)), autocast():
                loss, _ = module.loss(batch)
                loss.backward()
            sync(check.device)
            model_runs[name] = "ok"
        except Exception as exc:  # noqa: BLE001
            model_runs[name] = first_line(exc)
        module.zero_grad(set_to_none=True)
    # SDPA alone, per kind of call the model makes, at its shapes
    layer = module.model.encoder.layers[0].self_attn
    heads, size = layer.num_heads, layer.q_proj.in_features // layer.num_heads
    b, s = batch["src"].shape
    dtype = torch.bfloat16
    q, k, v = (torch.randn(b, heads, s, size, device=check.device, dtype=dtype, requires_grad=True) for _ in range(3))
    kinds = {"padding mask (encoder, cross-attention)": {"attn_mask": batch["src_mask"][:, None, None, :]},
             "causal (decoder self-attention)": {"is_causal": True}, "no mask": {}}
    calls = result["sdpa_calls"] = {"shape": [b, heads, s, size], "dtype": str(dtype).replace("torch.", "")}
    for kind, kwargs in kinds.items():
        calls[kind] = {}
        for name in names:
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    F.scaled_dot_product_attention(q, k, v, **kwargs).sum().backward()
                sync(check.device)
                calls[kind][name] = "ok"
            except Exception as exc:  # noqa: BLE001
                calls[kind][name] = first_line(exc)
    # what ran in one training step, backends chosen by torch
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    activities = [torch.profiler.ProfilerActivity.CPU]
    if check.mode.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    module.train()
    with torch.profiler.profile(activities=activities) as prof:
        with autocast():
            loss, _ = module.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(check.device)
    ops, kernels = Counter(), Counter()
    for event in prof.events():
        if ATTENTION_NAMES.search(event.name):
            on_device = "cuda" in str(getattr(event, "device_type", "")).lower()
            (kernels if on_device else ops)[event.name] += 1
    result["profiled_ops"] = dict(ops.most_common())
    result["profiled_kernels"] = dict(kernels.most_common())
    result["backends_ran"] = sorted({backend for op in ops for pattern, backend in SDPA_OPS if re.search(pattern, op)})
    check.say(f"sdpa: alone {model_runs}; ran {result['backends_ran']}; kernels {list(kernels)}")
