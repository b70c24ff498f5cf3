"""nmt.exporters.huggingface: ``transformers`` loads the folder with no nmt code and computes what
our Transformer computes (logits of random models of each class, the tokenizer's ids, greedy
outputs of a trained model), refuses what no class expresses in one line, and never overwrites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nmt.checkpoints.loading import load_checkpoint  # noqa: E402
from nmt.data.tokenizer import BOS, EOS, PAD, train_sentencepiece  # noqa: E402
from nmt.decoding.search import greedy_search  # noqa: E402
from nmt.export import export  # noqa: E402
from nmt.exporters.huggingface import to_huggingface  # noqa: E402
from nmt.train import train  # noqa: E402
from tests.conftest import ROOT, TORCH_INIT, compose_train  # noqa: E402
from tests.test_export_ctranslate2 import build, encode, lines_of  # noqa: E402

pytestmark = pytest.mark.slow  # each model trained, exported and run through transformers: the slow tier (CI runs it)

SAVED = ROOT / "tests" / "data" / "saved"


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    """A joint vocabulary, and a source and a target one of other sizes."""
    tmp = tmp_path_factory.mktemp("spm")
    joint = train_sentencepiece(lines_of("train.src", "train.tgt"), tmp / "joint", {"vocab_size": 100, "hard_vocab_limit": False})
    src = train_sentencepiece(lines_of("train.src"), tmp / "src", {"vocab_size": 80, "hard_vocab_limit": False})
    tgt = train_sentencepiece(lines_of("train.tgt"), tmp / "tgt", {"vocab_size": 90, "hard_vocab_limit": False})
    return joint, src, tgt


def load(folder: Path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    return AutoModelForSeq2SeqLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("overrides, separate, cls", [
    ([], False, "PegasusForConditionalGeneration"),  # the default: pre-norm, all embeddings shared
    (["model.tie_embeddings=false"], False, "PegasusForConditionalGeneration"),
    (["model.encoder.norm=post", "model.decoder.norm=post", "model.tie_embeddings=false", "model.encoder.num_heads=4",
      "model.decoder.num_layers=3", "model.encoder.ff_size=24"], False, "MarianMTModel"),
    (["model.encoder.norm=post", "model.decoder.norm=post", "model.share_src_tgt_embeddings=false",
      "data.tokenizer.joint=false"], True, "MarianMTModel"),
], ids=["pre_tied", "pre_untied_output", "post_other_sizes", "post_separate_vocabularies"])
def test_logits_and_token_ids_equal_ours(vocabs, tmp_path, overrides, separate, cls):
    """Teacher-forced logits of the loaded model equal ours to fp32 tolerance, for a model with
    every weight perturbed (no layer norm an identity, no bias zero); its tokenizer gives our
    source ids (pieces + EOS) and decodes our target ids to our text."""
    joint, src_vocab, tgt_vocab = vocabs
    if not separate:
        src_vocab = tgt_vocab = joint
    model, run_config = build_sized(overrides, src_vocab.vocab_size, tgt_vocab.vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf, tokenizer = load(to_huggingface(model, src_vocab, tgt_vocab, run_config, tmp_path / "hf"))
    assert type(hf).__name__ == cls
    sources = lines_of("test.src")[:6]
    targets = [[BOS, *tgt_vocab.encode(line)[:7]] for line in lines_of("test.tgt")[:6]]
    width = min(map(len, targets))
    tgt_in = torch.tensor([t[:width] for t in targets])
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    src, src_mask = encode(src_vocab, sources)
    assert batch["input_ids"].tolist() == src.tolist() and batch["attention_mask"].bool().tolist() == src_mask.tolist()
    with torch.no_grad():
        ours = model(src, src_mask, tgt_in)[..., : tgt_vocab.vocab_size]
        theirs = hf(**batch, decoder_input_ids=tgt_in).logits
    assert ours.abs().max() > 1  # not a model of zeros
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    ids = [tgt_vocab.encode(line) + [EOS] for line in lines_of("test.tgt")[:6]]
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == [tgt_vocab.decode(i) for i in ids]


def build_sized(overrides: list[str], src_size: int, tgt_size: int):
    """``build`` with a source and a target vocabulary of their own sizes."""
    model, run_config = build(overrides, src_size)
    if src_size == tgt_size:
        return model, run_config
    config = OmegaConf.create(run_config["model"])
    config.tgt_vocab_size = tgt_size
    config.decoder.vocab_size = -(-tgt_size // config.vocab_multiple) * config.vocab_multiple
    from nmt.training.builders import instantiate_model

    torch.manual_seed(0)
    return instantiate_model(config).eval(), {"model": OmegaConf.to_container(config)}


@pytest.fixture(scope="module", params=["pre_norm", pytest.param("post_norm", marks=pytest.mark.slow)])
def trained(request, tmp_path_factory):
    """A tiny Transformer trained for real on the tiny corpus (greedy outputs are sentences),
    its checkpoint exported with ``nmt-export format=huggingface``."""
    tmp = tmp_path_factory.mktemp(request.param)
    variant = [] if request.param == "pre_norm" else ["model.encoder.norm=post", "model.decoder.norm=post"]
    cfg = compose_train(tmp, ["trainer.max_epochs=120", "model.hidden_size=64", "module.label_smoothing=0.0",
                              "scheduler=inverse_sqrt", "scheduler.warmup_steps=20", "optimizer.lr=0.003", "test=false",
                              "trainer.check_val_every_n_epoch=120", *TORCH_INIT, *variant], model="transformer")
    train(cfg)
    GlobalHydra.instance().clear()
    ckpt = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    out = export(OmegaConf.create({"ckpt": str(ckpt), "format": "huggingface", "out": str(tmp / "hf"),
                                   "weights": "stored", "allow_pickle": False}))
    return load_checkpoint(ckpt), out


def test_generate_greedy_gives_our_greedy_output(trained):
    """``generate()`` with greedy search gives our greedy translations on the test, validation and
    40 training sources (same step cap: ours forces EOS at its last step, theirs stops before)."""
    loaded, out = trained
    hf, tokenizer = load(out)
    lines = lines_of("test.src", "valid.src") + lines_of("train.src")[:40]
    src, src_mask = encode(loaded.src_vocab, lines)
    ours = [loaded.tgt_vocab.decode(t) for t in greedy_search(loaded.model, src, src_mask, max_len_a=0, max_len_b=40).tokens]
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = tokenizer.batch_decode(hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=39),
                                        skip_special_tokens=True)
    assert theirs == ours
    refs = lines_of("train.tgt")[:40]  # non-trivial outputs: the memorised training pairs
    assert sum(o == r for o, r in zip(ours[-40:], refs)) >= 0.8 * len(refs)
    assert hf.generation_config.num_beams == 5 and hf.generation_config.suppress_tokens == [PAD, BOS]


def test_the_folder_needs_no_nmt(trained, tmp_path):
    """A process that cannot import nmt loads the folder and translates as we do."""
    loaded, out = trained
    blocked = tmp_path / "blocked" / "nmt"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('nmt imported')\n")
    line = lines_of("test.src")[0]
    code = ("import sys, transformers as t; f = sys.argv[1]; m = t.AutoModelForSeq2SeqLM.from_pretrained(f); "
            "k = t.AutoTokenizer.from_pretrained(f); "
            "print(k.decode(m.generate(**k([sys.argv[2]], return_tensors='pt'), num_beams=1, max_new_tokens=39)[0], "
            "skip_special_tokens=True))")
    result = subprocess.run([sys.executable, "-c", code, str(out), line], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(blocked.parent), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    src, src_mask = encode(loaded.src_vocab, [line])
    assert result.stdout.strip() == loaded.tgt_vocab.decode(greedy_search(loaded.model, src, src_mask, max_len_a=0,
                                                                          max_len_b=40).tokens[0])
    metadata = json.loads((out / "nmt_export.json").read_text())
    assert metadata["class"] == type(load(out)[0]).__name__ and {"source.spm", "target.spm", "vocab.json"} <= {
        p.name for p in out.iterdir()}


def test_the_saved_release_file_exports(tmp_path):
    """A release file written by an older version (tests/data/saved): refused in one line as an LSTM,
    and the saved Transformer checkpoint exports (its logits equal ours)."""
    with pytest.raises(ValueError, match=r"^model.encoder._target_=nmt.models.rnn.RNNEncoder: an LSTM encoder; no "
                                         r"transformers class expresses it, so the model does not export to Hugging "
                                         r"Face \(format=ctranslate2 may\)$"):
        run_export(SAVED / "lstm_luong.release.ckpt", tmp_path / "lstm")
    assert not (tmp_path / "lstm").exists() and not list(tmp_path.glob(".lstm.*"))
    out = run_export(SAVED / "transformer.ckpt", tmp_path / "tf")
    loaded = load_checkpoint(SAVED / "transformer.ckpt")
    hf, tokenizer = load(out)
    batch = tokenizer(lines_of("test.src")[:4], return_tensors="pt", padding=True)
    tgt_in = torch.full((4, 3), BOS)
    with torch.no_grad():
        ours = loaded.model(batch["input_ids"], batch["attention_mask"].bool(), tgt_in)[..., : loaded.tgt_vocab.vocab_size]
        torch.testing.assert_close(hf(**batch, decoder_input_ids=tgt_in).logits, ours, atol=1e-4, rtol=1e-4)


def run_export(ckpt: Path, out: Path, **options) -> Path:
    return export(OmegaConf.create({"ckpt": str(ckpt), "format": "huggingface", "out": str(out), "weights": "stored",
                                    "allow_pickle": False, **options}))


@pytest.mark.parametrize("overrides, message", [
    (["model.encoder.positions=learned", "model.decoder.positions=learned"],
     "model.encoder.positions=learned: positions other than sinusoidal (the classes recompute their sinusoids when "
     "loading)"),
    (["model.encoder.positions=rope"], "model.encoder.positions=rope: positions other than sinusoidal"),
    (["model.decoder.attention=local", "model.decoder.window=4"], "model.decoder.attention=local: attention patterns other than full"),
    (["model.decoder.norm=post"], "model.encoder.norm=pre, model.decoder.norm=post: pre-norm on one side and "
                                  "post-norm on the other"),
    (["model.share_src_tgt_embeddings=false"], "model.share_src_tgt_embeddings=false: a pre-norm model with separate "
                                               "source and target embeddings"),
    (["model.encoder.hidden_size=24", "+model.decoder.memory_size=24", "model.share_src_tgt_embeddings=false"],
     "model.encoder.hidden_size=24, model.decoder.hidden_size=16: an encoder and a decoder of different widths"),
    (["model/decoder=lstm_luong", "model.share_src_tgt_embeddings=false", "model.tie_embeddings=false"],
     "model.decoder._target_=nmt.models.rnn.RNNDecoder: an LSTM decoder"),
    (["model.decoder.start_from_eos=true"], "model.decoder.start_from_eos=true: a decoder starting from EOS's row "
                                            "outside M2M100 and mBART"),
], ids=["learned", "rope", "window", "mixed_norms", "pre_separate", "widths", "hybrid", "start_from_eos"])
def test_what_no_class_expresses_is_refused_in_one_line(vocabs, tmp_path, overrides, message):
    joint = vocabs[0]
    model, run_config = build(overrides, joint.vocab_size)
    with pytest.raises(ValueError) as refused:
        to_huggingface(model, joint, joint, run_config, tmp_path / "hf")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert str(refused.value).endswith("no transformers class expresses it, so the model does not export to Hugging "
                                       "Face (format=ctranslate2 may)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides, message", [
    (["model.encoder.positions=fairseq", "model.decoder.positions=fairseq"],
     "model.decoder.start_from_eos=false: exported only as the M2M100ForConditionalGeneration it was imported from"),
    (["model.encoder.positions=learned", "model.decoder.positions=learned", "model.encoder.embedding_norm=true",
      "model.decoder.embedding_norm=true"],
     "model.decoder.start_from_eos=false: exported only as the MBartForConditionalGeneration it was imported from"),
    (["model.encoder.positions=fairseq"], "model.decoder.positions=sinusoidal, model.decoder.embedding_norm=false: "
                                          "M2M100 has fairseq positions without an embedding layer norm"),
    (["model.encoder.embedding_norm=true"], "model.encoder.positions=sinusoidal, model.encoder.embedding_norm=true"),
], ids=["fairseq", "mbart_like", "mixed_positions", "norm_alone"])
def test_what_is_not_an_imported_m2m100_or_mbart_is_refused_in_one_line(vocabs, tmp_path, overrides, message):
    """fairseq positions or an embedding norm export as the M2M100 or mBART model they were imported
    from (``tests/test_m2m100.py``); an nmt model trained with them has no such layout."""
    joint = vocabs[0]
    model, run_config = build(overrides, joint.vocab_size)
    with pytest.raises(ValueError) as refused:
        to_huggingface(model, joint, joint, run_config, tmp_path / "hf")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    assert str(refused.value).endswith("; the model does not export to Hugging Face")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="hf exists and is not empty: remove it or export elsewhere"):
        run_export(SAVED / "transformer.ckpt", tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["mine.txt"] and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match="quantization=int8: format=huggingface writes fp32 weights"):
        run_export(SAVED / "transformer.ckpt", tmp_path / "q", quantization="int8")
    not_a_model = tmp_path / "not_a_model.ckpt"
    not_a_model.write_bytes(b"PK\x03\x04 not a checkpoint")
    with pytest.raises(Exception) as refused:
        run_export(not_a_model, tmp_path / "x")
    assert str(not_a_model) in str(refused.value) and not (tmp_path / "x").exists()


def test_without_transformers_the_extra_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails as if not installed
    with pytest.raises(ImportError, match=r"^format=huggingface needs the transformers package: pip install 'nmt\[hf\]'$"):
        run_export(SAVED / "transformer.ckpt", tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
