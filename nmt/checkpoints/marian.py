"""A Hugging Face ``MarianMTModel`` folder (the OPUS-MT models) read as an nmt release checkpoint
(``nmt-import format=huggingface src=<folder> out=model.ckpt``; ``init_from=<folder>`` in train.py).

The reverse of ``nmt.exporters.huggingface``: Marian is the post-norm Transformer of
``nmt/models/transformer.py`` with sinusoids laid out sines first (their unit ``j`` is our unit
``perm[j]``), a feed-forward ``activation`` (OPUS-MT: swish) and a logits bias
(``final_logits_bias``: ``logits_bias: true``). What differs is the vocabulary:

- Marian's ids: ``</s>`` 0, ``<unk>`` 1, the pieces, ``<pad>`` last, and the decoder starts from
  ``<pad>``. Ours are PAD 0, UNK 1, BOS 2, EOS 3 (``nmt.specials``), so our id ``i`` is their id
  ``order[i]``: PAD their pad, UNK their unk, BOS their decoder start (a second row of their pad
  when they start from pad, whose logit bias is ``NEVER`` so that the softmax is theirs), EOS their eos, then their other ids in their order. Every table is
  indexed by ``order``; the output layer's PAD and BOS are never generated, as theirs.
- ``MarianTokenizer`` cuts text with ``source.spm`` (``target.spm`` for targets) and maps the
  pieces through ``vocab.json``. We write each side's SentencePiece model again with the joint
  vocabulary as its pieces in our id order: a piece the side's model has keeps its type and
  score (the same segmentation), a piece it lacks becomes UNUSED (never produced, still decoded).
  A piece the side's model produces that ``vocab.json`` lacks is their ``<unk>``: it gets an id of
  its own past theirs whose embedding row is their unk row and whose logit is never chosen
  (bias ``NEVER``).
- Multilingual models mark the target language with ``>>fra<<``, which MarianTokenizer splits off
  the start of the source: the piece becomes ``▁<2fra>`` (user-defined), so our ``tgt_lang=fra``
  (``nmt.languages.tags``), which writes ``<2fra> text``, gives their ids.

A folder is untrusted input: weights are read from ``model.safetensors`` only (a pickled
``pytorch_model.bin`` is refused unless ``allow_pickle``, and is then read with
``weights_only=True``), every size in ``config.json`` is bounded (``LIMITS``) and every tensor's name
and shape checked against the config before it is read, and what the model does not compute
(another architecture, pre-norm, embeddings not scaled, ...) is refused in one line naming the
file and key. A hub id (``Helsinki-NLP/opus-mt-en-de``) is fetched with ``huggingface_hub``.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt.checkpoints.files import FORMAT, CheckpointError, _refused_global, check_structure, nonfinite
from nmt.checkpoints.folder_limits import check_safetensors_header, count_pieces, json_object
from nmt.data.tokenizer import Tokenizer
from nmt.languages.tags import LANGUAGE
from nmt.specials import BOS, EOS, NEVER, PAD, UNK

# Bounds on config.json's sizes, checked before any tensor is allocated (OPUS-MT big: 1024 wide,
# 6+6 layers, 4096 feed-forward, ~60k pieces, 512 positions).
LIMITS = {"d_model": 8192, "encoder_layers": 64, "decoder_layers": 64, "encoder_attention_heads": 256,
          "decoder_attention_heads": 256, "encoder_ffn_dim": 65536, "decoder_ffn_dim": 65536,
          "vocab_size": 1_000_000, "decoder_vocab_size": 1_000_000, "max_position_embeddings": 65536}
MAX_BYTES = {"config.json": 1 << 20, "generation_config.json": 1 << 20, "tokenizer_config.json": 1 << 20,
             "vocab.json": 64 << 20, "target_vocab.json": 64 << 20, "source.spm": 64 << 20, "target.spm": 64 << 20,
             "special_tokens_map.json": 1 << 20, "sentencepiece.bpe.model": 64 << 20, "tokenizer.json": 64 << 20}
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}  # transformers' -> ours
# config.json keys of Marian's relatives that change the computation; true (or set) is refused.
NOT_COMPUTED = ("normalize_before", "add_final_layer_norm", "layernorm_embedding", "normalize_embedding",
                "add_bias_logits", "static_position_embeddings")
FILES = ["config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
         "target_vocab.json", "tokenizer_config.json", "special_tokens_map.json",
         "sentencepiece.bpe.model", "tokenizer.json"]  # what a hub download fetches (M2M100, NLLB-200 too)
TAG = re.compile(r">>(.+)<<")
SPIECE = "\u2581"


class ImportRefused(CheckpointError):
    """A folder that does not import; the message names the file, the key and what to do."""


def is_model_source(src: str | Path) -> bool:
    """Whether ``src`` names a model folder (``config.json`` in it) or, not being a path that exists
    or a ``.ckpt``, a hub id (``owner/name``)."""
    path = Path(src)
    if path.is_dir():
        return (path / "config.json").is_file()
    return not path.exists() and path.suffix != ".ckpt" and bool(re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)))


def resolve(src: str | Path, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local folder of ``src``: a folder as it is, or a hub id (``owner/name``) downloaded with
    ``huggingface_hub`` (the files the import reads only)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)):
        raise FileNotFoundError(f"src={src}: no such folder (give a MarianMTModel folder or a hub id owner/name)")
    from huggingface_hub import snapshot_download

    patterns = FILES + (["pytorch_model.bin"] if allow_pickle else [])
    try:
        return Path(snapshot_download(str(src), revision=revision, allow_patterns=patterns))
    except Exception as e:  # the hub library's errors: offline, unknown repository, gated
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ImportRefused(f"src={src}: not a local folder, and the hub download failed ({first[:200]})") from None


def _read(folder: Path, name: str, required: bool = True) -> bytes | None:
    path = folder / name
    if not path.is_file():
        if required:
            raise ImportRefused(f"{path}: missing; a MarianMTModel folder has {name}")
        return None
    limit = MAX_BYTES[name]
    try:
        if path.stat().st_size > limit:
            raise ImportRefused(f"{path}: {path.stat().st_size:,} bytes, more than any Marian model's {name} ({limit:,})")
        with path.open("rb") as f:  # at most the limit, whatever the size says (a link to a /proc file says 0)
            raw = f.read(limit + 1)
    except OSError as e:
        raise ImportRefused(f"{path}: cannot be read ({e.strerror or type(e).__name__}); a MarianMTModel folder's "
                            f"{name} is a plain file") from None
    if len(raw) > limit:
        raise ImportRefused(f"{path}: more than {limit:,} bytes, more than any Marian model's {name}")
    return raw


def _json(folder: Path, name: str, required: bool = True) -> dict[str, Any]:
    raw = _read(folder, name, required)
    if raw is None:
        return {}
    return json_object(raw, folder / name, ImportRefused)  # its values and depth bounded (nmt.checkpoints.folder_limits)


def _count(config: dict, key: str, where: Path, low: int = 1) -> int:
    value = config.get(key)
    top = LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
        raise ImportRefused(f"{where}: {key}={str(value)[:40]} is not a count from {low} to {top:,}; refused before "
                            "any weight is allocated")
    return value


def _ratio(config: dict, key: str, where: Path) -> float:
    value = config.get(key, 0.0) or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ImportRefused(f"{where}: {key}={str(value)[:40]} is not a dropout rate from 0 to 1")
    return float(value)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, checked: a MarianMTModel we compute exactly, every size bounded."""
    config = _json(folder, "config.json")
    where = folder / "config.json"
    kind, classes = config.get("model_type"), config.get("architectures") or []
    if kind != "marian" or not isinstance(classes, list) or any(c != "MarianMTModel" for c in classes):
        raise ImportRefused(f"{where}: model_type={str(kind)[:40]}, architectures={str(classes)[:80]}: nmt imports "
                            "MarianMTModel (model_type=marian), M2M100ForConditionalGeneration (m2m_100: M2M100, NLLB-200) and "
                            "MBartForConditionalGeneration (mbart: mBART-50); T5, BART and the others compute what nmt "
                            "does not")
    for key in NOT_COMPUTED:
        if config.get(key):
            raise ImportRefused(f"{where}: {key}={str(config[key])[:40]}: nmt's post-norm Transformer has no such "
                                "layer norm or bias (a Marian variant nmt does not compute)")
    if config.get("scale_embedding") is not True:
        raise ImportRefused(f"{where}: scale_embedding={config.get('scale_embedding')}: nmt scales embeddings by "
                            "sqrt(d_model), as every OPUS-MT model does")
    act = config.get("activation_function")
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: activation_function={str(act)[:40]}: nmt computes {', '.join(ACTIVATIONS)}")
    config = {**config, "decoder_vocab_size": config.get("decoder_vocab_size") or config.get("vocab_size")}
    sizes = {key: _count(config, key, where) for key in LIMITS}
    if sizes["d_model"] % 2:
        raise ImportRefused(f"{where}: d_model={sizes['d_model']}: an odd width (the sinusoid tables differ)")
    for part in ("encoder", "decoder"):
        if sizes["d_model"] % sizes[f"{part}_attention_heads"]:
            raise ImportRefused(f"{where}: d_model={sizes['d_model']} is not divisible by "
                                f"{part}_attention_heads={sizes[f'{part}_attention_heads']}")
    shared = config.get("share_encoder_decoder_embeddings", True)
    if shared and sizes["decoder_vocab_size"] != sizes["vocab_size"]:
        raise ImportRefused(f"{where}: decoder_vocab_size={sizes['decoder_vocab_size']} with "
                            f"share_encoder_decoder_embeddings=true needs vocab_size={sizes['vocab_size']}")
    ids = {}
    for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        value = config.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < sizes["decoder_vocab_size"]:
            raise ImportRefused(f"{where}: {key}={str(value)[:40]} is not an id of the vocabulary")
        ids[key] = value
    dropouts = {key: _ratio(config, key, where) for key in ("dropout", "attention_dropout", "activation_dropout")}
    return {**sizes, **ids, **dropouts, "activation": ACTIVATIONS[act], "shared": bool(shared),
            "tied": bool(config.get("tie_word_embeddings", True))}


