"""Process-wide state belongs to the entry points: importing nmt registers no config resolver, switches
no matplotlib backend and imports no checkpoint code into nmt.data; training and translating leave
torch's thread count as they found it; and nothing reseeds or draws from the global torch RNG
between training batches, so the state a checkpoint saves is the one the next batch starts from."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pytorch_lightning.callbacks import Callback

import nmt.training.builders
import nmt.train
from nmt.checkpoints.loading import load_checkpoint
from nmt.decoding.search import greedy_search
from nmt.training.lit_module import TranslationModule
from nmt.inference.translator import translate_lines
from tests.conftest import ROOT, compose_train, translate_here

# 10 steps with dropout: a validation after steps 3, 6 and 9, epochs of 5 batches (a new loader
# iterator before step 6), last.ckpt every 4 steps.
STEPS = [
    "model.dropout=0.3", "trainer.max_epochs=-1", "trainer.max_steps=10", "trainer.val_check_interval=3",
    "trainer.check_val_every_n_epoch=null", "callbacks.last_checkpoint.every_n_train_steps=4", "test=false",
]


def python(code: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


class EndStates(Callback):
    """The global torch RNG state at the end of every training batch."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def on_train_batch_end(self, *args) -> None:
        self.states.append(torch.get_rng_state())


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A 10-step run with 2 torch threads, recording the RNG state where each training step starts
    (inside ``training_step``, after every hook) and where each batch ends."""
    tmp_path = tmp_path_factory.mktemp("traced")
    cfg = compose_train(tmp_path, STEPS)
    starts: list[torch.Tensor] = []
    epochs: list[int] = []
    ends = EndStates()
    step = TranslationModule.training_step
    group = nmt.training.builders.instantiate_group

    def traced_step(self, batch, batch_idx):
        starts.append(torch.get_rng_state())
        epochs.append(self.current_epoch)
        return step(self, batch, batch_idx)

    def with_ends(node):
        built = group(node)
        return [*built, ends] if node is cfg.get("callbacks") else built

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TranslationModule, "training_step", traced_step)
        patch.setattr(nmt.training.builders, "instantiate_group", with_ends)
        torch.set_num_threads(2)
        try:
            nmt.train.train(cfg)
            threads = torch.get_num_threads()
        finally:
            torch.set_num_threads(1)  # conftest's
    return SimpleNamespace(starts=starts, ends=ends.states, epochs=epochs, threads=threads,
                           ckpt=Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")


def test_each_step_starts_from_the_rng_state_the_previous_one_ended_with(traced):
    """No reseeding per batch, and no draws between batches: not by new loader iterators at epoch
    starts, not by validation; last.ckpt saves the state the next step would start from."""
    assert len(traced.starts) == len(traced.ends) == 10 and traced.epochs[5] == traced.epochs[4] + 1
    for i in range(1, 10):
        assert torch.equal(traced.starts[i], traced.ends[i - 1]), f"step {i + 1}"
        assert not torch.equal(traced.starts[i], traced.ends[i]), f"step {i + 1} drew no dropout mask"
    saved = torch.load(traced.ckpt, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 10 and torch.equal(saved["rng"]["torch"], traced.ends[-1])


def test_training_and_translating_leave_the_thread_count_alone(traced):
    assert traced.threads == 2  # training set to 2 threads ended with 2
    loaded = load_checkpoint(traced.ckpt)
    lines = (ROOT / "tests/data/tiny/test.src").read_text().splitlines()[:8]
    torch.set_num_threads(2)
    try:
        translate_lines(loaded.model, loaded.src_vocab, loaded.tgt_vocab, lines, greedy_search, max_tokens=40, workers=2)
        started: list[int] = []  # torch.set_num_threads in the workers also sets the count new threads start with
        thread = threading.Thread(target=lambda: started.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 2 and started == [2]
    finally:
        torch.set_num_threads(1)


def test_every_rank_resumes_from_its_own_rng_state(monkeypatch):
    """Under DDP a checkpoint (written by rank 0) holds the torch RNG state of every rank."""
    import torch.distributed as dist

    module = TranslationModule(torch.nn.Linear(2, 2), optimizer=None)
    other = torch.Generator().manual_seed(7).get_state()  # rank 1's state
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, mine: out.__setitem__(slice(None), [mine, {"torch": other, "cuda": None}]))
    checkpoint: dict = {}
    module._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), callbacks=[], world_size=2, global_rank=0,
                                      is_global_zero=True, callback_metrics={})
    try:
        module.on_save_checkpoint(checkpoint)
    finally:
        module._trainer = None
    mine = torch.get_rng_state()
    assert torch.equal(checkpoint["rng"]["torch"], mine) and torch.equal(checkpoint["rng"]["ranks"][1]["torch"], other)

    module._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), callbacks=[], world_size=2, global_rank=1,
                                      is_global_zero=False)
    try:
        module.on_load_checkpoint(checkpoint)
        assert torch.equal(torch.get_rng_state(), other)
    finally:
        torch.set_rng_state(mine)
        module._trainer = None


@pytest.fixture(scope="module")
def imports_then_entry_points(tmp_path_factory) -> tuple[list[str], str, Path]:
    """One Python process: import every module with a side effect to fear and draw a heatmap
    under the caller's matplotlib backend, then run each entry point's ``main`` composing only
    (``--cfg job``), clearing the resolver before each. (Import checks of ``nmt.data``: static, in
    tests/test_import_graph.py.)"""
    png = tmp_path_factory.mktemp("side_effects") / "attention.png"
    code = """
