"""nmt.checkpoints.marian: a MarianMTModel folder that ``transformers`` builds (small random weights,
``save_pretrained``, SentencePiece models trained on the tiny corpus, Marian's id order) imports into
a release file whose logits, greedy and beam outputs and token ids equal ``transformers``'; import,
export and import again gives the same weights; what the folder must not hold is refused in one line."""

from __future__ import annotations

import json
import re
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
from nmt.languages.tags import vocabulary_languages, with_target_language  # noqa: E402
from tests.test_export_ctranslate2 import lines_of  # noqa: E402

LANGUAGES = ("fra", "deu", "por_Latn")
EOS_BIAS = 6.0


def _spm(lines: list[str], folder: Path, name: str, size: int) -> Path:
    """A SentencePiece model with SentencePiece's own special ids (unk 0, <s> 1, </s> 2), as Marian's."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / name), vocab_size=size,
                                   hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return folder / f"{name}.model"


def marian_folder(out: Path, *, activation: str = "swish", languages: tuple[str, ...] = (), tied: bool = True,
                  seed: int = 0, generation: dict | None = None, std: float | None = 0.3, dropout: float = 0.1,
                  eos_bias: float = EOS_BIAS) -> Path:
    """A MarianMTModel folder as OPUS-MT's: Marian's vocabulary order (</s> 0, <unk> 1, [>>xxx<< tags],
    the pieces of both SentencePiece models, <pad> last; the decoder starts from <pad>), post-norm,
    scaled embeddings, every weight random (no layer norm an identity) and a non-zero logits bias;
    ``std=None``: transformers' own initialisation (a model that trains), the logits bias still random."""
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
                          tie_word_embeddings=tied, share_encoder_decoder_embeddings=True, dropout=dropout)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if std is not None:
                p.normal_(0.0, std).add_(1.0 if "layer_norm.weight" in name else 0.0)
        model.final_logits_bias.normal_(0.0, 1.0 if std is not None else 0.1)
        model.final_logits_bias[0, 0] += eos_bias  # outputs of every length below the cap, not only cut ones
    model.generation_config.update(**{"bad_words_ids": [[pad]], "num_beams": 4, "length_penalty": 0.0, "max_length": 128,
                                      "renormalize_logits": True, **(generation or {})})
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
    kept = torch.arange(ours.size(-1)) != BOS  # their decoder start <pad> a second time: never in our softmax
    difference = (ours - theirs[..., order])[..., kept].abs().max().item()
    assert ours.abs().max() > 1 and difference < 1e-4, difference
    assert ours[..., BOS].max() < -1000
    torch.testing.assert_close(ours.log_softmax(-1)[..., kept], theirs.log_softmax(-1)[..., order][..., kept],
                               atol=1e-4, rtol=1e-4)
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



def their_outputs(hf, tokenizer, lines: list[str], order: torch.Tensor, **generate) -> list[list[int]]:
    """``generate()``'s tokens under the folder's generation config, in our ids, without the
    decoder start and from EOS on."""
    ours_of = {int(theirs): ours for ours, theirs in reversed(list(enumerate(order.tolist())))}
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, **generate)
    outputs = []
    for row in out[:, 1:].tolist():
        ids = [ours_of[t] for t in row]
        outputs.append(ids[: ids.index(EOS)] if EOS in ids else ids)
    return outputs


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_greedy_and_beam_equal_generate(pair, search):
    """Our greedy search gives ``generate()``'s tokens on the 40 test and validation sources at the
    same cap; our beam search (beam 4, no length penalty: the folder's generation config) gives
    them on every sentence whose output ends before the cap. At the cap the two score the forced
    EOS differently (transformers gives it log-probability 0, ours its own), which can reorder
    hypotheses that both searches cut there."""
    hf, tokenizer, loaded, languages, folder = pair
    theirs_lines, ours_lines = sources(languages)
    order = order_of(folder, loaded)
    src, src_mask = our_ids(loaded, ours_lines)
    cap = 12
    if search == "greedy":
        ours = greedy_search(loaded.model, src, src_mask, max_len_a=0, max_len_b=cap).tokens
        theirs = their_outputs(hf, tokenizer, theirs_lines, order, num_beams=1, max_new_tokens=cap)
    else:
        assert hf.generation_config.num_beams == 4 and hf.generation_config.length_penalty == 0.0
        ours = beam_search(loaded.model, src, src_mask, beam_size=4, alpha=0.0, max_len_a=0, max_len_b=cap).tokens
        theirs = their_outputs(hf, tokenizer, theirs_lines, order, max_new_tokens=cap)
    ended = [len(o) < cap - 1 and len(t) < cap - 1 for o, t in zip(ours, theirs)]
    same = sum(o == t for o, t in zip(ours, theirs))
    print(f"{search}: {same}/{len(ours)} outputs equal, {sum(ended)} ended before the cap")
    if search == "greedy":
        assert same == len(ours)
    else:
        assert sum(ended) >= 30 and all(o == t for o, t, e in zip(ours, theirs, ended) if e)