def _vocab(folder: Path, name: str, size: int) -> dict[str, int]:
    vocab = _json(folder, name)
    where = folder / name
    if len(vocab) > size:
        raise ImportRefused(f"{where}: {len(vocab):,} pieces for the config's vocabulary of {size:,}")
    seen: set[int] = set()
    for piece, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size or i in seen:
            raise ImportRefused(f"{where}: piece {piece[:40]!r} has id {str(i)[:20]}, not a new id below {size:,}")
        seen.add(i)
    return vocab


def _spm(folder: Path, name: str) -> Any:
    import sentencepiece.sentencepiece_model_pb2 as pb

    proto, raw = pb.ModelProto(), _read(folder, name)
    count_pieces(raw, folder / name, ImportRefused)  # before protobuf builds them
    try:
        proto.ParseFromString(raw)
        if not proto.pieces:
            raise ValueError("no pieces")
    except Exception:  # protobuf's DecodeError, or a proto without pieces
        raise ImportRefused(f"{folder / name}: not a SentencePiece model") from None
    byte = pb.ModelProto.SentencePiece.BYTE
    if proto.trainer_spec.byte_fallback and sum(p.type == byte for p in proto.pieces) != 256:
        raise ImportRefused(f"{folder / name}: a byte_fallback model without its 256 byte pieces (<0x00> .. <0xFF>); "
                            "SentencePiece cannot load it")
    return proto


