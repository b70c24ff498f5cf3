# Sourced by the GPU scripts: the Python to run ($PYTHON, else python, else python3), the wheels of
# scripts/gpu_wheels.sh installed from .gpu_wheels/ when the packages are missing (no network
# needed), and the checkout's nmt on the path, installed or not.
python="${PYTHON:-$(command -v python || command -v python3)}"
if [ -d .gpu_wheels ] && ! "$python" -c "import hydra, datasets, py3langid" 2>/dev/null; then
  "$python" -m pip install --quiet --no-index --no-deps .gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