def test_import_export_import_gives_the_same_weights(pair, tmp_path):
    """``nmt-export format=huggingface`` of the imported model, imported again: the same weights
    (names, shapes, values) and the same vocabularies; the export keeps our id order."""
    hf, tokenizer, loaded, languages, folder = pair
    out = to_huggingface(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, tmp_path / "hf")
    again = imported(out, tmp_path / "again.ckpt")
    first, second = loaded.model.state_dict(), again.model.state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    for side in ("src_vocab", "tgt_vocab"):
        sp, sp2 = getattr(loaded, side).sp, getattr(again, side).sp
        assert [sp.id_to_piece(i) for i in range(sp.get_piece_size())] == [
            sp2.id_to_piece(i) for i in range(sp2.get_piece_size())]
    assert again.run_config["model"] == loaded.run_config["model"]


def edited(folder: Path, tmp_path: Path, name: str, **changes) -> Path:
    """A copy of ``folder`` with keys of its config.json changed (None: removed)."""
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return copy


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return marian_folder(tmp_path_factory.mktemp("refusals") / "hf", tied=False)


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]},
     "config.json: model_type=t5, architectures=['T5ForConditionalGeneration']: nmt imports MarianMTModel "
     "(model_type=marian), M2M100ForConditionalGeneration (m2m_100: M2M100, NLLB-200) and "
     "MBartForConditionalGeneration (mbart: mBART-50); T5, BART and the others compute what nmt does not"),
    ({"model_type": "m2m_100"}, "config.json: model_type=m2m_100, architectures=['MarianMTModel']: nmt imports"),
    ({"normalize_before": True}, "config.json: normalize_before=True: nmt's post-norm Transformer has no such layer "
                                 "norm or bias (a Marian variant nmt does not compute)"),
    ({"scale_embedding": False}, "config.json: scale_embedding=False: nmt scales embeddings by sqrt(d_model), as "
                                 "every OPUS-MT model does"),
    ({"activation_function": "gelu_new"}, "config.json: activation_function=gelu_new: nmt computes relu, gelu, swish, silu"),
    ({"d_model": 10**9}, "config.json: d_model=1000000000 is not a count from 1 to 8,192; refused before any weight is "
                         "allocated"),
    ({"vocab_size": 10**8}, "config.json: vocab_size=100000000 is not a count from 1 to 1,000,000; refused before"),
    ({"encoder_layers": 10**6}, "config.json: encoder_layers=1000000 is not a count from 1 to 64"),
    ({"max_position_embeddings": -1}, "config.json: max_position_embeddings=-1 is not a count from 1 to 65,536"),
    ({"encoder_ffn_dim": 64}, "model.safetensors: model.encoder.layers.0.fc1.bias has shape (48,), config.json's model "
                              "needs (64,)"),
    ({"decoder_layers": 3}, "model.safetensors: model.decoder.layers.2.encoder_attn.k_proj.bias is missing"),
    ({"encoder_layers": 1}, "model.safetensors: model.encoder.layers.1.fc1.bias is not a weight of the MarianMTModel "
                            "config.json describes"),
], ids=["t5", "m2m100", "pre_norm", "unscaled", "gelu_new", "width", "vocabulary", "layers", "positions", "ffn_shape",
        "missing_layer", "extra_layer"])
