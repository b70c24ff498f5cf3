"""Training speed of this tree's models against another revision's, in one process:

    python scripts/benchmark_revisions.py --before 1a3d409 [--precision bf16] [--models lstm transformer] [--decode]
        [--set lstm:model.decoder.input_feeding=none]   # a preset's override, for both revisions

Separate benchmark processes on a shared machine drift by more than the few percent a change
is judged by; here both versions train in turns inside one process. The other revision's
``nmt/`` is extracted with ``git archive`` and imported as the package ``nmt_before`` (its imports
and config targets renamed; ``nmt.bench.revisions``), both models get the same initial weights, and
they train with their own ``TranslationModule.loss`` and optimizer on the same Multi30k batches. In each round every batch
trains both, one right after the other (old-new, then new-old for the next batch), so the
machine's drift hits the two alike. Prints, per preset, before / after (above 1: this tree is
faster) as the ratio of the median round times and as the geometric mean of the paired steps'
ratios with a 95% bootstrap interval; writes the times as JSON to ``--out``. ``--decode``: the
step is beam search (beam 5, each revision's own search) on the batch instead of a training step.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf, open_dict

import nmt
from nmt.bench.revisions import import_revision
from nmt.training.builders import build_model, build_module
from nmt.kernels.malloc import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]


def before_targets(node, dropped: list[str], path: str = "model"):
    """A config with every ``_target_: nmt.*`` pointing into ``nmt_before``, without the keys its
    constructor does not take (options added since; their names go to ``dropped``). Both models
    get the same weights, so a key that only sets the initialisation changes nothing."""
    if isinstance(node, list):
        return [before_targets(v, dropped, f"{path}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    target = node.get("_target_")
    if isinstance(target, str) and target.startswith("nmt."):
        target = "nmt_before" + target[3:]
        params = inspect.signature(get_object(target)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            keep = [k for k in node if k in params or (k.startswith("_") and k.endswith("_"))]  # and _partial_ etc.
            dropped += [f"{path}.{k}={node[k]}" for k in node if k not in keep]
            node = {k: node[k] for k in keep}
        node = {**node, "_target_": target}
    return {k: v if k.startswith("_") else before_targets(v, dropped, f"{path}.{k}") for k, v in node.items()}


def paired_ratio(ratios: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The geometric mean of per-step before/after time ratios and its 95% bootstrap interval."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])


def train_config(preset: str, data_dir: str, overrides: list[str] = ()):
    try:
        cfg = compose("train", overrides=[f"model={preset}", "data=multi30k", f"paths.data_dir={data_dir}", *overrides],
                      return_hydra_config=True)
    except HydraException as error:
        raise SystemExit(f"--set {preset}: {error}") from None
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = tempfile.mkdtemp()
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)  # the optimizer's per-preset rate reads the chosen model
    with open_dict(cfg):
        del cfg["hydra"], cfg.module["report_dir"], cfg.module["report_name"]
        # what only the report reads, as every revision takes it (today's `auto` came later)
        cfg.module.length_buckets, cfg.module.sacrebleu_tokenize = [10, 20, 30, 40, 50, 60], None
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--models", nargs="*", default=["lstm", "lstm_bahdanau", "lstm_luong", "transformer"])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=16, help="batches per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmark_revisions.json")
    parser.add_argument("--decode", action="store_true", help="time beam search (beam 5) instead of training steps")
    parser.add_argument("--set", action="append", default=[], metavar="PRESET:KEY=VALUE",
                        help="an override of one preset's config for both revisions, e.g. to build an architecture "
                             "the older revision also has (repeatable)")
    args = parser.parse_args()
    overrides: dict[str, list[str]] = {}
    for item in args.set:
        preset, _, override = item.partition(":")
        if preset not in args.models or "=" not in override or override.startswith(("=", "data.", "+data.")):
            parser.error(f"--set {item}: expected PRESET:KEY=VALUE with PRESET one of --models ({' '.join(args.models)}) "
                         "and a key outside data (the batches are shared)")
        overrides.setdefault(preset, []).append(override)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # for both versions (train.py sets it on CPUs)
    import_revision(args.before, Path(tempfile.mkdtemp()))
    import nmt_before

    try:  # where the revision keeps its LightningModule (nmt/training/ since the tree was split by role)
        from nmt_before.training.lit_module import TranslationModule as BeforeModule
    except ModuleNotFoundError:
        from nmt_before.lit_module import TranslationModule as BeforeModule

    for package in (nmt, nmt_before):  # older revisions register resolvers at import
        if hasattr(package, "register_resolvers"):
            package.register_resolvers()
    autocast = partial(torch.autocast, "cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext
    results = {}
    with initialize_config_dir(config_dir=str(ROOT / "nmt" / "conf"), version_base="1.3"):
        data_cfg = train_config(args.models[0], args.data_dir).data
        with open_dict(data_cfg):
            data_cfg.max_tokens = args.max_tokens
        dm = instantiate(data_cfg)
        dm.setup("fit")
        loader = iter(dm.train_dataloader())
        batches = [next(loader) for _ in range(args.steps)]
        for preset in args.models:
            cfg = train_config(preset, args.data_dir, overrides.get(preset, []))
            torch.manual_seed(0)
            model = build_model(cfg, dm.src_vocab.vocab_size, dm.tgt_vocab.vocab_size)
            dropped: list[str] = []
            try:
                old_model = instantiate(OmegaConf.create(before_targets(OmegaConf.to_container(cfg.model, resolve=True), dropped)))
                old_model.load_state_dict(model.state_dict())
            except (InstantiationException, ImportError, RuntimeError) as error:
                raise SystemExit(f"{preset}: {args.before} cannot build this preset as it is configured today "
                                 f"({error.__cause__ or error}); compare an architecture both revisions have: "
                                 f"--set {preset}:KEY=VALUE") from None
            if dropped:
                print(f"{preset}: {args.before} takes no {', '.join(dropped)}; built without them")
            kwargs = {k: v for k, v in OmegaConf.to_container(cfg.module, resolve=True).items() if k != "_target_"}
            takes = inspect.signature(BeforeModule.__init__).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
                older = sorted(k for k in kwargs if k not in takes)  # options added since the revision
                if older:
                    print(f"{preset}: {args.before}'s module takes no {', '.join(older)}; built without them")
                kwargs = {k: v for k, v in kwargs.items() if k in takes}
            sides = {"before": BeforeModule(old_model, optimizer=instantiate(cfg.optimizer), **kwargs),
                     "after": build_module(cfg, model)}
            optimizers = {name: instantiate(cfg.optimizer)(params=module.parameters()) for name, module in sides.items()}

            def step(name: str, batch: dict) -> float:
                module, optimizer = sides[name], optimizers[name]
                start = time.perf_counter()
                if args.decode:
                    with torch.no_grad(), autocast():
                        searches[name](module.model, batch["src"], batch["src_mask"], beam_size=5)
                    return time.perf_counter() - start
                with autocast():
                    loss, _ = module.loss(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                return time.perf_counter() - start

            if args.decode:
                from nmt.decoding.search import beam_search

                try:
                    from nmt_before.decoding.search import beam_search as before_search
                except ModuleNotFoundError:
                    from nmt_before.search import beam_search as before_search
                searches = {"before": before_search, "after": beam_search}
            for module in sides.values():
                module.train(not args.decode)
            for batch in batches[:2]:  # warm-up
                step("before", batch), step("after", batch)
            times = {"before": [], "after": []}  # per round, the seconds of its steps
            pairs = []  # before / after on the same batch, one right after the other
            for r in range(args.rounds):
                spent = {"before": 0.0, "after": 0.0}
                for i, batch in enumerate(batches):
                    seconds = {name: step(name, batch) for name in (("before", "after") if (r + i) % 2 == 0 else ("after", "before"))}
                    pairs.append(seconds["before"] / seconds["after"])
                    for name in spent:
                        spent[name] += seconds[name]
                for name in spent:
                    times[name].append(spent[name])
            ratio = statistics.median(times["before"]) / statistics.median(times["after"])
            paired, low, high = paired_ratio(pairs)
            results[preset] = {"seconds": times, "before_over_after": ratio, "step_ratios": pairs,
                               "paired": {"geometric_mean": paired, "ci95": [low, high]}}
            print(f"{preset} {args.precision}{' decoding' if args.decode else ''}: after is {ratio:.3f}x the speed of {args.before} by the median rounds, "
                  f"{paired:.3f}x (95% CI {low:.3f}-{high:.3f}) by {len(pairs)} paired steps "
                  f"(round seconds before {[round(t, 2) for t in times['before']]}, after {[round(t, 2) for t in times['after']]})",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"before": args.before, "precision": args.precision, "decode": args.decode, "results": results},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
