"""The gold word alignments of a synthetic split (``nmt.data.synthetic.gold_alignment``), one Pharaoh line
per pair, for guided-alignment training on the synthetic data (``data.alignments=<file>``):

    python scripts/synthetic_alignments.py --out train.align [--split train] [--set num_pairs=2000 ...]

``--set key=value`` changes a key of ``data.source`` in ``nmt/conf/data/synthetic.yaml``, as the run's
own ``data.source.<key>=<value>`` overrides do (the file must align the pairs the run trains on).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from nmt import CONF_DIR
from nmt.data.sources import SyntheticSource
from nmt.data.synthetic import gold_alignment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--split", default="train", choices=["train", "valid", "test"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a data.source key")
    args = parser.parse_args()
    options = yaml.safe_load((Path(CONF_DIR) / "data" / "synthetic.yaml").read_text())["source"]
    options.pop("_target_")
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in options:
            raise SystemExit(f"--set {item}: data.source has no key {key!r} ({', '.join(options)})")
        options[key] = yaml.safe_load(value)
    with open(args.out, "w", encoding="utf-8") as f:
        for sources, _ in SyntheticSource(**options).pairs(args.split):
            f.writelines(gold_alignment(s) + "\n" for s in sources)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
