"""Resuming training: the checkpoint must be a training one, of the configured vocabularies and
model, and every value of its training state (optimizer, schedule, RNG states, counters, loops,
callbacks) of the type, range and shape the code that restores it expects."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoints.files import (CheckpointError, check_weights, checkpoint_kind, is_count, is_number,
                                   model_state, read_checkpoint, vocabulary_difference)
from nmt.data.tokenizer import Tokenizer

COUNTERS = {"skipped_steps": "count", "nonfinite_in_a_row": "count", "train_tokens": "count",
            "train_tgt_tokens": "count or null", "train_seconds": "seconds"}  # TranslationModule.COUNTERS
OPTIMIZER_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "nesterov",
                   "decoupled_weight_decay")
SCHEDULER_KEYS = {  # what LambdaLR (WarmupCosine, inverse_sqrt) and ReduceLROnPlateau save, and what each must be
    "base_lrs": "rates", "_last_lr": "rates", "min_lrs": "rates", "last_epoch": "step", "_step_count": "count",
    "_is_initial": "bool", "_get_lr_called_within_step": "bool", "verbose": "bool", "lr_lambdas": "lambdas",
    "factor": "number", "default_min_lr": "number", "eps": "number", "threshold": "number", "patience": "count",
    "cooldown": "count", "cooldown_counter": "count", "num_bad_epochs": "count", "mode": ("min", "max"),
    "threshold_mode": ("rel", "abs"), "best": "score", "mode_worse": "score"}
SCALER_KEYS = {"scale": None, "growth_factor": None, "backoff_factor": None, "growth_interval": 1,
               "_growth_tracker": 0}  # None: a finite number above 0; an int: a count from it
MAX_LIST = 1 << 16  # entries of a list or mapping of the training state (rates, loaders, ranks)


class Refuse:
    """Raises the one-line error about a value of a checkpoint: ``prefix`` names the file (and the
    key that gave it), ``hint`` what to do instead."""

    def __init__(self, prefix: str, hint: str = "resume from another checkpoint") -> None:
        self.prefix, self.hint = prefix, hint

    def __call__(self, where: str, value: Any, what: str) -> None:
        if torch.is_tensor(value):
            shown = f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
        elif isinstance(value, (str, int, float, bool, type(None))):
            shown = repr(value)[:60]
        else:
            shown = f"a {type(value).__name__}"
        raise CheckpointError(f"{self.prefix}: {where} is {shown}, not {what}; refused: it was not written by "
                              f"nmt's train.py, {self.hint}")


def check_resume(path: str | Path, model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer,
                 allow_pickle: bool = False, optimizer: str = "torch.optim.Adam") -> None:
    """Before resuming training from ``path``: it must be a training checkpoint, its SentencePiece
    vocabularies must be the ones of the configured data and its weights must fit ``model``, else
    a ValueError names what differs (the vocabulary first: another vocabulary also changes the
    embedding shapes); its optimizer state must be one of the configured ``optimizer`` (a class path)."""
    checkpoint = read_checkpoint(path, allow_pickle, what="ckpt_path")
    if checkpoint_kind(checkpoint) != "training" or "optimizer_states" not in checkpoint:
        raise CheckpointError(
            f"ckpt_path={path}: a {checkpoint_kind(checkpoint)} file saved with weights only (no optimizer "
            "or training state) cannot resume training; resume from the run's checkpoints/last.ckpt, or "
            "translate/evaluate with this file"
        )
    for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
        proto = checkpoint.get("tokenizers", {}).get(side)
        if proto is None:
            continue
        if found := vocabulary_difference(proto, side, vocab):
            i, saved, now = found
            raise ValueError(
                f"{path} was trained with another {side} vocabulary ({saved} pieces, the data config "
                f"gives {now}; first difference at id {i}): resume with the data config it was trained with, "
                f"or set data.vocab_from={path} to continue on other data with its vocabulary"
            )
    check_weights(model, model_state(checkpoint, adapters="kept"), str(path))  # a LoRA run's adapters as trained
    check_training_state(checkpoint, path, model, optimizer)


def check_training_state(checkpoint: dict[str, Any], path: str | Path, model: torch.nn.Module,
                         optimizer: str | None = None) -> None:
    """Refuse (``CheckpointError``, one line naming the file and the value) a training state that
    is not what ``train.py`` saves, before Lightning, torch or NumPy restore it: the optimizer state
    (each moment of its parameter's shape: a fused optimizer writes that many values in place),
    the learning-rate schedule (its keys become the scheduler's attributes), the RNG states (of
    their generators' exact sizes), the counters, the loops' progress and the callbacks' values.
    ``read_checkpoint`` has checked every tensor of the file already (dense, contiguous, stored)."""
    refuse = Refuse(f"ckpt_path={path}")
    trained = [p for p in model.parameters() if p.requires_grad]  # the optimizer's (module.freeze, module.lora)
    check_optimizer(checkpoint.get("optimizer_states"), trained, refuse, optimizer,
                    checkpoint.get("global_step"))
    schedulers = checkpoint.get("lr_schedulers", [])
    if not isinstance(schedulers, list) or len(schedulers) > 1:
        refuse("lr_schedulers", schedulers, "a list of at most one scheduler state")
    for i, state in enumerate(schedulers):
        _check_scheduler(state, f"lr_schedulers[{i}]", refuse)
    counters = checkpoint.get("counters", {})
    if not isinstance(counters, dict):
        refuse("counters", counters, "a mapping of the training counters")
    for name, kind in COUNTERS.items():
        value = counters.get(name)
        if name in counters and not (is_count(value) or (value is None and kind == "count or null")
                                     or (kind == "seconds" and is_number(value) and value >= 0)):
            refuse(f"counters.{name}", value, f"a {'number of seconds from 0' if kind == 'seconds' else kind}")
    for key in ("world_size",):
        if key in checkpoint and not is_count(checkpoint[key], 1):
            refuse(key, checkpoint[key], "a number of processes from 1")
    best = checkpoint.get("best_bleu")
    if best is not None and not (isinstance(best, (int, float)) and not isinstance(best, bool) and not math.isnan(best)):
        refuse("best_bleu", best, "a score")
    origin = checkpoint.get("init_from")  # written to summary.json as it is
    if origin is not None and not (isinstance(origin, dict) and len(origin) <= MAX_LIST and all(
            isinstance(k, str) and (v is None or isinstance(v, (str, bool)) or is_number(v)) for k, v in origin.items())):
        refuse("init_from", origin, "a mapping of names to plain values (the file a fine-tuning run started from)")
    rng = checkpoint.get("rng")
    if rng is not None:
        _check_rng(rng, refuse)
    for section in ("loops", "callbacks"):
        _check_plain(checkpoint.get(section, {}), section, refuse, scores=section == "callbacks")
    for name, state in (checkpoint.get("callbacks") or {}).items():
        _check_checkpoint_paths(state, f"callbacks.{name}", refuse)
    if checkpoint.get("current_model_state") is not None:  # an EMA run's raw weights, which a resumed run trains
        check_weights(model, model_state(checkpoint, "raw", adapters="kept"), f"{path} (current_model_state)")
    scaler = checkpoint.get("MixedPrecision")  # 16-mixed: Lightning saves the GradScaler's state under this key
    if scaler is not None:
        if not isinstance(scaler, dict) or not set(scaler) <= set(SCALER_KEYS):
            refuse("MixedPrecision", scaler, f"a GradScaler state ({', '.join(SCALER_KEYS)})")
        for key, value in scaler.items():
            low = SCALER_KEYS[key]
            if not ((is_count(value, low) if isinstance(low, int) else is_number(value) and value > 0)):
                refuse(f"MixedPrecision.{key}", value, f"a count from {low}" if isinstance(low, int) else
                       "a finite number above 0")
    averaging = checkpoint.get("averaging_state")
    if averaging is not None and not (isinstance(averaging, dict) and set(averaging) <= {"n_averaged"}
                                      and all(_scalar(v) and not v.is_floating_point() for v in averaging.values())):
        refuse("averaging_state", averaging, "{n_averaged: a count} (an EMA's state beside its weights)")


def _check_checkpoint_paths(state: Any, where: str, refuse: Refuse) -> None:
    """Lightning's ModelCheckpoint restores its top-k files from a checkpoint of its own folder
    (``dirpath``) and later deletes the worst of them: every file it names must be a ``.ckpt`` in
    that folder, so a crafted file cannot have another file deleted."""
    if not isinstance(state, dict) or not isinstance(state.get("dirpath"), str):
        return
    folder = Path(state["dirpath"]).resolve()
    named = [(f"{where}.{key}", state.get(key)) for key in ("best_model_path", "kth_best_model_path", "last_model_path")]
    named += [(f"{where}.best_k_models", key) for key in state.get("best_k_models") or {}]
    for at, value in named:
        if value in (None, ""):
            continue
        if not (isinstance(value, str) and value.endswith(".ckpt") and Path(value).resolve().parent == folder):
            refuse(at, value, f"a .ckpt file in its dirpath {folder}")


ADAMS = ("torch.optim.Adam", "torch.optim.AdamW")  # the optimizers whose per-parameter state is checked by name


def check_optimizer(states: Any, params: list[torch.nn.Parameter], refuse: Refuse, optimizer: str | None = None,
                    step: Any = None) -> None:
    """One torch optimizer state for ``params`` (the module's parameters, in the order the
    optimizer was given them): its parameter ids, its groups' options and every parameter's state;
    with ``optimizer`` one of ``ADAMS``, the state that optimizer keeps (another optimizer's state
    fails inside torch's step), and none missing from a file saved after ``step`` > 0 steps."""
    if not isinstance(states, list) or len(states) != 1 or not isinstance(states[0], dict):
        refuse("optimizer_states", states, "a list of one optimizer state")
    saved = states[0]
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not 1 <= len(groups) <= len(params) or not all(isinstance(g, dict) for g in groups):
        refuse("optimizer_states[0].param_groups", groups, "a list of parameter groups")
    if not isinstance(state, dict):
        refuse("optimizer_states[0].state", state, "a mapping of parameter ids to their state")
    ids: list[int] = []
    for g, group in enumerate(groups):
        where = f"optimizer_states[0].param_groups[{g}]"
        if not isinstance(group.get("params"), list) or not all(is_count(i) for i in group["params"]):
            refuse(f"{where}.params", group.get("params"), "a list of parameter ids")
        ids += group["params"]
        for key, value in group.items():
            if key == "params":
                continue
            if key in OPTIMIZER_FLAGS:
                if not (value is None or isinstance(value, bool)):
                    refuse(f"{where}.{key}", value, "true, false or null")
            elif key == "betas":
                if not (isinstance(value, (list, tuple)) and len(value) == 2
                        and all(is_number(b) and 0 <= b < 1 for b in value)):
                    refuse(f"{where}.{key}", value, "two numbers from 0 to 1")
            elif not (is_number(value) and value >= 0) and not _scalar(value):
                refuse(f"{where}.{key}", value, "a finite number from 0")
        if group.get("differentiable"):
            refuse(f"{where}.differentiable", True, "false (nmt never trains with it)")
        if group.get("fused") and group.get("foreach"):
            refuse(f"{where}.foreach", True, "false with fused true")
    if len(ids) != len(params) or len(set(ids)) != len(ids):
        refuse("optimizer_states[0].param_groups", f"{len(ids)} parameter ids ({len(set(ids))} distinct)",
               f"the {len(params)} distinct parameters of the configured model")
    shapes = dict(zip(ids, (p.shape for p in params)))
    kinds = {frozenset(values) for values in state.values() if isinstance(values, dict) and values}
    adam = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if groups[0].get("amsgrad") else set())
    if len(kinds) > 1 or any("exp_avg" in kind and kind != adam for kind in kinds):
        refuse("optimizer_states[0].state", f"a state of {' / '.join(sorted(', '.join(sorted(k)) for k in kinds))}",
               f"one optimizer's state for every parameter ({', '.join(sorted(adam))} for Adam)")
    if optimizer in ADAMS:
        if any(kind != adam for kind in kinds):
            refuse("optimizer_states[0].state", f"a state of {' / '.join(sorted(', '.join(sorted(k)) for k in kinds))}",
                   f"the state {optimizer} keeps for every parameter ({', '.join(sorted(adam))}): the file was saved "
                   f"with another optimizer")
        if not kinds and is_count(step) and step > 0:
            refuse("optimizer_states[0].state", "empty", f"the state of an optimizer that took {step} steps")
    for pid, values in state.items():
        where = f"optimizer_states[0].state[{pid!r}]"
        if pid not in shapes:
            refuse(where, pid, "a parameter id of the optimizer's groups")
        if not isinstance(values, dict):
            refuse(where, values, "a mapping of a parameter's optimizer state")
        for name, value in values.items():
            if name == "step":
                if not (is_number(value) and value >= 0) and not (_scalar(value) and value.is_floating_point()):
                    refuse(f"{where}.step", value, "a step count (a float scalar)")
            elif torch.is_tensor(value):
                if value.shape != shapes[pid] or not value.is_floating_point():
                    refuse(f"{where}.{name}", value, f"a float tensor of its parameter's shape {tuple(shapes[pid])}")
            elif value is not None:  # SGD's momentum_buffer is None before its first step
                refuse(f"{where}.{name}", value, "a tensor")


def _scalar(value: Any) -> bool:
    """A one-value tensor holding a finite number (an optimizer's step, a tensor learning rate)."""
    return torch.is_tensor(value) and value.dim() == 0 and bool(torch.isfinite(value)) and value.item() >= 0


SCHEDULER_VALUES = {  # a kind of SCHEDULER_KEYS: the test, what it must be
    "rates": (lambda v: isinstance(v, list) and len(v) <= MAX_LIST and all(is_number(r) and r >= 0 for r in v),
              "a list of learning rates"),
    "step": (lambda v: is_count(v, -1), "a step from -1"),
    "count": (is_count, "a count from 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "number": (lambda v: is_number(v) and v >= 0, "a finite number from 0"),
    "score": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), "a score"),
    "lambdas": (lambda v: isinstance(v, list) and len(v) <= MAX_LIST and all(f is None or f == {} for f in v),
                "a list of empty states (nmt's schedules keep none)"),
}


def _check_scheduler(state: Any, where: str, refuse: Refuse) -> None:
    """A scheduler state of the keys ``SCHEDULER_KEYS`` allows, each of its kind: LambdaLR sets
    every key it loads as an attribute of the scheduler."""
    if not isinstance(state, dict):
        refuse(where, state, "a scheduler state")
    for key, value in state.items():
        kind = SCHEDULER_KEYS.get(key)
        if kind is None:
            refuse(f"{where}.{key}", value, "a key of a torch scheduler's state")
        test, what = SCHEDULER_VALUES[kind] if isinstance(kind, str) else (lambda v: v in kind, " or ".join(kind))
        if not test(value):
            refuse(f"{where}.{key}", value, what)


def _check_rng(rng: Any, refuse: Refuse) -> None:
    """Python's, NumPy's and torch's generator states as ``TranslationModule.on_save_checkpoint``
    saves them, of their exact sizes."""
    if not isinstance(rng, dict):
        refuse("rng", rng, "a mapping of random generator states")
    python = rng.get("python")
    if not (isinstance(python, tuple) and len(python) == 3 and python[0] == 3 and isinstance(python[1], tuple)
            and len(python[1]) == 625 and all(is_count(x) and x < 1 << 32 for x in python[1]) and python[1][-1] <= 624
            and (python[2] is None or is_number(python[2]))):
        refuse("rng.python", python, "Python's random state (version 3, 625 words, a Gaussian or null)")
    numpy = rng.get("numpy")
    if isinstance(numpy, dict):  # format 2: the MT19937 key as an int64 tensor
        state = numpy.get("state")
        key = state.get("key") if isinstance(state, dict) else None
        if numpy.get("bit_generator") != "MT19937" or not isinstance(state, dict):
            refuse("rng.numpy", numpy, "NumPy's MT19937 state")
        if not (torch.is_tensor(key) and key.dtype == torch.int64 and key.shape == (624,)
                and bool(((key >= 0) & (key < 1 << 32)).all())):
            refuse("rng.numpy.state.key", key, "624 int64 words from 0 to 2**32")
        if not (is_count(state.get("pos")) and state["pos"] <= 624):
            refuse("rng.numpy.state.pos", state.get("pos"), "a position from 0 to 624")
        if numpy.get("has_gauss") not in (0, 1) or not is_number(numpy.get("gauss")):
            refuse("rng.numpy.gauss", numpy.get("gauss"), "a cached Gaussian (has_gauss 0 or 1, a finite number)")
    elif numpy is not None:
        refuse("rng.numpy", numpy, "NumPy's MT19937 state")
    ranks = rng.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and 1 <= len(ranks) <= MAX_LIST):
        refuse("rng.ranks", ranks, "a list of the processes' torch states")
    for where, states in [("rng", rng), *((f"rng.ranks[{i}]", r) for i, r in enumerate(ranks or []))]:
        if not isinstance(states, dict):
            refuse(where, states, "a mapping of torch generator states")
        size = torch.get_rng_state().numel()  # the CPU generator's state: Mersenne Twister, seed and flags
        value = states.get("torch")
        if not (torch.is_tensor(value) and value.dtype == torch.uint8 and value.shape == (size,)):
            refuse(f"{where}.torch", value, f"torch's CPU generator state ({size} bytes)")
        cuda = states.get("cuda")
        if cuda is not None and not (isinstance(cuda, list) and len(cuda) <= MAX_LIST and all(
                torch.is_tensor(c) and c.dtype == torch.uint8 and c.dim() == 1 and len(c) in CUDA_STATE_BYTES for c in cuda)):
            refuse(f"{where}.cuda", cuda, "a list of CUDA generator states (16 or 816 bytes each) or null")


