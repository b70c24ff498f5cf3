"""The checkpoint file format: read a file safely, check what it holds, write one atomically.

Every file is read with ``torch.load(weights_only=True)``: tensors and plain containers only, so
opening a checkpoint never runs code stored in it. A checkpoint holds (``FORMAT`` 2):
``state_dict`` (the module's weights, ``model.`` prefixed), ``run_config`` (the resolved run config
as plain dicts and lists), ``tokenizers`` (the SentencePiece models as bytes), ``global_step``,
``nmt_format`` and ``kind``: ``training`` (written by ``train.py``: optimizer, loops, callbacks and
RNG states too; resumable) or ``release`` (``nmt-export format=release`` and ``nmt-average``:
weights, config and vocabularies only; for translating and evaluating). Every tensor a file holds,
wherever it is, and the values every reader uses are checked on reading (``check_stored``,
``check_values``); what resuming restores is checked by ``nmt.checkpoints.resume``. Checkpoints
written before format 2 hold pickled Python objects: they load only with ``allow_pickle=True``,
for files you trust, since unpickling runs whatever code the file names.

Before ``torch.load`` builds anything, the archive's pickled structure (its ``*.pkl`` entries:
everything but the tensors' bytes) is read and counted (``check_structure``): at most
``MAX_STRUCTURE_BYTES``, ``MAX_STRUCTURE_OPS`` pickle operations and ``MAX_CONTAINERS`` lists,
dicts, tuples and sets. A checkpoint's structure is about 1 MB, 10,000 operations and 3,000
containers; within the limits the worst a file can build (each operation a new container or a
reference) is a few hundred MB and a few seconds, whatever it repeats.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import pickletools
import re
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoints import file_config
from nmt.cli_io import current_umask, write_failure
from nmt.data.tokenizer import Tokenizer
from nmt.models import lora

FORMAT = 2  # checkpoint["nmt_format"] this version writes and reads (1: before weights-only loading)
KINDS = ("training", "release")


class CheckpointError(ValueError):
    """A file that cannot be used as a checkpoint; the message names the file and what it is."""


def _refused_global(error: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"it names {found.group(1)}" if found else str(error).strip().splitlines()[0]


MAX_STRUCTURE_BYTES = 64 << 20  # a file's pickled structure: configs, tokenizers (a 256k-piece model: ~5 MB), ...
MAX_STRUCTURE_OPS = 1_000_000  # a checkpoint's: about 10,000 (a model of 1,000 weight tensors: about 100,000)
MAX_CONTAINERS = 250_000
MAX_MEMBERS = 100_000  # files in a checkpoint's archive: one per stored tensor and a few (a training checkpoint: ~500)
CONTAINER_OPS = frozenset({"EMPTY_LIST", "LIST", "EMPTY_DICT", "DICT", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
                           "TUPLE3", "EMPTY_SET", "FROZENSET", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"})


def zip_members(path: Path) -> int | None:
    """The number of files a zip archive's end record declares (its ZIP64 record's where the count
    does not fit in 16 bits), read without its central directory; None where it has none."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - 22 - 0xFFFF))  # the end record (22 bytes) and a comment of at most 64 KB
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < 22:
            return None
        count = struct.unpack("<H", tail[at + 10 : at + 12])[0]
        if count == 0xFFFF and at >= 20 and tail[at - 20 : at - 16] == b"PK\x06\x07":  # the ZIP64 record's locator
            f.seek(struct.unpack("<Q", tail[at - 12 : at - 4])[0])
            record = f.read(56)
            if len(record) == 56 and record[:4] == b"PK\x06\x06":
                count = struct.unpack("<Q", record[32:40])[0]
    return count