def test_what_does_not_import_is_refused_in_one_line(folder, tmp_path, changes, message):
    copy = edited(folder, tmp_path, "copy", **changes)
    with pytest.raises(ImportRefused) as refused:
        import_marian(copy)
    text = str(refused.value)
    assert text.startswith(f"{copy}/{message.split(':')[0]}") and message in text and "\n" not in text, text


def test_pickled_weights_are_refused_unless_allowed(folder, tmp_path):
    """A folder with pytorch_model.bin and no model.safetensors: refused in one line; with
    allow_pickle, read with weights_only=True into the same model."""
    from safetensors.torch import load_file

    copy = tmp_path / "pickled"
    shutil.copytree(folder, copy)
    torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    with pytest.raises(ImportRefused) as refused:
        import_marian(copy)
    assert str(refused.value) == (f"{copy}/pytorch_model.bin: refused, pickled weights can run code when loaded and "
                                  "the folder has no model.safetensors; only if you trust it: allow_pickle=true (read "
                                  "with weights_only=True)")
    allowed = import_marian(copy, allow_pickle=True)["state_dict"]
    safe = import_marian(folder)["state_dict"]
    assert allowed.keys() == safe.keys() and all(torch.equal(allowed[k], safe[k]) for k in safe)
    torch.save({"weights": load_file(folder / "model.safetensors"), "code": print}, copy / "pytorch_model.bin")
    with pytest.raises(ImportRefused) as refused:
        import_marian(copy, allow_pickle=True)
    assert str(refused.value) == (f"{copy}/pytorch_model.bin: refused even with allow_pickle=true: it holds more than "
                                  "tensors (it names print), which weights_only=True never loads")


def test_a_missing_folder_or_offline_hub_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        import_marian(tmp_path / "nowhere" / "x" / "y")
    with pytest.raises(ImportRefused, match=r"^src=Helsinki-NLP/opus-mt-xx-yy: not a local folder, and the hub "
                                            r"download failed \("):
        import_marian("Helsinki-NLP/opus-mt-xx-yy")


def test_import_model_writes_a_release_file(folder, tmp_path):
    """``nmt-import``'s body: the release file, read back; a folder as ``out`` refused."""
    from nmt.import_model import import_model

    cfg = {"format": "huggingface", "src": str(folder), "out": str(tmp_path / "model.ckpt"), "allow_pickle": False,
           "revision": None}
    import_model(OmegaConf.create(cfg))
    assert load_checkpoint(tmp_path / "model.ckpt").run_config["model"]["decoder"]["activation"] == "swish"
    with pytest.raises(ValueError, match=r"^out=.*: is a folder; give the release file to write \(model.ckpt\)$"):
        import_model(OmegaConf.create({**cfg, "out": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"^format=fairseq: choose one of huggingface"):
        import_model(OmegaConf.create({**cfg, "format": "fairseq"}))


@pytest.mark.slow
def test_nmt_import_writes_a_release_file_every_command_takes(folder, tmp_path):
    """The command writes a release file that nmt-translate reads, and refuses in one line."""
    import subprocess
    import sys

    out = tmp_path / "model.ckpt"
    done = subprocess.run([sys.executable, "-m", "nmt.import_model", "format=huggingface", f"src={folder}",
                           f"out={out}"], capture_output=True, text=True, timeout=300, env={**_env()})
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = load_checkpoint(out)
    assert loaded.run_config["model"]["decoder"]["logits_bias"] is True
    bad = subprocess.run([sys.executable, "-m", "nmt.import_model", f"src={edited(folder, tmp_path, 'bad', d_model=10**9)}",
                          f"out={tmp_path / 'bad.ckpt'}"], capture_output=True, text=True, timeout=300, env={**_env()})
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "d_model=1000000000" in bad.stderr
    assert not (tmp_path / "bad.ckpt").exists()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_init_from_a_folder_fine_tunes_the_imported_model(folder, tmp_path):
    """``train.py init_from=<folder>``: the folder is imported into the run folder, the run trains
    its architecture (not model=) with its vocabularies from the imported weights, and its
    checkpoints load and record the origin."""
    from nmt.train import train
    from tests.conftest import compose_train

    cfg = compose_train(tmp_path, [f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=2",
                                   "trainer.limit_val_batches=0", "test=false"], model="transformer")
    before = import_marian(folder)["state_dict"]
    train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    assert (run_dir / "init_from.ckpt").is_file() and cfg.init_from == str(run_dir / "init_from.ckpt")
    tuned = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    model_config = tuned.run_config["model"]
    assert model_config["decoder"]["norm"] == "post" and model_config["decoder"]["activation"] == "swish"
    assert model_config["decoder"]["logits_bias"] and not model_config["tie_embeddings"]
    state = tuned.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], state[k.removeprefix("model.")])]
    assert "model.decoder.out.bias" in moved and len(moved) > len(before) // 2  # the bias trains too
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["init_from"]["path"] == str(run_dir / "init_from.ckpt")


