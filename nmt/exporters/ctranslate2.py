"""Export a Transformer checkpoint to a CTranslate2 model folder (``nmt-translate ckpt=<folder>``
and ``nmt-serve ckpt=<folder>`` translate with one: ``nmt.inference.ctranslate2``).

The model is described with CTranslate2's model-spec API (``ctranslate2.specs.TransformerSpec``)
and saved through its ``Converter``, which also quantizes the weights. The layout follows
``nmt/models/transformer.py``:

- attention: our ``q_proj`` and ``kv_proj`` (keys then values) are CTranslate2's fused projections,
  ``[q; k; v]`` in self-attention, ``q`` and ``[k; v]`` in cross-attention; ``out_proj`` the last;
- layer norms: ``norms[0]`` self-attention, ``norms[1]`` cross-attention (decoder) or feed-forward
  (encoder), ``norms[2]`` the decoder's feed-forward; pre-norm adds the final norm of each stack,
  post-norm has none, as in CTranslate2;
- embeddings are scaled by sqrt(H) on both sides; positions are our own table (sinusoidal,
  learned or fairseq's), so CTranslate2 adds exactly what we add; its own sinusoids are laid out
  differently; ``embedding_norm`` is its ``layernorm_embedding``, after the positions as ours;
- the vocabulary rows past the SentencePiece sizes (``vocab_multiple`` padding) are dropped, and
  the output layer gets a bias of -inf on PAD and BOS, which ``nmt.decoding.search`` never generates;
- the source gets EOS appended (``add_source_eos``) and the decoder starts from BOS, as ours. An
  imported M2M100, NLLB-200 or mBART-50 starts from ``</s>`` (``model.decoder.start_from_eos``:
  BOS reads EOS's row, its logit the constant ``NEVER``): the export writes EOS's row as BOS's, in
  the output layer and a shared encoder table too (BOS is never generated nor a source token), so
  a table shared and tied in the model is one in ``model.bin``. A file imported before that option
  holds a copy of ``</s>``'s row, and a run fine-tuned from it its trained BOS row: kept, as ours
  reads it. The BOS logit, ``NEVER`` or a bias of -1e4, is -inf here: the same probabilities;
- a model that writes the target language as its first token (``run_config.languages``:
  ``DECODER_LANGUAGES``) is recorded so in ``nmt_export.json``: the backend then takes
  ``src_lang`` and ``tgt_lang`` and forces the target code as CTranslate2's ``target_prefix``.

Folder contents: CTranslate2's ``model.bin``, ``config.json`` and vocabularies, the SentencePiece
models ``source.model`` / ``target.model``, and ``nmt_export.json`` (languages, the longest source,
the decoding defaults: ``scoring=huggingface`` and its ``early_stopping`` where the run tested so).
The folder is built beside ``out_dir`` and renamed into place at the end.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nmt.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
from nmt.decoding.limits import model_max_src_len
from nmt.exporters.folder import check_free, new_folder
from nmt.models.head_mask import pruned_keys
from nmt.models.transformer import TransformerDecoder, TransformerEncoder

log = logging.getLogger(__name__)

METADATA = "nmt_export.json"
# What a translator needs when the run config has no test decoding (conf/decoding/beam.yaml).
DEFAULT_DECODING = {"beam_size": 5, "alpha": 0.6, "max_len_a": 1.5, "max_len_b": 10}
# A model that reads the source language as a tag and writes the target language as the decoder's first
# token (``run_config.languages`` of an imported M2M100, NLLB-200 or mBART-50, and of runs fine-tuned from one)
DECODER_LANGUAGES = {"source": "tag", "target": "decoder_prefix"}


def reads_languages(run_config: dict) -> bool:
    """Whether the model reads ``src_lang`` as a source tag and writes ``tgt_lang`` as its first token
    (``nmt.inference.translator.Translator.decoder_languages``)."""
    languages = run_config.get("languages")
    return isinstance(languages, dict) and languages.get("target") == "decoder_prefix"


def _part_config(run_config: dict, part: str) -> dict:
    return run_config.get("model", {}).get(part, {}) or {}


def check_exportable(model: nn.Module, run_config: dict) -> None:
    """Raise a one-line ValueError naming the first config key CTranslate2 cannot express."""
    parts = {"encoder": (model.encoder, TransformerEncoder), "decoder": (model.decoder, TransformerDecoder)}
    for part, (module, cls) in parts.items():
        if not isinstance(module, cls):
            target = _part_config(run_config, part).get("_target_", f"{type(module).__module__}.{type(module).__name__}")
            other = parts["decoder" if part == "encoder" else "encoder"]
            kind = "a hybrid model's " if isinstance(other[0], other[1]) else "an "
            raise ValueError(f"model.{part}._target_={target}: CTranslate2 cannot express {kind}LSTM {part}; "
                             "only Transformer encoder-decoder models export")
    for part, (module, _) in parts.items():
        positions = module.embed_tokens.positions
        if positions not in ("sinusoidal", "learned", "fairseq"):
            raise ValueError(f"model.{part}.positions={positions}: CTranslate2 cannot express rotary positions "
                             "in an encoder-decoder Transformer; export sinusoidal, learned or fairseq positions")
        if module.attention != "full":
            raise ValueError(f"model.{part}.attention={module.attention}: CTranslate2 computes full attention "
                             "only (its sliding_window trims the decoder's cache, not what a query reads); export attention=full")


def _w(t: Tensor) -> Tensor:
    """A copy: CTranslate2 quantizes the spec's weights in place, which must not touch the model's."""
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()


def _linear(spec, *layers: nn.Linear) -> None:
    """Set a CTranslate2 linear layer from one of ours, or from several fused along the outputs."""
    spec.weight = _w(torch.cat([layer.weight for layer in layers]))
    if layers[0].bias is not None:
        spec.bias = _w(torch.cat([layer.bias for layer in layers]))


def _norm(spec, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _w(norm.weight), _w(norm.bias)


def _attention(spec, attn: nn.Module, norm: nn.LayerNorm, self_attention: bool) -> None:
    if self_attention:  # [q; k; v]: kv_proj's rows are keys, then values
        _linear(spec.linear[0], attn.q_proj, attn.kv_proj)
    else:
        _linear(spec.linear[0], attn.q_proj)
        _linear(spec.linear[1], attn.kv_proj)
    _linear(spec.linear[-1], attn.out_proj)
    _norm(spec.layer_norm, norm)


def _ffn(spec, ff: nn.Sequential, norm: nn.LayerNorm) -> None:
    _linear(spec.linear_0, ff[0])
    _linear(spec.linear_1, ff[3])
    _norm(spec.layer_norm, norm)


def _eos_for_bos(table: Tensor) -> Tensor:
    """``table`` (V, H) with BOS's row replaced by EOS's: what a ``start_from_eos`` decoder reads for BOS."""
    return torch.cat([table[:BOS], table[EOS : EOS + 1], table[BOS + 1 :]])


def _inputs(spec, module: nn.Module, vocab_size: int, eos_for_bos: bool = False) -> None:
    """Positions, embedding norm and table; ``eos_for_bos``: BOS's row is EOS's (see ``build_spec``)."""
    emb = module.embed_tokens
    table = emb.pos.weight if emb.positions == "learned" else emb.pos_table  # sinusoidal or fairseq: our table
    spec.position_encodings.encodings = _w(table)  # (max_len, H)
    if emb.norm is not None:  # embedding_norm: after the scaled embeddings and positions, as ours
        _norm(spec.layernorm_embedding, emb.norm)
    spec.scale_embeddings = True  # x * sqrt(H), as _Embedding.scale
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    table = emb.embed.weight[:vocab_size]  # the vocab_multiple padding rows dropped
    embeddings.weight = _w(_eos_for_bos(table) if eos_for_bos else table)


def build_spec(model: nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer):
    """The ``ctranslate2.specs.TransformerSpec`` of ``model``, weights set, vocabularies registered."""
    from ctranslate2.specs import TransformerDecoderSpec, TransformerEncoderSpec, TransformerSpec
    from ctranslate2.specs.common_spec import Activation

    if pruned := pruned_keys(model):
        raise ValueError(f"{pruned[0]}: attention heads pruned (fewer in some layers than others); CTranslate2's "
                         "Transformer has the same heads in every layer, so the model does not export to it")
    enc, dec = model.encoder, model.decoder
    acts = {nn.ReLU: Activation.RELU, nn.GELU: Activation.GELU, nn.SiLU: Activation.SWISH}  # the ff's activation
    act = lambda stack: acts[type(stack.layers[0].ff[1])]  # noqa: E731
    src_size, tgt_size = src_vocab.vocab_size, tgt_vocab.vocab_size
    if (model.src_vocab_size, model.tgt_vocab_size) != (src_size, tgt_size):
        raise ValueError(f"the model's vocabulary sizes ({model.src_vocab_size}, {model.tgt_vocab_size}) differ "
                         f"from the tokenizers' ({src_size}, {tgt_size})")
    spec = TransformerSpec(
        TransformerEncoderSpec(len(enc.layers), enc.layers[0].self_attn.num_heads, pre_norm=enc.layers[0].pre_norm,
                               activation=act(enc), layernorm_embedding=enc.embed_tokens.norm is not None),
        # attention returned (heat maps, alignments): the last layer's, averaged over all heads, as nmt's
        TransformerDecoderSpec(len(dec.layers), dec.layers[0].self_attn.num_heads, pre_norm=dec.layers[0].pre_norm,
                               alignment_layer=-1, alignment_heads=dec.layers[0].cross_attn.num_heads,
                               activation=act(dec), layernorm_embedding=dec.embed_tokens.norm is not None),
    )
    # start_from_eos: BOS reads EOS's row (model.decoder.start_from_eos) and its logit is never generated;
    # the same row is written wherever BOS's is never read (the projection, an encoder sharing the
    # table), so that a table tied or shared in the model is one table in the export (CTranslate2
    # aliases equal weights)
    eos_for_bos = bool(getattr(dec.embed_tokens, "start_from_eos", False))
    shared = enc.embed_tokens.embed.weight is dec.embed_tokens.embed.weight
    _inputs(spec.encoder, enc, src_size, eos_for_bos and shared)
    for layer_spec, layer in zip(spec.encoder.layer, enc.layers):
        _attention(layer_spec.self_attention, layer.self_attn, layer.norms[0], self_attention=True)
        _ffn(layer_spec.ffn, layer.ff, layer.norms[1])
    if enc.layers[0].pre_norm:
        _norm(spec.encoder.layer_norm, enc.final_norm)

    _inputs(spec.decoder, dec, tgt_size, eos_for_bos)
    for layer_spec, layer in zip(spec.decoder.layer, dec.layers):
        _attention(layer_spec.self_attention, layer.self_attn, layer.norms[0], self_attention=True)
        _attention(layer_spec.attention, layer.cross_attn, layer.norms[1], self_attention=False)
        _ffn(layer_spec.ffn, layer.ff, layer.norms[2])
    if dec.layers[0].pre_norm:
        _norm(spec.decoder.layer_norm, dec.final_norm)
    projection = dec.out.weight[:tgt_size]
    spec.decoder.projection.weight = _w(_eos_for_bos(projection) if eos_for_bos else projection)  # tied: aliased
    bias = torch.zeros(tgt_size) if dec.out.bias is None else dec.out.bias[:tgt_size].detach().float().cpu().clone()
    bias[[PAD, BOS]] = float("-inf")  # never generated (nmt.decoding.scoring.log_probs)
    spec.decoder.projection.bias = bias

    src_pieces = [src_vocab.sp.id_to_piece(i) for i in range(src_size)]
    tgt_pieces = [tgt_vocab.sp.id_to_piece(i) for i in range(tgt_size)]
    for name, i in (("unk", UNK), ("bos", BOS), ("eos", EOS)):
        if src_pieces[i] != tgt_pieces[i]:
            raise ValueError(f"the source and target {name} pieces differ ({src_pieces[i]!r} vs {tgt_pieces[i]!r}): "
                             "CTranslate2 has one special token of each kind")
        for pieces in (src_pieces, tgt_pieces):
            if pieces.index(pieces[i]) != i:
                raise ValueError(f"the {name} piece {pieces[i]!r} is not unique in the vocabulary")
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(tgt_pieces)
    config = spec.config
    config.unk_token, config.bos_token, config.eos_token = tgt_pieces[UNK], tgt_pieces[BOS], tgt_pieces[EOS]
    config.decoder_start_token = tgt_pieces[BOS]  # greedy_search/beam_search start from BOS
    config.add_source_bos, config.add_source_eos = False, True  # nmt.inference.translator.encode_sources: ids + EOS
    config.layer_norm_epsilon = float(enc.layers[0].norms[0].eps)  # nn.LayerNorm's 1e-5, not CTranslate2's 1e-6
    return spec


def _metadata(model: nn.Module, run_config: dict, quantization: str | None) -> dict[str, Any]:
    data = run_config.get("data", {})
    tested = run_config.get("test_decoding") or {}
    decoding = {**DEFAULT_DECODING, **{k: v for k, v in tested.items() if k in DEFAULT_DECODING and v is not None}}
    if tested.get("scoring") == "huggingface":  # an imported folder's ranking: score / length ** alpha
        decoding.update(scoring="huggingface", early_stopping=tested.get("early_stopping", False))
    return {
        "src_lang": data.get("src_lang"),
        "tgt_lang": data.get("tgt_lang"),
        "languages": DECODER_LANGUAGES if reads_languages(run_config) else None,  # src_lang and tgt_lang, both
        "max_src_len": model_max_src_len(run_config),  # source pieces + EOS
        "max_tgt_len": model.decoder.embed_tokens.max_len,  # the decoder's position table
        "decoding": decoding,  # nmt.decoding.search: GNMT length penalty alpha, max_len_a * src_len + max_len_b
        "special_ids": {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS},
        "never_generated": [PAD, BOS],
        "attention": "last decoder layer, mean of all heads",  # what return_attention gives (alignments)
        "quantization": quantization,
        "run": {"task_name": run_config.get("task_name"), "tags": run_config.get("tags"),  # what nmt-serve's /info shows
                "hidden_size": run_config.get("model", {}).get("hidden_size"),
                "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())},
    }


def to_ctranslate2(model, src_vocab, tgt_vocab, run_config: dict, out_dir: str | Path,
                   quantization: str | None = None) -> Path:
    """Write ``model`` (a Transformer ``Seq2Seq``) as a CTranslate2 model folder ``out_dir``, with
    the SentencePiece models and ``nmt_export.json``; returns ``out_dir``. ``quantization``: the
    weights' type in CTranslate2 (``int8``, ``int8_float32``, ``bfloat16``, ...; None keeps fp32).

    Raises a ValueError naming the config key CTranslate2 cannot express (rotary positions, local
    attention patterns other than full, LSTM encoders or decoders), and FileExistsError for a non-empty ``out_dir``.
    Nothing is left behind on error."""
    from ctranslate2.converters import Converter
    from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES

    if quantization is not None and quantization not in ACCEPTED_MODEL_TYPES:
        raise ValueError(f"quantization={quantization!r}: choose one of {', '.join(ACCEPTED_MODEL_TYPES)} or None")
    check_exportable(model, run_config)
    out_dir = Path(out_dir)
    check_free(out_dir)  # before the conversion starts

    class SpecConverter(Converter):  # Converter.convert validates, quantizes and saves a spec
        def _load(self):
            return build_spec(model, src_vocab, tgt_vocab)

    with new_folder(out_dir) as tmp:
        with torch.no_grad():
            SpecConverter().convert(str(tmp), quantization=quantization, force=True)
        (tmp / "source.model").write_bytes(src_vocab.sp.serialized_model_proto())
        (tmp / "target.model").write_bytes(tgt_vocab.sp.serialized_model_proto())
        (tmp / METADATA).write_text(json.dumps(_metadata(model, run_config, quantization), indent=2) + "\n")
    log.info("exported to %s (quantization %s)", out_dir, quantization)
    return out_dir