def check_structure(path: Path, writer: str = "nmt") -> None:
    """A ``CheckpointError`` for a torch archive of more than ``MAX_MEMBERS`` files (counted before
    zipfile reads their list), with a compressed file (``torch.save`` stores each as it is, and a
    memory-mapped read would take the compressed bytes for a tensor's), or whose pickled structure
    is larger than the limits above (read and counted without building it); ``writer``: what should
    have written it."""
    members = zip_members(path)
    if members is not None and members > MAX_MEMBERS:
        raise CheckpointError(f"{path}: its archive lists {members:,} files, over the {MAX_MEMBERS:,} a checkpoint may "
                              f"hold (one per stored tensor): refused, it was not written by {writer}")
    with zipfile.ZipFile(path) as archive:
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: {entry.filename} is compressed in the archive, where torch.save stores "
                                      "every file as it is (its tensors would be read from the compressed bytes): "
                                      "refused; save it again with torch.save, or zip it with -0")
            if not entry.filename.endswith(".pkl"):
                continue
            if entry.file_size > MAX_STRUCTURE_BYTES:  # the size zipfile holds the entry's reading to
                raise CheckpointError(f"{path}: its pickled structure ({entry.filename}) is over "
                                      f"{MAX_STRUCTURE_BYTES >> 20} MB, where a checkpoint's is about 1 MB: refused, it "
                                      f"was not written by {writer}")
            ops = containers = 0
            try:
                with archive.open(entry) as f:  # read as it is counted: a string at a time
                    for op, _, _ in pickletools.genops(f):
                        ops += 1
                        containers += op.name in CONTAINER_OPS
                        if ops > MAX_STRUCTURE_OPS or containers > MAX_CONTAINERS:
                            raise CheckpointError(
                                f"{path}: its pickled structure ({entry.filename}) holds over "
                                f"{MAX_STRUCTURE_OPS:,} operations or {MAX_CONTAINERS:,} containers, where a "
                                f"checkpoint's holds about 10,000 and 3,000: refused, it was not written by {writer}")
            except ValueError as e:  # not a pickle pickletools can read: torch's own reader says what it is
                if isinstance(e, CheckpointError):
                    raise
                return


def read_checkpoint(path: str | Path, allow_pickle: bool = False, what: str = "ckpt") -> dict[str, Any]:
    """The checkpoint dict of ``path``, read with ``weights_only=True`` (memory-mapped), or a
    one-line ``CheckpointError`` naming the file and what it is: not a checkpoint, truncated, of a
    newer format, or holding pickled objects (older checkpoints: only with ``allow_pickle=True``,
    for trusted files). ``what`` names the config key that gave the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}={path}: no such file (give <run>/checkpoints/<file>.ckpt)")
    with path.open("rb") as f:
        head = f.read(4)
    if not zipfile.is_zipfile(path):
        if head == b"PK\x03\x04":
            raise CheckpointError(f"{path}: truncated or corrupt checkpoint (the zip archive has no end); "
                                  "copy it again or use another checkpoint")
        raise CheckpointError(f"{path}: not a checkpoint (not a torch.save archive); give a .ckpt written by "
                              "nmt's train.py, nmt-average or nmt-export")
    try:
        check_structure(path)
        checkpoint = torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except pickle.UnpicklingError as e:
        if _refused_global(e) in ("it names bytes", "it names builtins.bytes"):  # how pickle writes b"": no nmt file has one
            raise CheckpointError(f"{path}: holds an empty byte string where nmt stores its tokenizers; refused: it "
                                  "was not written by nmt") from None
        raise CheckpointError(
            f"{path}: refused, the file holds pickled Python objects ({_refused_global(e)}), which could run "
            "code when loaded; nmt checkpoints before format 2 do. Only if you trust the file: set "
            "allow_pickle=true (convert it once with nmt-export ckpt=... format=release allow_pickle=true)"
        ) from None
    # zipfile raises zlib.error for a corrupt deflated entry and NotImplementedError for a compression it lacks
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, zlib.error, NotImplementedError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({str(e).strip().splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path}: a torch file, but not a checkpoint (no state_dict); give a .ckpt written by "
                              "nmt's train.py, nmt-average or nmt-export")
    version = checkpoint.get("nmt_format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {version} of a newer nmt (this version reads up to "
                              f"{FORMAT}); upgrade nmt to use it")
    if "run_config" not in checkpoint or "tokenizers" not in checkpoint:
        raise CheckpointError(f"{path}: no saved run config/tokenizers: it was not written by nmt")
    state, protos = checkpoint["state_dict"], checkpoint["tokenizers"]
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict) or not all(isinstance(run_config.get(k, {}), dict) for k in ("model", "data")):
        raise CheckpointError(f"{path}: its run config is not a mapping with model and data sections: it was not "
                              "written by nmt")
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise CheckpointError(f"{path}: its state_dict is not a mapping of names to tensors: it was not written by nmt")
    if not isinstance(protos, dict) or not all(isinstance(protos.get(side), bytes) for side in ("src", "tgt")):
        raise CheckpointError(f"{path}: its tokenizers are not two SentencePiece models: it was not written by nmt")
    raw = checkpoint.get("current_model_state")
    if raw is not None and not (isinstance(raw, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                                              for k, v in raw.items())):
        raise CheckpointError(f"{path}: its current_model_state is not a mapping of names to tensors: it was not "
                              "written by nmt")
    check_stored(path, file_tensors(checkpoint, path))
    check_values(path, checkpoint)
    return checkpoint


MAX_STEP = 1 << 53  # a step, epoch or counter beyond which a float no longer counts


def is_count(value: Any, low: int = 0) -> bool:
    """An int (not a bool) from ``low`` to ``MAX_STEP``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_STEP


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_values(path: str | Path, checkpoint: dict[str, Any]) -> None:
    """Refuse (``CheckpointError``) the values every reader of a file uses when they are not of
    their type and range: ``kind``, ``global_step``, ``epoch`` and ``monitor`` (its validation score)."""
    def refuse(key: str, value: Any, what: str) -> None:
        shown = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"a {type(value).__name__}"
        raise CheckpointError(f"{path}: {key} is {shown[:60]}, not {what}; refused: it was not written by nmt")

    if "kind" in checkpoint and checkpoint["kind"] not in KINDS:
        refuse("kind", checkpoint["kind"], " or ".join(KINDS))
    for key in ("global_step", "epoch"):
        if checkpoint.get(key) is not None and not is_count(checkpoint[key]):
            refuse(key, checkpoint[key], f"a count from 0 to {MAX_STEP}")
    monitor = checkpoint.get("monitor")
    if monitor is not None:
        if not isinstance(monitor, dict):
            refuse("monitor", monitor, "a mapping of the validation score's name, value and step")
        if monitor.get("value") is not None and not is_number(monitor["value"]):
            refuse("monitor.value", monitor["value"], "a finite number")
        if monitor.get("step") is not None and not is_count(monitor["step"]):
            refuse("monitor.step", monitor["step"], f"a count from 0 to {MAX_STEP}")
        if monitor.get("name") is not None and not isinstance(monitor["name"], str):
            refuse("monitor.name", monitor["name"], "a metric name")


