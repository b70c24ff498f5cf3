"""A Hugging Face ``M2M100ForConditionalGeneration`` folder (M2M100, Fan et al. 2021; NLLB-200,
NLLB Team et al. 2022, the same architecture) or ``MBartForConditionalGeneration`` folder of
mBART-50 (Tang et al. 2020) read as an nmt release checkpoint (``nmt-import format=huggingface
src=<folder>``; ``init_from=<folder>``).

mBART-50 is the same pre-norm stack with GELU, learned positions (``positions: learned``: their
table's rows from 2, its offset, are ours from 0), a layer norm after the embeddings
(``embedding_norm``, their ``layernorm_embedding``) and a logits bias; ``MBart50Tokenizer`` keeps its
vocabulary in tokenizer.json as NLLB's does, with the codes ``fr_XX``.

M2M100 is fairseq's pre-norm Transformer: ``norm: pre`` with a layer norm closing the encoder and the
decoder (our ``final_norm``), embeddings scaled by sqrt(d_model) as ours, fairseq's sinusoids
(``positions: fairseq``, ``nmt.models.transformer.fairseq_sinusoids``: sines then cosines, positions
from padding id + 1 = 2), ReLU, no embedding layer norm, the output layer tied to the embedding.
The units keep their order (no permutation, unlike Marian's).

The vocabulary is ``M2M100Tokenizer``'s: ``sentencepiece.bpe.model`` cuts the text, ``vocab.json``
(fairseq's dictionary: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, the pieces) maps the pieces to
ids, and after it come the language codes ``__fr__`` (``LANGUAGES``, in the order of
``tokenizer_config.json``'s ``language_codes``) and fairseq's ``madeupword`` fillers up to the
config's ``vocab_size``. As for Marian (``nmt.checkpoints.marian.Vocabulary``), our id ``i`` is
their id ``order[i]``: PAD their pad, UNK their unk, BOS their decoder start ``</s>``, EOS their
``</s>``; a language code
becomes the piece ``▁<2fr>`` (one of our tags, ``nmt.languages.tags``). NLLB-200's
``NllbTokenizer`` keeps the same fairseq dictionary in ``tokenizer.json`` (the SentencePiece pieces
one id up after ``<s> <pad> </s> <unk>``, then its added tokens: the 202 codes ``fra_Latn`` and
``<mask>``); its ids are read from there and its text cut with the ``sentencepiece.bpe.model`` the
hub's folders hold beside it (``_nllb_pieces``); ``fra_Latn`` becomes ``▁<2fra_Latn>``.

The decoder starts from ``</s>``: ``start_from_eos`` (``nmt.models.transformer``) makes BOS read the
``</s>`` row of the embedding and gives it the constant logit ``NEVER`` (out of the softmax), so
fine-tuning trains nothing the class does not have (the BOS row, holding a copy of ``</s>``'s, is
never read) and ``nmt.exporters.huggingface_m2m100`` writes the tuned model back exactly. M2M100
has no logits bias (``logits_bias: false``, unless pieces their tokenizer maps to ``<unk>`` need one
of ``NEVER``); mBART's ``final_logits_bias`` is ours. Files imported before ``start_from_eos``
existed hold a BOS row copying ``</s>``'s and a logits bias of ``NEVER`` at BOS; they load,
translate and fine-tune as they did (the export refuses them once tuned).

M2M100 and NLLB-200 (``legacy_behaviour`` false, its default) write the *source* language first
(``[__en__] + pieces + [</s>]``: ``src_lang`` as a source
tag, ``<2en> text``) and makes the target language the decoder's first token (``forced_bos``):
``tgt_lang`` becomes a target prefix of one token, scored 0 by ``scoring=huggingface``
(``nmt.decoding.search``) as by ``generate()``, and cut from the output
(``nmt.inference.requests``). The release file records this as ``run_config.languages``.

The folder is untrusted input, read as a Marian folder is (safetensors only unless ``allow_pickle``,
files and sizes bounded, every tensor's name and shape checked before it is read); ``config.json``
may hold only the keys in ``CONFIG_KEYS``, and anything else is refused in one line naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt.checkpoints.files import FORMAT
from nmt.checkpoints.marian import (ACTIVATIONS, LIMITS, ImportRefused, Vocabulary, _count, _json, _ratio, _spm,
                                    _vocab, decoding_of, model_config, our_state, read_weights, resolve)
from nmt.data.tokenizer import Tokenizer
from nmt.languages.tags import LANGUAGE

ARCHITECTURE = "M2M100ForConditionalGeneration"
ARCHITECTURES = {"m2m_100": ARCHITECTURE, "mbart": "MBartForConditionalGeneration"}  # model_type -> the class read
# mBART's config.json keys that must say what nmt computes for it (pre-norm, both final layer norms,
# the embedding layer norm, learned positions, no logits bias layer)
MBART_FIXED = {"normalize_before": True, "add_final_layer_norm": True, "normalize_embedding": True,
               "static_position_embeddings": False, "add_bias_logits": False}
MBART_TOKENIZERS = ("MBart50Tokenizer", "MBart50TokenizerFast")  # the source code first; MBartTokenizer puts it last
# The language codes of M2M100's dictionaries, in their order (fairseq's lists).
LANGUAGES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi "
               "hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns "
               "oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh "
               "zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
# What config.json may hold: the sizes, ids and rates read below, and keys that change nothing
# nmt computes (training-only layer dropping, generation defaults, bookkeeping).
CONFIG_KEYS = frozenset({
    "model_type", "architectures", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
    "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "vocab_size", "max_position_embeddings",
    "activation_function", "scale_embedding", "dropout", "attention_dropout", "activation_dropout", "pad_token_id",
    "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id", "tie_word_embeddings",
    "encoder_layerdrop", "decoder_layerdrop", "init_std", "use_cache", "is_encoder_decoder", "num_hidden_layers",
    "transformers_version", "dtype", "torch_dtype", "_name_or_path", "tokenizer_class", "max_length", "num_beams",
    "early_stopping", "gradient_checkpointing", "id2label", "label2id", "output_past", "return_dict",
    "output_hidden_states", "output_attentions", "classifier_dropout", "classif_dropout", "_num_labels", "is_decoder",
    *MBART_FIXED})
FAIRSEQ_PAD = 1  # the padding id fairseq's positions are offset by (positions start at 2)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, checked: an M2M100 or mBART model nmt computes exactly, every size bounded."""
    config = _json(folder, "config.json")
    where = folder / "config.json"
    kind, classes = config.get("model_type"), config.get("architectures") or []
    architecture = ARCHITECTURES.get(kind)
    if architecture is None or not isinstance(classes, list) or any(c != architecture for c in classes):
        raise ImportRefused(f"{where}: model_type={str(kind)[:40]}, architectures={str(classes)[:80]}: not an "
                            f"{ARCHITECTURE} (model_type=m2m_100) or MBartForConditionalGeneration (model_type=mbart)")
    unknown = sorted(set(config) - (CONFIG_KEYS if kind == "mbart" else CONFIG_KEYS - set(MBART_FIXED)))
    if unknown:
        raise ImportRefused(f"{where}: {unknown[0][:60]}={str(config[unknown[0]])[:40]}: a key nmt does not know for "
                            f"an {architecture}; it may change what the model computes, so the folder is refused")
    for key, value in MBART_FIXED.items() if kind == "mbart" else ():
        if config.get(key, value) is not value:
            raise ImportRefused(f"{where}: {key}={str(config[key])[:40]}: nmt computes mBART with {key}={value}")
    if config.get("scale_embedding", True) is not True:
        raise ImportRefused(f"{where}: scale_embedding={config.get('scale_embedding')}: nmt scales embeddings by "
                            "sqrt(d_model), as M2M100, NLLB-200 and mBART-50 do")
    act = config.get("activation_function", "relu")
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{where}: activation_function={str(act)[:40]}: nmt computes {', '.join(ACTIVATIONS)}")
    config = {**config, "decoder_vocab_size": config.get("vocab_size")}
    sizes = {key: _count(config, key, where) for key in LIMITS}
    if sizes["d_model"] % 2 or sizes["d_model"] < 4:
        raise ImportRefused(f"{where}: d_model={sizes['d_model']}: fairseq's sinusoids need an even width of at least 4")
    for part in ("encoder", "decoder"):
        if sizes["d_model"] % sizes[f"{part}_attention_heads"]:
            raise ImportRefused(f"{where}: d_model={sizes['d_model']} is not divisible by "
                                f"{part}_attention_heads={sizes[f'{part}_attention_heads']}")
    ids = {}
    for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < sizes["vocab_size"]:
            raise ImportRefused(f"{where}: {key}={str(value)[:40]} is not an id of the vocabulary")
        ids[key] = value
    if kind == "m2m_100" and ids["pad_token_id"] != FAIRSEQ_PAD:
        raise ImportRefused(f"{where}: pad_token_id={ids['pad_token_id']}: nmt's fairseq positions start at 2, after "
                            f"fairseq's padding id {FAIRSEQ_PAD}")
    if len({ids["pad_token_id"], ids["eos_token_id"]}) < 2:
        raise ImportRefused(f"{where}: pad_token_id and eos_token_id are both {ids['eos_token_id']}")
    dropouts = {key: _ratio(config, key, where) for key in ("dropout", "attention_dropout", "activation_dropout")}
    return {**sizes, **ids, **dropouts, "activation": ACTIVATIONS[act], "shared": True,
            "tied": bool(config.get("tie_word_embeddings", True)), "pre_norm": True, "architecture": architecture,
            "positions": "learned" if kind == "mbart" else "fairseq"}


