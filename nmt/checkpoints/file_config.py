"""Configs read from files (checkpoints, release files): checked, then built from nmt's own classes only.

A checkpoint stores its run's config, and translating, evaluating, serving or exporting it builds
the model (and, for ``nmt-evaluate``, the data) from that config. Hydra's ``instantiate`` would
import and call whatever a ``_target_`` names, and resolve interpolations that read environment
variables: given a crafted file, that runs code. So a config from a file never reaches
``instantiate``. ``check`` walks it and refuses, naming the key:

- a ``_target_`` that is not exactly one of the classes in ``BUILDABLE`` (the qualified names of
  the model, encoder, decoder, attention and data-source classes nmt defines; the name is looked
  up, never imported or resolved attribute by attribute);
- any other key starting with ``_`` but ``_partial_`` (``_args_``, ``_recursive_``, ``_convert_``,
  ...), ``trust_remote_code`` (a hub dataset's own code), and keys that are not strings;
- values other than None, bools, numbers, strings, lists and dicts, and a tree deeper than
  ``MAX_DEPTH`` or larger than ``MAX_NODES``; numbers over ``MAX_COUNTS`` where a class has them;
- hub arguments other than ``HUB_KEYS`` (which dataset), so a file never says where the hub
  library writes or which files it reads;
- any ``${`` in a string: nmt saves configs resolved, so an interpolation (``${oc.env:...}``, a
  resolver name built from another key, a key doubling another) can only be an attack. Nothing
  read from a file is ever given to OmegaConf. The one exception is the vocabulary size older
  nmt versions saved unresolved, ``${pad_to:${..src_vocab_size},${..vocab_multiple}}``: exactly
  that form, with two integers, is computed here.

``build`` then calls the classes itself (``_partial_: true`` gives a ``functools.partial``); the
root must be ``ROOTS[section]`` and a data config's ``source`` a class of its own.
``build_model`` first builds on the meta device, which allocates nothing, and compares every
weight's shape with the file's tensors: a config asking for more or larger weights than the file
holds is refused before any memory is spent on it.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nmt import pad_to
from nmt.models.base import seq2seq_config
from nmt.models.lora import LoRASettings


# What a config read from a file may build, by section of the run config: exact qualified names.
BUILDABLE: dict[str, tuple[str, ...]] = {
    "model": ("nmt.models.base.Seq2Seq", "nmt.models.rnn.RNNEncoder", "nmt.models.rnn.RNNDecoder",
              "nmt.models.transformer.TransformerEncoder", "nmt.models.transformer.TransformerDecoder",
              "nmt.models.attention.BahdanauAttention", "nmt.models.attention.LuongAttention"),
    "data": ("nmt.data.datamodule.TranslationDataModule", "nmt.data.sources.FileSource",
             "nmt.data.sources.SyntheticSource", "nmt.data.multilingual.MultilingualSource"),
}
ROOTS = {"model": "nmt.models.base.Seq2Seq", "data": "nmt.data.datamodule.TranslationDataModule"}
# Bounds on arguments that set how much work a class does (a file must not ask for 10^12 pairs).
MAX_COUNTS = {"nmt.data.sources.SyntheticSource": {"num_pairs": 10**7, "valid_pairs": 10**6, "test_pairs": 10**6,
                                                   "min_len": 1000, "max_len": 1000}}
# Mappings of hub arguments a class passes on to ``datasets.load_dataset``: from a file, only these
# keys (which dataset), never where it writes or which files it reads (cache_dir, data_files, ...).
HUB_KEYS = {"nmt.data.sources.FileSource": ("path", "name", "revision", "data_dir")}
MAX_DEPTH = 32
MAX_NODES = 10_000
MAX_STRING = 65_536  # characters of one string value
_PAD_TO = re.compile(r"\$\{pad_to:\$\{\.\.(\w+)\},\$\{\.\.(\w+)\}\}")  # older nmt's unresolved vocab_size


class ConfigRefused(ValueError):
    """A config from a file that would build or read something nmt does not allow."""


def _walk(node: Any, where: str, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_NODES or depth > MAX_DEPTH:
        raise ConfigRefused(f"{where}: the config is larger than any nmt config ({MAX_NODES} values, "
                            f"{MAX_DEPTH} levels)")
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                raise ConfigRefused(f"{where}: key {key!r} is not a string")
            if key.startswith("_") and key not in ("_target_", "_partial_"):
                raise ConfigRefused(f"{where}.{key}: refused (a config from a file may use _target_ and "
                                    "_partial_ only)")
            if key == "trust_remote_code":
                raise ConfigRefused(f"{where}.{key}: refused (a config from a file never runs a dataset's code)")
            _walk(value, f"{where}.{key}", depth + 1, count)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _walk(value, f"{where}[{i}]", depth + 1, count)
    elif isinstance(node, str):
        if len(node) > MAX_STRING:
            raise ConfigRefused(f"{where}: a string of {len(node)} characters (at most {MAX_STRING})")
    elif node is not None and not isinstance(node, (bool, int, float)):
        raise ConfigRefused(f"{where}: a {type(node).__name__} value (configs hold numbers, strings, lists and dicts)")


def _no_interpolation(node: Any, where: str, parent: Mapping[str, Any] | None) -> Any:
    """``node`` with older nmt's ``${pad_to:${..a},${..b}}`` computed; any other ``${`` refused."""
    if isinstance(node, Mapping):  # ``${..key}`` in a value of ``node`` is ``key`` of ``parent``
        return {k: _string(v, f"{where}.{k}", parent) if isinstance(v, str) else _no_interpolation(v, f"{where}.{k}", node)
                for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_no_interpolation(v, f"{where}[{i}]", None) for i, v in enumerate(node)]
    return node


