"""Export a Transformer to a Hugging Face ``transformers`` folder that
``AutoModelForSeq2SeqLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)``
load with no nmt code (``nmt-export format=huggingface out=<folder>``).

Two ``transformers`` classes compute exactly what ``nmt/models/transformer.py`` computes:

- post-norm (the original Transformer): ``MarianMTModel``, with separate source and target
  vocabularies if ours are separate (``share_encoder_decoder_embeddings``);
- pre-norm (Xiong et al. 2020, our default): ``PegasusForConditionalGeneration``, which adds the
  final layer norm of each stack as ours does; it has one embedding for both sides, so the
  model must share its source and target embeddings (``model.share_src_tgt_embeddings``).

Both scale embeddings by sqrt(H), use feed-forward layers with biases (our ``activation``:
ReLU, GELU or swish) and a logits bias (``final_logits_bias``, zero unless ``logits_bias``), layer norms with
eps 1e-5 and the sinusoids of Vaswani et al. from position 0, which they recompute when loading
(they are not stored). Their table holds every sine before every cosine, ours interleaves them: the
hidden units are permuted (``perm``), which every weight reading or writing the residual stream
follows, so each layer computes the same numbers in another order. What no class expresses is
refused in one line: LSTM encoders or decoders, learned or rotary positions, local attention
attention patterns other than full, mixed pre/post-norm, an encoder and decoder of other widths, pre-norm with separate
embeddings.

The tokenizer is ``MarianTokenizer`` (SentencePiece pieces mapped to ids by ``vocab.json``, EOS
appended to the source) for both classes; ``generation_config.json`` starts the decoder from
BOS, never generates PAD or BOS (``suppress_tokens``), and holds the run's beam size. The
folder is built beside ``out`` and renamed into place at the end.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nmt.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
from nmt.decoding.limits import model_max_src_len
from nmt.exporters.folder import new_folder
from nmt.exporters.huggingface_m2m100 import FAMILIES, check_tokenizer, family, generation, their_rows
from nmt.models.head_mask import pruned_keys
from nmt.models.transformer import TransformerDecoder, TransformerEncoder

log = logging.getLogger(__name__)

METADATA = "nmt_export.json"
TESTED = "transformers 5.25"  # the versions the parity tests ran with (pyproject's [hf] extra)


def _refuse(key: str, what: str) -> None:
    raise ValueError(f"{key}: {what}; no transformers class expresses it, so the model does not export to "
                     "Hugging Face (format=ctranslate2 may)")


def model_class(model: nn.Module, run_config: dict) -> str:
    """``marian`` (post-norm), ``pegasus`` (pre-norm), or for fairseq positions or an embedding norm
    ``m2m100`` or ``mbart`` (``nmt.exporters.huggingface_m2m100``); a one-line ValueError naming the
    first config key that no ``transformers`` class can express."""
    parts = {"encoder": (model.encoder, TransformerEncoder), "decoder": (model.decoder, TransformerDecoder)}
    for part, (module, cls) in parts.items():
        if not isinstance(module, cls):
            target = (run_config.get("model", {}).get(part) or {}).get("_target_", type(module).__name__)
            _refuse(f"model.{part}._target_={target}", f"an LSTM {part}")
    imported = family(model)  # M2M100 (fairseq positions) or mBART (an embedding norm), else None
    for part, (module, _) in parts.items():
        if module.embed_tokens.positions != "sinusoidal" and imported is None:
            _refuse(f"model.{part}.positions={module.embed_tokens.positions}",
                    "positions other than sinusoidal (the classes recompute their sinusoids when loading)")
        if module.attention != "full":
            _refuse(f"model.{part}.attention={module.attention}", "attention patterns other than full")
        if module.embed_tokens.norm is not None and imported is None:
            _refuse(f"model.{part}.embedding_norm=true", "a layer norm after the embeddings")
    for key in pruned_keys(model):
        _refuse(key, "attention heads pruned (fewer in some layers than others)")
    enc, dec = model.encoder, model.decoder
    if dec.start_from_eos and imported is None:
        _refuse("model.decoder.start_from_eos=true", "a decoder starting from EOS's row outside M2M100 and mBART "
                "(MarianMT and Pegasus start from a row of their own, in their softmax)")
    norms = {enc.layers[0].pre_norm, dec.layers[0].pre_norm}
    if len(norms) > 1:
        _refuse(f"model.encoder.norm={'pre' if enc.layers[0].pre_norm else 'post'}, model.decoder.norm="
                f"{'pre' if dec.layers[0].pre_norm else 'post'}", "pre-norm on one side and post-norm on the other")
    widths = (enc.embed.embedding_dim, dec.embed.embedding_dim, dec.layers[0].cross_attn.kv_proj.in_features)
    if len(set(widths)) > 1:
        _refuse(f"model.encoder.hidden_size={widths[0]}, model.decoder.hidden_size={widths[1]}",
                "an encoder and a decoder of different widths")
    if widths[0] % 2:
        _refuse(f"model.hidden_size={widths[0]}", "an odd width (the sinusoid tables differ)")
    if enc.embed_tokens.max_len != dec.embed_tokens.max_len:
        _refuse(f"model.encoder.max_len={enc.embed_tokens.max_len}, model.decoder.max_len={dec.embed_tokens.max_len}",
                "position tables of different lengths")
    activation(model)
    if norms == {True} and enc.embed.weight is not dec.embed.weight:
        _refuse("model.share_src_tgt_embeddings=false", "a pre-norm model with separate source and target "
                "embeddings (Pegasus has one embedding for both sides; MarianMT, which has two, is post-norm)")
    return imported or ("pegasus" if norms == {True} else "marian")


ACTIVATIONS = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "swish"}  # ours -> transformers' activation_function


def activation(model: nn.Module) -> str:
    """The ``activation_function`` of the model's feed-forward layers (one for both stacks)."""
    kinds = {type(layer.ff[1]) for stack in (model.encoder, model.decoder) for layer in stack.layers}
    if len(kinds) > 1:
        _refuse("model.encoder.activation, model.decoder.activation", "two feed-forward activations")
    return ACTIVATIONS[kinds.pop()]


