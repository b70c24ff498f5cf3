#!/usr/bin/env bash
# The payoff no CPU can give, for GPU time left after scripts/gpu_check.sh: the Europarl it->en
# BLEU-by-length study (nmt-study, experiment=bleu_vs_length_europarl) on all 150,000 training pairs
# of up to 50 words instead of a 60,000-pair subset of up to 30, each of the four models trained for
# at most 2 minutes on one GPU (trainer.max_time; the step budgets are set out of reach), at the batch
# data.max_tokens=auto finds, compiled on shape buckets (a GPU run's defaults), then tested by length.
#   NMT_DATA_DIR=../shared/data scripts/gpu_europarl_study.sh [OUT]      # default docs/results/gpu/europarl_study
# About 12 minutes on one GPU: preparing the corpus (SentencePiece on 150,000 pairs) once, then per
# model 2 minutes of training, validation and the 3,000-sentence test in beam 5. On a machine
# without network: copy the corpus into the checkout (mkdir -p shared/data; cp
# ../shared/data/europarl-it-en/*.{it,en} into shared/data/europarl-it-en), run
# `scripts/gpu_wheels.sh --no-ctranslate2`, and carry .gpu_wheels/ with NMT_DATA_DIR=shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out="${1:-docs/results/gpu/europarl_study}"
export NMT_DATA_DIR="${NMT_DATA_DIR:-../shared/data}"
if [ ! -d "$NMT_DATA_DIR/europarl-it-en" ]; then
  echo "no Europarl it-en corpus under $NMT_DATA_DIR (set NMT_DATA_DIR)" >&2
  exit 2
fi
exec "$python" -m nmt.study --experiment bleu_vs_length_europarl --out "$out" \
  trainer=gpu data.train_pairs=null data.train_max_words=50 data.max_tokens=auto \
  trainer.max_time=00:00:02:00 trainer.val_check_interval=1000 \
  'steps_by_model={lstm: 1000000, lstm_bahdanau: 1000000, lstm_luong: 1000000, transformer: 1000000}' \
  scheduler=inverse_sqrt