def _m2m100_pieces(folder: Path, config: dict[str, Any], tokenizer_config: dict[str, Any]
                   ) -> tuple[dict[str, int], list[str], str]:
    """``M2M100Tokenizer``'s ids: vocab.json's, then the language codes ``__xx__`` and fairseq's
    fillers; the languages; the file named in errors."""
    codes = tokenizer_config.get("language_codes", "m2m100")
    if codes not in LANGUAGES:
        raise ImportRefused(f"{folder / 'tokenizer_config.json'}: language_codes={str(codes)[:40]}: nmt knows "
                            f"{', '.join(LANGUAGES)}")
    vocab = _vocab(folder, "vocab.json", config["vocab_size"])
    size = len(vocab)
    if set(vocab.values()) != set(range(size)):
        raise ImportRefused(f"{folder / 'vocab.json'}: its ids are not 0 to {size - 1}; M2M100Tokenizer numbers the "
                            "language codes from its size on")
    languages = LANGUAGES[codes]
    fillers = config["vocab_size"] - size - len(languages)
    if fillers < 0:
        raise ImportRefused(f"{folder / 'config.json'}: vocab_size={config['vocab_size']} has no room for "
                            f"vocab.json's {size:,} pieces and {len(languages)} language codes")
    added = {f"__{lang}__": size + i for i, lang in enumerate(languages)}
    added.update({f"madeupword{j:04d}": size + len(languages) + j for j in range(fillers)})  # fairseq's fillers
    clash = sorted(set(added) & set(vocab))
    if clash:
        raise ImportRefused(f"{folder / 'vocab.json'}: holds {clash[0][:40]!r}, a language code or filler "
                            "M2M100Tokenizer adds")
    return {**vocab, **added}, languages, "vocab.json"


