"""nmt.checkpoints.m2m100: M2M100, NLLB-200 (M2M100ForConditionalGeneration) and mBART-50
(MBartForConditionalGeneration) folders that ``transformers`` builds (small random weights, its own
config and tokenizer classes saved with ``save_pretrained``, SentencePiece models trained on the tiny
corpus, fairseq's dictionary order, the language codes after it) import into release files whose
token ids, logits, greedy and beam outputs equal ``transformers``' for a source and a target
language; nmt-export format=huggingface writes the folder back; format=ctranslate2 writes a CTranslate2
folder whose backend translates as the torch Translator; translate.py, evaluate.py and nmt-serve take
src_lang and tgt_lang; what a folder must not hold is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from nmt.checkpoints.files import atomic_save  # noqa: E402
from nmt.checkpoints.loading import load_checkpoint  # noqa: E402
from nmt.checkpoints.marian import ImportRefused  # noqa: E402
from nmt.checkpoints.m2m100 import import_folder  # noqa: E402
from nmt.data.tokenizer import BOS, EOS, PAD  # noqa: E402
from nmt.decoding.search import beam_search, greedy_search  # noqa: E402
from nmt.inference.requests import Request  # noqa: E402
from nmt.languages.tags import tag  # noqa: E402
from tests.test_export_ctranslate2 import lines_of  # noqa: E402

PAIRS = {"m2m100": (("de", "fr"), ("en", "zu")),  # (source, target) languages, one per half of the sentences
         "nllb": (("deu_Latn", "fra_Latn"), ("eng_Latn", "zul_Latn")),
         "mbart": (("de_DE", "fr_XX"), ("en_XX", "zh_CN"))}
CODES = {"m2m100": 100, "nllb": 202, "mbart": 52}
EOS_BIAS = {"m2m100": 2.0, "nllb": 6.0, "mbart": 6.0}  # what gives each folder's random model outputs of mixed lengths


def m2m100_folder(out: Path, *, seed: int = 0, std: float = 0.3, generation: dict | None = None,
                  eos_bias: float | None = None, family: str = "m2m100") -> Path:
    """An M2M100 folder: fairseq's dictionary (<s> 0, <pad> 1, </s> 2, <unk> 3, the pieces of a BPE
    SentencePiece model) and the language codes, every weight random (no layer norm an identity,
    the <pad> row not zero), the </s> row of the tied output layer shifted so that outputs end at
    mixed lengths. ``m2m100``: M2M100Tokenizer's vocab.json, its 100 codes and 8 fillers after it;
    ``nllb``: NllbTokenizer made from the SentencePiece model (tokenizer.json, the 202 codes
    ``fra_Latn``, ``<mask>``), the SentencePiece model beside it as in the hub's folders; ``mbart``:
    an MBartForConditionalGeneration (mBART-50's settings: scaled embeddings, decoding from </s>,
    GELU, learned positions, embedding layer norms, a random logits bias) with MBart50Tokenizer
    (``fr_XX``)."""
    import sentencepiece as spm
    from transformers import (M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer, MBart50Tokenizer,
                              MBartConfig, MBartForConditionalGeneration, NllbTokenizer)
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    work = out.parent / f".{out.name}.spm"
    work.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines_of("train.src", "train.tgt")),
                                   model_prefix=str(work / "sp"), vocab_size=120, hard_vocab_limit=False,
                                   minloglevel=2, num_threads=1,
                                   model_type="unigram" if family == "mbart" else "bpe")  # as each family's
    sp = spm.SentencePieceProcessor(model_file=str(work / "sp.model"))
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                                                  if not (sp.is_control(i) or sp.is_unknown(i))]
    if family in ("nllb", "mbart"):
        (work / "tok").mkdir()
        shutil.copy(work / "sp.model", work / "tok" / "sentencepiece.bpe.model")
        if family == "nllb":
            tokenizer = NllbTokenizer.from_pretrained(work / "tok", extra_special_tokens=FAIRSEQ_LANGUAGE_CODES)
        else:
            tokenizer = MBart50Tokenizer.from_pretrained(work / "tok")
        size = len(tokenizer)
    else:
        (work / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
        tokenizer = M2M100Tokenizer(str(work / "vocab.json"), str(work / "sp.model"), src_lang="en", tgt_lang="fr")
        size = len(pieces) + 100 + 8
    make, kind = (MBartConfig, MBartForConditionalGeneration) if family == "mbart" else (
        M2M100Config, M2M100ForConditionalGeneration)
    extra = {"scale_embedding": True, "decoder_start_token_id": 2} if family == "mbart" else {}
    config = make(vocab_size=size, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=40,
                          max_position_embeddings=64, dropout=0.1, **extra)
    torch.manual_seed(seed)
    model = kind(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std).add_(1.0 if "layer_norm.weight" in name else 0.0)
        if family == "mbart":  # its logits bias, random, the </s> one raised
            model.final_logits_bias.normal_(0.0, 0.5)[0, 2] += eos_bias or EOS_BIAS[family]
        else:
            last = model.model.decoder.layer_norm.bias  # the </s> logit gains eos_bias through it
            model.model.shared.weight[2] += (eos_bias or EOS_BIAS[family]) * last / last.norm() ** 2
    model.generation_config.update(**{"bad_words_ids": [[1]], "num_beams": 4, "length_penalty": 1.0,
                                      "forced_eos_token_id": 2,
                                      **(generation or {})})
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family in ("nllb", "mbart"):
        shutil.copy(work / "sp.model", out / "sentencepiece.bpe.model")
    shutil.rmtree(work)
    return out


def load_hf(folder: Path, family: str):
    from transformers import (M2M100ForConditionalGeneration, M2M100Tokenizer, MBart50Tokenizer,
                              MBartForConditionalGeneration, NllbTokenizer)

    tokenizer = {"nllb": NllbTokenizer, "mbart": MBart50Tokenizer}.get(family, M2M100Tokenizer).from_pretrained(folder)
    kind = MBartForConditionalGeneration if family == "mbart" else M2M100ForConditionalGeneration
    return kind.from_pretrained(folder).eval(), tokenizer


# M2M100 in the default tier; NLLB-200 and mBART-50, the same checks on their folders, in the slow tier
FAMILIES = ["m2m100", *(pytest.param(family, marks=pytest.mark.slow) for family in PAIRS if family != "m2m100")]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(their model, their tokenizer, our Loaded, the folder, the family) of an M2M100, an NLLB-200
    and an mBART-50 folder."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = m2m100_folder(tmp / "hf", family=request.param)
    atomic_save(import_folder(folder), tmp / "model.ckpt")
    return (*load_hf(folder, request.param), load_checkpoint(tmp / "model.ckpt"), folder, request.param)


def halves(family: str) -> list[tuple[str, str, list[str]]]:
    lines = lines_of("test.src", "valid.src")
    half = len(lines) // 2
    return [(src, tgt, part) for (src, tgt), part in zip(PAIRS[family], (lines[:half], lines[half:]))]


def lang_id(tokenizer, family: str, lang: str) -> int:
    return tokenizer.get_lang_id(lang) if family == "m2m100" else tokenizer.convert_tokens_to_ids(lang)


def order_of(tokenizer, family: str, folder: Path, loaded) -> torch.Tensor:
    """Their id of each of our ids, through the pieces' names (``▁<2fr>`` is ``__fr__`` or
    ``fra_Latn``; M2M100's fillers ``madeupword0000``... follow its codes)."""
    vocab = tokenizer.get_vocab()
    sp = loaded.tgt_vocab.sp
    order = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if i == BOS:
            order.append(vocab["</s>"])
        elif piece.startswith("\u2581<2"):
            order.append(lang_id(tokenizer, family, piece[3:-1]))
        elif piece.startswith("madeupword"):
            order.append(tokenizer.vocab_size + 100 + int(piece[-4:]))
        else:
            order.append(vocab.get(piece, -1))
    return torch.tensor(order)


def translator_languages(loaded) -> list[str]:
    from nmt.languages.tags import vocabulary_languages

    return vocabulary_languages(loaded.src_vocab.sp)


