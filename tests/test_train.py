"""End to end on the tiny corpus: every model trains, checkpoints, tests and translates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from sacrebleu.metrics import BLEU, CHRF

from nmt.checkpoints.loading import load_checkpoint
from nmt.data.tokenizer import BOS, EOS, PAD
from nmt.decoding.search import beam_search, greedy_search, search_of
from nmt.decoding.settings import SearchSettings
from nmt.train import build_model, build_module, cpu_name, train
from nmt.inference.translator import translate_lines
from tests.conftest import ROOT, TORCH_INIT, compose_train, translate_here

MODELS = ["lstm", "lstm_bahdanau", "lstm_luong", "transformer"]


def last_checkpoint(cfg) -> Path:
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(model)``: that model's 2-epoch run on the tiny corpus (config, metrics), trained
    once for every test of this file that reads its files. The config is resolved at once: its
    paths read Hydra's runtime, which the next composed config replaces."""
    done = {}

    def run(model: str):
        if model not in done:
            cfg = compose_train(tmp_path_factory.mktemp(model), ["trainer.max_epochs=2"], model=model)
            metrics = train(cfg)
            OmegaConf.resolve(cfg)
            done[model] = cfg, metrics
        return done[model]

    yield run
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("model", MODELS)
def test_train_checkpoint_test_translate(runs, model):
    cfg, metrics = runs(model)
    out_dir = Path(cfg.paths.output_dir)
    for key in ("train/loss", "val/loss", "val/bleu", "val/chrf", "val/bleu_best", "test/bleu", "test/chrf"):
        assert key in metrics and metrics[key] == metrics[key], key
    ckpt = last_checkpoint(cfg)
    assert ckpt.is_file()
    assert (out_dir / "csv" / "metrics.csv").is_file()
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["parameters"] > 0 and summary["steps"] > 0
    assert 0 < summary["train_tgt_tokens_per_sec"] < summary["train_tokens_per_sec"]
    assert summary["hardware"]["accelerator"] == "CPUAccelerator" and summary["hardware"]["cpu_threads"] == torch.get_num_threads()
    assert summary["hardware"]["cpu"] == cpu_name()
    for name in ("bleu_by_length.csv", "bleu_by_length.json", "bleu_by_length.md", "bleu_by_length.png", "test_hyps.txt"):
        assert (out_dir / name).is_file()
    assert f"| {model} BLEU [95% CI] |" in (out_dir / "bleu_by_length.md").read_text()

    # The test decoded the best checkpoint by val/bleu, and the summary and report name it.
    best = Path(summary["best_checkpoint"])
    assert best.parent == ckpt.parent and best != ckpt
    tested = {"path": str(best), "step": torch.load(best, map_location="cpu", weights_only=True)["global_step"]}
    assert summary["tested_checkpoint"] == json.loads((out_dir / "bleu_by_length.json").read_text())["checkpoint"] == tested

    # Each checkpoint alone rebuilds its model, weight for weight.
    for path in (best, ckpt):
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        weights = load_checkpoint(path).model.state_dict()
        assert {f"model.{k}" for k in weights} == state.keys()
        for key, value in weights.items():
            assert torch.equal(state[f"model.{key}"], value), (path.name, key)

    # The tested checkpoint, decoded again with the test's search, gives the test's translations,
    # and sacreBLEU on them against the references is the test BLEU the run reported.
    loaded = load_checkpoint(best)
    sources = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
    refs = (ROOT / "tests/data/tiny/test.tgt").read_text().splitlines()
    hyps = (out_dir / "test_hyps.txt").read_text().splitlines()
    again, _ = translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, sources, search_of(SearchSettings.from_config(cfg.test_decoding)))
    assert again == hyps and len(hyps) == len(refs)
    assert metrics["test/bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score, rel=1e-6)
    assert metrics["test/chrf"] == pytest.approx(CHRF().corpus_score(hyps, [refs]).score, rel=1e-6)

    # The last checkpoint translates batched as it does sentence by sentence.
    loaded = load_checkpoint(ckpt)
    lines = sources[:8]
    search = lambda m, s, sm, **kw: beam_search(m, s, sm, beam_size=3, **kw)  # noqa: E731
    out, _ = translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, search)
    assert len(out) == len(lines)
    src = [loaded.src_vocab.encode(line) + [3] for line in lines]
    for line, ids, hyp in zip(lines, src, out):
        alone = search(loaded.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
        assert loaded.tgt_vocab.decode(alone.tokens[0]) == hyp


def test_the_summary_describes_the_run_not_the_tested_checkpoint(cfg_train):
    """Testing an earlier checkpoint (the best by a metric that peaks at the first validation)
    restores that checkpoint's counters; summary.json keeps the whole run's."""
    cfg = cfg_train(["trainer.max_epochs=3", "callbacks.model_checkpoint.monitor=val/loss",
                     "callbacks.model_checkpoint.mode=max"], model="lstm")
    train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    last = torch.load(last_checkpoint(cfg), map_location="cpu", weights_only=True)
    assert summary["tested_checkpoint"]["step"] < summary["steps"] == last["global_step"]
    counters = last["counters"]
    assert summary["train_tokens_per_sec"] == round(counters["train_tokens"] / counters["train_seconds"], 1)


def test_cpu_name_gives_the_family_and_model_where_linux_lists_them(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
                       "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n")
    assert cpu_name(cpuinfo) == "AMD EPYC (family 26, model 2)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_name(cpuinfo) == "Some CPU"
    assert cpu_name(tmp_path / "missing")  # no /proc: the platform's name


@pytest.mark.slow
def test_learns_the_tiny_task(cfg_train):
    """Slow (about 30 s on 2 cores): a few hundred steps on 100 pairs; the training loss falls
    well below its start, and decoding the trained model in bf16 or int8 agrees with fp32."""
    # scheduler=inverse_sqrt: the agreement thresholds below were measured on the model it trains
    cfg = cfg_train(["trainer.max_epochs=80", "module.label_smoothing=0.0", "scheduler=inverse_sqrt",
                     "scheduler.warmup_steps=20", "model.hidden_size=64", "optimizer.lr=0.003", "test=false", *TORCH_INIT],
                    model="transformer")
    metrics = train(cfg)
    assert metrics["train/loss"] < 1.0, metrics

    # bf16 decoding (autocast) of the trained model agrees with fp32 on nearly every sentence.
    loaded = load_checkpoint(last_checkpoint(cfg))
    lines = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
    args = (loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, greedy_search)
    fp32, _ = translate_lines(*args)
    bf16, _ = translate_lines(*args, precision="bf16")
    assert sum(a == b for a, b in zip(fp32, bf16)) >= 0.8 * len(lines), list(zip(fp32, bf16))
    # So does int8, on a quantized copy: the model itself keeps its float layers. (Coarser than
    # bf16 for this tiny model, whose outputs on several lines are repetitions that any rounding
    # can flip; on Multi30k's 1,000 test sentences int8 and fp32 give the same BLEU, README.)
    int8, _ = translate_lines(*args, precision="int8")
    assert sum(a == b for a, b in zip(fp32, int8)) >= 0.7 * len(lines), list(zip(fp32, int8))
    assert isinstance(loaded.model.decoder.out, torch.nn.Linear)


def test_batches_decoded_side_by_side_give_the_serial_translations_and_attention(runs):
    """One thread per batch gives what the batches give one after another, attention included,
    and torch's thread count is restored; an unknown precision is refused naming the choices."""
    cfg, _ = runs("transformer")
    loaded = load_checkpoint(last_checkpoint(cfg))
    lines = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
    args = (loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, greedy_search)
    threads = torch.get_num_threads()
    serial, serial_attn = translate_lines(*args, max_tokens=40, attention_lines=[0, 7], workers=1)
    parallel, parallel_attn = translate_lines(*args, max_tokens=40, attention_lines=[0, 7], workers=3)
    assert parallel == serial and parallel_attn.keys() == serial_attn.keys() == {0, 7}
    for i, attn in serial_attn.items():
        torch.testing.assert_close(torch.tensor(parallel_attn[i].weights), torch.tensor(attn.weights))
        assert (parallel_attn[i].source, parallel_attn[i].target) == (attn.source, attn.target)
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="precision=.fp16.: choose one of auto, 32, bf16, int8"):
        translate_lines(*args, precision="fp16")