def _string(value: str, where: str, grandparent: Mapping[str, Any] | None) -> str | int:
    if "${" not in value:
        return value
    found = _PAD_TO.fullmatch(value)
    numbers = [grandparent.get(key) for key in found.groups()] if found and grandparent is not None else []
    if len(numbers) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**31 for n in numbers):
        return pad_to(*numbers)
    raise ConfigRefused(f"{where}: refused, {value[:80]!r} is an interpolation (nmt saves configs resolved; "
                        "a config from a file is never resolved)")


def _check_targets(node: Any, where: str, allowed: tuple[str, ...]) -> None:
    if isinstance(node, Mapping):
        if "_target_" in node:
            target = node["_target_"]
            if not isinstance(target, str) or target not in allowed:
                raise ConfigRefused(f"{where}._target_: refused, {str(target)[:200]!r} is not one of the classes "
                                    f"a config from a file may build: {', '.join(allowed)}")
            if not isinstance(node.get("_partial_", False), bool):
                raise ConfigRefused(f"{where}._partial_: must be true or false")
            if target in HUB_KEYS and node.get("hub") is not None:
                hub = node["hub"]
                if not isinstance(hub, Mapping):
                    raise ConfigRefused(f"{where}.hub: must be a mapping of {', '.join(HUB_KEYS[target])}")
                for key, value in hub.items():
                    if key not in HUB_KEYS[target] or not isinstance(value, str):
                        raise ConfigRefused(f"{where}.hub.{key}: refused (a config from a file names a hub dataset "
                                            f"by {', '.join(HUB_KEYS[target])} only, as strings)")
                    if key == "data_dir" and (value.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", value)):
                        raise ConfigRefused(f"{where}.hub.data_dir: refused, {value[:80]!r} leaves the dataset's folder")
            for key, top in MAX_COUNTS.get(target, {}).items():
                value = node.get(key)
                if value is not None and not (isinstance(value, int) and 0 <= value <= top):
                    raise ConfigRefused(f"{where}.{key}: {str(value)[:40]} is not a count from 0 to {top:,}")
        elif "_partial_" in node:
            raise ConfigRefused(f"{where}._partial_: refused without a _target_")
        for key, value in node.items():
            _check_targets(value, f"{where}.{key}", allowed)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_targets(value, f"{where}[{i}]", allowed)


def check(config: Any, section: str, source: str) -> dict[str, Any]:
    """The ``section`` (``model`` or ``data``) config read from ``source``, interpolations resolved,
    or ``ConfigRefused`` naming the file, the key and why."""
    try:
        if not isinstance(config, Mapping):
            raise ConfigRefused(f"{section}: not a mapping but a {type(config).__name__}")
        _walk(config, section, 0, [0])
        plain = _no_interpolation(config, section, None)
        _check_targets(plain, section, BUILDABLE[section])
        if plain.get("_target_") != ROOTS[section] or plain.get("_partial_", False):
            raise ConfigRefused(f"{section}._target_: a {section} config from a file builds {ROOTS[section]}")
        if section == "data" and not (isinstance(plain.get("source"), Mapping) and "_target_" in plain["source"]):
            raise ConfigRefused("data.source: must name its class (_target_) in a config from a file")
    except ConfigRefused as e:
        raise ConfigRefused(f"{source}: {e}") from None
    return plain


@functools.cache
def classes(section: str) -> dict[str, type]:
    """``BUILDABLE[section]``'s classes by name, imported at first use: the data module imports
    Lightning, seconds that loading a model to translate does not need."""
    found = {}
    for name in BUILDABLE[section]:
        module, _, attr = name.rpartition(".")
        found[name] = getattr(importlib.import_module(module), attr)
    return found


def build(config: Any, allowed: Mapping[str, type], **kwargs: Any) -> Any:
    """The object a checked config describes (``check`` first), built children first; ``kwargs``
    go to the outermost class."""
    if isinstance(config, Mapping):
        values = {k: build(v, allowed) for k, v in config.items() if k not in ("_target_", "_partial_")}
        if "_target_" not in config:
            return values
        cls: Callable[..., Any] = allowed[config["_target_"]]
        if config.get("_partial_", False):
            return functools.partial(cls, **values, **kwargs)
        return cls(**values, **kwargs)
    if isinstance(config, (list, tuple)):
        return [build(v, allowed) for v in config]
    return config


def _checked_build(config: dict[str, Any], section: str, source: str, **kwargs: Any) -> Any:
    try:
        return build(config, classes(section), **kwargs)
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, OverflowError) as e:  # DataError too
        raise ConfigRefused(f"{source}: its {section} config does not build ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:300]})") from None