def our_ids(loaded, lines: list[str], src_lang: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [loaded.src_vocab.encode(f"{tag(src_lang)} {line}") + [EOS] for line in lines]
    src = torch.full((len(ids), max(map(len, ids))), PAD)
    for i, seq in enumerate(ids):
        src[i, : len(seq)] = torch.tensor(seq)
    return src, src != PAD


def test_token_ids_and_logits_equal_transformers(pair):
    """For each (source, target) pair, our source ids (``<2de> text``) are their ids with
    ``src_lang=de`` on 20 sentences each; teacher-forced from their decoder start and the target
    code, our logits equal theirs within 1e-4 (fp32), and so do the log-probs (the BOS row, a
    second copy of their </s>, out of our softmax)."""
    hf, tokenizer, loaded, folder, family = pair
    order = order_of(tokenizer, family, folder, loaded)
    assert (order >= 0).all() and sorted(order.tolist()[:2] + order.tolist()[3:]) == list(range(hf.config.vocab_size))
    assert len(translator_languages(loaded)) == CODES[family]
    largest = 0.0
    for src_lang, tgt_lang, lines in halves(family):
        tokenizer.src_lang = src_lang
        batch = tokenizer(lines, return_tensors="pt", padding=True)
        src, src_mask = our_ids(loaded, lines, src_lang)
        assert order[src].masked_fill(~src_mask, 1).tolist() == batch["input_ids"].tolist()
        code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        targets = [[BOS, code, *loaded.tgt_vocab.encode(line)[:8]] for line in lines_of("test.tgt")[: len(lines)]]
        width = min(map(len, targets))
        tgt_in = torch.tensor([t[:width] for t in targets])
        with torch.no_grad():
            ours = loaded.model(src, src_mask, tgt_in)
            raw = hf(**batch, decoder_input_ids=order[tgt_in]).logits
        theirs = raw[..., order]
        kept = torch.arange(ours.size(-1)) != BOS
        largest = max(largest, (ours - theirs)[..., kept].abs().max().item())
        assert ours.abs().max() > 1
        torch.testing.assert_close(ours.log_softmax(-1)[..., kept], raw.log_softmax(-1)[..., order][..., kept],
                                   atol=1e-4, rtol=1e-4)
    assert largest < 1e-4, largest
    print(f"max logit difference {largest:.2e}")


def their_outputs(hf, tokenizer, family, lines, src_lang, tgt_lang, order, **generate) -> list[list[int]]:
    ours_of = {int(theirs): ours for ours, theirs in reversed(list(enumerate(order.tolist())))}
    tokenizer.src_lang = src_lang
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, forced_bos_token_id=lang_id(tokenizer, family, tgt_lang), **generate)
    outputs = []
    for row in out[:, 1:].tolist():
        ids = [ours_of[t] if t != 2 else EOS for t in row]
        outputs.append(ids[: ids.index(EOS)] if EOS in ids else ids)
    return outputs


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_greedy_and_beam_equal_generate(pair, search):
    """Greedy search and beam search (the folder's beam 4 and length penalty 1.0, ranked as
    transformers ranks: the imported file's ``test_decoding``) with the target code as a one-token
    prefix give ``generate(forced_bos_token_id=...)``'s outputs on all 40 sentences, cap 12."""
    hf, tokenizer, loaded, folder, family = pair
    order = order_of(tokenizer, family, folder, loaded)
    tested = loaded.run_config["test_decoding"]
    assert (tested["beam_size"], tested["alpha"], tested["scoring"]) == (4, 1.0, "huggingface")
    cap, same, total, ended = 12, 0, 0, 0
    for src_lang, tgt_lang, lines in halves(family):
        src, src_mask = our_ids(loaded, lines, src_lang)
        code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        prefix = torch.full((len(lines), 1), code)
        if search == "greedy":
            ours = greedy_search(loaded.model, src, src_mask, max_len_a=0, max_len_b=cap, prefix=prefix).tokens
            theirs = their_outputs(hf, tokenizer, family, lines, src_lang, tgt_lang, order, num_beams=1, max_new_tokens=cap)
        else:
            ours = beam_search(loaded.model, src, src_mask, beam_size=4, alpha=1.0, max_len_a=0, max_len_b=cap,
                               prefix=prefix, scoring="huggingface").tokens
            theirs = their_outputs(hf, tokenizer, family, lines, src_lang, tgt_lang, order, max_new_tokens=cap)
        assert all(o[0] == code for o in ours)
        same += sum(o == t for o, t in zip(ours, theirs))
        ended += sum(len(t) < cap - 1 for t in theirs)
        total += len(lines)
    print(f"{search}: {same}/{total} outputs equal, {ended} ended before the cap")
    assert same == total and ended >= 5


def test_export_gives_the_folder_back_and_generate_our_outputs(pair, tmp_path):
    """``nmt-export format=huggingface`` of the imported file writes the family's own class and
    tokenizer (M2M100Tokenizer, NllbTokenizer, MBart50Tokenizer): imported again, it gives the same
    weights bit for bit, the same vocabulary and the same config; ``generate()`` on it, with the
    length penalty and beam it wrote, gives our beam outputs (``scoring=huggingface``) on 20 sentences."""
    from nmt.exporters.huggingface import to_huggingface

    hf, tokenizer, loaded, folder, family = pair
    out = to_huggingface(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, tmp_path / "out")
    first, again = import_folder(folder), import_folder(out)
    assert first["state_dict"].keys() == again["state_dict"].keys()
    assert all(torch.equal(first["state_dict"][k], again["state_dict"][k]) for k in first["state_dict"])
    assert first["tokenizers"] == again["tokenizers"] and first["run_config"] == again["run_config"]
    exported, their_tokenizer = load_hf(out, family)
    assert type(exported) is type(hf) and type(their_tokenizer).__name__ == type(tokenizer).__name__
    order = order_of(their_tokenizer, family, out, loaded)
    lengths = []
    for src_lang, tgt_lang, lines in halves(family):
        src, src_mask = our_ids(loaded, lines, src_lang)
        code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        ours = beam_search(loaded.model, src, src_mask, beam_size=4, alpha=1.0, max_len_a=0, max_len_b=12,
                           prefix=torch.full((len(lines), 1), code), scoring="huggingface").tokens
        theirs = their_outputs(exported, their_tokenizer, family, lines, src_lang, tgt_lang, order, max_new_tokens=12)
        assert ours == theirs
        lengths += [len(o) for o in ours]
    print(f"{family}: outputs of {sorted(set(lengths))} tokens")
    assert len(set(lengths)) > 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return m2m100_folder(tmp_path_factory.mktemp("refusals") / "hf")


