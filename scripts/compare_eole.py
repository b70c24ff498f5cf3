"""Training speed and beam-5 translation side by side with Eole (the successor of OpenNMT-py):
same data, vocabulary, sizes, batches, optimizer and machine, runs alternating so that the
machine's drift hits every toolkit alike:

    python scripts/compare_eole.py --eole-python /path/to/eole-venv/bin/python \\
        [--onmt-bin /path/to/opennmt-venv/bin] [--steps 100 --rounds 2 --translate-steps 1000]

Eole (0.6, in a virtual environment of its own: ``pip install torch==2.13.0 eole aiohttp``; its
command line imports aiohttp without requiring it) reads the pieces of this project's
SentencePiece model as its tokens, as OpenNMT-py does in ``compare_opennmt.py``; the two share
the pieces, the vocabulary building and the log reading (``nmt.bench.toolkits``). ``EOLE_KEYS``
below says which Eole key stands for which of ours.

1. Training speed: in each round, for each model, Eole in each of ``--eole-precisions`` (``fp32``;
   ``bf16``: ``compute_dtype: bf16`` with ``use_amp``, i.e. torch.autocast on the CPU over fp32
   weights, as our ``bf16-mixed``), OpenNMT-py when ``--onmt-bin`` is given, and ``train.py`` in
   each of ``--precisions``, ``--steps`` steps each. Target tokens/s: Eole's (and OpenNMT-py's)
   report lines after ``--warmup`` steps, ours from ``summary.json`` (the first step excluded).
2. Translation, when ``--translate-steps`` > 0: Eole and ``train.py`` train each of
   ``--translate-models`` once for that many steps in fp32 with the settings above, then, in
   ``--translate-rounds`` alternating rounds, translate the test split (Multi30k test2016, or its
   first ``--translate-lines``) with beam 5 and 2,048 source tokens per batch: ``eole predict``
   in each of ``--eole-translate-precisions`` and ``translate.py`` in each of
   ``--translate-precisions``. Wall seconds of the whole command (start-up included), BLEU
   (sacreBLEU on text: Eole's pieces joined back with our SentencePiece model) and words written.

Writes ``compare_eole.json`` and ``compare_eole.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nmt import register_resolvers
from nmt.bench.opennmt import ONMT_MODELS, onmt_config, onmt_speed
from nmt.bench.toolkits import our_speed, report_speed, vocab_config, write_pieces, yaml_lines
from nmt.machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("compare_eole")

# Which Eole key stands for which of ours (nmt/conf; train.yaml's lr_by_model for the peak rate):
#   model.architecture: transformer / custom (brnn encoder + rnn decoder) <- model=transformer / lstm_*
#   model.layers                          <- model.{encoder,decoder}.num_layers (2)
#   model.hidden_size, embeddings.word_vec_size <- model.hidden_size (= emb_size), 256
#   model.heads, model.transformer_ff     <- model.{encoder,decoder}.num_heads (4), .ff_size (1,024)
#   model.layer_norm: standard (pre-norm, final norm) <- model.*.norm: pre
#   embeddings.position_encoding_type: SinusoidalInterleaved <- positions: sinusoidal (sin even, cos odd)
#   model.add_qkvbias, add_final_linear_bias, add_ffnbias: true <- our nn.Linear layers have biases
#   model.generator_bias: false           <- decoder.out is a bias-free Linear
#   model.share_embeddings / share_decoder_embeddings <- share_src_tgt_embeddings / tie_embeddings
#   model.encoder.encoder_type: brnn      <- model.encoder.bidirectional: true (128 units a direction)
#   model.decoder.global_attention: general / mlp <- LuongAttention score=general / BahdanauAttention
#   model.input_feed: 1                   <- RNNDecoder input_feeding (attentional / context)
#   training.batch_type: tokens, batch_size: 3000 <- data.max_tokens=3000 (sentences x longest side)
#   training.optim: adam, adam_beta1/2, adam_eps <- optimizer: adam, betas [0.9, 0.98], eps 1e-9
#   training.decay_method: noam, warmup_steps: 300, learning_rate: peak * sqrt(hidden * warmup)
#                                         <- scheduler: inverse_sqrt (linear warmup, 1/sqrt decay)
#   training.max_grad_norm: 1.0           <- trainer.gradient_clip_val: 1.0
#   training.label_smoothing: 0.1         <- module.label_smoothing: 0.1
#   training.normalization: tokens        <- the loss is a mean over target tokens
#   training.dropout / attention_dropout  <- model.dropout / model.*.attention_dropout (0)
#   training.compute_dtype: fp32 / bf16 (+ use_amp) <- trainer.precision: 32 / bf16-mixed
#   training.num_workers: 0               <- data.num_workers: auto, 0 on a CPU (batches made in the training process)
#   top-level seed: 1234                  <- seed: 1234
# Translation (eole predict; ours: nmt/conf/decoding/beam.yaml, translate.yaml):
#   beam_size: 5                          <- decoding.beam_size: 5
#   length_penalty: wu, alpha: 0.6        <- GNMT length penalty, alpha 0.6
#   max_length_ratio: 1.5 (+ 5, per batch) <- max_len_a: 1.5, max_len_b: 10 (per sentence)
#   batch_type: tokens, batch_size: 2048  <- max_tokens: 2048 (source tokens, padding included)
#   compute_dtype: fp32 / bf16            <- precision: 32 / bf16 (Eole's bf16 casts the weights)
TRANSFORMER = {"architecture": "transformer", "layers": 2, "hidden_size": 256, "heads": 4, "transformer_ff": 1024,
               "layer_norm": "standard", "add_qkvbias": True, "add_final_linear_bias": True, "add_ffnbias": True,
               "generator_bias": False, "share_embeddings": True, "share_decoder_embeddings": True,
               "embeddings": {"word_vec_size": 256, "position_encoding": True,
                              "position_encoding_type": "SinusoidalInterleaved"}}
# architecture "rnn" would reset encoder_type to "rnn" (one direction); "custom" keeps brnn
LSTM = {"architecture": "custom", "layers": 2, "hidden_size": 256, "input_feed": 1, "generator_bias": False,
        "embeddings": {"word_vec_size": 256}, "encoder": {"encoder_type": "brnn", "rnn_type": "LSTM"}}
EOLE_MODELS = {
    "lstm_luong": {**LSTM, "decoder": {"decoder_type": "rnn", "rnn_type": "LSTM", "global_attention": "general"}},
    "lstm_bahdanau": {**LSTM, "decoder": {"decoder_type": "rnn", "rnn_type": "LSTM", "global_attention": "mlp"}},
    "transformer": TRANSFORMER,
}
OURS = {"lstm_luong": {"dropout": 0.0, "lr": 0.004}, "lstm_bahdanau": {"dropout": 0.1, "lr": 0.008},
        "transformer": {"dropout": 0.0, "lr": 0.002}}  # model.dropout, lr_by_model
WARMUP = 300  # scheduler.warmup_steps
BATCH_TOKENS, TRANSLATE_TOKENS = 3000, 2048


def eole_config(model: str, paths: dict[str, Path], work: Path, steps: int, precision: str, workers: int = 0,
                model_dir: Path | None = None) -> Path:
    """``eole train``'s config, written into ``work`` (which holds the vocabulary); the model goes
    to ``model_dir`` (default ``work/<model>_<precision>``)."""
    hidden = EOLE_MODELS[model]["hidden_size"]
    training = {
        "model_path": str(model_dir or work / f"{model}_{precision}"), "train_steps": steps, "save_checkpoint_steps": steps,
        "valid_steps": 1000000, "batch_type": "tokens", "batch_size": BATCH_TOKENS, "bucket_size": 32768,
        "num_workers": workers, "optim": "adam", "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-9,
        # noam: learning_rate * hidden**-0.5 * min(step**-0.5, step * warmup**-1.5), peak at the warmup's end
        "decay_method": "noam", "warmup_steps": WARMUP, "learning_rate": round(OURS[model]["lr"] * (hidden * WARMUP) ** 0.5, 6),
        "max_grad_norm": 1.0, "label_smoothing": 0.1, "normalization": "tokens",
        "dropout": [OURS[model]["dropout"]], "attention_dropout": [0.0], "dropout_steps": [0],
        "param_init": 0.0, "param_init_method": "xavier_uniform",
        "compute_dtype": precision, "use_amp": True,
        "log_attention_entropy": False,  # a diagnostic that ours does not compute
    }
    config = {"src_vocab": str(work / "vocab"), "tgt_vocab": str(work / "vocab"), "share_vocab": True,
              "vocab_size_multiple": 8, "overwrite": True, "seed": 1234, "report_every": 10,
              "data": {"corpus_1": {"path_src": str(paths["train_src"]), "path_tgt": str(paths["train_tgt"])},
                       "valid": {"path_src": str(paths["valid_src"]), "path_tgt": str(paths["valid_tgt"])}},
              "model": EOLE_MODELS[model], "training": training}
    path = work / f"{Path(training['model_path']).name}.yaml"
    path.write_text(yaml_lines(config))
    return path


def predict_config(model_dir: Path, src: Path, output: Path, precision: str) -> Path:
    config = {"model_path": str(model_dir), "src": str(src), "output": str(output), "beam_size": 5,
              "batch_type": "tokens", "batch_size": TRANSLATE_TOKENS, "length_penalty": "wu", "alpha": 0.6,
              "max_length": 256, "max_length_ratio": 1.5, "compute_dtype": precision, "seed": 1234}
    path = output.with_suffix(".yaml")
    path.write_text(yaml_lines(config))
    return path


def eole(python: Path, command: str, config: Path, threads: int) -> str:
    """Runs ``eole <command> -config <config>``; its log (stderr and stdout)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([str(python), "-m", "eole.bin.main", command, "-config", str(config)], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"eole {command} -config {config} failed:\n{run.stderr[-3000:]}")
    return run.stderr + run.stdout