class _CountParameters:
    """Refuses (``ConfigRefused``) once a module being built registers more than ``limit`` parameters."""

    def __init__(self, stored: int, source: str) -> None:
        self.stored, self.source, self.count = stored, source, 0
        self.limit = 2 * stored + 32  # a tied weight registers twice

    def __call__(self, module: torch.nn.Module, name: str, param: Any) -> None:
        self.count += 1
        if self.count > self.limit:
            raise ConfigRefused(f"{self.source}: its model config builds far more weight tensors than the "
                                f"{self.stored} the file holds")


def build_model(config: dict[str, Any], state: Mapping[str, torch.Tensor], source: str,
                check_weights: Callable[[torch.nn.Module, Mapping[str, torch.Tensor], str], None]) -> torch.nn.Module:
    """The model a checked ``model`` config describes, with ``state``'s weights loaded. It is built
    on the meta device first and ``check_weights`` compares it with ``state``; buffers outside the
    weights (position tables) may not outgrow them. Only then is it built for real."""
    config = seq2seq_config(config)  # the preset's shared sizes reached the encoder and decoder already
    counter = _CountParameters(len(state), source)
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(counter)
    try:
        with torch.device("meta"):
            skeleton = _checked_build(config, "model", source)
    finally:
        hook.remove()
    check_weights(skeleton, state, source)
    weights = sum(t.numel() for t in state.values())
    extra = sum(b.numel() for name, b in skeleton.named_buffers() if name not in state)
    if extra > max(weights, 1 << 26):
        raise ConfigRefused(f"{source}: its model config would allocate {extra:,} values beside its {weights:,} "
                            "weights (position tables larger than any model needs)")
    model = _checked_build(config, "model", source)
    model.load_state_dict(state)
    return model


def lora_settings(run_config: Any, source: str) -> LoRASettings | None:
    """The LoRA settings of a run config read from a file (``module.lora``: rank, alpha, dropout and
    targets only, each bounded, ``nmt.models.lora.LoRASettings``), None where it has none, or
    ``ConfigRefused`` naming the file and key."""
    module = run_config.get("module") if isinstance(run_config, Mapping) else None
    if module is None:
        return None
    if not isinstance(module, Mapping):
        raise ConfigRefused(f"{source}: module: not a mapping but a {type(module).__name__}")
    try:
        return LoRASettings.from_config(module.get("lora"), "module.lora")
    except ValueError as e:
        raise ConfigRefused(f"{source}: {e}") from None


def build_data(config: dict[str, Any], source: str, **kwargs: Any) -> Any:
    """The data module a checked ``data`` config describes (``kwargs``: e.g. ``vocab_loader``)."""
    return _checked_build(config, "data", source, **kwargs)