def edited(folder: Path, tmp_path: Path, **changes) -> Path:
    """A copy of ``folder`` with keys of its config.json changed (None: removed)."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return copy


@pytest.mark.parametrize("changes, message", [
    ({"auto_map": {"AutoModel": "modeling.M"}}, "config.json: auto_map={'AutoModel': 'modeling.M'}: a key nmt does not "
                                                "know for an M2M100ForConditionalGeneration; it may change what the model "
                                                "computes, so the folder is refused"),
    ({"normalize_before": True}, "config.json: normalize_before=True: a key nmt does not know for an "
                                 "M2M100ForConditionalGeneration"),
    ({"scale_embedding": False}, "config.json: scale_embedding=False: nmt scales embeddings by sqrt(d_model), as "
                                 "M2M100, NLLB-200 and mBART-50 do"),
    ({"activation_function": "gelu_new"}, "config.json: activation_function=gelu_new: nmt computes relu, gelu, swish, silu"),
    ({"pad_token_id": 0}, "config.json: pad_token_id=0: nmt's fairseq positions start at 2, after fairseq's padding id 1"),
    ({"d_model": 10**9}, "config.json: d_model=1000000000 is not a count from 1 to 8,192; refused before any weight is "
                         "allocated"),
    ({"vocab_size": 150}, "config.json: vocab_size=150 has no room for vocab.json's"),
    ({"encoder_layers": 1}, "model.safetensors: model.encoder.layers.1.fc1.bias is not a weight of the "
                            "M2M100ForConditionalGeneration config.json describes"),
    ({"architectures": ["M2M100Model"]}, "config.json: model_type=m2m_100, architectures=['M2M100Model']: not an "
                                         "M2M100ForConditionalGeneration"),
], ids=["auto_map", "mbart_key", "unscaled", "gelu_new", "pad_id", "width", "vocabulary", "extra_layer", "architecture"])
def test_what_does_not_import_is_refused_in_one_line(folder, tmp_path, changes, message):
    copy = edited(folder, tmp_path, **changes)
    with pytest.raises(ImportRefused) as refused:
        import_folder(copy)
    text = str(refused.value)
    assert text.startswith(f"{copy}/{message.split(':')[0]}") and message in text and "\n" not in text, text


def test_pickled_weights_are_refused_unless_allowed(folder, tmp_path):
    from safetensors.torch import load_file

    copy = edited(folder, tmp_path)
    torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    with pytest.raises(ImportRefused, match=r"pytorch_model.bin: refused, pickled weights can run code"):
        import_folder(copy)
    allowed = import_folder(copy, allow_pickle=True)["state_dict"]
    safe = import_folder(folder)["state_dict"]
    assert allowed.keys() == safe.keys() and all(torch.equal(allowed[k], safe[k]) for k in safe)


def test_nmt_import_and_init_from_take_the_folder(folder, tmp_path):
    """``nmt-import``'s body writes the release file (pre-norm, fairseq positions, the language
    record); ``train.py init_from=<folder>`` fine-tunes it for two steps."""
    from omegaconf import OmegaConf

    from nmt.import_model import import_model
    from nmt.train import train
    from tests.conftest import compose_train

    cfg = {"format": "huggingface", "src": str(folder), "out": str(tmp_path / "model.ckpt"), "allow_pickle": False,
           "revision": None}
    import_model(OmegaConf.create(cfg))
    loaded = load_checkpoint(tmp_path / "model.ckpt")
    model = loaded.run_config["model"]
    assert (model["encoder"]["norm"], model["decoder"]["positions"], model["decoder"]["activation"]) == (
        "pre", "fairseq", "relu")
    assert loaded.run_config["languages"]["target"] == "decoder_prefix"
    cfg = compose_train(tmp_path / "run", [f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=2",
                                           "trainer.limit_val_batches=0", "test=false"], model="transformer")
    train(cfg)
    tuned = load_checkpoint(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")
    assert tuned.run_config["model"]["encoder"]["positions"] == "fairseq"


def test_translator_takes_src_lang_and_tgt_lang(pair):
    """The torch Translator on the imported file: ``src_lang=de tgt_lang=fr`` tags the source with
    the source code and starts every output with the target code (cut from the text), giving the
    text of the beam search ``generate()`` equals (the file's beam 4, length penalty 1.0, ranked
    as transformers ranks) and its scores; scoring given translations (``mode=score``) reads the
    code unscored; either language missing or unknown: one line."""
    from nmt.inference.requests import Request, RequestError
    from nmt.inference.translator import Translator

    hf, tokenizer, loaded, folder, family = pair
    decoding = {"_target_": "nmt.decoding.search.beam_search", "beam_size": 4, "max_len_a": 0, "max_len_b": 12}
    translator = Translator(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, decoding, workers=1)
    src_lang, tgt_lang, lines = halves(family)[1]
    assert translator.decoder_languages and tgt_lang in translator.target_languages
    got = translator.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)
    src, src_mask = our_ids(loaded, lines, src_lang)
    code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
    hyps = beam_search(loaded.model, src, src_mask, beam_size=4, alpha=1.0, max_len_a=0, max_len_b=12,
                       prefix=torch.full((len(lines), 1), code), scoring="huggingface")
    assert [t.hypotheses[0].text for t in got] == [loaded.tgt_vocab.decode(t[1:]) for t in hyps.tokens]
    torch.testing.assert_close(torch.tensor([t.hypotheses[0].score for t in got]), hyps.scores)
    prepared = translator.prepare(Request(lines, tgt_lang, src_lang=src_lang))
    ids = [loaded.tgt_vocab.encode(t.hypotheses[0].text) for t in got]
    scored = translator.score(prepared.sources, [t.hypotheses[0].text for t in got], lead=prepared.lead)
    forced = [(torch.tensor(v).sum() / (len(v) + 1)).item() for v in scored]  # the code scored 0, as in the search
    # text that encodes back to its ids and ended before the cap (the forced EOS scores 0 in the search)
    kept = [i for i, (a, b) in enumerate(zip(ids, hyps.tokens)) if a == b[1:] and len(b) < 11]
    assert len(kept) >= 3  # random outputs full of fillers (madeupword, <mask>) do not encode back
    torch.testing.assert_close(torch.tensor(forced)[kept], hyps.scores[kept], atol=1e-4, rtol=1e-4)
    for options, message in (({"tgt_lang": tgt_lang}, "src_lang: this model reads the source language first"),
                             ({"src_lang": src_lang}, "tgt_lang: this model reads the source language first"),
                             ({"src_lang": src_lang, "tgt_lang": "xx"}, "tgt_lang=xx: unknown language code")):
        with pytest.raises(RequestError, match=f"^{message}") as refused:
            translator.translate(lines[:2], **options)
        assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def exported(pair, tmp_path_factory):
    """The imported file of ``pair`` exported with ``nmt-export format=ctranslate2`` (fp32)."""
    pytest.importorskip("ctranslate2")
    from nmt.exporters.ctranslate2 import to_ctranslate2

    hf, tokenizer, loaded, folder, family = pair
    return to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config,
                          tmp_path_factory.mktemp(f"{family}_ct2") / "ct2")


def both_backends(loaded, exported, decoding: dict):
    """The torch Translator on ``loaded`` and the CTranslate2 backend on its export, one decoding."""
    from nmt.inference.ctranslate2 import CTranslate2Translator
    from nmt.inference.translator import Translator

    return (Translator(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, decoding, workers=1),
            CTranslate2Translator(exported, decoding, device="cpu", workers=1, intra_threads=1))


PER_TOKEN = 0.015  # CTranslate2's log-probs renormalised without PAD: up to 0.0126 higher a token (mBART's folder)


@pytest.mark.parametrize("search, early_stopping, floor", [("greedy", None, 39), ("beam", True, 35), ("beam", False, 20)],
                         ids=["greedy", "beam", "beam_early_stopping_false"])
def test_ctranslate2_export_translates_as_the_torch_translator(pair, exported, search, early_stopping, floor):
    """``nmt-export format=ctranslate2`` of the imported file: the CTranslate2 backend takes
    ``src_lang`` and ``tgt_lang`` as the torch Translator does (the source code a tag, the target
    code CTranslate2's ``target_prefix``, cut from the text) and gives its greedy translations of
    the 40 sentences in two directions, cap 12, with its log-probs within ``PER_TOKEN`` a token once
    the code's is taken out (CTranslate2 scores the forced code 0, as transformers), for the
    outputs that end before the cap (at the cap CTranslate2 stops without the EOS ours forces). Beam 4,
    ``scoring=huggingface`` (score / length ** 1.0, CTranslate2's own length penalty) with
    ``early_stopping=true``, CTranslate2's stopping rule: at least 35 of 40 equal (measured 35, 35,
    39; every M2M100 and NLLB difference a sentence where EOS is the 2nd to 4th token after the
    code, which CTranslate2 lets end only from the best candidate), scores within 1e-2. With the
    folder's ``early_stopping=false`` (transformers' default: a sentence searches on while its best
    live hypothesis could still win) CTranslate2 still stops once 4 hypotheses have ended: at least
    20 of 40 (measured 30, 21, 32)."""
    hf, tokenizer, loaded, folder, family = pair
    decoding = {"_target_": f"nmt.decoding.search.{search}_search", "max_len_a": 0, "max_len_b": 12}
    if search == "beam":
        decoding.update(beam_size=4, alpha=1.0, scoring="huggingface", early_stopping=early_stopping)
    ours, theirs = both_backends(pair[2], exported, decoding)
    assert theirs.decoder_languages and theirs.target_languages == ours.target_languages
    same, total, compared, largest, offset = 0, 0, 0, 0.0, 0.0
    for src_lang, tgt_lang, lines in halves(family):
        mine = ours.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)
        got = theirs.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)
        src, src_mask = our_ids(loaded, lines, src_lang)
        code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        with torch.no_grad():  # the code's log-prob, which ours counts in greedy search, and the outputs' lengths
            first = loaded.model(src, src_mask, torch.full((len(lines), 1), BOS))[:, 0]
            ended = [len(t) < 11 for t in greedy_search(loaded.model, src, src_mask, max_len_a=0, max_len_b=12,
                                                        prefix=torch.full((len(lines), 1), code)).tokens]
        code_logprob = first.log_softmax(-1)[:, code] if search == "greedy" else torch.zeros(len(lines))
        offset = max(offset, code_logprob.abs().max().item())
        for a, b, c, end in zip(mine, got, code_logprob.tolist(), ended):
            total += 1
            if a.text != b.text:
                continue
            same += 1
            if search == "greedy" and not end:  # CTranslate2's logprob lacks the EOS ours forces at the cap
                continue
            compared += 1
            tokens = len(loaded.tgt_vocab.encode(a.text)) + 1  # EOS
            limit = PER_TOKEN * tokens if search == "greedy" else 1e-2
            assert b.hypotheses[0].score == pytest.approx(a.hypotheses[0].score - c, abs=limit)
            largest = max(largest, abs(b.hypotheses[0].score - a.hypotheses[0].score + c))
    taken_out = f" (the code's log-prob, down to -{offset:.2f}, taken out)" if search == "greedy" else ""
    print(f"{family} {search} (early_stopping={early_stopping}): {same}/{total} equal, max score difference "
          f"{largest:.2e} over {compared}{taken_out}")
    assert same >= floor and compared >= 15


@pytest.mark.parametrize("reads_eos", [True, False], ids=["start_from_eos", "own_bos_row"])
def test_ctranslate2_export_starts_the_decoder_from_the_row_ours_reads(pair, tmp_path, reads_eos):
    """The decoder's first input. With ``start_from_eos`` (an import, and a run fine-tuned from one)
    BOS reads ``</s>``'s row whatever the BOS row holds, and the export writes that row as BOS's; a
    file imported before ``start_from_eos`` (its BOS row a copy of ``</s>``'s) and a run fine-tuned
    from it (the row trained apart) read their own BOS row, which the export keeps. Here the BOS row
    is moved at random and ``</s>``'s too (as training moves it): our greedy translations and
    CTranslate2's agree on the 40 sentences either way; moving the BOS row changes none of ours with
    ``start_from_eos`` and some without. The model's one vocabulary table (shared, tied) stays one
    in the export."""
    import copy
    import dataclasses

    from nmt.data.tokenizer import BOS, EOS
    from nmt.exporters.ctranslate2 import build_spec, to_ctranslate2

    hf, tokenizer, loaded, folder, family = pair
    model = copy.deepcopy(loaded.model)
    assert model.decoder.embed_tokens.start_from_eos
    generator = torch.Generator().manual_seed(0)
    table = model.decoder.embed_tokens.embed.weight
    with torch.no_grad():
        table[EOS].add_(0.1 * torch.randn(table.size(1), generator=generator))
        tuned = copy.deepcopy(model)
        table[BOS].add_(torch.randn(table.size(1), generator=generator))
    model.decoder.embed_tokens.start_from_eos = reads_eos  # off: the decoder reads the BOS row, as an older import
    run_config = {**loaded.run_config, "languages": {"source": "tag", "target": "decoder_prefix"}}
    run_config.pop("test_decoding")  # a fine-tuned run decodes with its own settings
    spec = build_spec(model, loaded.src_vocab, loaded.tgt_vocab)
    spec.validate()
    spec._alias_variables()
    size = (loaded.tgt_vocab.vocab_size, table.size(1))
    tables = [name for name, value in spec.variables().items() if not isinstance(value, str) and tuple(value.shape) == size]
    assert len(tables) == 1, tables  # the decoder's, the encoder's and the output layer's
    out = to_ctranslate2(model, loaded.src_vocab, loaded.tgt_vocab, run_config, tmp_path / "ct2")
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    ours, theirs = both_backends(dataclasses.replace(loaded, model=model, run_config=run_config), out, greedy)
    before = both_backends(dataclasses.replace(loaded, model=tuned, run_config=run_config), out, greedy)[0]
    same, moved = 0, 0
    for src_lang, tgt_lang, lines in halves(family):
        mine = [t.text for t in ours.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)]
        got = [t.text for t in theirs.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)]
        same += sum(a == b for a, b in zip(mine, got))
        moved += sum(a != t.text for a, t in zip(mine, before.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)))
    print(f"{family}, start_from_eos={reads_eos}: {same}/40 equal, {moved} changed by the BOS row")
    assert same >= 39 and (moved == 0 if reads_eos else moved >= 3)


@pytest.mark.parametrize("family", ["m2m100", pytest.param("mbart", marks=pytest.mark.slow)])  # a training run each
def test_ctranslate2_export_of_a_run_fine_tuned_on_one_direction(family, tmp_path):
    """``train.py init_from=<folder>`` on the tiny corpus (one direction, no ``languages`` record: its
    codes are source tags, as a multilingual nmt model's) moves ``</s>``'s row, which its decoder reads for BOS;
    ``nmt-export format=ctranslate2`` of its last checkpoint gives our greedy translations of the
    40 sentences and our log-probs of their references within ``PER_TOKEN``, and its shared, tied
    vocabulary table is one table in ``model.bin``."""
    from omegaconf import OmegaConf

    from nmt.data.tokenizer import EOS
    from nmt.export import export
    from nmt.exporters.ctranslate2 import build_spec

    pytest.importorskip("ctranslate2")
    folder = m2m100_folder(tmp_path / "hf", family=family)
    ckpt = fine_tuned(folder, tmp_path)
    tuned = load_checkpoint(ckpt)
    table = tuned.model.decoder.embed.weight.detach()
    assert tuned.model.decoder.embed_tokens.start_from_eos and not torch.equal(table[BOS], table[EOS])
    assert tuned.run_config.get("languages") is None
    out = tmp_path / "ct2"
    export(OmegaConf.create({"ckpt": str(ckpt), "format": "ctranslate2", "out": str(out), "weights": "stored",
                             "allow_pickle": False, "quantization": None}))
    spec = build_spec(tuned.model, tuned.src_vocab, tuned.tgt_vocab)
    spec.validate()
    spec._alias_variables()
    tables = [name for name, value in spec.variables().items()
              if not isinstance(value, str) and tuple(value.shape) == tuple(table.shape)]
    ours, theirs = both_backends(tuned, out, {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0,
                                              "max_len_b": 12})
    lines, lang = lines_of("test.src", "valid.src"), PAIRS[family][0][1]  # its codes are source tags here
    assert not theirs.decoder_languages and theirs.target_languages == ours.target_languages
    mine = [t.text for t in ours.translate(lines, tgt_lang=lang)]
    same = sum(a == b.text for a, b in zip(mine, theirs.translate(lines, tgt_lang=lang)))
    print(f"{family}: {same}/{len(lines)} greedy outputs equal ({len(set(mine))} distinct); vocabulary tables in "
          f"model.bin: {tables}")
    assert same >= len(lines) - 1 and len(set(mine)) > 1 and len(tables) == 1
    prepared = ours.prepare(Request(lines, lang))  # the references' per-token log-probs: every position reads BOS
    references = lines_of("test.tgt", "valid.tgt")
    for a, b in zip(ours.score(prepared.sources, references), theirs.score(prepared.sources, references)):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < PER_TOKEN


def test_ctranslate2_export_scores_and_refuses_as_the_torch_translator(pair, exported):
    """``mode=score`` on the folder reads the target code unscored, as the torch Translator: the
    per-token log-probs of the greedy translations agree within ``PER_TOKEN``; a missing or
    unknown language is the torch backend's one-line ``RequestError``; int8 weights translate."""
    from nmt.exporters.ctranslate2 import to_ctranslate2
    from nmt.inference.ctranslate2 import CTranslate2Translator
    from nmt.inference.requests import Request, RequestError

    hf, tokenizer, loaded, folder, family = pair
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    ours, theirs = both_backends(pair[2], exported, greedy)
    src_lang, tgt_lang, lines = halves(family)[1]
    texts = [t.text for t in ours.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)]
    prepared = ours.prepare(Request(lines, tgt_lang, src_lang=src_lang))
    assert theirs.prepare(Request(lines, tgt_lang, src_lang=src_lang)) == prepared
    for a, b in zip(ours.score(prepared.sources, texts, lead=prepared.lead),
                    theirs.score(prepared.sources, texts, lead=prepared.lead)):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < PER_TOKEN
    for options in ({"tgt_lang": tgt_lang}, {"src_lang": src_lang}, {"src_lang": src_lang, "tgt_lang": "xx"}):
        with pytest.raises(RequestError) as torch_refused:
            ours.translate(lines[:2], **options)
        with pytest.raises(RequestError) as refused:
            theirs.translate(lines[:2], **options)
        assert str(refused.value) == str(torch_refused.value) and "\n" not in str(refused.value)
    int8 = to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config,
                          exported.parent / "int8", quantization="int8")
    quantized = CTranslate2Translator(int8, greedy, device="cpu", workers=1, intra_threads=1)
    got = quantized.translate(lines, src_lang=src_lang, tgt_lang=tgt_lang)
    assert (int8 / "model.bin").stat().st_size < 0.75 * (exported / "model.bin").stat().st_size
    assert len(got) == len(lines) and all(len(t.hypotheses) == 1 for t in got)
    print(f"{family} int8: {sum(a == t.text for a, t in zip(texts, got))}/{len(lines)} greedy outputs as fp32's")


