"""The inputs of docs/finetuning.md's worked example on an NLLB-200 model ("The whole path on an
imported NLLB-200 model"): the corpora, written as files named with NLLB-200's language codes, and
an untrained ``M2M100ForConditionalGeneration`` folder of NLLB-200's architecture and tokenizer,
which ``experiment=nllb_like_general`` trains into the stand-in for a pretrained model.

    python scripts/nllb_like.py --out nllb_like     # writes nllb_like/{general,finetune,indomain,random}/
    python scripts/nllb_like.py --run --out runs/nllb_like   # and runs every step after it (``steps``)

- ``general/``: the synthetic language's sentences of 3 to 15 words (20,000 training pairs, 200
  validation, 500 test; the pairs of ``experiment=opus_like_general``), as ``deu_Latn`` ->
  ``fra_Latn``: the codes are labels the model's tokenizer knows, the language is made up.
- ``finetune/``: its sentences of 16 to 40 words (5,000 training pairs, 200 validation, 500 test;
  ``experiment=opus_like_finetune``'s pairs), the in-domain corpus with references;
- ``indomain/``: the same validation and test pairs, and 20,000 training pairs
  (``experiment=opus_like_student``'s), whose sources the fine-tuned model translates for its student.
- ``random/``: ``transformers`` builds NLLB-200's layout at a small size (width 128, 2 + 2
  layers, 4 heads, feed-forward 512: ``opus_like_general``'s): pre-norm with final layer norms,
  scaled embeddings, fairseq's sinusoids, ReLU, one embedding for both sides and the output layer,
  fairseq's initialisation (``fairseq_init``); ``NllbTokenizer`` over a SentencePiece model trained on the
  general corpus, with NLLB-200's 202 codes; the generation config of the hub's NLLB folders
  (beam 4, ``length_penalty`` 1.0, ``max_length`` 200).

Needs ``pip install ".[hf]"`` (``transformers``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SRC, TGT = "deu_Latn", "fra_Latn"
CORPORA = {  # folder -> (seed, words, median, pair counts): the opus_like experiments' corpora
    "general": (1, (3, 15), 8, {"train": 20000, "valid": 200, "test": 500}),
    "finetune": (2, (16, 40), 24, {"train": 5000, "valid": 200, "test": 500}),
    "indomain": (2, (16, 40), 24, {"train": 20000, "valid": 200, "test": 500}),
}
SIZES = {"d_model": 128, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512, "max_position_embeddings": 256}


def write_corpora(out: Path) -> None:
    from nmt.data.synthetic import write_corpus

    for name, (seed, (low, high), median, splits) in CORPORA.items():
        write_corpus(out / name, splits, seed=seed, min_len=low, max_len=high, src_lang=SRC, tgt_lang=TGT,
                     lengths={"train": "natural", "valid": "uniform", "test": "uniform"}, median_len=median)


def fairseq_init(model, width: int) -> None:
    """fairseq's initialisation, which M2M100 and NLLB-200 were trained from: embeddings drawn from
    N(0, width^-1/2) (the padding row zero), every linear map Glorot-uniform with zero biases.
    ``transformers`` draws everything from N(0, 0.02): at width 128 the scaled token embeddings
    (0.02 x sqrt(128) = 0.23) are a third of the sinusoids, and 1,200 steps do not learn to read
    the source (0.1 BLEU)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.shared.weight":
                p.normal_(0.0, width ** -0.5)[model.config.pad_token_id] = 0
            elif p.dim() == 2:
                torch.nn.init.xavier_uniform_(p)
            elif name.endswith(".bias") and "layer_norm" not in name:
                p.zero_()


def random_folder(out: Path, corpus: Path, vocab_size: int = 1000, seed: int = 0) -> Path:
    """An untrained NLLB-200-architecture folder whose SentencePiece model is trained on ``corpus``."""
    import sentencepiece as spm
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(input=[str(corpus / f"train.{SRC}"), str(corpus / f"train.{TGT}")],
                                       model_prefix=str(work / "sentencepiece.bpe"), vocab_size=vocab_size,
                                       model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                       minloglevel=2, num_threads=1)
        tokenizer = NllbTokenizer.from_pretrained(work, extra_special_tokens=FAIRSEQ_LANGUAGE_CODES,
                                                  src_lang=SRC, tgt_lang=TGT)
        config = M2M100Config(vocab_size=len(tokenizer), **SIZES, dropout=0.1, attention_dropout=0.0,
                              activation_dropout=0.0, activation_function="relu", scale_embedding=True,
                              decoder_start_token_id=2)
        torch.manual_seed(seed)
        model = M2M100ForConditionalGeneration(config).eval()
        fairseq_init(model, config.d_model)
        model.generation_config.update(num_beams=4, length_penalty=1.0, max_length=200, bad_words_ids=[[1]],
                                       forced_eos_token_id=2)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        shutil.copy(work / "sentencepiece.bpe.model", out / "sentencepiece.bpe.model")  # as the hub's folders
    return out