def _piece_name(piece: str) -> tuple[str, bool]:
    """Our name of a vocabulary piece, and whether it is a target-language tag."""
    found = TAG.fullmatch(piece)
    if found and LANGUAGE.fullmatch(found.group(1)):
        return f"{SPIECE}<2{found.group(1)}>", True
    return piece, bool(found)


def _unused_name(vocab: dict[str, int]) -> str:
    """A name for the BOS piece a Marian vocabulary lacks (its decoder starts from PAD): ``<s>``, else
    the first of ``<nmt_bos>``, ``<nmt_bos_1>``, ``<nmt_bos_2>``, ... that no piece has."""
    for name in ("<s>", "<nmt_bos>"):
        if name not in vocab:
            return name
    return next(f"<nmt_bos_{i}>" for i in range(1, len(vocab) + 2) if f"<nmt_bos_{i}>" not in vocab)


class Vocabulary:
    """One side's vocabulary in our id order: ``order[i]`` is their id of our id ``i`` (``extra``
    ids past theirs read their unk row), ``pieces`` our piece names."""

    def __init__(self, vocab: dict[str, int], ids: dict[str, int], protos: list[Any], where: Path,
                 languages: dict[str, str] | None = None) -> None:
        """``languages``: their language-code pieces (``__fr__``) and their languages, named as our
        tags (``▁<2fr>``); Marian's ``>>fra<<`` are found by their form."""
        import sentencepiece.sentencepiece_model_pb2 as pb

        kind = pb.ModelProto.SentencePiece
        by_id = {i: p for p, i in vocab.items()}
        pad, eos, start, unk = ids["pad"], ids["eos"], ids["start"], ids["unk"]
        for name, i in (("pad", pad), ("eos", eos), ("unk", unk), ("decoder start", start)):
            if i not in by_id:
                raise ImportRefused(f"{where}: no piece has the {name} id {i}")
        bos_name = by_id[start] if start not in (pad, eos) else _unused_name(vocab)  # a second row of theirs
        specials = [(by_id[pad], pad), (by_id[unk], unk), (bos_name, start), (by_id[eos], eos)]
        self.order = [i for _, i in specials] + sorted(set(by_id) - {pad, unk, start, eos})
        self.pieces, self.tags = [p for p, _ in specials], []
        for i in self.order[4:]:
            code = (languages or {}).get(by_id[i])
            name, tag = (f"{SPIECE}<2{code}>", True) if code else _piece_name(by_id[i])
            self.pieces.append(name)
            if tag:
                self.tags.append(name)
        known = set(vocab)
        produced = (kind.NORMAL, kind.USER_DEFINED, kind.BYTE)  # what encoding may give
        spm_only = [p.piece for proto in protos for p in proto.pieces if p.type in produced and p.piece not in known]
        self.extra = list(dict.fromkeys(spm_only))  # their <unk>, ours an id each
        self.pieces += self.extra
        self.order += [unk] * len(self.extra)
        if len(set(self.pieces)) != len(self.pieces):
            raise ImportRefused(f"{where}: two pieces share a name once >>xxx<< tags are <2xxx>")

    def proto(self, proto: Any) -> bytes:
        """``proto`` (the side's SentencePiece model) with our pieces in our order (module docstring)."""
        import sentencepiece.sentencepiece_model_pb2 as pb

        kind = pb.ModelProto.SentencePiece
        own = {p.piece: p for p in proto.pieces if p.type in (kind.NORMAL, kind.USER_DEFINED, kind.BYTE)}
        out = pb.ModelProto()
        out.CopyFrom(proto)
        del out.pieces[:]
        for i, piece in enumerate(self.pieces):
            if i in (PAD, BOS, EOS):
                out.pieces.add(piece=piece, score=0.0, type=kind.CONTROL)
            elif i == UNK:
                out.pieces.add(piece=piece, score=0.0, type=kind.UNKNOWN)
            elif piece in self.tags or TAG.fullmatch(piece):
                out.pieces.add(piece=piece, score=0.0, type=kind.USER_DEFINED)
            elif piece in own:
                out.pieces.add(piece=piece, score=own[piece].score, type=own[piece].type)
            else:
                out.pieces.add(piece=piece, score=0.0, type=kind.UNUSED)
        spec = out.trainer_spec
        spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD, UNK, BOS, EOS
        spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = self.pieces[:4]
        spec.vocab_size = len(self.pieces)
        return out.SerializeToString()


