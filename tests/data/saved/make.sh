#!/bin/bash
# Writes the saved checkpoint and release file that tests/test_saved_files.py opens: tiny runs
# trained, exported and translated by the commands of the nmt version that wrote them, so that
# later versions are tested against files they did not write. Run from the repository root:
#   bash tests/data/saved/make.sh
set -euo pipefail
out=tests/data/saved
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for model in transformer lstm_luong; do
  extra=()
  if [ "$model" = transformer ]; then
    extra=(model.encoder.num_layers=1 model.decoder.num_layers=1 model.encoder.num_heads=2 model.decoder.num_heads=2
           model.encoder.ff_size=32 model.decoder.ff_size=32)
  fi
  OMP_NUM_THREADS=1 NMT_CACHE_DIR="$tmp/cache" python train.py "hydra.searchpath=[file://$PWD/tests/conf]" data=tiny \
    model=$model model.emb_size=16 model.hidden_size=16 "${extra[@]}" trainer=cpu trainer.precision=32-true logger=csv \
    trainer.max_steps=6 trainer.val_check_interval=3 trainer.check_val_every_n_epoch=null callbacks.early_stopping=null \
    callbacks.rich_progress_bar=null trainer.enable_progress_bar=false test=false "hydra.run.dir=$tmp/$model" >/dev/null 2>&1
  if [ "$model" = transformer ]; then  # a training checkpoint: it translates and resumes
    saved="$out/$model.ckpt"
    cp "$tmp/$model/checkpoints/last.ckpt" "$saved"
  else  # a release file: it translates
    saved="$out/$model.release.ckpt"
    nmt-export ckpt="$tmp/$model/checkpoints/last.ckpt" format=release out="$saved" >/dev/null 2>&1
  fi
  python translate.py ckpt="$saved" input=tests/data/tiny/test.src precision=32 decoding.beam_size=3 \
    > "$out/$model.beam3.txt" 2>/dev/null
done
git rev-parse --short HEAD > "$out/written_by.txt"