NLLB_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def _nllb_pieces(folder: Path, config: dict[str, Any], tokenizer_config: dict[str, Any]
                 ) -> tuple[dict[str, int], list[str], str]:
    """``NllbTokenizer``'s ids, read from tokenizer.json (its ``model.vocab``, fairseq's dictionary:
    the SentencePiece pieces one id up after ``<s> <pad> </s> <unk>``, and its added tokens: the
    language codes ``fra_Latn`` and ``<mask>``), unused fillers up to ``vocab_size``; the languages;
    the file named in errors. The text is cut with ``sentencepiece.bpe.model``, which tokenizer.json
    was made from."""
    where = folder / "tokenizer.json"
    if config["architecture"] != ARCHITECTURE and tokenizer_config.get("tokenizer_class") not in MBART_TOKENIZERS:
        raise ImportRefused(f"{folder / 'tokenizer_config.json'}: tokenizer_class="
                            f"{str(tokenizer_config.get('tokenizer_class'))[:40]}: nmt reads mBART-50's MBart50Tokenizer "
                            "(the source language first); mBART's MBartTokenizer puts it after </s>")
    if tokenizer_config.get("legacy_behaviour"):
        raise ImportRefused(f"{folder / 'tokenizer_config.json'}: legacy_behaviour=true puts the source language "
                            "after the sentence's </s>; nmt puts it first, as NllbTokenizer does by default")
    tokenizer = _json(folder, "tokenizer.json")
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list) and model.get("type") == "Unigram":  # [piece, score] pairs, in id order
        if not all(isinstance(p, list) and p and isinstance(p[0], str) for p in vocab):
            raise ImportRefused(f"{where}: model.vocab is not a list of [piece, score] pairs")
        vocab = {p[0]: i for i, p in enumerate(vocab)}
    if not isinstance(vocab, dict) or model.get("type") not in ("BPE", "Unigram"):
        raise ImportRefused(f"{where}: model.type={str(model.get('type') if isinstance(model, dict) else model)[:40]}: "
                            "nmt reads a BPE or Unigram vocabulary (NllbTokenizer's, MBart50Tokenizer's)")
    added_tokens = tokenizer.get("added_tokens") or []
    if not isinstance(added_tokens, list) or not all(isinstance(t, dict) for t in added_tokens):
        raise ImportRefused(f"{where}: added_tokens is not a list of tokens")
    pieces = dict(vocab)
    for token in added_tokens:
        content, i = token.get("content"), token.get("id")
        if not isinstance(content, str) or isinstance(i, bool) or not isinstance(i, int) or pieces.get(content, i) != i:
            raise ImportRefused(f"{where}: added token {str(content)[:40]!r} has id {str(i)[:20]}, not its vocabulary's")
        pieces[content] = i
    size = config["vocab_size"]
    ids = set(pieces.values())
    if len(ids) != len(pieces) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size
                                          for i in ids):
        raise ImportRefused(f"{where}: its {len(pieces):,} pieces do not have distinct ids below config.json's "
                            f"vocab_size={size:,}")
    languages = [p for p in pieces if p not in NLLB_SPECIALS and any(t.get("content") == p for t in added_tokens)
                 and LANGUAGE.fullmatch(p)]
    free = sorted(set(range(size)) - ids)
    pieces.update({f"<nmt_unused_{i}>": i for i in free})  # ids past the tokenizer's: never produced
    return pieces, languages, "tokenizer.json"