# A CUDA generator's state: its seed and Philox offset, 8 bytes each, after 800 unused bytes before torch 2.1.
CUDA_STATE_BYTES = (16, 816)


def _check_plain(node: Any, where: str, refuse: Refuse, scores: bool) -> None:
    """Lightning's loop progress and the data position (counts from 0, flags) or callback states
    (also names and scores: finite or infinite numbers, one-value tensors), within ``MAX_LIST``
    entries a level."""
    stack = [(where, node)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, dict):
            if len(value) > MAX_LIST:
                refuse(at, f"a mapping of {len(value):,} entries", f"at most {MAX_LIST:,}")
            stack.extend((f"{at}.{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            if len(value) > MAX_LIST:
                refuse(at, f"a list of {len(value):,} entries", f"at most {MAX_LIST:,}")
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(value))
        elif torch.is_tensor(value):
            if not (scores and value.numel() == 1 and value.dim() <= 1 and not bool(torch.isnan(value).any())):
                refuse(at, value, "a one-value score")
        elif isinstance(value, float):
            if not scores or math.isnan(value):
                refuse(at, value, "a count" if not scores else "a score")
        elif not (value is None or isinstance(value, bool) or is_count(value) or (scores and isinstance(value, str))):
            refuse(at, value, "a count from 0, a flag or a name" if scores else "a count from 0 or a flag")