# What a tensor of an nmt file may be: plain dense, of one of these dtypes, stored contiguously.
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                    torch.int32, torch.int64, torch.bool})
STATE_DICTS = ("state_dict", "current_model_state")  # the weights: where a tensor may have several names
MAX_NAMES = 8  # names of one stored tensor in a state dict: a tied Transformer embedding has 5 (its modules')
MAX_DEPTH = 256  # levels of containers in a file (a training checkpoint has 9; its configs are held to 32 where read)


def file_tensors(checkpoint: dict[str, Any], path: str | Path) -> list[tuple[str, Any, str]]:
    """Every tensor of ``checkpoint``, wherever it is (weights, optimizer and scheduler state, RNG
    states, callbacks, loops, counters): (its name, the tensor, the top-level key it is under). A
    weight is named by its state-dict key, anything else by its place
    (``optimizer_states[0].state[3].exp_avg``). Containers deeper than ``MAX_DEPTH`` are refused.
    Each container is walked once, at its first place: a file stores an object once however often
    it is named (a list of two references to one list, 45 levels deep, is 46 lists and 2^45 paths),
    so the walk costs what the file's objects count, not its paths."""
    found: list[tuple[str, Any, str]] = []
    walked: set[int] = set()  # the ids of the containers walked (all alive: the checkpoint holds them)
    # one iterator per open container: memory follows the depth, and a name is made when its item is reached
    stack: list[Iterator[tuple[str, Any, str]]] = [iter([(str(k), v, str(k)) for k, v in checkpoint.items()])]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            continue
        where, node, section = item
        if len(stack) > MAX_DEPTH:
            raise CheckpointError(f"{path}: {where} is nested deeper than any nmt file ({MAX_DEPTH} levels); refused")
        if torch.is_tensor(node):
            found.append((where, node, section))
        elif isinstance(node, (dict, list, tuple)) and id(node) not in walked:
            walked.add(id(node))
            stack.append(_named_children(where, node, section))
    return found


