"""Export an M2M100, NLLB-200 or mBART-50 model imported by ``nmt.checkpoints.m2m100`` back to the
``transformers`` class it came from (``nmt-export format=huggingface``):

- ``positions: fairseq`` without an embedding layer norm: ``M2M100ForConditionalGeneration``, with
  ``M2M100Tokenizer`` (the 100 codes ``__fr__`` of M2M100, or WMT21's 8) or ``NllbTokenizer`` (the
  202 codes ``fra_Latn``);
- ``positions: learned`` with ``embedding_norm``: ``MBartForConditionalGeneration`` (its
  ``layernorm_embedding``; the position table's rows from 2, its offset, are ours from 0), with
  ``MBart50Tokenizer`` (``fr_XX``).

Both are pre-norm with a final layer norm per stack, scaled embeddings, one embedding for both sides
tied to the output layer; the units keep their order. The vocabulary is written back in fairseq's
order (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, the pieces, the codes): our BOS is dropped,
and the decoder starts from ``</s>`` as theirs does. That is what the import's decoder computes
(``start_from_eos``: BOS reads the ``</s>`` row and its logit is a constant out of the softmax), so
a run fine-tuned from an imported model (``init_from=<folder>``; its LoRA adapters merged when it
is loaded) exports exactly too. A file imported before that option existed holds a BOS row copying
``</s>``'s and a logits bias of ``NEVER`` at BOS: it exports while they hold, and is refused in one
line once fine-tuning has moved the row. M2M100 has no logits bias, so a model whose bias is not
zero (but on BOS) is refused; mBART's is its ``final_logits_bias``. The tokenizer is built by
``transformers`` from a SentencePiece model in that order, and every id it gives is checked against
ours before the folder is written, so ``nmt-import`` reads the folder back to the same weights and
vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nmt.checkpoints.m2m100 import LANGUAGES
from nmt.checkpoints.marian import NEVER
from nmt.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
from nmt.languages.tags import TAG

FAMILIES = {"m2m100": "M2M100ForConditionalGeneration", "mbart": "MBartForConditionalGeneration"}


def _refuse(key: str, what: str) -> None:
    raise ValueError(f"{key}: {what}; the model does not export to Hugging Face")


def family(model: nn.Module) -> str | None:
    """``m2m100`` (fairseq positions, no embedding norm) or ``mbart`` (learned positions and an
    embedding norm) for a model with either option, else None; a one-line ValueError naming the key
    for a mix no class computes."""
    stacks = {"encoder": model.encoder.embed_tokens, "decoder": model.decoder.embed_tokens}
    kinds = {part: (emb.positions, emb.norm is not None) for part, emb in stacks.items()}
    if not any(p == "fairseq" or norm for p, norm in kinds.values()):
        return None
    for part, (positions, norm) in kinds.items():
        if (positions, norm) not in (("fairseq", False), ("learned", True)):
            _refuse(f"model.{part}.positions={positions}, model.{part}.embedding_norm={str(norm).lower()}",
                    "M2M100 has fairseq positions without an embedding layer norm, mBART learned positions with one")
    if kinds["encoder"] != kinds["decoder"]:
        _refuse(f"model.encoder.positions={kinds['encoder'][0]}, model.decoder.positions={kinds['decoder'][0]}",
                "one kind of positions on each side")
    return "m2m100" if kinds["encoder"][0] == "fairseq" else "mbart"


def their_rows(model: nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, kind: str) -> list[int]:
    """Our id of each of their ids (fairseq's order), for a model of the import's layout; a
    one-line ValueError naming what differs."""
    enc, dec = model.encoder, model.decoder
    if not (enc.layers[0].pre_norm and dec.layers[0].pre_norm and enc.final_norm is not None):
        _refuse("model.encoder.norm, model.decoder.norm", f"{FAMILIES[kind]} is pre-norm with a final layer norm")
    if enc.embed.weight is not dec.embed.weight or dec.out.weight is not dec.embed.weight:
        _refuse("model.share_src_tgt_embeddings, model.tie_embeddings", f"{FAMILIES[kind]} has one embedding for "
                "both sides and the output layer")
    if src_vocab.sp.serialized_model_proto() != tgt_vocab.sp.serialized_model_proto():
        _refuse("tokenizers", "one vocabulary for both sides")
    sp, table, bias = tgt_vocab.sp, dec.embed.weight, dec.out.bias
    start = [i for i in range(sp.get_piece_size()) if sp.id_to_piece(i) == "<s>"]
    fairseq_start = getattr(dec, "start_from_eos", False) or (  # an import's; or an older import's copy of </s>
        bias is not None and torch.equal(table[BOS], table[EOS]) and float(bias[BOS].detach()) <= NEVER / 2)
    if not start or not fairseq_start:
        _refuse(f"model.decoder.start_from_eos={str(getattr(dec, 'start_from_eos', False)).lower()}",
                f"exported only as the {FAMILIES[kind]} it was imported from (its <s> piece, a decoder starting from "
                "</s>), and this model is not one (a run fine-tuned from a file imported before start_from_eos "
                "existed trains its BOS apart from </s>: fine-tune from the folder itself)")
    if kind == "m2m100" and bias is not None and bool(
            bias.detach().clone().index_fill_(0, torch.tensor([BOS]), 0).ne(0).any()):
        _refuse("model.decoder.logits_bias=true", "a logits bias that is not zero (M2M100 has none)")
    return [start[0], PAD, EOS, UNK] + [i for i in range(4, tgt_vocab.vocab_size) if i != start[0]]


def _codes(pieces: list[str]) -> tuple[int, list[str]]:
    """Where the language codes begin in ``pieces`` (their order) and the codes, as names."""
    at = [i for i, p in enumerate(pieces) if p.startswith("\u2581<2") and TAG.fullmatch(p[1:])]
    if not at or at != list(range(at[0], at[0] + len(at))):
        _refuse("tokenizers", "the language codes are not one run of pieces after the others")
    return at[0], [pieces[i][3:-1] for i in at]


def _spm(tgt_vocab: Tokenizer, pieces: list[str], types: list[int], scores: list[float]) -> bytes:
    """A SentencePiece model cutting text as ours does, its ids fairseq's less one (``<unk>`` 0,
    ``<s>`` 1, ``</s>`` 2, the pieces), as the hub's M2M100, NLLB and mBART models are."""
    import sentencepiece.sentencepiece_model_pb2 as pb

    kind = pb.ModelProto.SentencePiece
    proto = pb.ModelProto()
    proto.ParseFromString(tgt_vocab.sp.serialized_model_proto())
    del proto.pieces[:]
    proto.pieces.add(piece="<unk>", score=0.0, type=kind.UNKNOWN)
    proto.pieces.add(piece="<s>", score=0.0, type=kind.CONTROL)
    proto.pieces.add(piece="</s>", score=0.0, type=kind.CONTROL)
    for piece, t, score in zip(pieces, types, scores):
        proto.pieces.add(piece=piece, score=score, type=t)
    spec = proto.trainer_spec
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    spec.unk_piece, spec.bos_piece, spec.eos_piece = "<unk>", "<s>", "</s>"
    spec.vocab_size = len(proto.pieces)
    return proto.SerializeToString()


