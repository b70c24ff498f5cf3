#!/usr/bin/env bash
# The Python packages the GPU check needs beyond a CUDA machine's own PyTorch, Lightning, NumPy,
# SentencePiece and sacreBLEU, as wheels for Linux x86-64 into .gpu_wheels/ (ignored by git):
#   scripts/gpu_wheels.sh [--no-ctranslate2] [PYTHON_VERSION]   # default 3.12, the device image's Python
# (--no-ctranslate2: 6 MB instead of 49, room for the Europarl corpus in a 64 MiB carry)
# Copy or carry that folder to a machine without network; scripts/gpu_check.sh installs from it
# (pip --no-index) before it starts. antlr4-python3-runtime 4.9 (Hydra's parser) is published as
# source only, so it is built into a wheel here. CTranslate2's wheel links CUDA 12's cuBLAS: on
# a machine with CUDA 13 alone the check records that CTranslate2 cannot run there.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(hydra-core "omegaconf<2.4" datasets dill multiprocess py3langid ctranslate2)
if [ "${1:-}" = "--no-ctranslate2" ]; then
  unset 'packages[-1]'
  shift
fi
version="${1:-3.12}"
out=.gpu_wheels
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download --quiet --dest "$out" --only-binary=:all: --no-deps --python-version "$version" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "${packages[@]}"
python3 -m pip wheel --quiet --no-deps --wheel-dir "$out" "antlr4-python3-runtime==4.9.3"
du -sh "$out"