def eole_speed(python: Path, config: Path, warmup: int, threads: int) -> float:
    speed = report_speed(eole(python, "train", config, threads), warmup)
    if speed is None:
        raise RuntimeError(f"no report line after step {warmup} in the log of eole train -config {config}")
    return speed


def timed(command: list[str], threads: int) -> float:
    """Wall seconds of one command, which must succeed."""
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    return seconds


def scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    import sacrebleu

    if len(hyps) != len(refs):
        raise RuntimeError(f"{len(hyps)} translations for {len(refs)} references")
    return {"bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2), "words": sum(len(h.split()) for h in hyps)}


def join_pieces(lines: list[str], spm_model: Path) -> list[str]:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    return [sp.decode_pieces(line.split()) for line in lines]


def median_table(title: str, results: dict[str, dict[str, list[float]]], fmt: str) -> list[str]:
    systems = list(next(iter(results.values())))
    lines = [title, "", "| model | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]
    for model, by in results.items():
        lines.append(f"| {model} | " + " | ".join(format(statistics.median(by[s]), fmt) for s in systems) + " |")
    return lines


def train_speeds(args, paths: dict[str, Path], work: Path) -> dict[str, dict[str, list[float]]]:
    systems = [f"eole {p}" for p in args.eole_precisions] + (["opennmt-py"] if args.onmt_bin else []) \
        + [f"ours {p}" for p in args.precisions]
    speeds = {m: {s: [] for s in systems} for m in args.models}
    for round_ in range(args.rounds):
        for model in args.models:
            for precision in args.eole_precisions:
                config = eole_config(model, paths, work, args.steps, precision, args.eole_workers)
                speeds[model][f"eole {precision}"].append(eole_speed(args.eole_python, config, args.warmup, args.threads))
            if args.onmt_bin:
                config = onmt_config(model, paths, work, args.steps)
                speeds[model]["opennmt-py"].append(onmt_speed(args.onmt_bin, config, args.warmup, args.threads))
            for precision in args.precisions:
                out = args.out / f"{model}_{precision}_{round_}"
                speeds[model][f"ours {precision}"].append(our_speed(model, args.steps, precision, args.data, out, args.threads))
            log.info("round %d %s: %s", round_ + 1, model, {k: round(v[-1]) for k, v in speeds[model].items()})
    return speeds


def translations(args, paths: dict[str, Path], work: Path) -> dict[str, dict[str, dict]]:
    lines = args.translate_lines or None
    refs = paths["test_raw_tgt"].read_text(encoding="utf-8").splitlines()[:lines]
    src_text, src_pieces = work / "test.txt", work / "test.pieces"
    src_text.write_text("".join(f"{s}\n" for s in paths["test_raw_src"].read_text(encoding="utf-8").splitlines()[:lines]))
    src_pieces.write_text("".join(f"{s}\n" for s in paths["test_src"].read_text(encoding="utf-8").splitlines()[:lines]))
    results: dict[str, dict[str, dict]] = {}
    for model in args.translate_models:
        log.info("%s: training the checkpoints (%d steps, fp32)", model, args.translate_steps)
        eole_dir = work / f"ckpt_{model}"
        ours_dir = args.out / f"ckpt_{model}"
        if args.reuse_checkpoints and (eole_dir / f"step_{args.translate_steps}").is_dir() \
                and trained_steps(ours_dir) == args.translate_steps:
            log.info("%s: reusing the checkpoints in %s and %s", model, eole_dir, ours_dir)
        else:
            eole(args.eole_python, "train", eole_config(model, paths, work, args.translate_steps, "fp32", args.eole_workers,
                                                        eole_dir), args.threads)
            our_speed(model, args.translate_steps, "32", args.data, ours_dir, args.threads)
        commands: dict[str, tuple[list[str], Path]] = {}
        for precision in args.eole_translate_precisions:
            output = work / "translate" / f"{model}_eole_{precision}.pieces"
            output.parent.mkdir(parents=True, exist_ok=True)
            config = predict_config(eole_dir, src_pieces, output, precision)
            commands[f"eole {precision}"] = ([str(args.eole_python), "-m", "eole.bin.main", "predict", "-config",
                                              str(config)], output)
        for precision in args.translate_precisions:
            output = work / "translate" / f"{model}_ours_{precision}.txt"
            commands[f"ours {precision}"] = ([sys.executable, str(ROOT / "translate.py"),
                                              f"ckpt={ours_dir / 'checkpoints' / 'last.ckpt'}", f"input={src_text}",
                                              f"output={output}", f"precision={precision}", "decoding.beam_size=5",
                                              f"max_tokens={TRANSLATE_TOKENS}"], output)
        results[model] = {name: {"seconds": []} for name in commands}
        for round_ in range(args.translate_rounds):
            for name, (command, output) in commands.items():
                results[model][name]["seconds"].append(timed(command, args.threads))
                hyps = output.read_text(encoding="utf-8").splitlines()
                results[model][name].update(scores(join_pieces(hyps, paths["spm"]) if name.startswith("eole") else hyps,
                                                   refs))
            log.info("round %d %s: %s", round_ + 1, model,
                     {k: f"{v['seconds'][-1]:.2f} s, BLEU {v['bleu']}" for k, v in results[model].items()})
    return results


def trained_steps(run_dir: Path) -> int | None:
    """The steps of the run ``train.py`` left in ``run_dir`` (None if there is none)."""
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text())["steps"] if summary.is_file() else None


def eole_version(python: Path) -> str:
    run = subprocess.run([str(python), "-c", "import eole, torch; print(eole.__version__, torch.__version__)"],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{python} cannot import eole:\n{run.stderr[-2000:]}")
    return run.stdout.strip()


def main() -> None:
    register_resolvers()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eole-python", type=Path, required=True, help="python of the environment with Eole")
    parser.add_argument("--onmt-bin", type=Path, help="bin/ of an environment with OpenNMT-py, to train it in the same rounds")
    parser.add_argument("--models", nargs="+", default=list(EOLE_MODELS), choices=list(EOLE_MODELS))
    parser.add_argument("--eole-precisions", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--precisions", nargs="*", default=["32", "bf16-mixed"], help="ours")
    parser.add_argument("--data", default="multi30k")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="Eole (and OpenNMT-py) steps left out (reports come every 10)")
    parser.add_argument("--rounds", type=int, default=2, help="training-speed rounds (0: none)")
    parser.add_argument("--eole-workers", type=int, default=0, help="Eole's training.num_workers (its default: 2)")
    parser.add_argument("--translate-steps", type=int, default=1000, help="training steps of the checkpoints (0: no translation)")
    parser.add_argument("--translate-models", nargs="+", default=["transformer", "lstm_luong"], choices=list(EOLE_MODELS))
    parser.add_argument("--translate-rounds", type=int, default=3)
    parser.add_argument("--reuse-checkpoints", action="store_true",
                        help="translate with the checkpoints an earlier run of the same --out and --translate-steps trained")
    parser.add_argument("--translate-lines", type=int, default=0, help="the test split's first N lines (0: all)")
    parser.add_argument("--eole-translate-precisions", nargs="+", default=["fp32", "bf16"],
                        help="Eole 0.6.4's int8 stops at a check of a removed option (config.gpu)")
    parser.add_argument("--translate-precisions", nargs="+", default=["32", "bf16", "int8"], help="ours")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "compare_eole")
    args = parser.parse_args()
    if args.onmt_bin and not (args.onmt_bin / "onmt_train").is_file():
        parser.error(f"--onmt-bin {args.onmt_bin}: no onmt_train there")
    if args.onmt_bin and set(args.models) - set(ONMT_MODELS):
        parser.error(f"OpenNMT-py configs exist for {list(ONMT_MODELS)} only")
    versions = eole_version(args.eole_python)
    log.info("eole, torch: %s", versions)
    work = args.out / "eole"
    work.mkdir(parents=True, exist_ok=True)
    paths = write_pieces(args.data, work, splits=("train", "valid", "test"), raw=("test",))
    eole(args.eole_python, "build_vocab", vocab_config(work, paths), args.threads)  # OpenNMT-py reads the same file

    speeds = train_speeds(args, paths, work) if args.rounds else {}
    translated = translations(args, paths, work) if args.translate_steps else {}
    cpu = cpu_name()
    report = {"eole_torch": versions, "cpu": cpu, "data": args.data, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
              "translate_steps": args.translate_steps, "translate_rounds": args.translate_rounds,
              "translate_lines": args.translate_lines, "speeds": speeds, "translation": translated}
    lines = []
    if speeds:
        lines += median_table(f"Target tokens/s, {args.data}, {BATCH_TOKENS:,}-token batches, {args.steps} steps, "
                              f"{args.threads} threads of {cpu}; median of {args.rounds} alternating rounds (eole, torch: {versions})",
                              speeds, ",.0f") + [""]
    if translated:
        seconds = {m: {s: r["seconds"] for s, r in by.items()} for m, by in translated.items()}
        lines += median_table(f"Translation of the test split ({args.translate_lines or 'all'} lines), beam 5, "
                              f"{TRANSLATE_TOKENS:,} source tokens per batch, checkpoints of {args.translate_steps} steps: "
                              f"seconds of the whole command, median of {args.translate_rounds} alternating rounds",
                              seconds, ".2f")
        lines += ["", "| model | system | BLEU | words |", "|---|---|---:|---:|"]
        lines += [f"| {m} | {s} | {r['bleu']:.2f} | {r['words']:,} |" for m, by in translated.items() for s, r in by.items()]
    (args.out / "compare_eole.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "compare_eole.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