def _named_children(where: str, node: dict | list | tuple, section: str) -> Iterator[tuple[str, Any, str]]:
    """(name, value, section) of each item of a container named ``where`` (``file_tensors``)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (str(key) if where in STATE_DICTS and section == "state_dict"
                   else f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"), value, section
    else:
        for i, value in enumerate(node):
            yield f"{where}[{i}]", value, section


def _not_plain(t: torch.Tensor) -> str | None:
    """What kind of tensor ``t`` is when it is not a plain dense one (None when it is)."""
    if t.is_nested:
        return "a nested"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(t).__name__}"
    if t.layout != torch.strided:
        return "a sparse"
    if t.is_meta:
        return "a meta"
    if t.is_quantized:
        return "a quantized"
    return None


def _sharing(section: str) -> str | None:
    """Which tensors one tensor of ``section`` may share its storage with: the weights of both state
    dicts (tied weights; an EMA run's two copies keep their ties), a callback's scores (Lightning's
    ModelCheckpoint saves its best score under several names); nothing for the rest."""
    return "weights" if section in STATE_DICTS else "callbacks" if section == "callbacks" else None


def check_stored(path: str | Path, tensors: Iterable[tuple[str, Any] | tuple[str, Any, str]]) -> None:
    """Refuse (``CheckpointError``, one line naming the file and the tensor) any tensor of a file
    that is not what nmt writes: a nested, sparse, meta, quantized or subclassed tensor; a dtype
    outside ``DTYPES``; a view that repeats stored values (a zero stride, more elements than its
    storage holds) or is not stored contiguously; a tensor sharing its storage with another,
    except one weight under several names (tied weights, at most ``MAX_NAMES``) or disjoint views
    of one storage (flattened RNN weights) in the state dicts. A tensor read from the file then
    costs no more than the bytes the file stores, a kernel that writes a tensor in place (a fused
    optimizer's moments) writes only bytes of its own, and a small file cannot declare a huge model
    by naming one tensor many times. ``tensors``: (name, tensor[, top-level key])."""
    owners: dict[int, tuple[str, str]] = {}  # storage -> its first tensor's name and section
    views: dict[int, dict[tuple, str]] = {}  # storage -> its distinct views (offset, shape, dtype) -> a name
    names: dict[tuple[int, str], int] = {}  # (storage, state dict) -> how many names it has there
    for name, t, *rest in tensors:
        if not torch.is_tensor(t):
            continue
        section = rest[0] if rest else "state_dict"
        if kind := _not_plain(t):
            raise CheckpointError(f"{path}: {name} is {kind} tensor; refused: a checkpoint holds plain dense tensors")
        if t.dtype not in DTYPES:
            raise CheckpointError(f"{path}: {name} is a {str(t.dtype).removeprefix('torch.')} tensor; refused: a "
                                  "checkpoint holds float, integer and bool tensors")
        storage, size = t.untyped_storage(), t.numel() * t.element_size()
        start = t.storage_offset() * t.element_size()
        if any(stride == 0 and n > 1 for stride, n in zip(t.stride(), t.shape)) or start + size > storage.nbytes():
            raise CheckpointError(f"{path}: {name} is not a plain dense tensor (it repeats {storage.nbytes():,} stored "
                                  f"bytes as a {tuple(t.shape)} tensor); refused: a checkpoint stores every value it holds")
        if not t.is_contiguous():
            raise CheckpointError(f"{path}: {name} is not a plain dense tensor (a {tuple(t.shape)} view of strides "
                                  f"{t.stride()}); refused: a checkpoint stores every tensor contiguously")
        if size == 0:
            continue
        key, view = storage.data_ptr(), (start, tuple(t.shape), t.dtype)
        if key not in owners:
            owners[key], views[key], names[key, section] = (name, section), {view: name}, 1
            continue
        first, first_section = owners[key]
        if _sharing(section) is None or _sharing(section) != _sharing(first_section):
            raise CheckpointError(f"{path}: {name} shares its storage with {first}; refused: every tensor of a "
                                  "checkpoint has its own (only tied weights and a callback's scores are one tensor "
                                  "under several names)")
        names[key, section] = names.get((key, section), 0) + 1
        if names[key, section] > MAX_NAMES and section in STATE_DICTS:
            raise CheckpointError(f"{path}: {first} is stored once and named more than {MAX_NAMES} times (also as "
                                  f"{name}); refused: a tied weight of an nmt model has at most {MAX_NAMES} names")
        views[key].setdefault(view, name)
    for found in views.values():
        spans = sorted((start, start + math.prod(shape) * dtype.itemsize, name)
                       for (start, shape, dtype), name in found.items())
        for (_, end, a), (b_start, _, b) in zip(spans, spans[1:]):
            if b_start < end:
                raise CheckpointError(f"{path}: {a} and {b} overlap in one storage; refused: a checkpoint stores every "
                                      "value once (tied weights are one tensor under several names)")


def check_run_config(checkpoint: dict[str, Any], source: str | Path) -> None:
    """Refuse (``CheckpointError``) a checkpoint whose model or data config would build anything but
    nmt's own classes or read the environment (``nmt.checkpoints.file_config.check``), or whose LoRA
    config is not one nmt writes (``file_config.lora_settings``)."""
    run_config = checkpoint["run_config"]
    if not isinstance(run_config, dict):
        raise CheckpointError(f"{source}: its run config is a {type(run_config).__name__}, not a mapping")
    for section in ("model", "data"):
        if section in run_config:
            try:
                file_config.check(run_config[section], section, str(source))
            except file_config.ConfigRefused as e:
                raise CheckpointError(str(e)) from None
    try:
        file_config.lora_settings(run_config, str(source))  # module.lora: what merging the adapters reads
    except file_config.ConfigRefused as e:
        raise CheckpointError(str(e)) from None


def checkpoint_kind(checkpoint: dict[str, Any]) -> str:
    """``training`` (resumable) or ``release`` (weights, config and vocabularies only)."""
    return checkpoint.get("kind", "training")


def tokenizer_protos(src_vocab: Tokenizer, tgt_vocab: Tokenizer) -> dict[str, bytes]:
    """The serialized SentencePiece models, stored in every checkpoint."""
    return {"src": src_vocab.sp.serialized_model_proto(), "tgt": tgt_vocab.sp.serialized_model_proto()}


def tokenizer_from_proto(proto: bytes, name: str, source: str | Path = "the checkpoint") -> Tokenizer:
    """The ``name`` (src or tgt) tokenizer saved in the checkpoint ``source``, checked (``Tokenizer.from_proto``)."""
    try:
        return Tokenizer.from_proto(proto, f"the {name} tokenizer saved in {source}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise a ValueError naming every missing, unexpected or differently shaped weight."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs config {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state_dict))
        if own[k].shape != state_dict[k].shape
    ]
    if missing or unexpected or shapes:
        def listed(names: list[str]) -> str:
            return ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")

        parts = [f"{what}: {listed(names)}" for what, names in (
            ("different shapes", shapes), ("missing from the checkpoint", missing), ("not in the model", unexpected))
                 if names]
        raise ValueError(f"{source} does not match the model config (model type, sizes or vocabulary differ): "
                         + "; ".join(parts) + "; use the config the checkpoint was trained with (it is saved in it)")


def model_state(checkpoint: dict[str, Any], weights: str = "stored", adapters: str = "merged",
                source: str | Path = "the checkpoint") -> dict[str, torch.Tensor]:
    """The Seq2Seq weights of a Lightning checkpoint (the module's ``model.`` prefix removed):
    ``merged_weights`` (a LoRA run's adapters merged, the plain model's weights), or with
    ``adapters="kept"`` ``model_weights`` as stored (what resuming the run loads)."""
    state = model_weights(checkpoint, weights) if adapters == "kept" else merged_weights(checkpoint, weights, source)
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def merged_weights(checkpoint: dict[str, Any], weights: str = "stored",
                   source: str | Path = "the checkpoint") -> dict[str, torch.Tensor]:
    """``model_weights``, with the adapters of a run with ``module.lora`` merged into the weights
    they adapt (W + alpha / rank B A, ``nmt.models.lora.merged_state``): the plain model's weights,
    which every reader and engine takes as they are. The file's LoRA config is checked
    (``file_config.lora_settings``) and every adapter's shape with it; a ``CheckpointError`` names
    the file otherwise."""
    state = model_weights(checkpoint, weights)
    if not any(lora.is_adapter(name) for name in state):
        return state
    try:
        settings = file_config.lora_settings(checkpoint["run_config"], str(source))
        if settings is None:
            raise CheckpointError(f"{source}: holds LoRA adapters (lora_A, lora_B) but its run config sets no "
                                  "module.lora rank: it was not written by nmt")
        return lora.merged_state(state, settings.scale, settings.rank)
    except file_config.ConfigRefused as e:
        raise CheckpointError(str(e)) from None
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {e}") from None


def saved_vocabularies(path: str | Path) -> tuple[Tokenizer, Tokenizer]:
    """Source and target tokenizers to train with instead of training new ones (``data.vocab_from``):
    those saved in a checkpoint written by ``train.py``, or one SentencePiece ``.model`` file for both
    sides (its special ids must be PAD=0, UNK=1, BOS=2, EOS=3)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.vocab_from={path}: no such file (give a checkpoint written by "
                                "train.py or a SentencePiece .model file)")
    if zipfile.is_zipfile(path):  # torch.save's format
        try:
            checkpoint = read_checkpoint(path, what="data.vocab_from")
        except CheckpointError as e:
            raise CheckpointError(f"data.vocab_from={e}") from None
        protos = checkpoint["tokenizers"]
        if not {"src", "tgt"} <= set(protos):
            raise ValueError(f"data.vocab_from={path}: the checkpoint has no saved tokenizers "
                             "(it was not written by nmt)")
        src = tokenizer_from_proto(protos["src"], "src", path)
        return src, src if protos["tgt"] == protos["src"] else tokenizer_from_proto(protos["tgt"], "tgt", path)
    try:
        tok = Tokenizer(path)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"data.vocab_from={path}: not a SentencePiece model ({e}); give a "
                         "checkpoint written by train.py or a SentencePiece .model file") from e
    except ValueError as e:  # special ids other than nmt's
        raise ValueError(f"data.vocab_from={e}") from e
    return tok, tok


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity (one host sync in all)."""
    named = [(name, t) for name, t in tensors if torch.is_tensor(t) and t.is_floating_point()]
    if not named:
        return []
    flags = [torch.isfinite(t).all() for _, t in named]
    finite = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def vocabulary_difference(proto: bytes, side: str, vocab: Tokenizer) -> tuple[int, int, int] | None:
    """Where the ``side`` tokenizer saved as ``proto`` and ``vocab`` first differ: (piece id, saved
    size, ``vocab``'s size), or None when they hold the same pieces in the same order."""
    saved_sp, now_sp = tokenizer_from_proto(proto, side).sp, vocab.sp
    saved = [saved_sp.id_to_piece(i) for i in range(saved_sp.get_piece_size())]
    now = [now_sp.id_to_piece(i) for i in range(now_sp.get_piece_size())]
    if saved == now:
        return None
    return next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now))), len(saved), len(now)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file in the target folder, flushed to disk, then renamed over
    ``path``: a crash while saving leaves the previous file intact and no half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # as open() would create it (mkstemp's file is 0600)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch reports a failed write as RuntimeError
        Path(tmp).unlink(missing_ok=True)
        kept = "the previous file is unchanged" if path.exists() else "nothing was written"
        cause = e if isinstance(e, OSError) else OSError(errno.EIO, "torch's writer stopped short")  # its text: C++ internals
        raise write_failure(path, cause, kept) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def model_weights(checkpoint: dict[str, Any], weights: str = "stored") -> dict[str, torch.Tensor]:
    """The module weights (``model.`` prefixed) of a checkpoint: ``stored`` (its ``state_dict``:
    the averaged weights of a run with ``callbacks.ema``) or ``raw`` (the weights being trained,
    ``current_model_state``, which only an EMA run saves besides)."""
    if weights == "stored":
        return checkpoint["state_dict"]
    if weights == "raw":
        return checkpoint.get("current_model_state", checkpoint["state_dict"])
    raise ValueError(f"weights={weights!r}: choose stored or raw")