def read_vocabulary(folder: Path, config: dict[str, Any]) -> tuple[Vocabulary, bytes, list[str]]:
    """The joint vocabulary in our order, the SentencePiece model written again with it, and the
    languages of its codes: ``M2M100Tokenizer``'s (vocab.json) or ``NllbTokenizer``'s (tokenizer.json)."""
    tokenizer_config = _json(folder, "tokenizer_config.json", required=False)
    if (folder / "vocab.json").is_file():
        pieces, languages, name = _m2m100_pieces(folder, config, tokenizer_config)
        codes = {f"__{lang}__": lang for lang in languages}
        spm_file = "sentencepiece.bpe.model"
    elif (folder / "tokenizer.json").is_file():
        pieces, languages, name = _nllb_pieces(folder, config, tokenizer_config)
        codes = {lang: lang for lang in languages}
        spm_file = "sentencepiece.bpe.model"
        if not (folder / spm_file).is_file():
            raise ImportRefused(f"{folder / spm_file}: missing; nmt cuts NLLB text with the SentencePiece model its "
                                "tokenizer.json was made from (the hub's folders have it)")
    else:
        raise ImportRefused(f"{folder / 'vocab.json'}: missing; an M2M100 folder has vocab.json (M2M100Tokenizer) or "
                            "tokenizer.json and sentencepiece.bpe.model (NllbTokenizer)")
    unk_piece = tokenizer_config.get("unk_token", "<unk>")
    unk_piece = unk_piece.get("content") if isinstance(unk_piece, dict) else unk_piece
    if not isinstance(unk_piece, str) or unk_piece not in pieces:
        raise ImportRefused(f"{folder / name}: no {str(unk_piece)[:40]!r} piece (tokenizer_config.json's unk_token)")
    ids = {"pad": config["pad_token_id"], "eos": config["eos_token_id"], "start": config["decoder_start_token_id"],
           "unk": pieces[unk_piece]}
    if ids["unk"] in (ids["pad"], ids["eos"]):
        raise ImportRefused(f"{folder / name}: the unk piece {unk_piece[:40]!r} has the pad or eos id")
    proto = _spm(folder, spm_file)
    full = Vocabulary(pieces, ids, [proto], folder / name, languages=codes)
    return full, full.proto(proto), languages