def test_translate_py_takes_the_languages_on_the_ctranslate2_folder(pair, exported, tmp_path, capsys):
    """``translate.py ckpt=<folder> src_lang=... tgt_lang=...`` writes the backend's greedy text
    (the CTranslate2 backend, chosen by the folder), ``mode=score`` its per-token log-probs of given
    translations (the code read, not scored); without ``src_lang`` the run stops in one line."""
    from tests.conftest import translate_here

    hf, tokenizer, loaded, folder, family = pair
    src_lang, tgt_lang, lines = halves(family)[1]
    source, target = tmp_path / "in.txt", tmp_path / "tgt.txt"
    source.write_text("\n".join(lines[:6]) + "\n")
    common = [f"ckpt={exported}", f"input={source}", "decoding=greedy", "decoding.max_len_a=0", "decoding.max_len_b=12",
              "workers=1", "ctranslate2.intra_threads=1"]
    done = translate_here(capsys, *common, f"src_lang={src_lang}", f"tgt_lang={tgt_lang}")
    assert done.returncode == 0 and "ctranslate2 backend" in done.stderr, done.stderr[-2000:]
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    backend = both_backends(loaded, exported, greedy)[1]
    texts = [t.text for t in backend.translate(lines[:6], src_lang=src_lang, tgt_lang=tgt_lang)]
    assert done.stdout.splitlines() == texts
    target.write_text("\n".join(texts) + "\n")
    scored = translate_here(capsys, *common, f"src_lang={src_lang}", f"tgt_lang={tgt_lang}", "mode=score",
                            f"target={target}", "format=jsonl", "score_tokens=true")
    assert scored.returncode == 0, scored.stderr[-2000:]
    prepared = backend.prepare(Request(lines[:6], tgt_lang, src_lang=src_lang))
    expected = backend.score(prepared.sources, texts, lead=prepared.lead)
    rows = [json.loads(line) for line in scored.stdout.splitlines()]
    assert [row["token_logprobs"] for row in rows] == [[pytest.approx(x, abs=1e-4) for x in v] for v in expected]
    assert [row["tokens"] for row in rows] == [len(loaded.tgt_vocab.encode(t)) + 1 for t in texts]  # + EOS, no code
    refused = translate_here(capsys, *common, f"tgt_lang={tgt_lang}")
    assert refused.returncode != 0 and refused.stdout == "" and "src_lang: this model reads the source language first" \
        in refused.stderr