def test_translate_cli_keeps_one_line_per_input_line(runs, tmp_path, capsys):
    """translate.py's run: one line per input line, each the model's own beam-2 translation (an
    empty line for an empty one), and the heatmaps of the lines asked for."""
    cfg, _ = runs("transformer")
    lines = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()
    lines = lines[:5] + ["", "   "] + lines[5:10] + [""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = translate_here(capsys, f"ckpt={last_checkpoint(cfg)}", f"input={src}", "decoding.beam_size=2", "precision=32",
                            f"attention_dir={tmp_path / 'attention'}", "attention_lines=[0,1]")
    assert result.returncode == 0, result.stderr
    # the same checkpoint decoded without the Translator: the model, the vocabularies and beam search, a line at a time
    loaded = load_checkpoint(last_checkpoint(cfg))
    expected = []
    for line in lines:
        if not line.strip():
            expected.append("")
            continue
        ids = torch.tensor([loaded.src_vocab.encode(line) + [EOS]])
        with torch.inference_mode():
            hyps = beam_search(loaded.model.eval(), ids, ids != PAD, beam_size=2, alpha=0.6, max_len_a=1.5, max_len_b=10)
        expected.append(loaded.tgt_vocab.decode(hyps.tokens[0]))
    assert result.stdout == "".join(e + "\n" for e in expected)
    assert all(hyp for hyp, line in zip(result.stdout.split("\n"), lines) if line.strip())
    assert sorted(p.name for p in (tmp_path / "attention").iterdir()) == ["line00001.png", "line00002.png"]
    before = (tmp_path / "attention" / "line00002.png").read_bytes()
    again = translate_here(capsys, f"ckpt={last_checkpoint(cfg)}", f"input={src}", f"attention_dir={tmp_path / 'attention'}",
                           "attention_lines=[1,2]", f"output={tmp_path / 'out.txt'}")
    assert again.returncode == 2 and again.stderr.strip().endswith(
        f"error: attention_dir={tmp_path / 'attention'}: line00002.png is already there (1 of the heatmaps asked for "
        "would overwrite files); give a new or empty folder")
    assert (tmp_path / "attention" / "line00002.png").read_bytes() == before and not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("vocab", [40, 37])
def test_loss_on_real_positions_equals_cross_entropy_on_all_logits(cfg_train, eps, vocab):
    """The module's loss (output layer on real target positions, one log-softmax) and its
    gradients equal the label-smoothed cross-entropy over the full padded logits, the smoothed
    mass on every entry but padding and BOS (no target is either); with a vocabulary of 37 the
    output layer has 40 rows and the 3 padding rows take no part."""
    cfg = cfg_train([f"module.label_smoothing={eps}"], model="transformer")
    torch.manual_seed(0)
    module = build_module(cfg, build_model(cfg, vocab, vocab))
    assert module.model.decoder.out.weight.shape[0] == 40  # padded to a multiple of 8
    module.model.eval()  # no dropout: both paths see the same network
    src = torch.randint(4, vocab, (3, 7))
    src_mask = torch.ones_like(src, dtype=torch.bool)
    src_mask[1, 5:] = False
    tgt = torch.randint(4, vocab, (3, 6))
    tgt[0, 4:] = PAD
    tgt[2, 2:] = PAD
    batch = {"src": src.masked_fill(~src_mask, PAD), "src_mask": src_mask, "tgt_in": tgt, "tgt_out": tgt}

    loss, nll = module.loss(batch)
    grads = torch.autograd.grad(loss, list(module.model.parameters()), allow_unused=True)
    logits = module.model(batch["src"], src_mask, tgt)[..., :vocab].flatten(0, 1)
    log_probs, real = torch.log_softmax(logits, -1), tgt.flatten() != PAD
    smooth = -torch.cat([log_probs[:, :PAD], log_probs[:, PAD + 1 : BOS], log_probs[:, BOS + 1 :]], -1).mean(-1)
    ref = (1 - eps) * torch.nn.functional.cross_entropy(logits, tgt.flatten(), ignore_index=PAD) + eps * smooth[real].mean()
    ref_grads = torch.autograd.grad(ref, list(module.model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, torch.nn.functional.cross_entropy(logits, tgt.flatten(), ignore_index=PAD).detach())
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r)


def test_training_validates_a_sample_and_the_final_weights_on_every_pair(cfg_train, caplog):
    """data.val_sample=5 of the tiny corpus's 20 valid pairs: each validation during training
    decodes the 5, then the final weights are validated on all 20 (its BLEU is val/bleu in the
    metrics and the summary; val/bleu_best stays the training validations' best); the log and the
    summary say which was used."""
    import logging

    cfg = cfg_train(["data.val_sample=5", "trainer.max_epochs=2", "test=false"], model="transformer")
    with caplog.at_level(logging.INFO):
        metrics = train(cfg)
    assert "validation during training: a fixed sample of 5 of the 20 valid pairs (data.val_sample)" in caplog.text
    assert "validating the final weights on all 20 valid pairs" in caplog.text
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    validation = summary["validation"]
    assert (validation["sentences"], validation["during_training"]) == (20, 5)
    assert [r["sentences"] for r in validation["runs"]] == [5, 5, 20]
    assert validation["runs"][-1]["step"] == summary["steps"]
    assert validation["seconds"] == pytest.approx(sum(r["seconds"] for r in validation["runs"]), abs=0.11)
    assert metrics["val/bleu"] == pytest.approx(validation["runs"][-1]["bleu"], abs=0.01)
    assert "train/loss" in metrics and "train/loss" in summary["metrics"]  # not reset by the final validation
    assert metrics["val/bleu_best"] == pytest.approx(max(r["bleu"] for r in validation["runs"][:2]), abs=0.01)
