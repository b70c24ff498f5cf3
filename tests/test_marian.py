"""nmt.checkpoints.marian: a MarianMTModel folder that ``transformers`` builds (small random weights,
``save_pretrained``, SentencePiece models trained on the tiny corpus, Marian's id order) imports into
a release file whose logits, greedy and beam outputs and token ids equal ``transformers``'; import,
export and import again gives the same weights; what the folder must not hold is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nmt.checkpoints.files import atomic_save  # noqa: E402
from nmt.checkpoints.loading import load_checkpoint  # noqa: E402
from nmt.checkpoints.marian import ImportRefused, import_marian  # noqa: E402
from nmt.data.tokenizer import BOS, EOS, PAD, train_sentencepiece  # noqa: E402
from nmt.decoding.search import beam_search, greedy_search  # noqa: E402
from nmt.exporters.huggingface import to_huggingface  # noqa: E402
from nmt.languages import vocabulary_languages, with_target_language  # noqa: E402
from tests.test_export_ctranslate2 import lines_of  # noqa: E402

LANGUAGES = ("fra", "deu", "por_Latn")


def _spm(lines: list[str], folder: Path, name: str, size: int) -> Path:
    """A SentencePiece model with SentencePiece's own special ids (unk 0, <s> 1, </s> 2), as Marian's."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / name), vocab_size=size,
                                   hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return folder / f"{name}.model"


def marian_folder(out: Path, *, activation: str = "swish", languages: tuple[str, ...] = (), tied: bool = True,
                  seed: int = 0, generation: dict | None = None) -> Path:
    """A MarianMTModel folder as OPUS-MT's: Marian's vocabulary order (</s> 0, <unk> 1, [>>xxx<< tags],
    the pieces of both SentencePiece models, <pad> last; the decoder starts from <pad>), post-norm,
    scaled embeddings, every weight random (no layer norm an identity) and a non-zero logits bias."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    import sentencepiece as spm

    work = out.parent / f".{out.name}.spm"
    src_model = _spm(lines_of("train.src"), work, "source", 90)
    tgt_model = _spm(lines_of("train.tgt"), work, "target", 100)
    pieces = ["</s>", "<unk>", *[f">>{lang}<<" for lang in languages]]
    for model in (src_model, tgt_model):
        sp = spm.SentencePieceProcessor(model_file=str(model))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                   if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in pieces]
    pieces.append("<pad>")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    (work / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = MarianTokenizer(str(src_model), str(tgt_model), str(work / "vocab.json"))
    pad = len(pieces) - 1
    config = MarianConfig(vocab_size=len(pieces), d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=40,
                          max_position_embeddings=128, activation_function=activation, scale_embedding=True,
                          pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
                          tie_word_embeddings=tied, share_encoder_decoder_embeddings=True, dropout=0.1)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3).add_(1.0 if "layer_norm.weight" in name else 0.0)
        model.final_logits_bias.normal_(0.0, 1.0)
    model.generation_config.update(bad_words_ids=[[pad]], num_beams=4, length_penalty=0.0, max_length=128,
                                   renormalize_logits=True, **(generation or {}))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.rmtree(work)
    return out


def imported(folder: Path, out: Path, **options):
    atomic_save(import_marian(folder, **options), out)
    return load_checkpoint(out)


def load_hf(folder: Path):
    from transformers import MarianMTModel, MarianTokenizer

    return MarianMTModel.from_pretrained(folder).eval(), MarianTokenizer.from_pretrained(folder)


VARIANTS = {"swish_tied": {}, "relu_untied": {"activation": "relu", "tied": False},
            "gelu_multilingual": {"activation": "gelu", "languages": LANGUAGES}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(their model, their tokenizer, our Loaded, the variant's languages) of one folder."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = marian_folder(tmp / "hf", **VARIANTS[request.param])
    hf, tokenizer = load_hf(folder)
    return hf, tokenizer, imported(folder, tmp / "model.ckpt"), VARIANTS[request.param].get("languages", ()), folder


def sources(languages) -> tuple[list[str], list[str]]:
    """Their source lines (>>xxx<< first for a multilingual model) and ours (tgt_lang's <2xxx> tags)."""
    lines = lines_of("test.src", "valid.src")
    if not languages:
        return lines, lines
    langs = [languages[i % len(languages)] for i in range(len(lines))]
    ours = [with_target_language([line], lang, list(languages))[0] for line, lang in zip(lines, langs)]
    return [f">>{lang}<< {line}" for line, lang in zip(lines, langs)], ours


def our_ids(loaded, lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [loaded.src_vocab.encode(line) + [EOS] for line in lines]
    src = torch.full((len(ids), max(map(len, ids))), PAD)
    for i, seq in enumerate(ids):
        src[i, : len(seq)] = torch.tensor(seq)
    return src, src != PAD


def order_of(folder: Path, loaded) -> torch.Tensor:
    """Their id of each of our ids (through the pieces' names, not the importer's own table)."""
    vocab = json.loads((folder / "vocab.json").read_text())
    sp = loaded.tgt_vocab.sp
    config = json.loads((folder / "config.json").read_text())
    order = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if i in (PAD, BOS):
            order.append(config["pad_token_id"])
        else:
            tag = piece.removeprefix("\u2581<2").removesuffix(">") if piece.startswith("\u2581<2") else None
            order.append(vocab[f">>{tag}<<" if tag else piece])
    return torch.tensor(order)


def test_token_ids_and_logits_equal_transformers(pair):
    """Our tokenizer gives their ids (mapped through the pieces) on 120 test and validation
    sources, and our teacher-forced logits equal theirs within 1e-4 (fp32)."""
    hf, tokenizer, loaded, languages, folder = pair
    theirs_lines, ours_lines = sources(languages)
    order = order_of(folder, loaded)
    batch = tokenizer(theirs_lines, return_tensors="pt", padding=True)
    src, src_mask = our_ids(loaded, ours_lines)
    assert src.shape == batch["input_ids"].shape and order[src].masked_fill(~src_mask, hf.config.pad_token_id).tolist() \
        == batch["input_ids"].tolist()
    assert (src_mask == batch["attention_mask"].bool()).all()
    if languages:
        assert vocabulary_languages(loaded.src_vocab.sp) == sorted(languages)
    targets = [[BOS, *loaded.tgt_vocab.encode(line)[:9]] for line in lines_of("test.tgt", "valid.tgt")]
    width = min(map(len, targets))
    tgt_in = torch.tensor([t[:width] for t in targets])
    with torch.no_grad():
        ours = loaded.model(src, src_mask, tgt_in)
        theirs = hf(**batch, decoder_input_ids=order[tgt_in]).logits
    difference = (ours - theirs[..., order]).abs().max().item()
    assert ours.abs().max() > 1 and difference < 1e-4, difference
    print(f"max logit difference {difference:.2e} over {tuple(ours.shape)}")


def test_decoded_text_equals_transformers(pair):
    """Their tokenizer decodes our target ids (mapped) to our text."""
    hf, tokenizer, loaded, languages, folder = pair
    order = order_of(folder, loaded)
    ids = [loaded.tgt_vocab.encode(line) + [EOS] for line in lines_of("test.tgt", "valid.tgt")]
    theirs = tokenizer.batch_decode([order[torch.tensor(i)].tolist() for i in ids], skip_special_tokens=True)
    assert theirs == [loaded.tgt_vocab.decode(i) for i in ids]
    labels = tokenizer(text_target=lines_of("test.tgt"))["input_ids"]
    assert labels == [order[torch.tensor(loaded.tgt_vocab.encode(line) + [EOS])].tolist() for line in lines_of("test.tgt")]

