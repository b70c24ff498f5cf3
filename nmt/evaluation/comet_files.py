"""A COMET checkpoint folder (wmt22-comet-da) read safely into ``nmt.evaluation.comet``.

The folder, as its publishers ship it, plus the XLM-R files its ``hparams.yaml`` names by hub id
(``pretrained_model: xlm-roberta-large``), which nmt never fetches::

    wmt22-comet-da/
      hparams.yaml                  the estimator's settings (class_identifier: regression_metric)
      checkpoints/model.ckpt        the weights (a Lightning checkpoint; or model.safetensors)
      encoder/config.json           XLM-R's sizes  } from xlm-roberta-large; another folder:
      encoder/sentencepiece.bpe.model   its pieces } comet.encoder=<folder>

The folder is untrusted input: ``hparams.yaml`` and ``config.json`` are read as plain YAML (no
aliases) and JSON of bounded size and values (``nmt.checkpoints.folder_limits``), every size is
bounded (``LIMITS``) before a tensor is allocated, the weights are read with
``torch.load(weights_only=True)`` (tensors and plain containers, nothing that runs code) or from
safetensors, and every tensor's name and shape is checked against the model the settings
describe. What nmt does not compute (another COMET class, another encoder) is refused in one line
naming the file and key.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt.checkpoints.files import CheckpointError, check_structure
from nmt.checkpoints.folder_limits import check_safetensors_header, count_pieces, json_object
from nmt.evaluation.comet import ACTIVATIONS, POOLS, Comet, CometEstimator, Head, XLMRPieces

LIMITS = {"hidden_size": 8192, "num_hidden_layers": 64, "num_attention_heads": 256, "intermediate_size": 65536,
          "vocab_size": 1_000_000, "max_position_embeddings": 65536, "type_vocab_size": 16}
MAX_BYTES = {"hparams.yaml": 64 << 10, "config.json": 1 << 20, "sentencepiece.bpe.model": 64 << 20}  # wmt22: 1 KB, 1 KB, 5 MB
MAX_HIDDEN, MAX_DEPTH = 65536, 8  # the feed-forward's widths and number of hidden layers
DOWNLOAD = ("huggingface-cli download Unbabel/wmt22-comet-da --local-dir wmt22-comet-da && huggingface-cli download "
            "FacebookAI/xlm-roberta-large config.json sentencepiece.bpe.model --local-dir wmt22-comet-da/encoder")


class CometRefused(ValueError):
    """A COMET folder nmt cannot read or compute; the message names the file (or key) and why."""


def _read(path: Path, key: str) -> bytes:
    if not path.is_file():
        raise CometRefused(f"{key}: {path} is missing (a COMET folder: {DOWNLOAD}; see docs/evaluating.md)")
    if path.stat().st_size > MAX_BYTES[path.name]:
        raise CometRefused(f"{path}: {path.stat().st_size:,} bytes, more than the {MAX_BYTES[path.name]:,} a {path.name} may have")
    return path.read_bytes()


def read_head(path: Path) -> tuple[Head, dict[str, Any]]:
    """The estimator's settings from ``hparams.yaml`` (plain YAML), checked."""
    import yaml

    raw = _read(path, "comet.model")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: 10x faster
    try:
        for event in yaml.parse(raw, Loader=loader):  # an alias repeats a value: 9 levels of 10 = 10^9
            if isinstance(event, yaml.AliasEvent):
                raise CometRefused(f"{path}: line {event.start_mark.line + 1}: a YAML alias (*{event.anchor[:40]}); "
                                   "nmt reads hparams.yaml as plain YAML, without anchors and aliases")
        hparams = yaml.load(raw, Loader=loader)  # a safe loader: plain values only
    except yaml.YAMLError as e:
        raise CometRefused(f"{path}: not plain YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(hparams, dict):
        raise CometRefused(f"{path}: not a mapping of settings")
    want = {"class_identifier": "regression_metric", "encoder_model": "XLM-RoBERTa"}
    for key, value in want.items():
        if hparams.get(key) != value:
            raise CometRefused(f"{path}: {key}={hparams.get(key)!r}; nmt computes {key}={value} (wmt22-comet-da, "
                               "wmt20/21-comet-da), not reference-free or unified COMET models")
    sizes = hparams.get("hidden_sizes", [3072, 1024])
    if (not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_DEPTH
            or not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_HIDDEN for s in sizes)):
        raise CometRefused(f"{path}: hidden_sizes={sizes!r}: 1 to {MAX_DEPTH} widths from 1 to {MAX_HIDDEN}")
    layer, transform = hparams.get("layer", "mix"), hparams.get("layer_transformation", "softmax")
    transform = "sparsemax" if transform == "sparsemax_patch" else transform  # the same computation, renamed by COMET 2.2.4
    pool, act, final = hparams.get("pool", "avg"), hparams.get("activations", "Tanh"), hparams.get("final_activation")
    checks = [("layer", layer, layer == "mix" or (isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0)),
              ("layer_transformation", transform, transform in ("softmax", "sparsemax")),
              ("pool", pool, pool in POOLS), ("activations", act, str(act).title() in ACTIVATIONS),
              ("final_activation", final, final is None or str(final).title() in ACTIVATIONS),
              ("layer_norm", hparams.get("layer_norm", False), isinstance(hparams.get("layer_norm", False), bool))]
    for key, value, ok in checks:
        if not ok:
            raise CometRefused(f"{path}: {key}={value!r} is not a setting nmt computes")
    head = Head(layer, transform, hparams.get("layer_norm", False), pool, tuple(sizes), str(act).title(),
                None if final is None else str(final).title())
    return head, hparams