def tokenizer(tmp: Path, tgt_vocab: Tokenizer, rows: list[int], kind: str) -> tuple[Any, list[str]]:
    """The ``transformers`` tokenizer of the vocabulary in their order, and the name it must give
    each id (checked by ``check_tokenizer``)."""
    import sentencepiece.sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(tgt_vocab.sp.serialized_model_proto())
    pieces = [tgt_vocab.sp.id_to_piece(i) for i in rows]
    first, codes = _codes(pieces)
    normal = [proto.pieces[i] for i in rows[4:first]]
    (tmp / "sentencepiece.bpe.model").write_bytes(_spm(tgt_vocab, [p.piece for p in normal], [p.type for p in normal],
                                                       [p.score for p in normal]))
    expected = ["<s>", "<pad>", "</s>", "<unk>", *pieces[4:first]]
    if kind == "mbart":
        from transformers import MBart50Tokenizer

        return MBart50Tokenizer.from_pretrained(tmp), expected + codes + pieces[first + len(codes):]
    lists = [name for name, langs in LANGUAGES.items() if list(langs) == codes]
    if lists:
        from transformers import M2M100Tokenizer

        (tmp / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(expected)}, ensure_ascii=False))
        made = M2M100Tokenizer(str(tmp / "vocab.json"), str(tmp / "sentencepiece.bpe.model"),
                               language_codes=lists[0], src_lang=codes[0], tgt_lang=codes[-1])
        return made, expected + [f"__{c}__" for c in codes] + pieces[first + len(codes):]
    from transformers import NllbTokenizer

    made = NllbTokenizer.from_pretrained(tmp, extra_special_tokens=codes)
    return made, expected + codes + pieces[first + len(codes):]


def check_tokenizer(made: Any, expected: list[str]) -> None:
    """Every id the tokenizer knows names the piece ours has there (``expected``), and it knows no more."""
    vocab = made.get_vocab()
    names = {i: p for p, i in vocab.items()}
    if len(names) > len(expected):
        _refuse("tokenizers", f"{type(made).__name__} holds {len(names)} pieces, the model {len(expected)}")
    wrong = [i for i in sorted(names) if i >= len(expected) or names[i] != expected[i]]
    if wrong:
        i = wrong[0]
        _refuse("tokenizers", f"{type(made).__name__} gives id {i} to {names[i]!r}, the model to "
                f"{expected[i] if i < len(expected) else None!r}")