def bleu_of(loaded, split: str) -> float:
    """Greedy BLEU of a loaded model on the tiny corpus' ``split``."""
    import sacrebleu

    src, src_mask = our_ids(loaded, lines_of(f"{split}.src"))
    hyps = [loaded.tgt_vocab.decode(t) for t in greedy_search(loaded.model, src, src_mask).tokens]
    return sacrebleu.corpus_bleu(hyps, [lines_of(f"{split}.tgt")]).score


@pytest.mark.slow
def test_fine_tuning_an_imported_model_raises_its_bleu(tmp_path):
    """A random MarianMTModel (swish, logits bias, Marian's ids), fine-tuned from its folder on the
    tiny synthetic corpus for 600 steps: its BLEU on the corpus rises far above the imported
    model's, and on the test sentences above it too."""
    from nmt.train import train
    from tests.conftest import compose_train

    folder = marian_folder(tmp_path / "hf", std=0.15, dropout=0.0)
    model = imported(folder, tmp_path / "model.ckpt")
    before = {split: bleu_of(model, split) for split in ("train", "test")}
    cfg = compose_train(tmp_path, [f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=600",
                                   "trainer.val_check_interval=600", "trainer.check_val_every_n_epoch=null",
                                   "optimizer.lr=0.005", "scheduler.warmup_steps=40", "scheduler.total_steps=600",
                                   "test=false"], model="transformer")
    train(cfg)
    tuned = load_checkpoint(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")
    after = {split: bleu_of(tuned, split) for split in ("train", "test")}
    print(f"BLEU imported -> fine-tuned: train {before['train']:.1f} -> {after['train']:.1f}, "
          f"test {before['test']:.1f} -> {after['test']:.1f}")
    assert after["train"] > before["train"] + 20 and after["test"] > before["test"], (before, after)


def test_the_imported_model_exports_to_ctranslate2(pair, tmp_path):
    """``nmt-export format=ctranslate2`` of the imported model (its activation and logits bias
    included): CTranslate2's greedy search gives our greedy translations, tags and all."""
    pytest.importorskip("ctranslate2")
    from nmt.exporters.ctranslate2 import to_ctranslate2
    from nmt.inference.ctranslate2 import CTranslate2Translator

    hf, tokenizer, loaded, languages, folder = pair
    _, lines = sources(languages)
    out = to_ctranslate2(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, tmp_path / "ct2")
    src, src_mask = our_ids(loaded, lines)
    ours = [loaded.tgt_vocab.decode(t) for t in greedy_search(loaded.model, src, src_mask, max_len_a=0,
                                                                max_len_b=12).tokens]
    backend = CTranslate2Translator(out, {"_target_": "nmt.decoding.search.greedy_search", "max_len_a": 0,
                                          "max_len_b": 12}, device="cpu", max_tokens=256, workers=1, intra_threads=1)
    theirs = [t.text for t in backend.translate(lines)]
    assert sum(a == b for a, b in zip(ours, theirs)) >= len(lines) - 1, [(a, b) for a, b in zip(ours, theirs) if a != b]


def test_the_training_loss_adds_the_logits_bias(pair):
    """The loss of a training step (the output layer and cross-entropy as one kernel, the bias
    folded into the weight) equals cross-entropy of the model's logits, bias included."""
    import torch.nn.functional as F

    from nmt.training.lit_module import TranslationModule

    hf, tokenizer, loaded, languages, folder = pair
    _, lines = sources(languages)
    src, src_mask = our_ids(loaded, lines[:8])
    targets = [[BOS, *loaded.tgt_vocab.encode(line), EOS] for line in lines_of("test.tgt")[:8]]
    tgt = torch.full((8, max(map(len, targets))), PAD)
    for i, t in enumerate(targets):
        tgt[i, : len(t)] = torch.tensor(t)
    batch = {"src": src, "src_mask": src_mask, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
    module = TranslationModule(loaded.model, optimizer=None, label_smoothing=0.0)
    loss, _ = module.loss(batch)
    logits = loaded.model(src, src_mask, batch["tgt_in"])
    assert loaded.model.decoder.out.bias.abs().max() > 0.1
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=PAD))