def read_encoder_config(path: Path) -> dict[str, Any]:
    """XLM-R's ``config.json``, every size bounded."""
    config = json_object(_read(path, "comet.encoder"), path, CometRefused)  # values and depth bounded
    if config.get("model_type") not in ("xlm-roberta", None):
        raise CometRefused(f"{path}: model_type={config.get('model_type')!r}; COMET's encoder here is xlm-roberta")
    for key, limit in LIMITS.items():
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise CometRefused(f"{path}: {key}={value!r}: a whole number from 1 to {limit:,}")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise CometRefused(f"{path}: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads")
    if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise CometRefused(f"{path}: hidden_act/position_embedding_type other than gelu/absolute are not XLM-R's")
    eps = config.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CometRefused(f"{path}: layer_norm_eps={eps!r}: a small positive number")
    return config


def expected_shapes(config: dict[str, Any], head: Head) -> dict[str, tuple[int, ...]]:
    """COMET's name and shape of every weight of the model ``config`` and ``head`` describe."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    e = "encoder.model."
    shapes = {f"{e}embeddings.word_embeddings.weight": (v, h),
              f"{e}embeddings.position_embeddings.weight": (config["max_position_embeddings"], h),
              f"{e}embeddings.token_type_embeddings.weight": (config["type_vocab_size"], h),
              f"{e}embeddings.LayerNorm.weight": (h,), f"{e}embeddings.LayerNorm.bias": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"{e}encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes.update({f"{p}{name}.weight": (h, h), f"{p}{name}.bias": (h,)})
        shapes.update({f"{p}intermediate.dense.weight": (f, h), f"{p}intermediate.dense.bias": (f,),
                       f"{p}output.dense.weight": (h, f), f"{p}output.dense.bias": (h,)})
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes.update({f"{p}{norm}.weight": (h,), f"{p}{norm}.bias": (h,)})
    if head.layer == "mix":
        shapes.update({f"layerwise_attention.scalar_parameters.{i}": (1,) for i in range(config["num_hidden_layers"] + 1)})
        shapes["layerwise_attention.gamma"] = (1,)
    sizes = [6 * h, *head.hidden_sizes, 1]
    for j, (a, b) in enumerate(zip(sizes, sizes[1:])):
        shapes.update({f"estimator.ff.{3 * j}.weight": (b, a), f"estimator.ff.{3 * j}.bias": (b,)})
    return shapes


# Tensors a COMET checkpoint may hold that the score does not read: buffers of training-time dropout
# and of older transformers, and a pooler some encoders keep.
IGNORED = re.compile(r"layerwise_attention\.(dropout_mask|dropout_fill)|encoder\.model\.embeddings\.(position_ids|token_type_ids)"
                     r"|encoder\.model\.pooler\..*")


def read_weights(folder: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """COMET's tensors from ``checkpoints/model.safetensors`` or ``checkpoints/model.ckpt``
    (``weights_only=True``, memory-mapped), every name and shape checked before a tensor is read."""
    safetensors, ckpt = folder / "checkpoints" / "model.safetensors", folder / "checkpoints" / "model.ckpt"
    if safetensors.is_file():
        from safetensors import SafetensorError, safe_open

        check_safetensors_header(safetensors, CometRefused)
        try:
            with safe_open(str(safetensors), framework="pt") as f:
                check_names(safetensors, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}, expected)
                state = {name: f.get_tensor(name) for name in expected}
        except (SafetensorError, OSError) as e:
            raise CometRefused(f"{safetensors}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
        path = safetensors
    elif ckpt.is_file():
        try:
            if zipfile.is_zipfile(ckpt):  # its pickled structure bounded, as every checkpoint's
                check_structure(ckpt, writer="COMET")
            raw = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
        except CheckpointError as e:
            raise CometRefused(str(e)) from None
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            raise CometRefused(f"{ckpt}: holds more than tensors and plain values ({found.group(1) if found else 'pickled objects'}), "
                               "which nmt never unpickles") from None
        except (RuntimeError, EOFError, OSError) as e:
            raise CometRefused(f"{ckpt}: truncated or not a torch file ({str(e).strip().splitlines()[0][:120]})") from None
        state = raw.get("state_dict") if isinstance(raw, dict) else None
        if not isinstance(state, dict):
            raise CometRefused(f"{ckpt}: no state_dict (not a COMET checkpoint)")
        for name, tensor in state.items():
            if not isinstance(name, str) or not torch.is_tensor(tensor):
                raise CometRefused(f"{ckpt}: {name!r} is not a named tensor")
        check_names(ckpt, {name: tuple(t.shape) for name, t in state.items()}, expected)
        path = ckpt
    else:
        raise CometRefused(f"comet.model: {ckpt} is missing (a COMET folder: {DOWNLOAD}; see docs/evaluating.md)")
    bad = [name for name in expected if not torch.isfinite(state[name]).all()]
    if bad:
        raise CometRefused(f"{path}: weights hold NaN or infinity ({', '.join(bad[:3])})")
    return {name: state[name].float() for name in expected}


def check_names(path: Path, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of ``shapes`` is a weight of ``expected`` with its shape (or one of ``IGNORED``), and none is missing."""
    for name, shape in shapes.items():
        if name in expected:
            if shape != expected[name]:
                raise CometRefused(f"{path}: {name} has shape {shape}, the model hparams.yaml and "
                                   f"config.json describe needs {expected[name]}")
        elif not IGNORED.fullmatch(name):
            raise CometRefused(f"{path}: {name} is not a weight of the COMET model hparams.yaml describes")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CometRefused(f"{path}: {missing[0]} is missing ({len(missing)} weights in all)")


