"""What the benchmarks and checks in ``scripts/`` share, each of them run on its own
(``python scripts/<name>.py``):

- ``flops``: model FLOPs per architecture, counted analytically on real tokens;
- ``measure``: device sync, the matmul peak, peak memory, bytes saved for backward;
- ``decoding``: decoding speed, and decoding without the key/value cache (``NoCache``);
- ``toolkits``, ``opennmt``: another toolkit trained beside ours (pieces, configs, log speeds);
- ``data``: what ``benchmark_data.py`` runs in other processes;
- ``revisions``: another revision of ``nmt`` imported beside this one;
- ``gpu``: the GPU check of ``scripts/gpu_check.py``, a module per part.

Modules here may import the rest of ``nmt``; nothing else in ``nmt`` imports them.
"""

from pathlib import Path


def checkout() -> Path:
    """The repository checkout ``nmt`` is installed from (``pip install -e .``): the benchmarks run
    its ``train.py`` and ``translate.py`` there, so that runs find the project's data, ``.cache`` and
    ``outputs/`` as a user's runs do. Installed from a wheel, there is no checkout to run."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "train.py").is_file() or not (root / "scripts").is_dir():
        raise RuntimeError(f"nmt.bench runs the benchmarks of a repository checkout and {root} is not one: "
                           "run them from a clone with nmt installed from it (pip install -e .)")
    return root