def build_model(model: nn.Module, rows: list[int], kind: str, activation: str) -> Any:
    """The ``transformers`` model of ``kind`` computing what ``model`` computes, its weights set."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, MBartConfig, MBartForConditionalGeneration

    enc, dec = model.encoder, model.decoder
    index = torch.tensor(rows)
    state: dict[str, Tensor] = {}

    def put(name: str, t: Tensor) -> None:
        state[name] = t.detach().to("cpu", torch.float32, copy=True).contiguous()

    table = enc.embed.weight[index]
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                 "lm_head.weight"):
        put(name, table)
    for part, stack in (("encoder", enc), ("decoder", dec)):
        attns = (("self_attn", "self_attn"),) + ((("encoder_attn", "cross_attn"),) if part == "decoder" else ())
        for i, layer in enumerate(stack.layers):
            name = f"model.{part}.layers.{i}"
            for n, (theirs, ours) in enumerate(attns):
                attn, size = getattr(layer, ours), getattr(layer, ours).out_proj.out_features
                for proj, w, b in (("q_proj", attn.q_proj.weight, attn.q_proj.bias),
                                   ("k_proj", attn.kv_proj.weight[:size], attn.kv_proj.bias[:size]),
                                   ("v_proj", attn.kv_proj.weight[size:], attn.kv_proj.bias[size:]),
                                   ("out_proj", attn.out_proj.weight, attn.out_proj.bias)):
                    put(f"{name}.{theirs}.{proj}.weight", w)
                    put(f"{name}.{theirs}.{proj}.bias", b)
                put(f"{name}.{theirs}_layer_norm.weight", layer.norms[n].weight)
                put(f"{name}.{theirs}_layer_norm.bias", layer.norms[n].bias)
            for theirs, k in (("fc1", 0), ("fc2", 3)):
                put(f"{name}.{theirs}.weight", layer.ff[k].weight)
                put(f"{name}.{theirs}.bias", layer.ff[k].bias)
            put(f"{name}.final_layer_norm.weight", layer.norms[-1].weight)
            put(f"{name}.final_layer_norm.bias", layer.norms[-1].bias)
        put(f"model.{part}.layer_norm.weight", stack.final_norm.weight)
        put(f"model.{part}.layer_norm.bias", stack.final_norm.bias)
        if kind == "mbart":
            put(f"model.{part}.layernorm_embedding.weight", stack.embed_tokens.norm.weight)
            put(f"model.{part}.layernorm_embedding.bias", stack.embed_tokens.norm.bias)
            pos = stack.embed_tokens.pos.weight
            put(f"model.{part}.embed_positions.weight", torch.cat([pos.new_zeros(2, pos.size(1)), pos]))  # offset 2
    ff = lambda layer: layer.ff[0].out_features  # noqa: E731
    config = dict(vocab_size=len(rows), d_model=enc.embed.embedding_dim, encoder_layers=len(enc.layers),
                  decoder_layers=len(dec.layers), encoder_attention_heads=enc.layers[0].self_attn.num_heads,
                  decoder_attention_heads=dec.num_heads, encoder_ffn_dim=ff(enc.layers[0]),
                  decoder_ffn_dim=ff(dec.layers[0]), activation_function=activation,
                  dropout=float(enc.embed_tokens.drop.p), attention_dropout=float(enc.layers[0].self_attn.dropout),
                  activation_dropout=float(enc.layers[0].ff[2].p), max_position_embeddings=enc.embed_tokens.max_len,
                  scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                  forced_eos_token_id=2, tie_word_embeddings=True)
    make, cls = (MBartConfig, MBartForConditionalGeneration) if kind == "mbart" else (
        M2M100Config, M2M100ForConditionalGeneration)
    hf = cls(make(**config)).eval()
    own = hf.state_dict()
    skip = {k for k in own if k.endswith("embed_positions.weights")}  # M2M100's sinusoids: computed, not stored
    missing = sorted(set(own) - set(state) - skip - {"final_logits_bias"})
    unknown = sorted(set(state) - set(own))
    if missing or unknown:
        raise ValueError(f"this transformers version names {FAMILIES[kind]}'s weights otherwise (missing "
                         f"{missing[:3]}, unknown {unknown[:3]})")
    with torch.no_grad():
        for name, value in state.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} for {FAMILIES[kind]}'s {tuple(own[name].shape)}")
            own[name].copy_(value)
        if "final_logits_bias" in own and dec.out.bias is not None:  # our BOS's, not in ``rows``, is not theirs
            own["final_logits_bias"][0].copy_(dec.out.bias[index])
    return hf


def generation(hf: Any, run_config: dict) -> None:
    """generation_config.json: the decoder starts from ``</s>``, ``<pad>`` is never generated, and
    the run's beam size and (``scoring: huggingface``) length penalty and stopping rule."""
    decoding = run_config.get("test_decoding") or {}
    settings = dict(decoder_start_token_id=2, bos_token_id=0, eos_token_id=2, pad_token_id=1, forced_eos_token_id=2,
                    bad_words_ids=[[1]], num_beams=int(decoding.get("beam_size") or 5),
                    max_new_tokens=int(hf.config.max_position_embeddings) - 1)
    if decoding.get("scoring") == "huggingface" and decoding.get("alpha") is not None:
        settings.update(length_penalty=float(decoding["alpha"]), early_stopping=decoding.get("early_stopping", False))
    hf.generation_config.update(**settings)