def build_model(config: dict[str, Any], head: Head, state: dict[str, Tensor]) -> CometEstimator:
    """The estimator with COMET's weights ``state`` (names as ``expected_shapes``)."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "type_vocab_size", "layer_norm_eps")
    encoder = XLMRobertaModel(XLMRobertaConfig(**{k: config[k] for k in keys if k in config}, pad_token_id=1,
                                               bos_token_id=0, eos_token_id=2), add_pooling_layer=False)
    model = CometEstimator(encoder, head)
    ours = {name[len("encoder.model."):]: t for name, t in state.items() if name.startswith("encoder.model.")}
    encoder.load_state_dict(ours, strict=False)  # position_ids (a buffer) is computed, not read
    with torch.no_grad():
        if head.layer == "mix":
            layers = config["num_hidden_layers"] + 1
            model.layer_weights.copy_(torch.cat([state[f"layerwise_attention.scalar_parameters.{i}"] for i in range(layers)]))
            model.gamma.copy_(state["layerwise_attention.gamma"])
        for name, t in state.items():
            if name.startswith("estimator.ff."):
                index, kind = name[len("estimator.ff."):].split(".")
                getattr(model.estimator[int(index)], kind).copy_(t)
    return model


def missing_extra() -> str:
    return "COMET needs transformers' XLM-R: pip install 'nmt[comet]'"


def load_comet(model: str | Path, encoder: str | Path | None = None, batch_size: int = 16, device: str = "cpu") -> Comet:
    """The COMET model of the folder ``model`` (``comet.model``), XLM-R's files in ``encoder``
    (``comet.encoder``; None: ``<model>/encoder``), or a one-line ``CometRefused``."""
    folder = Path(model)
    if not folder.is_dir():
        raise CometRefused(f"comet.model={model}: no such folder; download wmt22-comet-da where there is internet "
                           f"({DOWNLOAD}) and set comet.model=<that folder>, or comet.model=null")
    enc = Path(encoder) if encoder is not None else folder / "encoder"
    if not enc.is_dir():
        raise CometRefused(f"comet.encoder={enc}: no such folder; it holds xlm-roberta-large's config.json and "
                           "sentencepiece.bpe.model (huggingface-cli download FacebookAI/xlm-roberta-large "
                           f"config.json sentencepiece.bpe.model --local-dir {enc})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 4096:
        raise CometRefused(f"comet.batch_size={batch_size!r}: a whole number from 1 to 4096")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CometRefused(missing_extra()) from None
    head, _ = read_head(folder / "hparams.yaml")
    config = read_encoder_config(enc / "config.json")
    state = read_weights(folder, expected_shapes(config, head))
    pieces = _read(enc / "sentencepiece.bpe.model", "comet.encoder")
    count_pieces(pieces, enc / "sentencepiece.bpe.model", CometRefused)  # before SentencePiece builds them
    try:
        tokenizer = XLMRPieces(pieces, config["max_position_embeddings"] - 4)
    except RuntimeError as e:
        raise CometRefused(f"{enc / 'sentencepiece.bpe.model'}: not a SentencePiece model ({str(e).splitlines()[0][:120]})") from None
    sp = tokenizer.sp
    if (sp.unk_id(), sp.bos_id(), sp.eos_id()) != (0, 1, 2) or sp.get_piece_size() + 2 != config["vocab_size"]:
        raise CometRefused(f"{enc / 'sentencepiece.bpe.model'}: not XLM-R's pieces for {enc / 'config.json'} (unk, <s>, </s> "
                           f"must be 0, 1, 2 and vocab_size the pieces + 2: {sp.get_piece_size()} + 2 != {config['vocab_size']})")
    return Comet(build_model(config, head, state), tokenizer, name=str(folder), batch_size=batch_size, device=device)