def test_nmt_serve_takes_the_languages_on_the_ctranslate2_folder(pair, exported):
    """``nmt-serve ckpt=<folder>``: ``/info`` lists the codes and ``reads_src_lang`` as for the
    release file; a request's ``"src_lang"`` and ``"tgt_lang"`` give the backend's text; one
    without ``"src_lang"`` is a 400 naming it."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from nmt.serve.app import create_app, load
    from tests.conftest import serve_cfg

    hf, tokenizer, loaded, folder, family = pair
    src_lang, tgt_lang, lines = halves(family)[0]
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    expected = [t.text for t in both_backends(pair[2], exported, greedy)[1].translate(lines[:4], src_lang=src_lang,
                                                                                   tgt_lang=tgt_lang)]
    cfg = serve_cfg(exported, "decoding=greedy", "decoding.max_len_a=0", "decoding.max_len_b=12",
                    "batching.process=false", "device=cpu", "workers=1", f"tgt_lang={tgt_lang}")
    with TestClient(create_app(load(cfg), cfg)) as client:
        info = client.get("/info").json()
        assert info["backend"] == "ctranslate2" and info["reads_src_lang"]
        assert src_lang in info["target_languages"] and len(info["target_languages"]) == CODES[family]
        reply = client.post("/translate", json={"text": lines[:4], "src_lang": src_lang})
        assert reply.status_code == 200, reply.text
        assert [t["text"] if "text" in t else t["hypotheses"][0]["text"] for t in reply.json()["translations"]] == expected
        refused = client.post("/translate", json={"text": lines[:1]})
        assert refused.status_code == 400 and "src_lang: this model reads the source language first" in refused.text


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    return m2m100_folder(tmp_path_factory.mktemp("nllb_refusals") / "hf", family="nllb")


def test_what_an_nllb_folder_must_hold_is_named_in_one_line(nllb, tmp_path):
    """NllbTokenizer's legacy_behaviour (the source code after </s>) and a folder without the
    SentencePiece model its tokenizer.json was made from are refused in one line."""
    copy = edited(nllb, tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "legacy_behaviour": True}))
    with pytest.raises(ImportRefused, match=r"tokenizer_config.json: legacy_behaviour=true puts the source language "
                                            r"after the sentence's </s>; nmt puts it first"):
        import_folder(copy)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "sentencepiece.bpe.model").unlink()
    with pytest.raises(ImportRefused) as refused:
        import_folder(copy)
    assert str(refused.value) == (f"{copy}/sentencepiece.bpe.model: missing; nmt cuts NLLB text with the SentencePiece "
                                  "model its tokenizer.json was made from (the hub's folders have it)")


def test_translate_py_takes_src_lang_and_tgt_lang(pair, tmp_path, capsys):
    """``translate.py ckpt=<imported> src_lang=... tgt_lang=...`` writes the Translator's text for
    each line (greedy here), and ``mode=score`` scores given translations; without ``src_lang`` the
    run stops before any output, in one line."""
    from nmt.inference.translator import Translator
    from tests.conftest import translate_here

    hf, tokenizer, loaded, folder, family = pair
    src_lang, tgt_lang, lines = halves(family)[0]
    ckpt, source = tmp_path / "model.ckpt", tmp_path / "in.txt"
    atomic_save(import_folder(folder), ckpt)
    source.write_text("\n".join(lines[:6]) + "\n")
    common = [f"ckpt={ckpt}", f"input={source}", "decoding=greedy", "decoding.max_len_a=0", "decoding.max_len_b=12",
              "device=cpu", "kernels=reference", "precision=32", "workers=1"]
    done = translate_here(capsys, *common, f"src_lang={src_lang}", f"tgt_lang={tgt_lang}")
    assert done.returncode == 0, done.stderr[-2000:]
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    translator = Translator(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, greedy, workers=1)
    expected = [t.hypotheses[0].text for t in translator.translate(lines[:6], src_lang=src_lang, tgt_lang=tgt_lang)]
    assert done.stdout.splitlines() == expected
    target = tmp_path / "tgt.txt"
    target.write_text("\n".join(expected) + "\n")
    scored = translate_here(capsys, *common, f"src_lang={src_lang}", f"tgt_lang={tgt_lang}", "mode=score",
                            f"target={target}")
    assert scored.returncode == 0 and len(scored.stdout.splitlines()) == 6, scored.stderr[-2000:]
    refused = translate_here(capsys, *common, f"tgt_lang={tgt_lang}")
    assert refused.returncode != 0 and refused.stdout == "" and "src_lang: this model reads the source language first" \
        in refused.stderr


def test_evaluate_takes_src_lang_and_tgt_lang(folder, tmp_path, capsys):
    """``evaluate.py ckpts=[<imported>] data=tiny src_lang=de tgt_lang=fr`` writes translate.py's
    hypotheses with the same languages; without them, or given to a model that does not read
    them (a hypothesis file alone), the run stops in one line before any output."""
    from tests.conftest import ROOT, evaluate_here, translate_here

    ckpt = tmp_path / "model.ckpt"
    atomic_save(import_folder(folder), ckpt)
    decoding = ["decoding.max_len_a=0", "decoding.max_len_b=12", "device=cpu", "kernels=reference", "precision=32"]
    quick = ["data=tiny", "reordering=false", "word_frequency=false", "n_bootstrap=0", "significance.bootstrap=0",
             "significance.randomization=0", *decoding]
    done = evaluate_here(capsys, tmp_path / "eval", f"ckpts={{m2m: {ckpt}}}", "src_lang=de", "tgt_lang=fr", *quick)
    assert done.returncode == 0, done.stderr[-2000:]
    hyps = (tmp_path / "eval" / "m2m.hyp.txt").read_text().splitlines()
    translated = translate_here(capsys, f"ckpt={ckpt}", f"input={ROOT / 'tests/data/tiny/test.src'}", "src_lang=de",
                                "tgt_lang=fr", "workers=1", *decoding)
    assert translated.returncode == 0, translated.stderr[-2000:]
    assert hyps == translated.stdout.splitlines() and len(hyps) == 20 and len(set(hyps)) > 1
    missing = evaluate_here(capsys, tmp_path / "eval2", f"ckpts={{m2m: {ckpt}}}", "tgt_lang=fr", *quick)
    assert missing.returncode == 2 and missing.stdout == "", missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("error: ckpts: m2m: src_lang: this model reads the "
                                                               "source language first")
    hyp_file = ROOT / "tests/data/tiny/test.tgt"
    unread = evaluate_here(capsys, tmp_path / "eval3", f"hyps={{a: {hyp_file}}}", "src_lang=de", "tgt_lang=fr", *quick)
    assert unread.returncode == 2 and unread.stdout == "", unread.stderr
    assert unread.stderr.strip().splitlines()[-1].startswith("error: src_lang=de, tgt_lang=fr: read only by a model "
                                                             "that writes the target language")


def test_nmt_serve_takes_src_lang_and_tgt_lang(pair, tmp_path):
    """``nmt-serve`` on the imported file: a request's ``"src_lang"`` and ``"tgt_lang"`` (or the
    server's defaults) give translate.py's text; a request without a source language is a 400
    naming it; ``/info`` lists the model's language codes."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from nmt.inference.translator import Translator
    from nmt.serve.app import create_app, load
    from tests.conftest import serve_cfg

    hf, tokenizer, loaded, folder, family = pair
    src_lang, tgt_lang, lines = halves(family)[0]
    ckpt = tmp_path / "model.ckpt"
    atomic_save(import_folder(folder), ckpt)
    greedy = {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0, "max_len_b": 12}
    translator = Translator(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, greedy, workers=1)
    expected = [t.hypotheses[0].text for t in translator.translate(lines[:4], src_lang=src_lang, tgt_lang=tgt_lang)]
    cfg = serve_cfg(ckpt, "decoding=greedy", "decoding.max_len_a=0", "decoding.max_len_b=12", "batching.process=false",
                    "device=cpu", "kernels=reference", "precision=32", f"tgt_lang={tgt_lang}")
    with TestClient(create_app(load(cfg), cfg)) as client:
        reply = client.post("/translate", json={"text": lines[:4], "src_lang": src_lang})
        assert reply.status_code == 200, reply.text
        assert [t["text"] if "text" in t else t["hypotheses"][0]["text"] for t in reply.json()["translations"]] == expected
        refused = client.post("/translate", json={"text": lines[:1]})
        assert refused.status_code == 400 and "src_lang: this model reads the source language first" in refused.text
        info = client.get("/info").json()
        assert src_lang in info["target_languages"] and tgt_lang in info["target_languages"] and info["reads_src_lang"]


