"""Training speed side by side with OpenNMT-py, same data, sizes, batch and machine, runs
alternating so that the machine's drift hits both toolkits alike:

    python scripts/compare_opennmt.py --onmt-bin /path/to/opennmt-venv/bin [--steps 100 --rounds 2]

OpenNMT-py (3.5; in a virtual environment of its own, it pins an older torch) trains on the
pieces of this project's SentencePiece model for the data config (``data=multi30k`` by default),
with the vocabulary shared as ours is, 3,000-token batches and the presets' sizes: LSTM with
``general`` attention and input feeding for ``lstm_luong``, with ``mlp`` (additive) attention for
``lstm_bahdanau``, and the Transformer for ``transformer``. Both read target tokens/s from their own
logs: OpenNMT-py's report lines after ``--warmup`` steps, ``train.py``'s ``summary.json`` (the first
step excluded). Writes ``compare_opennmt.json`` and ``compare_opennmt.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]
from nmt import CONF_DIR, register_resolvers

log = logging.getLogger("compare_opennmt")

COMMON = {"batch_type": "tokens", "batch_size": 3000, "bucket_size": 32768, "report_every": 10,
          "save_checkpoint_steps": 1000000, "valid_steps": 1000000, "optim": "adam", "seed": 1234,
          "share_vocab": True, "overwrite": True}
LSTM = {"encoder_type": "brnn", "decoder_type": "rnn", "rnn_type": "LSTM", "layers": 2, "hidden_size": 256,
        "word_vec_size": 256, "input_feed": 1, "dropout": 0.2, "learning_rate": 0.001}
ONMT_MODELS = {
    "lstm_luong": {**LSTM, "global_attention": "general"},
    "lstm_bahdanau": {**LSTM, "global_attention": "mlp"},
    "transformer": {"encoder_type": "transformer", "decoder_type": "transformer", "position_encoding": True,
                    "layers": 2, "heads": 4, "hidden_size": 256, "word_vec_size": 256, "transformer_ff": 1024,
                    "dropout": 0.1, "attention_dropout": 0.0, "share_decoder_embeddings": True,
                    "label_smoothing": 0.1, "adam_beta2": 0.98, "decay_method": "noam", "warmup_steps": 1000,
                    "learning_rate": 2.0, "param_init": 0.0, "param_init_glorot": True,
                    # OpenNMT-py's Transformer recipe; with its default per-sentence loss
                    # normalisation this model barely learned (BLEU 6.6 after 1,500 steps)
                    "normalization": "tokens"},
}
REPORT = re.compile(r"Step (\d+)/.*?(\d+)/\s*(\d+) tok/s")


def write_pieces(data: str, work: Path, splits: tuple[str, ...] = ("train", "valid"),
                 raw: tuple[str, ...] = ()) -> dict[str, Path]:
    """Train (or load from the cache) this project's tokenizer for ``data`` and write each of
    ``splits`` as space-separated pieces (``{split}.{src,tgt}``), which OpenNMT-py and Eole read as
    their tokens; the splits in ``raw`` also as text (``{split}.raw.{src,tgt}``). ``paths["spm"]``:
    the SentencePiece model, to join pieces back into text."""
    from nmt.builders import build_datamodule

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}"], return_hydra_config=True)
    with open_dict(cfg):  # what @hydra.main would set
        cfg.hydra.runtime.output_dir, cfg.hydra.runtime.cwd, cfg.hydra.job.num = str(work), str(ROOT), 0
    HydraConfig().set_config(cfg)
    dm = build_datamodule(cfg.data)
    dm.setup()
    paths = {"spm": Path(dm.tgt_vocab.model_file)}
    for split in splits:
        src, tgt = dm.raw(split)
        for side, lines, vocab in (("src", src, dm.src_vocab), ("tgt", tgt, dm.tgt_vocab)):
            path = work / f"{split}.{side}"
            path.write_text("".join(" ".join(vocab.pieces(ids)) + "\n" for ids in vocab.encode_batch(lines)), encoding="utf-8")
            paths[f"{split}_{side}"] = path
            if split in raw:
                paths[f"{split}_raw_{side}"] = work / f"{split}.raw.{side}"
                paths[f"{split}_raw_{side}"].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return paths


def yaml_lines(config: dict) -> str:
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out.append(f"{key}:")
            out += [f"  {line}" for line in yaml_lines(value).splitlines()]
        elif isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
            out.append(f"{key}: {repr(value).replace('e', '.0e')}")  # YAML 1.1 reads 1e-09 as a string
        else:
            out.append(f"{key}: {json.dumps(value)}")
    return "\n".join(out) + "\n"


def onmt_config(model: str, paths: dict[str, Path], work: Path, steps: int) -> Path:
    config = {**COMMON, **ONMT_MODELS[model], "train_steps": steps, "save_model": str(work / model / "model"),
              "src_vocab": str(work / "vocab"), "tgt_vocab": str(work / "vocab"),
              "data": {"corpus_1": {"path_src": str(paths["train_src"]), "path_tgt": str(paths["train_tgt"])},
                       "valid": {"path_src": str(paths["valid_src"]), "path_tgt": str(paths["valid_tgt"])}}}
    path = work / f"{model}.yaml"
    path.write_text(yaml_lines(config))
    return path


def onmt_speed(bin_dir: Path, config: Path, warmup: int, threads: int) -> float:
    """Target tokens/s: OpenNMT-py's report lines after ``warmup`` steps, weighted by time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([str(bin_dir / "onmt_train"), "-config", str(config)], env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"onmt_train -config {config} failed:\n{run.stderr[-3000:]}")
    speed = report_speed(run.stderr + run.stdout, warmup)
    if speed is None:
        raise RuntimeError(f"no report line after step {warmup} in the log of onmt_train -config {config}")
    return speed


