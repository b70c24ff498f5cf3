"""Word alignments computed when the data are prepared (``data.alignments=eflomal``).

eflomal (Östling and Tiedemann 2016: a Bayesian IBM model sampled with MCMC, ``pip install
eflomal``) aligns the prepared training text in both directions; the two are joined by
grow-diag-final-and (Koehn et al. 2005), as Moses and fast_align's ``atools`` symmetrize.
"""

from __future__ import annotations

import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

NEIGHBOURS = ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))


def _eflomal() -> Any:
    try:
        import eflomal
    except ImportError:
        raise ValueError("data.alignments=eflomal needs the eflomal package (pip install 'nmt[align]'); or give a Pharaoh "
                         "file of the training split's word alignments") from None
    return eflomal


def describe(name: str) -> dict[str, Any]:
    """What the alignments depend on besides the text (part of their folder's key)."""
    _eflomal()
    try:
        version = metadata.version("eflomal")
    except metadata.PackageNotFoundError:  # imported from a folder without its metadata
        version = "unknown"
    return {"version": version, "symmetrize": "grow-diag-final-and"}


def grow_diag_final_and(forward: set[tuple[int, int]], reverse: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Koehn et al. (2005): start from the intersection of two directional alignments, add
    neighbouring links of the union that align a word not yet aligned, then links of the union
    whose two words are both unaligned. Links are (source word, target word)."""
    union, links = forward | reverse, forward & reverse
    aligned_src, aligned_tgt = {s for s, _ in links}, {t for _, t in links}
    grown = True
    while grown:
        grown = False
        for s, t in sorted(links):
            for ds, dt in NEIGHBOURS:
                link = (s + ds, t + dt)
                if link in union and link not in links and (link[0] not in aligned_src or link[1] not in aligned_tgt):
                    links.add(link)
                    aligned_src.add(link[0])
                    aligned_tgt.add(link[1])
                    grown = True
    for s, t in sorted(union - links):  # final-and
        if s not in aligned_src and t not in aligned_tgt:
            links.add((s, t))
            aligned_src.add(s)
            aligned_tgt.add(t)
    return links


def _read(path: Path) -> list[set[tuple[int, int]]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        out.append({tuple(int(x) for x in item.split("-")) for item in line.split()})  # type: ignore[misc]
    return out


def align(name: str, sources: list[str], targets: list[str], out: Path) -> None:
    """Align the pairs (whitespace-separated words) with aligner ``name`` and write one Pharaoh line
    per pair to ``out``."""
    eflomal = _eflomal()
    with tempfile.TemporaryDirectory() as tmp:
        fwd, rev = Path(tmp) / "fwd", Path(tmp) / "rev"
        eflomal.Aligner().align(sources, targets, links_filename_fwd=str(fwd), links_filename_rev=str(rev), quiet=True)
        joined = [grow_diag_final_and(f, r) for f, r in zip(_read(fwd), _read(rev))]
    with open(out, "w", encoding="utf-8") as f:
        for links in joined:
            f.write(" ".join(f"{s}-{t}" for s, t in sorted(links, key=lambda link: (link[1], link[0]))) + "\n")