@pytest.fixture(scope="module")
def mbart(tmp_path_factory):
    return m2m100_folder(tmp_path_factory.mktemp("mbart_refusals") / "hf", family="mbart")


@pytest.mark.parametrize("changes, message", [
    ({"normalize_before": False}, "config.json: normalize_before=False: nmt computes mBART with normalize_before=True"),
    ({"add_bias_logits": True}, "config.json: add_bias_logits=True: nmt computes mBART with add_bias_logits=False"),
    ({"scale_embedding": False}, "config.json: scale_embedding=False: nmt scales embeddings by sqrt(d_model)"),
    ({"max_position_embeddings": 32}, "model.safetensors: model.decoder.embed_positions.weight has shape (66, 32), "
                                      "config.json's model needs (34, 32)"),
], ids=["post_norm", "bias_logits", "unscaled", "positions"])
def test_what_an_mbart_folder_must_hold_is_named_in_one_line(mbart, tmp_path, changes, message):
    copy = edited(mbart, tmp_path, **changes)
    with pytest.raises(ImportRefused) as refused:
        import_folder(copy)
    text = str(refused.value)
    assert text.startswith(f"{copy}/{message.split(':')[0]}") and message in text and "\n" not in text, text


def test_an_mbart_tokenizer_that_puts_the_language_last_is_refused(mbart, tmp_path):
    """mBART's MBartTokenizer (mbart-large-cc25: the source code after </s>) is refused in one line."""
    copy = edited(mbart, tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "MBartTokenizer"}))
    with pytest.raises(ImportRefused, match=r"tokenizer_config.json: tokenizer_class=MBartTokenizer: nmt reads "
                                            r"mBART-50's MBart50Tokenizer \(the source language first\)"):
        import_folder(copy)


@pytest.mark.slow
def test_multilingual_fine_tuning_writes_the_models_own_codes(folder, tmp_path):
    """``init_from=<M2M100 folder>`` on a multilingual corpus (de-fr, en-fr) trains as the model
    reads its languages: each source starts with its own language's code ``▁<2de>``, each target
    with the target's ``▁<2fr>`` (after BOS: the decoder's first token), both the folder's pieces
    (nmt's ``<2fr>`` tags are not in its vocabulary); the references are scored without it, and the
    run's checkpoint translates with ``src_lang`` and ``tgt_lang`` as the imported file does, and so
    does its CTranslate2 export (the same greedy text of the validation sources)."""
    from pytorch_lightning import Callback

    from nmt.inference.translator import Translator
    from tests.conftest import TINY, compose_run, train_with_callbacks
    from tests.test_multilingual import corpus

    class FirstBatch(Callback):
        batch = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.batch = self.batch or {k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}
            self.vocab, self.refs = trainer.datamodule.src_vocab, trainer.datamodule.raw("valid")[1]

    data = corpus(tmp_path / "corpus", {"train": 40, "val": 6, "test": 4})
    seen = FirstBatch()
    tiny = [o for o in TINY if not o.startswith(("data=", "model."))]
    cfg = compose_run("train", tmp_path / "run", [*tiny, "data=multi30k_multilingual", f"data.source.path={data}",
                                                   "data.source.directions=[de-fr,en-fr]", "data.source.zero_shot=[]",
                                                   "data.source.splits.test=test", "data.max_tokens=256",
                                                   f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=3",
                                                   "trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null",
                                                   "data.val_sample=null", "optimizer.lr=1e-6", "decoding@test_decoding=greedy"],
                      cache_dir=tmp_path / "cache")
    train_with_callbacks(cfg, [seen])
    sp = seen.vocab.sp
    codes = {lang: sp.piece_to_id(f"\u2581{tag(lang)}") for lang in ("de", "en", "fr")}
    assert sp.unk_id() not in codes.values() and sp.piece_to_id(tag("fr")) == sp.unk_id()  # ▁<2fr>, not <2fr>
    assert set(seen.batch["src"][:, 0].tolist()) <= {codes["de"], codes["en"]}  # each source's own language
    assert set(seen.batch["tgt_in"][:, 1].tolist()) == {codes["fr"]}  # BOS, then the target's code
    assert set(seen.batch["tgt_out"][:, 0].tolist()) == {codes["fr"]}
    ckpt = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    translator = Translator.load(ckpt, device="cpu", workers=1)
    assert translator.decoder_languages and translator.run_config["data"]["source"]["target_language"] == "decoder_prefix"
    out = translator.translate(["hund katze"], src_lang="de", tgt_lang="fr")[0].hypotheses[0].text
    assert not out.startswith("<2")  # the forced code is cut from the text
    assert seen.refs == 2 * (data / "val.fr").read_text().splitlines()  # de-fr, en-fr: scored without the code
    run = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert run["validation"]["runs"][-1]["sentences"] == 12 and run["steps"] == 3
    # the run's test forces each target's code as translate.py does: the same outputs (the folder's
    # random weights, barely moved, do not write the code first by themselves)
    fp32 = Translator.load(ckpt, device="cpu", workers=1, precision="32",
                           decoding={"_target_": "nmt.decoding.search.greedy_search"})
    ours = [t.text for lang in ("de", "en")
            for t in fp32.translate((data / f"test.{lang}").read_text().splitlines(), src_lang=lang, tgt_lang="fr")]
    assert (Path(cfg.paths.output_dir) / "test_hyps.txt").read_text().splitlines() == ours and any(ours)
    if importlib.util.find_spec("ctranslate2") is not None:
        from nmt.exporters.ctranslate2 import to_ctranslate2

        tuned = load_checkpoint(ckpt)
        exported = to_ctranslate2(tuned.model, tuned.src_vocab, tuned.tgt_vocab, tuned.run_config, tmp_path / "ct2")
        greedy = {"_target_": "nmt.decoding.search.greedy_search"}
        ours, theirs = both_backends(tuned, exported, greedy)
        sources = (data / "val.de").read_text().splitlines()
        assert [t.text for t in theirs.translate(sources, src_lang="de", tgt_lang="fr")] == \
            [t.text for t in ours.translate(sources, src_lang="de", tgt_lang="fr")]


