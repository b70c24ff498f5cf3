"""``nmt-prune`` (``nmt.prune``): heads pruned by importance level by level, each level's report
and release file; a pruned file, read back, translates as the full model with the same heads
masked; the order heads are pruned in; bad levels refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nmt.models import head_mask
from tests.conftest import compose_run

SAVED = Path(__file__).parent / "data" / "saved" / "transformer.ckpt"


def test_pruned_files_translate_as_the_masked_model(tmp_path):
    from nmt.inference.translator import Translator, encode_sources, pad
    from nmt.prune import run_prune

    out = tmp_path / "prune"
    cfg = compose_run("prune", out, [f"ckpt={SAVED}", "levels=[0,0.5]", "pairs=8", "importance_pairs=8",
                                     "n_bootstrap=0", "decoding=beam", "device=cpu", f"paths.cache_dir={tmp_path / 'cache'}"])
    run_prune(cfg)
    summary = json.loads((out / "pruning.json").read_text())
    assert [r["level"] for r in summary["levels"]] == [0.0, 0.5] and summary["pairs"] == 8
    full, half = summary["levels"]
    assert half["heads"] == full["of"] // 2 and half["parameters"] < full["parameters"]
    assert "| 50% | 3/6 |" in (out / "pruning.md").read_text()
    file = torch.load(out / "level_50" / "pruned.ckpt", map_location="cpu", weights_only=True)
    kept = file["pruned"]["kept"]
    pruned = Translator.load(out / "level_50" / "pruned.ckpt", device="cpu", precision="32")
    masked = Translator.load(SAVED, device="cpu", precision="32")
    assert head_mask.head_counts(pruned.model) == {kind: [len(h) for h in layers] for kind, layers in kept.items()}
    masks = {kind: [torch.tensor([float(h in heads) for h in range(a.num_heads)]) for a, heads in zip(found, kept[kind])]
             for kind, found in head_mask.attentions(masked.model).items()}
    head_mask.set_head_mask(masked.model, masks)
    sources = (Path(__file__).parent / "data" / "tiny" / "test.src").read_text().splitlines()[:8]
    for beam in (1, 4):
        assert [t.text for t in pruned.translate(sources, beam_size=beam)] == \
               [t.text for t in masked.translate(sources, beam_size=beam)]
    assert (out / "level_50" / "hyp.txt").read_text().splitlines() == [t.text for t in pruned.translate(sources)]
    src, src_mask = pad(encode_sources(sources, masked.src_vocab, 64), torch.device("cpu"))
    tgt_in = src.clone()  # any tokens: the logits of the two models at every position
    with torch.no_grad():
        torch.testing.assert_close(pruned.model(src, src_mask, tgt_in), masked.model(src, src_mask, tgt_in), atol=1e-5, rtol=0)


def test_the_least_important_heads_go_first_and_every_attention_keeps_one():
    scores = {"encoder": [torch.tensor([0.1, 0.9]), torch.tensor([0.2, 0.3])], "cross": [torch.tensor([0.05, 0.01])]}
    assert head_mask.least_important(scores, 0.0) == {"encoder": [[0, 1], [0, 1]], "cross": [[0, 1]]}
    assert head_mask.least_important(scores, 0.4) == {"encoder": [[1], [0, 1]], "cross": [[0]]}
    # 0.8 of 6 heads is 5, but three attentions keep one each: 3 pruned
    assert head_mask.least_important(scores, 0.8) == {"encoder": [[1], [1]], "cross": [[0]]}


@pytest.mark.parametrize("levels", ["[0.5,0.2]", "[1.0]", "[]"])
def test_bad_levels_are_refused_in_one_line(levels):
    from nmt.prune import levels_of

    with pytest.raises(ValueError, match=r"^levels=.*: increasing shares of the heads to prune, each from 0 up to \(not including\) 1$"):
        levels_of(json.loads(levels))


@pytest.mark.parametrize("override, message", [("pairs=0", "pairs=0: a number of pairs, at least 1 (null: all)"),
                                               ("importance_pairs=true", "importance_pairs=True: a number of pairs, at least 1")])
def test_bad_pair_counts_are_refused_in_one_line(tmp_path, override, message):
    from nmt.prune import run_prune

    cfg = compose_run("prune", tmp_path / "prune", [f"ckpt={SAVED}", override])
    with pytest.raises(ValueError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        run_prune(cfg)