def import_m2m100(folder: Path, allow_pickle: bool = False, source: str | None = None) -> dict[str, Any]:
    """The release checkpoint of an M2M100ForConditionalGeneration folder (``resolve``'d)."""
    config = read_config(folder)
    vocab, proto, languages = read_vocabulary(folder, config)
    weights = read_weights(folder, config, allow_pickle, config["architecture"])
    state, shared, tied = our_state(weights, config, vocab, vocab)
    try:
        Tokenizer.from_proto(proto, f"{folder}: the vocabulary")
    except ValueError as e:
        raise ImportRefused(str(e)) from None
    size = len(vocab.pieces)
    model = model_config(config, size, size, shared, tied)
    model["decoder"]["start_from_eos"] = True  # BOS reads the </s> row and is never an output: no weight of its own
    if config["architecture"] == ARCHITECTURE and not vocab.extra:  # M2M100 has no logits bias
        model["decoder"]["logits_bias"] = False
        del state["decoder.out.bias"]
    return {"nmt_format": FORMAT, "kind": "release", "state_dict": {f"model.{k}": v for k, v in state.items()},
            "run_config": {"model": model, "test_decoding": decoding_of(folder),
                           "languages": {"source": "tag", "target": "decoder_prefix", "codes": languages}},
            "tokenizers": {"src": proto, "tgt": proto},
            "global_step": None, "epoch": None, "monitor": None, "report": None,
            "source": {"path": str(source or folder), "format": "huggingface", "folder": str(folder),
                       "architecture": config["architecture"], "extra_pieces": len(vocab.extra)}}


def import_folder(src: str | Path, allow_pickle: bool = False, revision: str | None = None) -> dict[str, Any]:
    """The release checkpoint of a Hugging Face folder or hub id: ``M2M100ForConditionalGeneration``
    here, anything else through ``nmt.checkpoints.marian.import_marian`` (which refuses what is not
    a MarianMTModel in one line)."""
    from nmt.checkpoints.marian import import_marian

    folder = resolve(src, revision, allow_pickle)
    if _json(folder, "config.json").get("model_type") in ARCHITECTURES:
        return import_m2m100(folder, allow_pickle, str(src))
    return import_marian(folder, allow_pickle=allow_pickle, revision=revision)