def fine_tuned(folder: Path, tmp_path: Path, *overrides: str, lr: float = 0.003) -> Path:
    """The last checkpoint of ``train.py init_from=<folder>``: four AdamW steps (weight decay 0.01,
    label smoothing 0.1) at a high learning rate on the tiny corpus."""
    from nmt.train import train
    from tests.conftest import compose_train

    cfg = compose_train(tmp_path / "run", [f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=4",
                                           "trainer.limit_val_batches=0", "test=false", "optimizer=adamw",
                                           f"optimizer.lr={lr}", "scheduler.warmup_steps=1", *overrides],
                        model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def nmt_export(ckpt: Path, out: Path) -> Path:
    """``nmt-export ckpt=<ckpt> format=huggingface out=<out>``'s body."""
    from omegaconf import OmegaConf

    from nmt.export import export

    export(OmegaConf.create({"ckpt": str(ckpt), "format": "huggingface", "out": str(out), "weights": "stored",
                             "allow_pickle": False}))
    return out


def exported_as_ours(tuned, base, out: Path, family: str) -> dict:
    """The exported folder against the fine-tuned checkpoint ``tuned`` on the 40 sentences: the
    largest teacher-forced logit difference (every entry but BOS), how many greedy and beam outputs
    (beam 4, length penalty 1.0, cap 12) ``generate()`` gives as ours, and how many beam outputs the
    tuning changed from ``base``'s; importing the folder again gives ``tuned``'s weights bit for
    bit (the BOS row, never read, a copy of ``</s>``'s)."""
    hf, tokenizer = load_hf(out, family)
    order = order_of(tokenizer, family, out, tuned)
    found = {"largest": 0.0, "greedy": 0, "beam": 0, "total": 0, "changed": 0}
    for src_lang, tgt_lang, lines in halves(family):
        tokenizer.src_lang = src_lang
        batch = tokenizer(lines, return_tensors="pt", padding=True)
        src, src_mask = our_ids(tuned, lines, src_lang)
        assert order[src].masked_fill(~src_mask, 1).tolist() == batch["input_ids"].tolist()
        code = tuned.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        targets = [[BOS, code, *tuned.tgt_vocab.encode(line)[:8]] for line in lines_of("test.tgt")[: len(lines)]]
        tgt_in = torch.tensor([t[: min(map(len, targets))] for t in targets])
        with torch.no_grad():
            ours = tuned.model(src, src_mask, tgt_in)
            theirs = hf(**batch, decoder_input_ids=order[tgt_in]).logits[..., order]
        kept = torch.arange(ours.size(-1)) != BOS
        found["largest"] = max(found["largest"], (ours - theirs)[..., kept].abs().max().item())
        prefix = torch.full((len(lines), 1), code)
        greedy = greedy_search(tuned.model, src, src_mask, max_len_a=0, max_len_b=12, prefix=prefix).tokens
        beam = beam_search(tuned.model, src, src_mask, beam_size=4, alpha=1.0, max_len_a=0, max_len_b=12,
                           prefix=prefix, scoring="huggingface").tokens
        before = beam_search(base.model, src, src_mask, beam_size=4, alpha=1.0, max_len_a=0, max_len_b=12,
                             prefix=prefix, scoring="huggingface").tokens
        found["changed"] += sum(b != o for b, o in zip(before, beam))
        for search, ours_out, generate in (("greedy", greedy, {"num_beams": 1}), ("beam", beam, {
                "num_beams": 4, "length_penalty": 1.0, "early_stopping": False})):  # the run's own beam is 5
            theirs_out = their_outputs(hf, tokenizer, family, lines, src_lang, tgt_lang, order, max_new_tokens=12,
                                       **generate)
            found[search] += sum(o == t for o, t in zip(ours_out, theirs_out))
        found["total"] += len(lines)
    again = import_folder(out)["state_dict"]
    mine = {f"model.{k}": v for k, v in tuned.model.state_dict().items()}
    assert again.keys() == mine.keys()
    for name, value in mine.items():
        if name.endswith("embed.weight") or name == "model.decoder.out.weight":  # one tied table: BOS's row aside
            assert torch.equal(again[name][EOS], again[name][BOS]) and torch.equal(again[name][kept], value[kept]), name
        elif name == "model.decoder.out.bias":  # mBART: the BOS entry, never read, is the import's NEVER
            assert torch.equal(again[name][kept], value[kept]), name
        else:
            assert torch.equal(again[name], value), name
    return found


@pytest.mark.parametrize("family", ["m2m100", *(pytest.param(f, marks=pytest.mark.slow) for f in ("nllb", "mbart"))])
def test_a_fine_tuned_model_exports_to_the_class_it_came_from(family, tmp_path):
    """``train.py init_from=<folder>`` trains the imported model as the class computes it (its
    decoder starts from ``</s>``'s row, BOS never an output: ``start_from_eos``; M2M100 without a
    logits bias, mBART's trained), so ``nmt-export format=huggingface`` writes the tuned model
    back: its logits equal ours within 1e-4 on the 40 sentences teacher-forced, ``generate()``
    gives our greedy and beam outputs, and importing the folder again gives the tuned weights bit
    for bit (the BOS row, never read, aside)."""
    folder = m2m100_folder(tmp_path / "hf", family=family)
    imported = import_folder(folder)["state_dict"]
    base = load_checkpoint_of(imported, folder, tmp_path)
    decoder = base.run_config["model"]["decoder"]
    assert decoder["start_from_eos"] and decoder["logits_bias"] == (family == "mbart")
    ckpt = fine_tuned(folder, tmp_path)
    tuned = load_checkpoint(ckpt)
    table = tuned.model.decoder.embed.weight.detach()
    eos_moved = (table[EOS] - imported["model.decoder.embed.weight"][EOS]).abs().max().item()
    assert eos_moved > 1e-3 and not torch.equal(table[BOS], table[EOS])  # what an export from a BOS row refused
    if family == "mbart":
        assert not torch.equal(tuned.model.decoder.out.bias[EOS:], imported["model.decoder.out.bias"][EOS:])
    found = exported_as_ours(tuned, base, nmt_export(ckpt, tmp_path / "out"), family)
    print(f"{family}: greedy {found['greedy']}/{found['total']}, beam {found['beam']}/{found['total']} equal to "
          f"generate(); max logit difference {found['largest']:.2e}; the </s> row moved {eos_moved:.3f}; "
          f"{found['changed']} beam outputs changed by the tuning")
    assert found["largest"] < 1e-4 and found["greedy"] == found["beam"] == found["total"] and found["changed"] >= 5


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["module.lora.rank=4", "module.lora.targets=[q,k,v,out]"],
                                       ["module.freeze=[embeddings]"]], ids=["lora", "frozen_embeddings"])