def perm(size: int) -> Tensor:
    """Our hidden unit of each of theirs: their sines (our even units), then their cosines (odd)."""
    return torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])


class _Weights:
    """The state dict of the ``transformers`` model, filled from ours in their unit order."""

    def __init__(self, order: Tensor) -> None:
        self.order, self.state = order, {}

    def _put(self, name: str, t: Tensor) -> None:
        self.state[name] = t.detach().to("cpu", torch.float32, copy=True).contiguous()

    def reads(self, name: str, linear: nn.Linear, rows: slice = slice(None)) -> None:
        """A linear map reading the residual stream: its input columns permuted."""
        self._put(f"{name}.weight", linear.weight[rows][:, self.order])
        if linear.bias is not None:
            self._put(f"{name}.bias", linear.bias[rows])

    def writes(self, name: str, linear: nn.Linear) -> None:
        """A linear map writing the residual stream: its output rows permuted."""
        self._put(f"{name}.weight", linear.weight[self.order])
        self._put(f"{name}.bias", linear.bias[self.order])

    def norm(self, name: str, norm: nn.LayerNorm) -> None:
        self._put(f"{name}.weight", norm.weight[self.order])
        self._put(f"{name}.bias", norm.bias[self.order])

    def table(self, name: str, weight: Tensor, rows: int) -> None:
        self._put(name, weight[:rows][:, self.order])  # the vocab_multiple padding rows dropped

    def attention(self, name: str, attn: nn.Module) -> None:
        size = attn.out_proj.out_features
        self.reads(f"{name}.q_proj", attn.q_proj)
        self.reads(f"{name}.k_proj", attn.kv_proj, slice(0, size))  # kv_proj's rows: keys, then values
        self.reads(f"{name}.v_proj", attn.kv_proj, slice(size, 2 * size))
        self.writes(f"{name}.out_proj", attn.out_proj)

    def ffn(self, name: str, ff: nn.Sequential) -> None:
        self.reads(f"{name}.fc1", ff[0])
        self.writes(f"{name}.fc2", ff[3])


def _config(kind: str, model: nn.Module, src_size: int, tgt_size: int, shared: bool, tied: bool) -> Any:
    from transformers import MarianConfig, PegasusConfig

    enc, dec = model.encoder, model.decoder
    ff = lambda layer: layer.ff[0].out_features  # noqa: E731
    common = dict(
        d_model=enc.embed.embedding_dim, encoder_layers=len(enc.layers), decoder_layers=len(dec.layers),
        encoder_attention_heads=enc.layers[0].self_attn.num_heads, decoder_attention_heads=dec.num_heads,
        encoder_ffn_dim=ff(enc.layers[0]), decoder_ffn_dim=ff(dec.layers[0]), activation_function=activation(model),
        dropout=float(enc.embed_tokens.drop.p), attention_dropout=float(enc.layers[0].self_attn.dropout),
        activation_dropout=float(enc.layers[0].ff[2].p), max_position_embeddings=enc.embed_tokens.max_len,
        scale_embedding=True, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS,
        forced_eos_token_id=None, tie_word_embeddings=tied)
    if kind == "marian":
        return MarianConfig(vocab_size=src_size, decoder_vocab_size=tgt_size,
                            share_encoder_decoder_embeddings=shared, **common)
    return PegasusConfig(vocab_size=src_size, **common)