def test_a_hub_id_goes_through_huggingface_hub(folder, monkeypatch):
    """A hub id is fetched with ``huggingface_hub.snapshot_download`` (here answering with a local
    folder): the files the import reads only, pickled weights only with allow_pickle."""
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    state = import_marian("Helsinki-NLP/opus-mt-aa-bb", revision="main")["state_dict"]
    assert state.keys() == import_marian(folder)["state_dict"].keys()
    repo, revision, patterns = calls[0]
    assert (repo, revision) == ("Helsinki-NLP/opus-mt-aa-bb", "main") and "model.safetensors" in patterns
    assert "pytorch_model.bin" not in patterns
    import_marian("Helsinki-NLP/opus-mt-aa-bb", allow_pickle=True)
    assert "pytorch_model.bin" in calls[1][2]


@pytest.mark.parametrize("separate", [False, True], ids=["joint", "separate_vocabularies"])
def test_our_export_imports_back_to_the_same_model(tmp_path, separate):
    """Our post-norm swish model with a logits bias, exported (``nmt-export format=huggingface``,
    our id order; with separate vocabularies ``target_vocab.json``) and imported: the same logits."""
    from tests.test_export_huggingface import build_sized

    joint = train_sentencepiece(lines_of("train.src", "train.tgt"), tmp_path / "joint", {"vocab_size": 100, "hard_vocab_limit": False})
    src_vocab = tgt_vocab = joint
    overrides = ["model.encoder.norm=post", "model.decoder.norm=post", "model.encoder.activation=swish",
                 "model.decoder.activation=swish", "model.decoder.logits_bias=true"]
    if separate:
        src_vocab = train_sentencepiece(lines_of("train.src"), tmp_path / "src", {"vocab_size": 80, "hard_vocab_limit": False})
        tgt_vocab = train_sentencepiece(lines_of("train.tgt"), tmp_path / "tgt", {"vocab_size": 90, "hard_vocab_limit": False})
        overrides += ["model.share_src_tgt_embeddings=false", "data.tokenizer.joint=false"]
    model, run_config = build_sized(overrides, src_vocab.vocab_size, tgt_vocab.vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    folder = to_huggingface(model, src_vocab, tgt_vocab, run_config, tmp_path / "hf")
    assert (folder / "target_vocab.json").is_file() == separate
    loaded = imported(folder, tmp_path / "model.ckpt")
    lines = lines_of("test.src")
    src, src_mask = our_ids(loaded, lines)
    assert src.tolist() == our_ids(type("L", (), {"src_vocab": src_vocab})(), lines)[0].tolist()
    tgt_in = torch.tensor([[BOS, *tgt_vocab.encode(line)[:6]][:5] for line in lines_of("test.tgt")])
    with torch.no_grad():
        ours = model(src, src_mask, tgt_in)[..., : tgt_vocab.vocab_size]
        theirs = loaded.model(src, src_mask, tgt_in)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_a_vocabulary_holding_the_bos_names_gets_one_it_lacks():
    """A Marian decoder starts from <pad>; our BOS piece takes a name no piece of the vocabulary has,
    even where ``<s>``, ``<nmt_bos>`` and their numbered forms are all taken."""
    from nmt.checkpoints.marian import Vocabulary

    vocab = {"</s>": 0, "<unk>": 1, "<s>": 2, "<nmt_bos>": 3, "<nmt_bos_>": 4, "<nmt_bos_1>": 5, "\u2581a": 6, "<pad>": 7}
    found = Vocabulary(vocab, {"pad": 7, "eos": 0, "start": 7, "unk": 1}, [], Path("hf"))
    assert found.pieces == ["<pad>", "<unk>", "<nmt_bos_2>", "</s>", "<s>", "<nmt_bos>", "<nmt_bos_>", "<nmt_bos_1>",
                            "\u2581a"]


@pytest.mark.parametrize("name", ["vocab.json", "config.json"])
def test_a_folder_file_that_links_to_a_proc_file_is_one_line(folder, tmp_path, name):
    copy = edited(folder, tmp_path, "linked")
    (copy / name).unlink()
    (copy / name).symlink_to("/proc/self/pagemap")
    with pytest.raises(ImportRefused) as refused:
        import_marian(copy)
    assert str(refused.value).startswith(f"{copy / name}: ") and "\n" not in str(refused.value)


@pytest.mark.parametrize("dtype, stored", [(torch.int64, "I64"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
                                           (torch.complex64, "C64")])
def test_weights_stored_as_integers_bools_or_complex_numbers_are_refused(folder, tmp_path, dtype, stored):
    from safetensors.torch import load_file, save_file

    copy = edited(folder, tmp_path, "typed")
    weights = load_file(copy / "model.safetensors")
    weights["final_logits_bias"] = weights["final_logits_bias"].to(dtype)
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(ImportRefused, match=rf"^{re.escape(str(copy))}/model.safetensors: final_logits_bias is stored "
                                            rf"as {stored}; a Marian model's weights are floating point "
                                            r"\(F16, BF16, F32, F64\)$"):
        import_marian(copy)


def _tokenizer_config(copy: Path, **changes) -> None:
    path = copy / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **changes}))