def read_vocabularies(folder: Path, config: dict[str, Any]) -> tuple[Vocabulary, Vocabulary, bytes, bytes]:
    """Source and target vocabularies in our order, and the two SentencePiece models written again."""
    tokenizer_config = _json(folder, "tokenizer_config.json", required=False)
    unk_piece = tokenizer_config.get("unk_token", "<unk>")
    unk_piece = unk_piece.get("content") if isinstance(unk_piece, dict) else unk_piece
    src_proto, tgt_proto = _spm(folder, "source.spm"), _spm(folder, "target.spm")
    src_vocab = _vocab(folder, "vocab.json", config["vocab_size"])
    separate = bool(tokenizer_config.get("separate_vocabs"))  # else one vocabulary (its embeddings may be two)
    tgt_vocab = _vocab(folder, "target_vocab.json", config["decoder_vocab_size"]) if separate else src_vocab
    sides = []
    for name, vocab in (("vocab.json", src_vocab), ("target_vocab.json" if separate else "vocab.json", tgt_vocab)):
        if not isinstance(unk_piece, str) or unk_piece not in vocab:
            raise ImportRefused(f"{folder / name}: no {str(unk_piece)[:40]!r} piece (tokenizer_config.json's unk_token)")
        ids = {"pad": config["pad_token_id"], "eos": config["eos_token_id"], "start": config["decoder_start_token_id"],
               "unk": vocab[unk_piece]}
        keys = {"pad": "config.json's pad_token_id", "eos": "config.json's eos_token_id",
                "unk": f"tokenizer_config.json's unk_token {unk_piece[:40]!r}"}
        same = [(a, b) for a, b in (("pad", "eos"), ("pad", "unk"), ("eos", "unk")) if ids[a] == ids[b]]
        if same:
            a, b = same[0]
            raise ImportRefused(f"{folder / name}: {keys[a]} and {keys[b]} are both id {ids[a]}; a Marian model keeps "
                                "padding, the end of a sentence and unknown pieces apart")
        protos = [src_proto, tgt_proto] if not separate else [src_proto if name == "vocab.json" else tgt_proto]
        sides.append(Vocabulary(vocab, ids, protos, folder / name))
    src, tgt = sides
    return src, tgt, src.proto(src_proto), tgt.proto(tgt_proto)