def build_hf_model(model: nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, run_config: dict) -> Any:
    """The ``transformers`` model computing what ``model`` computes, its weights set."""
    from transformers import MarianMTModel, PegasusForConditionalGeneration

    kind = model_class(model, run_config)
    enc, dec = model.encoder, model.decoder
    src_size, tgt_size = src_vocab.vocab_size, tgt_vocab.vocab_size
    if (model.src_vocab_size, model.tgt_vocab_size) != (src_size, tgt_size):
        raise ValueError(f"the model's vocabulary sizes ({model.src_vocab_size}, {model.tgt_vocab_size}) differ "
                         f"from the tokenizers' ({src_size}, {tgt_size})")
    shared, tied = enc.embed.weight is dec.embed.weight, dec.out.weight is dec.embed.weight
    w = _Weights(perm(enc.embed.embedding_dim))
    if shared:  # every name of it: whether the class ties them depends on the version and tie_word_embeddings
        w.table("model.shared.weight", enc.embed.weight, src_size)
    w.table("model.encoder.embed_tokens.weight", enc.embed.weight, src_size)
    w.table("model.decoder.embed_tokens.weight", dec.embed.weight, tgt_size)
    for i, layer in enumerate(enc.layers):
        name = f"model.encoder.layers.{i}"
        w.attention(f"{name}.self_attn", layer.self_attn)
        w.norm(f"{name}.self_attn_layer_norm", layer.norms[0])
        w.ffn(name, layer.ff)
        w.norm(f"{name}.final_layer_norm", layer.norms[1])
    for i, layer in enumerate(dec.layers):
        name = f"model.decoder.layers.{i}"
        w.attention(f"{name}.self_attn", layer.self_attn)
        w.norm(f"{name}.self_attn_layer_norm", layer.norms[0])
        w.attention(f"{name}.encoder_attn", layer.cross_attn)
        w.norm(f"{name}.encoder_attn_layer_norm", layer.norms[1])
        w.ffn(name, layer.ff)
        w.norm(f"{name}.final_layer_norm", layer.norms[2])
    if kind == "pegasus":
        w.norm("model.encoder.layer_norm", enc.final_norm)
        w.norm("model.decoder.layer_norm", dec.final_norm)
    w.table("lm_head.weight", dec.out.weight, tgt_size)

    config = _config(kind, model, src_size, tgt_size, shared, tied)
    hf = (MarianMTModel if kind == "marian" else PegasusForConditionalGeneration)(config).eval()
    own = hf.state_dict()
    missing = sorted(set(own) - set(w.state) - {"final_logits_bias"} - {k for k in own if "embed_positions" in k})
    unknown = sorted(set(w.state) - set(own))
    if missing or unknown:  # a transformers version with other names: refuse rather than export half a model
        raise ValueError(f"this transformers version names {kind}'s weights otherwise (missing {missing[:3]}, "
                         f"unknown {unknown[:3]}); install the tested one ({TESTED})")
    with torch.no_grad():
        for name, value in w.state.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} for {kind}'s {tuple(own[name].shape)}")
            own[name].copy_(value)
        own["final_logits_bias"].zero_()
        if dec.out.bias is not None:
            own["final_logits_bias"][0].copy_(dec.out.bias[:tgt_size])
    return hf