def _byte_fallback(copy: Path) -> None:
    import sentencepiece.sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((copy / "source.spm").read_bytes())
    proto.trainer_spec.byte_fallback = True
    (copy / "source.spm").write_bytes(proto.SerializeToString())


@pytest.mark.parametrize("edit, message", [
    (lambda c: (c / "config.json").write_text(json.dumps({**json.loads((c / "config.json").read_text()),
                                                           "pad_token_id": 0})),
     "vocab.json: config.json's pad_token_id and config.json's eos_token_id are both id 0; a Marian model keeps "
     "padding, the end of a sentence and unknown pieces apart"),
    (lambda c: _tokenizer_config(c, unk_token="</s>"),
     "vocab.json: config.json's eos_token_id and tokenizer_config.json's unk_token '</s>' are both id 0; a Marian "
     "model keeps padding, the end of a sentence and unknown pieces apart"),
    (_byte_fallback, "source.spm: a byte_fallback model without its 256 byte pieces (<0x00> .. <0xFF>); SentencePiece "
                     "cannot load it"),
], ids=["pad_is_eos", "unk_is_eos", "byte_fallback"])
def test_special_ids_that_coincide_and_byte_fallback_without_bytes_are_named(folder, tmp_path, edit, message):
    copy = edited(folder, tmp_path, "specials")
    edit(copy)
    with pytest.raises(ImportRefused) as refused:
        import_marian(copy)
    assert str(refused.value) == f"{copy}/{message}"


@pytest.fixture(scope="module")
def penalised(tmp_path_factory):
    """Two multilingual folders whose generation config asks for transformers' length
    normalisation (length_penalty 1.0, its default), imported, by seed: their model, tokenizer,
    our Loaded and the folder. Their end-of-sentence biases give outputs of mixed lengths (ended
    early, empty, cut at the cap) under the penalties the test gives each."""
    tmp, folders = tmp_path_factory.mktemp("penalised"), {}
    for seed, eos_bias in ((0, 4.5), (1, 3.0)):
        folder = marian_folder(tmp / f"hf{seed}", languages=LANGUAGES, seed=seed, eos_bias=eos_bias,
                               generation={"length_penalty": 1.0, "renormalize_logits": False, "num_beams": 5})
        folders[seed] = (*load_hf(folder), imported(folder, tmp / f"model{seed}.ckpt"), folder)
    return folders


@pytest.mark.parametrize("seed, length_penalty, early_stopping", [(1, 1.0, False), (0, 0.6, False), (1, 2.0, False),
                                                                  (1, 2.0, True), (0, 0.6, "never")])