def _expected(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Their tensor names and shapes for ``config`` (embeddings and the output layer apart)."""
    h, shapes = config["d_model"], {}
    for part, sublayers in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        ff = config[f"{part}_ffn_dim"]
        for i in range(config[f"{part}_layers"]):
            name = f"model.{part}.layers.{i}"
            for attn in sublayers:
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    shapes[f"{name}.{attn}.{proj}.weight"], shapes[f"{name}.{attn}.{proj}.bias"] = (h, h), (h,)
                for what in ("weight", "bias"):
                    shapes[f"{name}.{attn}_layer_norm.{what}"] = (h,)
            shapes[f"{name}.fc1.weight"], shapes[f"{name}.fc1.bias"] = (ff, h), (ff,)
            shapes[f"{name}.fc2.weight"], shapes[f"{name}.fc2.bias"] = (h, ff), (h,)
            for what in ("weight", "bias"):
                shapes[f"{name}.final_layer_norm.{what}"] = (h,)
    return shapes


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may be stored in


def read_weights(folder: Path, config: dict[str, Any], allow_pickle: bool = False,
                 architecture: str = "MarianMTModel") -> dict[str, Tensor]:
    """Their tensors (fp32), every name and shape checked against ``config`` before it is read;
    a pre-norm ``architecture`` (M2M100) has the encoder's and decoder's final layer norms too."""
    safetensors, pickled = folder / "model.safetensors", folder / "pytorch_model.bin"
    h, v_src, v_tgt = config["d_model"], config["vocab_size"], config["decoder_vocab_size"]
    expected = _expected(config)
    if config.get("pre_norm"):
        expected.update({f"model.{part}.layer_norm.{what}": (h,) for part in ("encoder", "decoder")
                         for what in ("weight", "bias")})
    if config.get("positions") == "learned":  # mBART: a learned table from position 2, and an embedding norm
        expected.update({f"model.{part}.{norm}.{what}": (h,) for part in ("encoder", "decoder")
                         for norm in ("layernorm_embedding",) for what in ("weight", "bias")})
        expected.update({f"model.{part}.embed_positions.weight": (config["max_position_embeddings"] + 2, h)
                         for part in ("encoder", "decoder")})
    tables = {"model.shared.weight": (v_src, h), "model.encoder.embed_tokens.weight": (v_src, h),
              "model.decoder.embed_tokens.weight": (v_tgt, h), "lm_head.weight": (v_tgt, h),
              "final_logits_bias": (1, v_tgt)}
    positions = {f"model.{part}.embed_positions.weight": (config["max_position_embeddings"], h)
                 for part in ("encoder", "decoder")  # older files store the sinusoids: recomputed, not read
                 if f"model.{part}.embed_positions.weight" not in expected}
    if safetensors.is_file():
        from safetensors import SafetensorError, safe_open

        check_safetensors_header(safetensors, ImportRefused)
        try:
            with safe_open(str(safetensors), framework="pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
                _check_names(safetensors, shapes, expected, tables, positions, architecture)
                for name in shapes:
                    if (dtype := f.get_slice(name).get_dtype()) not in FLOAT_DTYPES:
                        raise ImportRefused(f"{safetensors}: {name} is stored as {dtype}; a Marian model's weights are "
                                            f"floating point ({', '.join(FLOAT_DTYPES)})")
                state = {name: f.get_tensor(name).float() for name in shapes if name not in positions}
        except (SafetensorError, OSError, ValueError) as e:
            if isinstance(e, ImportRefused):
                raise
            raise ImportRefused(f"{safetensors}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    elif pickled.is_file():
        if not allow_pickle:
            raise ImportRefused(f"{pickled}: refused, pickled weights can run code when loaded and the folder has no "
                                "model.safetensors; only if you trust it: allow_pickle=true (read with weights_only=True)")
        try:
            if zipfile.is_zipfile(pickled):  # its pickled structure bounded, as every checkpoint's (an older
                check_structure(pickled, writer="transformers")  # format is refused by the memory-mapped load)
            raw = torch.load(pickled, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:  # weights_only refused what the file names
            raise ImportRefused(f"{pickled}: refused even with allow_pickle=true: it holds more than tensors "
                                f"({_refused_global(e)}), which weights_only=True never loads") from None
        except (RuntimeError, EOFError, OSError) as e:
            raise ImportRefused(f"{pickled}: truncated or not a torch file ({str(e).strip()[:120]})") from None
        if not isinstance(raw, dict) or not all(isinstance(k, str) and torch.is_tensor(t) for k, t in raw.items()):
            raise ImportRefused(f"{pickled}: not a mapping of names to tensors")
        _check_names(pickled, {k: tuple(t.shape) for k, t in raw.items()}, expected, tables, positions, architecture)
        state = {k: t.float() for k, t in raw.items() if k not in positions}
    else:
        raise ImportRefused(f"{safetensors}: missing; nmt reads a Marian model's weights from model.safetensors")
    if bad := nonfinite(state.items()):
        raise ImportRefused(f"{folder}: weights hold NaN or infinity ({', '.join(bad[:3])})")
    return state


def _check_names(path: Path, shapes: dict[str, tuple], expected: dict, tables: dict, positions: dict,
                 architecture: str = "MarianMTModel") -> None:
    for name, shape in shapes.items():
        want = expected.get(name) or tables.get(name) or positions.get(name)
        if want is None:
            raise ImportRefused(f"{path}: {name} is not a weight of the {architecture} config.json describes "
                                "(another architecture or a variant nmt does not compute)")
        if shape != want:
            raise ImportRefused(f"{path}: {name} has shape {shape}, config.json's model needs {want}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ImportRefused(f"{path}: {missing[0]} is missing ({len(missing)} weights in all)")
    if not ({"model.shared.weight", "model.encoder.embed_tokens.weight"} & set(shapes)):
        raise ImportRefused(f"{path}: model.shared.weight is missing (no source embedding)")


def perm(size: int) -> Tensor:
    """Our hidden unit of each of theirs (``nmt.exporters.huggingface.perm``): sines, then cosines."""
    return torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])


def our_state(state: dict[str, Tensor], config: dict[str, Any], src: Vocabulary, tgt: Vocabulary
              ) -> tuple[dict[str, Tensor], bool, bool]:
    """Our Seq2Seq state dict of their tensors; whether the source and target embeddings are one
    tensor and whether the output layer is the target embedding."""
    p = torch.arange(config["d_model"]) if config.get("pre_norm") else perm(config["d_model"])  # M2M100: our layout
    inv = torch.argsort(p)  # their unit of each of ours
    shared_table = state.get("model.shared.weight")
    enc_table = state.get("model.encoder.embed_tokens.weight", shared_table)
    dec_table = state.get("model.decoder.embed_tokens.weight", shared_table)
    if dec_table is None:
        raise ImportRefused("model.safetensors: model.decoder.embed_tokens.weight is missing (no target embedding)")
    tied = config["tied"] or "lm_head.weight" not in state
    head = dec_table if tied else state["lm_head.weight"]
    shared = src.order == tgt.order and torch.equal(enc_table, dec_table)
    ours: dict[str, Tensor] = {}

    def table(t: Tensor, vocab: Vocabulary) -> Tensor:  # rows in our id order, units in ours
        return t[torch.tensor(vocab.order)][:, inv].contiguous()

    ours["encoder.embed_tokens.embed.weight"] = table(enc_table, src)
    ours["decoder.embed_tokens.embed.weight"] = ours["encoder.embed_tokens.embed.weight"] if shared else table(dec_table, tgt)
    ours["decoder.out.weight"] = ours["decoder.embed_tokens.embed.weight"] if tied else table(head, tgt)
    for part in ("encoder", "decoder"):  # ``embed`` is ``embed_tokens.embed`` (a second name of the module)
        ours[f"{part}.embed.weight"] = ours[f"{part}.embed_tokens.embed.weight"]
    bias = state.get("final_logits_bias", torch.zeros(1, config["decoder_vocab_size"]))[0][torch.tensor(tgt.order)].clone()
    bias[len(tgt.order) - len(tgt.extra):] = NEVER
    if tgt.order[BOS] in (tgt.order[PAD], tgt.order[EOS]):  # a second row of theirs: out of the softmax, as theirs
        bias[BOS] = NEVER                                     # has it once
    ours["decoder.out.bias"] = bias

    def reads(w: Tensor) -> Tensor:  # a map reading the residual stream: input columns in our unit order
        return w[:, inv]

    def writes(t: Tensor) -> Tensor:  # a map (or norm) writing it: output rows in our order
        return t[inv]

    for part, ours_attn in (("encoder", (("self_attn", "self_attn"),)),
                            ("decoder", (("self_attn", "self_attn"), ("encoder_attn", "cross_attn")))):
        norms = {"self_attn_layer_norm": 0, "encoder_attn_layer_norm": 1,
                 "final_layer_norm": 1 if part == "encoder" else 2}
        for i in range(config[f"{part}_layers"]):
            theirs, mine = f"model.{part}.layers.{i}", f"{part}.layers.{i}"
            for attn, name in ours_attn:
                a = f"{theirs}.{attn}"
                ours[f"{mine}.{name}.q_proj.weight"] = reads(state[f"{a}.q_proj.weight"])
                ours[f"{mine}.{name}.q_proj.bias"] = state[f"{a}.q_proj.bias"]
                ours[f"{mine}.{name}.kv_proj.weight"] = reads(torch.cat([state[f"{a}.k_proj.weight"],
                                                                         state[f"{a}.v_proj.weight"]]))
                ours[f"{mine}.{name}.kv_proj.bias"] = torch.cat([state[f"{a}.k_proj.bias"], state[f"{a}.v_proj.bias"]])
                ours[f"{mine}.{name}.out_proj.weight"] = writes(state[f"{a}.out_proj.weight"])
                ours[f"{mine}.{name}.out_proj.bias"] = writes(state[f"{a}.out_proj.bias"])
                ours[f"{mine}.norms.{norms[attn + '_layer_norm']}.weight"] = writes(state[f"{a}_layer_norm.weight"])
                ours[f"{mine}.norms.{norms[attn + '_layer_norm']}.bias"] = writes(state[f"{a}_layer_norm.bias"])
            ours[f"{mine}.ff.0.weight"] = reads(state[f"{theirs}.fc1.weight"])
            ours[f"{mine}.ff.0.bias"] = state[f"{theirs}.fc1.bias"]
            ours[f"{mine}.ff.3.weight"] = writes(state[f"{theirs}.fc2.weight"])
            ours[f"{mine}.ff.3.bias"] = writes(state[f"{theirs}.fc2.bias"])
            ours[f"{mine}.norms.{norms['final_layer_norm']}.weight"] = writes(state[f"{theirs}.final_layer_norm.weight"])
            ours[f"{mine}.norms.{norms['final_layer_norm']}.bias"] = writes(state[f"{theirs}.final_layer_norm.bias"])
    for part in ("encoder", "decoder"):  # a pre-norm model's last layer norms (M2M100's ``layer_norm``)
        for what in ("weight", "bias"):
            if f"model.{part}.layer_norm.{what}" in state:
                ours[f"{part}.final_norm.{what}"] = writes(state[f"model.{part}.layer_norm.{what}"])
            if f"model.{part}.layernorm_embedding.{what}" in state:  # mBART's
                ours[f"{part}.embed_tokens.norm.{what}"] = writes(state[f"model.{part}.layernorm_embedding.{what}"])
        if config.get("positions") == "learned":  # mBART's rows from position 2 (its offset)
            ours[f"{part}.embed_tokens.pos.weight"] = state[f"model.{part}.embed_positions.weight"][2:][:, inv]
    return {k: v.contiguous() for k, v in ours.items()}, shared, tied


def model_config(config: dict[str, Any], src_size: int, tgt_size: int, shared: bool, tied: bool) -> dict[str, Any]:
    """Our resolved model config of their ``config`` (the release file's ``run_config.model``)."""
    pre = bool(config.get("pre_norm"))  # M2M100/NLLB-200: pre-norm, fairseq's sinusoids; mBART: learned positions
    positions = config.get("positions") or ("fairseq" if pre else "sinusoidal")
    common = {"hidden_size": config["d_model"], "dropout": config["dropout"], "norm": "pre" if pre else "post",
              "positions": positions, "max_len": config["max_position_embeddings"],
              "embedding_norm": positions == "learned",
              "attention": "full",
              "window": None, "global_tokens": None, "attention_dropout": config["attention_dropout"],
              "activation_dropout": config["activation_dropout"], "init": "xavier", "activation": config["activation"]}
    encoder = {"_target_": "nmt.models.transformer.TransformerEncoder", "vocab_size": src_size,
               "num_layers": config["encoder_layers"], "num_heads": config["encoder_attention_heads"],
               "ff_size": config["encoder_ffn_dim"], "block_size": None, "global_blocks": None, "random_blocks": None,
               "rank": None, "position_shift": 0, **common}
    decoder = {"_target_": "nmt.models.transformer.TransformerDecoder", "vocab_size": tgt_size,
               "num_layers": config["decoder_layers"], "num_heads": config["decoder_attention_heads"],
               "ff_size": config["decoder_ffn_dim"], "logits_bias": True, **common}
    return {"_target_": "nmt.models.base.Seq2Seq", "encoder": encoder, "decoder": decoder,
            "src_vocab_size": src_size, "tgt_vocab_size": tgt_size, "vocab_multiple": 1,
            "emb_size": config["d_model"], "hidden_size": config["d_model"], "dropout": config["dropout"],
            "tie_embeddings": tied, "share_src_tgt_embeddings": shared, "gradient_checkpointing": False}


def decoding_of(folder: Path) -> dict[str, Any]:
    """Our beam settings of generation_config.json: its beam size, and transformers' ranking of
    ended hypotheses (``scoring: huggingface``: log-prob / length ** length_penalty, its
    ``early_stopping``; ``nmt.decoding.search.beam_search``) with its length penalty (1.0, transformers'
    default, where it sets none). A penalty outside 0..10 keeps our GNMT default."""
    generation = _json(folder, "generation_config.json", required=False)
    beams = generation.get("num_beams", 1)
    beams = beams if isinstance(beams, int) and not isinstance(beams, bool) and 1 <= beams <= 64 else 4
    penalty = generation.get("length_penalty", 1.0)
    early = generation.get("early_stopping", False)
    decoding = {"_target_": "nmt.decoding.search.beam_search", "beam_size": beams, "max_len_a": 1.5, "max_len_b": 10}
    if isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and 0 <= penalty <= 10:
        decoding.update(alpha=float(penalty), scoring="huggingface",
                        early_stopping=early if early is True or early is False or early == "never" else False)
    return decoding


def import_marian(src: str | Path, allow_pickle: bool = False, revision: str | None = None) -> dict[str, Any]:
    """The release checkpoint (``nmt.checkpoints.release``'s format) of a MarianMTModel folder or hub id."""
    folder = resolve(src, revision, allow_pickle)
    config = read_config(folder)
    src_vocab, tgt_vocab, src_proto, tgt_proto = read_vocabularies(folder, config)
    state, shared, tied = our_state(read_weights(folder, config, allow_pickle), config, src_vocab, tgt_vocab)
    src_size, tgt_size = len(src_vocab.pieces), len(tgt_vocab.pieces)
    for side, proto in (("src", src_proto), ("tgt", tgt_proto)):  # nmt's own check of what it will load
        try:
            Tokenizer.from_proto(proto, f"{folder}: the {side} vocabulary")
        except ValueError as e:
            raise ImportRefused(str(e)) from None
    model = model_config(config, src_size, tgt_size, shared, tied)
    return {"nmt_format": FORMAT, "kind": "release", "state_dict": {f"model.{k}": v for k, v in state.items()},
            "run_config": {"model": model, "test_decoding": decoding_of(folder)},
            "tokenizers": {"src": src_proto, "tgt": src_proto if src_proto == tgt_proto else tgt_proto},
            "global_step": None, "epoch": None, "monitor": None, "report": None,
            "source": {"path": str(src), "format": "huggingface", "folder": str(folder),
                       "extra_pieces": len(tgt_vocab.extra)}}