def steps(out: Path) -> list[tuple[str, list[str], Path]]:
    """The worked example's commands after the inputs, each with the file that shows it done: the
    stand-in trained, exported as a Hugging Face folder, imported, fine-tuned in-domain, compared on
    the general and the in-domain test sets (beam 5 and GNMT's length penalty 0.6 for every model,
    the rule nmt's runs test with), distilled into a student and timed with its teacher (torch fp32
    and CTranslate2 int8, one thread)."""
    py, c = sys.executable, out / "corpus"
    general, folder, imported = out / "general", out / "nllb_like_folder", out / "nllb_like.ckpt"
    finetune, student = out / "finetune", out / "student"
    last = lambda run: run / "checkpoints" / "last.ckpt"  # noqa: E731
    # one decoding rule for all (the imported file's own is transformers' beam scoring, the runs' GNMT's)
    evaluate = [py, "evaluate.py", "word_frequency=false", "reordering=false", "decoding.scoring=gnmt", "decoding.alpha=0.6"]
    return [
        ("general", [py, "train.py", "experiment=nllb_like_general", f"corpus={c}", f"init_from={c / 'random'}",
                     f"hydra.run.dir={general}"], general / "summary.json"),
        ("export", [py, "-m", "nmt.export", f"ckpt={last(general)}", "format=huggingface", f"out={folder}"],
         folder / "config.json"),
        ("import", [py, "-m", "nmt.import_model", "format=huggingface", f"src={folder}", f"out={imported}"], imported),
        ("finetune", [py, "train.py", "experiment=nllb_like_finetune", f"corpus={c}", f"init_from={folder}",
                      f"hydra.run.dir={finetune}"], finetune / "summary.json"),
        ("general_domain", [*evaluate, f"ckpts={{general: {last(general)}, imported: {imported}, "
                                       f"finetuned: {last(finetune)}}}", "baseline=imported",
                            f"hydra.run.dir={out / 'general_domain'}"], out / "general_domain" / "comparison.json"),
        ("in_domain", [*evaluate, f"ckpts={{finetuned: {last(finetune)}, imported: {imported}}}", "baseline=imported",
                       f"hydra.run.dir={out / 'in_domain'}"], out / "in_domain" / "comparison.json"),
        ("student", [py, "distill.py", "experiment=nllb_like_student", f"corpus={c}",
                     f"distill.teacher={last(finetune)}", f"hydra.run.dir={student}"], student / "summary.json"),
        ("speed", [py, "scripts/translation_speed.py", "--input", str(c / "finetune" / f"test.{SRC}"), "--lines", "500",
                   "--src-lang", SRC, "--tgt-lang", TGT, "--model", f"teacher={last(finetune)}",
                   "--model", f"student={last(student)}", "--out", str(out / "speed.json")], out / "speed.json"),
    ]


def run_all(out: Path) -> None:
    """Every step whose result is not there yet, one thread each, logs beside the results."""
    if not (out / "corpus" / "random" / "config.json").is_file():
        write_corpora(out / "corpus")
        random_folder(out / "corpus" / "random", out / "corpus" / "general")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name, command, done in steps(out.resolve()):
        if done.exists():
            print(f"{name}: done ({done})", flush=True)
            continue
        print(f"{name}: {shlex.join(command)}", flush=True)
        with open(out / f"{name}.log", "w") as log:
            if subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"{name} failed: see {out / f'{name}.log'}")
    print(f"the worked example's results are in {out}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("nllb_like"))
    parser.add_argument("--run", action="store_true", help="also run every step of the worked example into --out "
                        "(the corpora and the untrained folder go to <out>/corpus)")
    args = parser.parse_args()
    if args.run:
        run_all(args.out)
        return
    write_corpora(args.out)
    random_folder(args.out / "random", args.out / "general")
    print(f"wrote {args.out}/general, finetune, indomain and the untrained folder {args.out}/random")


if __name__ == "__main__":
    main()