def report_speed(log: str, warmup: int) -> float | None:
    """Target tokens/s of the report lines (``Step N/...; ... src/tgt tok/s``, OpenNMT-py's and
    Eole's) after ``warmup`` steps, weighted by time; None without such a line."""
    rates = [int(tgt) for step, _, tgt in REPORT.findall(log) if int(step) > warmup]
    return statistics.harmonic_mean(rates) if rates else None  # tokens over time, for windows of similar tokens


def our_speed(model: str, steps: int, precision: str, data: str, out: Path, threads: int) -> float:
    command = [sys.executable, str(ROOT / "train.py"), f"model={model}", f"data={data}", "data.max_tokens=3000",
               f"trainer.max_steps={steps}", f"trainer.precision={precision}", "test=false", "scheduler=inverse_sqrt",
               "trainer.num_sanity_val_steps=0", "trainer.val_check_interval=1000000", "trainer.check_val_every_n_epoch=null",
               "trainer.max_time=null", "callbacks.rich_progress_bar=null", "trainer.enable_progress_bar=false",
               f"hydra.run.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{run.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["train_tgt_tokens_per_sec"]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    register_resolvers()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onmt-bin", type=Path, required=True, help="bin/ of the environment with OpenNMT-py")
    parser.add_argument("--models", nargs="+", default=list(ONMT_MODELS), choices=list(ONMT_MODELS))
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"], help="ours; OpenNMT-py trains in fp32 on CPUs")
    parser.add_argument("--data", default="multi30k")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="OpenNMT-py steps left out (reports come every 10)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "compare_opennmt")
    args = parser.parse_args()
    if not (args.onmt_bin / "onmt_train").is_file():
        parser.error(f"--onmt-bin {args.onmt_bin}: no onmt_train there; pip install OpenNMT-py==3.5.1 into an environment of its own")
    work = args.out / "opennmt"
    work.mkdir(parents=True, exist_ok=True)
    paths = write_pieces(args.data, work)
    vocab_config = work / "vocab.yaml"
    vocab_config.write_text(yaml_lines({"src_vocab": str(work / "vocab"), "share_vocab": True, "overwrite": True, "n_sample": -1,
                                        "save_data": str(work), "data": {"corpus_1": {"path_src": str(paths["train_src"]),
                                                                                       "path_tgt": str(paths["train_tgt"])}}}))
    subprocess.run([str(args.onmt_bin / "onmt_build_vocab"), "-config", str(vocab_config)], check=True, capture_output=True)

    speeds: dict[str, dict[str, list[float]]] = {m: {"opennmt-py": [], **{p: [] for p in args.precisions}} for m in args.models}
    for round_ in range(args.rounds):
        for model in args.models:
            config = onmt_config(model, paths, work, args.steps)
            speeds[model]["opennmt-py"].append(onmt_speed(args.onmt_bin, config, args.warmup, args.threads))
            for precision in args.precisions:
                out = args.out / f"{model}_{precision}_{round_}"
                speeds[model][precision].append(our_speed(model, args.steps, precision, args.data, out, args.threads))
            log.info("round %d %s: %s", round_ + 1, model, {k: round(v[-1]) for k, v in speeds[model].items()})

    report = {"data": args.data, "steps": args.steps, "rounds": args.rounds, "threads": args.threads, "speeds": speeds}
    lines = [f"Target tokens/s, {args.data}, 3,000-token batches, {args.steps} steps, {args.threads} threads; median of "
             f"{args.rounds} alternating rounds (all runs in compare_opennmt.json)", "",
             "| model | OpenNMT-py (fp32) | " + " | ".join(f"ours {p}" for p in args.precisions) + " | "
             + " | ".join(f"{p} / OpenNMT-py" for p in args.precisions) + " |",
             "|---|" + "---:|" * (1 + 2 * len(args.precisions))]
    for model, by in speeds.items():
        onmt = statistics.median(by["opennmt-py"])
        ours = [statistics.median(by[p]) for p in args.precisions]
        lines.append(f"| {model} | {onmt:,.0f} | " + " | ".join(f"{v:,.0f}" for v in ours) + " | "
                     + " | ".join(f"{v / onmt:.2f}x" for v in ours) + " |")
    (args.out / "compare_opennmt.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "compare_opennmt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