def test_huggingface_scoring_equals_generate(penalised, seed, length_penalty, early_stopping):
    """``scoring=huggingface`` beam search gives ``generate()``'s outputs and sequence scores on the
    40 test and validation sources (beam 5, cap 12, the cut ones included: the forced EOS scores 0
    in both) for length penalties 1.0 (the folder's), 0.6 and 2.0 and every early-stopping rule; the
    imported file decodes that way by default."""
    from nmt.decoding.settings import SearchSettings

    hf, tokenizer, loaded, folder = penalised[seed]
    theirs_lines, ours_lines = sources(LANGUAGES)
    order = order_of(folder, loaded)
    src, src_mask = our_ids(loaded, ours_lines)
    cap = 12
    ours = beam_search(loaded.model, src, src_mask, beam_size=5, alpha=length_penalty, max_len_a=0, max_len_b=cap,
                       scoring="huggingface", early_stopping=early_stopping)
    generate = {"max_new_tokens": cap, "length_penalty": length_penalty, "early_stopping": early_stopping}
    batch = tokenizer(theirs_lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, **generate, output_scores=True, return_dict_in_generate=True)
    theirs = their_outputs(hf, tokenizer, theirs_lines, order, **generate)
    same = sum(o == t for o, t in zip(ours.tokens, theirs))
    ended = sum(0 < len(t) < cap - 1 for t in theirs)
    print(f"length_penalty {length_penalty}, early_stopping {early_stopping}: {same}/{len(theirs)} outputs equal, "
          f"{ended} ended before the cap, {sum(not t for t in theirs)} empty, max score difference "
          f"{(ours.scores - out.sequences_scores).abs().max():.1e}")
    assert same == len(theirs) and ended >= 2
    torch.testing.assert_close(ours.scores, out.sequences_scores, atol=1e-4, rtol=1e-4)
    tested = loaded.run_config["test_decoding"]
    assert (tested["scoring"], tested["alpha"], tested["beam_size"]) == ("huggingface", 1.0, 5)
    settings = SearchSettings.from_config({"_target_": "nmt.decoding.search.beam_search"}).for_model(
        tested["alpha"], tested["scoring"], tested["early_stopping"])
    assert (settings.scoring, settings.alpha, settings.early_stopping) == ("huggingface", 1.0, False)


@pytest.mark.slow
def test_multilingual_fine_tuning_takes_the_models_own_tags(tmp_path):
    """``init_from=<multilingual Marian folder>`` on a multilingual corpus (en-fr, en-de): the
    target-language tags nmt writes on the source (``<2fr>``) are cut into the folder's own pieces
    (``>>fr<<``, imported as ``▁<2fr>``), which the vocabulary check takes; the run trains and its
    checkpoint translates with ``tgt_lang``."""
    from pytorch_lightning import Callback

    from nmt.inference.translator import Translator
    from tests.conftest import TINY, compose_run, train_with_callbacks
    from tests.test_multilingual import corpus

    class FirstBatch(Callback):
        src = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.src = batch["src"].clone() if self.src is None else self.src
            self.sp = trainer.datamodule.src_vocab.sp

    folder = marian_folder(tmp_path / "hf", languages=("fr", "de"))
    data = corpus(tmp_path / "corpus", {"train": 40, "val": 6, "test": 4})
    seen = FirstBatch()
    tiny = [o for o in TINY if not o.startswith(("data=", "model."))]
    cfg = compose_run("train", tmp_path / "run", [*tiny, "data=multi30k_multilingual", f"data.source.path={data}",
                                                   "data.source.directions=[en-fr,en-de]", "data.source.zero_shot=[]",
                                                   "data.source.splits.test=test", "data.max_tokens=256",
                                                   f"init_from={folder}", "trainer.max_epochs=-1", "trainer.max_steps=2",
                                                   "trainer.limit_val_batches=0", "test=false"], cache_dir=tmp_path / "cache")
    train_with_callbacks(cfg, [seen])
    tags = {seen.sp.piece_to_id(f"\u2581<2{lang}>") for lang in ("fr", "de")}
    assert seen.sp.unk_id() not in tags and set(seen.src[:, 0].tolist()) <= tags
    translator = Translator.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", device="cpu", workers=1)
    assert translator.target_languages == ["de", "fr"] and not translator.decoder_languages
    assert len(translator.translate(["dog cat"], tgt_lang="fr")[0].hypotheses) == 1