import importlib, sys
import matplotlib
matplotlib.use("svg")  # the caller's backend, which nmt must keep
from omegaconf import OmegaConf
import nmt, nmt.models.base, nmt.data.datamodule, nmt.evaluation.plots, nmt.evaluation.length_report, nmt.train, nmt.translate
import nmt.evaluate, nmt.serve.app
import torch
nmt.evaluation.plots.plot_attention(torch.rand(3, 4), list("abcd"), list("xyz"), sys.argv[1])
print("## imported", OmegaConf.has_resolver("pad_to"), matplotlib.get_backend())
for name in ["nmt.train", "nmt.translate", "nmt.evaluate", "nmt.average", "nmt.export", "nmt.serve.app",
             "nmt.data.prepare", "nmt.data.stats"]:
    main = importlib.import_module(name).main
    OmegaConf.clear_resolver("pad_to")
    resolve = ["model.src_vocab_size=10", "model.tgt_vocab_size=10", "trainer=gpu", "--resolve"] if name == "nmt.train" else []
    sys.argv = [name, "--cfg", "job", *resolve]  # compose and print, run nothing
    main()
    print("##", name, OmegaConf.has_resolver("pad_to"))
"""
    out = python(code, str(png))
    return [line.split()[1:] for line in out.splitlines() if line.startswith("## ")], out, png


@pytest.mark.slow  # one process importing everything and composing every entry point: the slow tier
def test_importing_nmt_registers_no_resolver_and_keeps_the_matplotlib_backend(imports_then_entry_points):
    marks, _, png = imports_then_entry_points
    assert marks[0] == ["imported", "False", "svg"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # the same process: the slow tier
def test_every_entry_point_registers_the_resolvers_before_hydra_composes(imports_then_entry_points):
    marks, out, _ = imports_then_entry_points
    assert [m[1:] for m in marks[1:]] == [["True"]] * 8 and len(marks) == 9
    assert "vocab_size: 16" in out


def test_translate_resolves_pad_to_in_a_checkpoints_model_config(traced, tmp_path, capsys):
    """A stored model config that still holds ``${pad_to:...}`` loads in translate.py."""
    checkpoint = torch.load(traced.ckpt, map_location="cpu", weights_only=True)
    model = checkpoint["run_config"]["model"]
    model["encoder"]["vocab_size"] = "${pad_to:${..src_vocab_size},${..vocab_multiple}}"
    model["decoder"]["vocab_size"] = "${pad_to:${..tgt_vocab_size},${..vocab_multiple}}"
    ckpt = tmp_path / "unresolved.ckpt"
    torch.save(checkpoint, ckpt)
    source = tmp_path / "in.txt"
    source.write_text("a b c\n\nd e\n")
    result = translate_here(capsys, f"ckpt={ckpt}", "decoding=greedy", f"input={source}")  # translate.py's body
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = translate_here(capsys, f"ckpt={traced.ckpt}", "decoding=greedy", f"input={source}")
    assert result.stdout == resolved.stdout and len(result.stdout.split("\n")) == 4  # the same model, the same lines