def test_a_lora_or_frozen_embeddings_run_exports_too(folder, tmp_path, overrides):
    """A run fine-tuned from an imported M2M100 with LoRA adapters on every attention map (merged
    into the weights when its checkpoint is read) or with its embeddings frozen exports as the
    plain run does: ``generate()`` gives our greedy and beam outputs, the logits are equal, and
    importing the folder again gives the tuned weights."""
    imported = import_folder(folder)["state_dict"]
    base = load_checkpoint_of(imported, folder, tmp_path)
    ckpt = fine_tuned(folder, tmp_path, *overrides, lr=0.03 if "lora" in overrides[0] else 0.003)  # B starts at 0
    tuned = load_checkpoint(ckpt)
    table = tuned.model.decoder.embed.weight.detach()
    assert torch.equal(table, imported["model.decoder.embed.weight"])  # both leave the embeddings as they were
    found = exported_as_ours(tuned, base, nmt_export(ckpt, tmp_path / "out"), "m2m100")
    print(f"{overrides[0]}: greedy {found['greedy']}/{found['total']}, beam {found['beam']}/{found['total']}; max "
          f"logit difference {found['largest']:.2e}; {found['changed']} beam outputs changed by the tuning")
    assert found["largest"] < 1e-4 and found["greedy"] == found["beam"] == found["total"] and found["changed"] >= 5


def load_checkpoint_of(state: dict, folder: Path, tmp_path: Path):
    """``import_folder(folder)`` saved and loaded (``state``: its weights, for the caller's checks)."""
    release = import_folder(folder)
    assert release["state_dict"].keys() == state.keys()
    atomic_save(release, tmp_path / "imported.ckpt")
    return load_checkpoint(tmp_path / "imported.ckpt")


def previous_layout(release: dict) -> dict:
    """The release file the import wrote before ``start_from_eos``: a BOS row copying ``</s>``'s
    (as ``release``'s) and a logits bias (M2M100: zeros) of ``NEVER`` at BOS keeping it out of the
    softmax."""
    from nmt.specials import NEVER

    model = json.loads(json.dumps(release["run_config"]["model"]))
    del model["decoder"]["start_from_eos"]
    model["decoder"]["logits_bias"] = True
    state = dict(release["state_dict"])
    table = state["model.decoder.embed.weight"]
    assert torch.equal(table[BOS], table[EOS])
    if "model.decoder.out.bias" not in state:
        state["model.decoder.out.bias"] = torch.zeros(table.size(0)).index_fill_(0, torch.tensor([BOS]), NEVER)
    return {**release, "state_dict": state, "run_config": {**release["run_config"], "model": model}}


def test_a_file_imported_before_start_from_eos_translates_and_tunes_as_before(folder, tmp_path):
    """A release file of the previous import (BOS a copy of the </s> row, a logits bias of NEVER
    at BOS, no ``start_from_eos``) loads and gives the logits (all but BOS's) and greedy outputs of
    today's import; it exports as it did; ``init_from`` fine-tunes it, and its tuned run, whose BOS
    row training moved apart from ``</s>``'s, is refused by the export in one line."""
    from nmt.exporters.huggingface import to_huggingface

    release = import_folder(folder)
    atomic_save(release, tmp_path / "new.ckpt")
    atomic_save(previous_layout(release), tmp_path / "old.ckpt")
    new, old = load_checkpoint(tmp_path / "new.ckpt"), load_checkpoint(tmp_path / "old.ckpt")
    assert old.model.decoder.out.bias is not None and not old.model.decoder.start_from_eos
    for src_lang, tgt_lang, lines in halves("m2m100"):
        src, src_mask = our_ids(new, lines, src_lang)
        prefix = torch.full((len(lines), 1), new.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}"))
        tgt_in = torch.cat([torch.full_like(prefix, BOS), prefix], dim=1)
        with torch.no_grad():
            logits = [loaded.model(src, src_mask, tgt_in)[..., torch.arange(len(new.tgt_vocab.sp)) != BOS]
                      for loaded in (new, old)]
        torch.testing.assert_close(*logits, atol=1e-5, rtol=0)
        outputs = [greedy_search(loaded.model, src, src_mask, max_len_a=0, max_len_b=12, prefix=prefix).tokens
                   for loaded in (new, old)]
        assert outputs[0] == outputs[1]
    exported = import_folder(to_huggingface(old.model, old.src_vocab, old.tgt_vocab, old.run_config, tmp_path / "out"))
    assert all(torch.equal(exported["state_dict"][k], release["state_dict"][k]) for k in release["state_dict"])
    tuned = load_checkpoint(fine_tuned(tmp_path / "old.ckpt", tmp_path))
    table = tuned.model.decoder.embed.weight
    assert not tuned.model.decoder.start_from_eos and not torch.equal(table[BOS], table[EOS])
    with pytest.raises(ValueError) as refused:
        to_huggingface(tuned.model, tuned.src_vocab, tuned.tgt_vocab, tuned.run_config, tmp_path / "tuned")
    assert str(refused.value) == (
        "model.decoder.start_from_eos=false: exported only as the M2M100ForConditionalGeneration it was imported from "
        "(its <s> piece, a decoder starting from </s>), and this model is not one (a run fine-tuned from a file "
        "imported before start_from_eos existed trains its BOS apart from </s>: fine-tune from the folder itself); "
        "the model does not export to Hugging Face")


def test_the_training_loss_keeps_bos_out_as_the_model_does(pair):
    """The training loss of an imported model (the output layer applied in the loss kernel) is the
    label-smoothed cross-entropy of the model's own logits, BOS's the constant NEVER and outside the
    smoothing, and no gradient reaches the BOS row (nor, for mBART, the BOS entry of the bias)."""
    import functools

    import torch.nn.functional as F

    from nmt.training.lit_module import TranslationModule

    hf, tokenizer, loaded, folder, family = pair
    model = loaded.model  # in eval mode: no dropout, the same logits in both passes
    try:
        module = TranslationModule(model, optimizer=functools.partial(torch.optim.Adam), label_smoothing=0.1)
        src_lang, tgt_lang, lines = halves(family)[0]
        src, src_mask = our_ids(loaded, lines[:6], src_lang)
        code = loaded.tgt_vocab.sp.piece_to_id(f"\u2581{tag(tgt_lang)}")
        targets = [[code, *loaded.tgt_vocab.encode(line)[:6], EOS] for line in lines_of("test.tgt")[:6]]
        tgt = torch.full((6, max(map(len, targets)) + 1), PAD)
        for i, t in enumerate(targets):
            tgt[i, : len(t) + 1] = torch.tensor([BOS, *t])
        batch = {"src": src, "src_mask": src_mask, "tgt_in": tgt[:, :-1].masked_fill(tgt[:, :-1] == EOS, PAD),
                 "tgt_out": tgt[:, 1:]}
        loss, nll, _ = module.losses(batch)
        logits = model(src, src_mask, batch["tgt_in"])[batch["tgt_out"] != PAD]
        log_probs, target = logits.log_softmax(-1), batch["tgt_out"][batch["tgt_out"] != PAD]
        smoothed = torch.ones(logits.size(-1)).index_fill_(0, torch.tensor([PAD, BOS]), 0)
        want = 0.9 * F.nll_loss(log_probs, target) - 0.1 * (log_probs @ (smoothed / smoothed.sum())).mean()
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nll, F.nll_loss(log_probs, target).detach(), atol=1e-5, rtol=1e-5)
        loss.backward()
        grad = model.decoder.embed.weight.grad
        assert grad[EOS].abs().max() > 0 and torch.count_nonzero(grad[BOS]) == 0
        if model.decoder.out.bias is not None:
            assert torch.count_nonzero(model.decoder.out.bias.grad[BOS]) == 0
    finally:
        for p in model.parameters():
            p.grad = None