def _tokenizer(tmp: Path, src_vocab: Tokenizer, tgt_vocab: Tokenizer, run_config: dict) -> Any:
    from transformers import MarianTokenizer

    separate = src_vocab is not tgt_vocab
    for side, vocab in (("source", src_vocab), ("target", tgt_vocab)):
        (tmp / f"{side}.spm").write_bytes(vocab.sp.serialized_model_proto())
        pieces = {vocab.sp.id_to_piece(i): i for i in range(vocab.vocab_size)}
        if len(pieces) != vocab.vocab_size:
            raise ValueError(f"the {side} vocabulary holds a piece twice")
        name = "vocab.json" if side == "source" else "target_vocab.json"
        if side == "source" or separate:
            (tmp / name).write_text(json.dumps(pieces, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    specials = {}
    for name, i in (("unk_token", UNK), ("eos_token", EOS), ("pad_token", PAD)):
        specials[name] = piece = tgt_vocab.sp.id_to_piece(i)
        if src_vocab.sp.id_to_piece(i) != piece:
            raise ValueError(f"the source and target {name} pieces differ ({src_vocab.sp.id_to_piece(i)!r} vs "
                             f"{piece!r}): MarianTokenizer has one of each")
    data = run_config.get("data", {})
    tokenizer = MarianTokenizer(
        str(tmp / "source.spm"), str(tmp / "target.spm"), str(tmp / "vocab.json"),
        target_vocab_file=str(tmp / "target_vocab.json") if separate else None, separate_vocabs=separate,
        source_lang=data.get("src_lang"), target_lang=data.get("tgt_lang"),
        model_max_length=model_max_src_len(run_config), **specials)
    return tokenizer


def _generation_config(hf: Any, run_config: dict) -> None:
    decoding = run_config.get("test_decoding") or {}
    hf.generation_config.update(
        decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        suppress_tokens=[PAD, BOS],  # never generated (nmt.decoding.search)
        num_beams=int(decoding.get("beam_size") or 5),
        max_new_tokens=int(hf.config.max_position_embeddings) - 1)  # the decoder's position table, BOS at 0


def to_huggingface(model: nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, run_config: dict,
                   out_dir: str | Path) -> Path:
    """Write ``model`` (a Transformer ``Seq2Seq``) as a ``transformers`` folder ``out_dir``:
    ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer files and
    ``nmt_export.json``. Raises a ValueError naming what no class expresses, FileExistsError for a
    non-empty ``out_dir``; nothing is left behind on error."""
    kind = model_class(model, run_config)  # before anything is written
    out_dir = Path(out_dir)
    if kind in FAMILIES:
        return _to_m2m100(model, src_vocab, tgt_vocab, run_config, out_dir, kind)
    with new_folder(out_dir) as tmp:
        with torch.no_grad():
            hf = build_hf_model(model, src_vocab, tgt_vocab, run_config)
        _generation_config(hf, run_config)
        hf.save_pretrained(tmp)
        spm_files = Path(tempfile.mkdtemp(dir=tmp))
        _tokenizer(spm_files, src_vocab, tgt_vocab, run_config).save_pretrained(tmp)
        shutil.rmtree(spm_files)
        data = run_config.get("data", {})
        (tmp / METADATA).write_text(json.dumps({
            "class": type(hf).__name__, "src_lang": data.get("src_lang"), "tgt_lang": data.get("tgt_lang"),
            "tested_with": TESTED, "note": "the length penalty of nmt's beam search (GNMT) is not transformers' "
            "length_penalty; greedy search and beam search without a penalty give nmt's outputs"}, indent=2) + "\n")
    log.info("exported to %s (%s)", out_dir, type(hf).__name__)
    return out_dir


def _to_m2m100(model: nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, run_config: dict, out_dir: Path,
               kind: str) -> Path:
    """``to_huggingface`` for an M2M100, NLLB-200 or mBART-50 model (``nmt.exporters.huggingface_m2m100``)."""
    from nmt.exporters import huggingface_m2m100 as m2m100

    rows = their_rows(model, src_vocab, tgt_vocab, kind)
    with new_folder(out_dir) as tmp:
        spm_files = Path(tempfile.mkdtemp(dir=tmp))
        made, expected = m2m100.tokenizer(spm_files, tgt_vocab, rows, kind)
        check_tokenizer(made, expected)
        with torch.no_grad():
            hf = m2m100.build_model(model, rows, kind, activation(model))
        generation(hf, run_config)
        hf.save_pretrained(tmp)
        made.save_pretrained(tmp)
        if not (tmp / "sentencepiece.bpe.model").exists():  # NLLB's and mBART's folders keep it beside tokenizer.json
            shutil.copy(spm_files / "sentencepiece.bpe.model", tmp / "sentencepiece.bpe.model")
        shutil.rmtree(spm_files)
        (tmp / METADATA).write_text(json.dumps({
            "class": type(hf).__name__, "tokenizer": type(made).__name__, "tested_with": TESTED,
            "languages": "src_lang and tgt_lang: the source code starts the source, the target code is forced as "
            "the decoder's first token (forced_bos_token_id)"}, indent=2) + "\n")
    log.info("exported to %s (%s, %s)", out_dir, type(hf).__name__, type(made).__name__)
    return out_dir
