"""Every tensor and value a checkpoint holds is checked, not only its weights: optimizer and
scheduler state, RNG states, callbacks, loops and counters (``read_checkpoint`` for every entry
point, ``check_resume`` for what resuming restores). Each crafted file is refused in one line
naming the file and the value, before any memory is spent on it or any kernel writes to it."""

from __future__ import annotations

import functools

import copy
import re
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nmt.average import run_average
from nmt.cli_io import EXIT_ERROR
from nmt.checkpoints.files import MAX_NAMES, CheckpointError, read_checkpoint
from nmt.checkpoints.finetune import read_init
from nmt.checkpoints.loading import load_checkpoint
from nmt.checkpoints.resume import check_resume
from nmt.export import export
from nmt.exporters.folder import new_folder
from nmt.serve.app import load as serve_load
from nmt.train import train
from tests.conftest import ROOT, TINY, compose_train, evaluate_here, heads, serve_cfg, translate_here

TRAIN = ["trainer.max_steps=3", "trainer.max_epochs=-1", "test=false"]  # fused Adam (the presets' optimizer)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("state")
    cfg = compose_train(tmp_path, TRAIN, model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def loaded(trained):
    return load_checkpoint(trained)


def crafted(trained: Path, tmp_path: Path, edit, name: str = "crafted.ckpt") -> Path:
    checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
    edit(checkpoint)
    path = tmp_path / name
    torch.save(checkpoint, path)
    return path


def param_state(checkpoint: dict, numel: int) -> tuple[int, dict]:
    """The id and Adam state of the first parameter of ``numel`` values."""
    return next((i, s) for i, s in checkpoint["optimizer_states"][0]["state"].items() if s["exp_avg"].numel() == numel)


def set_exp_avg(value, numel: int = 16):
    return lambda c: param_state(c, numel)[1].__setitem__("exp_avg", value)


def foreach(c: dict) -> None:
    c["optimizer_states"][0]["param_groups"][0].update(fused=False, foreach=True)
    set_exp_avg(torch.zeros(1).expand(16))(c)


def first_layer_weight(c: dict) -> str:
    return next(k for k in c["state_dict"] if k.startswith("model.encoder.layers.0."))


def nested_weight(c: dict) -> None:
    c["state_dict"][first_layer_weight(c)] = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(5)])


def aliases(c: dict, count: int = 400_000) -> None:
    """Item 4 of the review: 400,000 extra names over the first layer's tensors, 50,000 layers
    (past the structure's limits since they were set); ``count`` names."""
    layer0 = {k.removeprefix("model.encoder.layers.0."): v for k, v in c["state_dict"].items()
              if k.startswith("model.encoder.layers.0.")}
    names = (f"model.encoder.layers.{i}.{suffix}" for i in range(1, 50000) for suffix in layer0)
    for _, name in zip(range(count), names):
        c["state_dict"][name] = layer0[name.split(".", 4)[4]]
    c["run_config"]["model"]["encoder"]["num_layers"] = 50000


def transposed(c: dict) -> None:
    pid, state = next((i, s) for i, s in c["optimizer_states"][0]["state"].items()
                      if s["exp_avg"].dim() == 2 and s["exp_avg"].shape[0] != s["exp_avg"].shape[1])
    state["exp_avg"] = state["exp_avg"].t().contiguous().t()


def alias_a_weight(c: dict) -> None:
    _, state = param_state(c, 16)
    state["exp_avg"] = next(v for v in c["state_dict"].values() if v.shape == state["exp_avg"].shape)


def pid16(trained: Path) -> int:
    return param_state(torch.load(trained, map_location="cpu", weights_only=True), 16)[0]


# edit -> the message after "<file>: " (a callable of the checkpoint for names it decides)
FILE_CASES = {
    "fused exp_avg repeated (item 1)": (set_exp_avg(torch.zeros(1).expand(16)), lambda c: (
        f"optimizer_states[0].state[{param_state(c, 16)[0]}].exp_avg is not a plain dense tensor (it repeats 4 stored "
        "bytes as a (16,) tensor); refused: a checkpoint stores every value it holds")),
    "foreach exp_avg repeated (item 1)": (foreach, lambda c: (
        f"optimizer_states[0].state[{param_state(c, 16)[0]}].exp_avg is not a plain dense tensor (it repeats 4 stored "
        "bytes as a (16,) tensor); refused: a checkpoint stores every value it holds")),
    "float64 exp_avg of 2**29 (item 2)": (set_exp_avg(torch.zeros(1, dtype=torch.float64).expand(2**29)), lambda c: (
        f"optimizer_states[0].state[{param_state(c, 16)[0]}].exp_avg is not a plain dense tensor (it repeats 8 stored "
        "bytes as a (536870912,) tensor); refused: a checkpoint stores every value it holds")),
    "NumPy key of 2**30 (item 2)": (
        lambda c: c["rng"]["numpy"]["state"].__setitem__("key", torch.zeros(1, dtype=torch.int64).expand(2**30)),
        lambda c: "rng.numpy.state.key is not a plain dense tensor (it repeats 8 stored bytes as a (1073741824,) "
                  "tensor); refused: a checkpoint stores every value it holds"),
    "400,000 names over one layer (item 4)": (aliases, lambda c: (
        "its pickled structure (crafted/data.pkl) holds over 1,000,000 operations or 250,000 containers, where a "
        "checkpoint's holds about 10,000 and 3,000: refused, it was not written by nmt")),
    "40,000 names over one layer": (functools.partial(aliases, count=40_000), lambda c: (
        f"{first_layer_weight(c)} is stored once and named more than {MAX_NAMES} times (also as "
        f"{first_layer_weight(c).replace('layers.0.', f'layers.{MAX_NAMES}.')}); refused: a tied weight of an nmt "
        f"model has at most {MAX_NAMES} names")),
    "nested weight (item 9)": (nested_weight, lambda c: (
        f"{first_layer_weight(c)} is a nested tensor; refused: a checkpoint holds plain dense tensors")),
    "nested optimizer state": (set_exp_avg(torch.nested.nested_tensor([torch.zeros(8), torch.zeros(8)],
                                                                        layout=torch.jagged)), lambda c: (
        f"optimizer_states[0].state[{param_state(c, 16)[0]}].exp_avg is a nested tensor; refused: a checkpoint holds "
        "plain dense tensors")),
    "transposed moment": (transposed, None),
    "complex RNG state": (lambda c: c["rng"].__setitem__("torch", torch.zeros(2528, dtype=torch.complex64)),
                          lambda c: "rng.torch is a complex64 tensor; refused: a checkpoint holds float, integer and "
                                    "bool tensors"),
    "moment aliasing a weight": (alias_a_weight, None),
    "global_step 'abc' (item 10)": (lambda c: c.__setitem__("global_step", "abc"), lambda c: (
        "global_step is 'abc', not a count from 0 to 9007199254740992; refused: it was not written by nmt")),
    "monitor a string": (lambda c: c.__setitem__("monitor", "best"), lambda c: (
        "monitor is 'best', not a mapping of the validation score's name, value and step; refused: it was not "
        "written by nmt")),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("400,000") else c
                                  for c in FILE_CASES])  # 400,000 names: the 40,000 case runs by default
def test_every_tensor_and_value_of_a_file_is_checked_by_the_one_reader(trained, tmp_path, case):
    edit, message = FILE_CASES[case]
    path = crafted(trained, tmp_path, edit)
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(path)
    text = str(raised.value)
    assert "\n" not in text and text.startswith(f"{path}: ")
    if message is not None:
        assert text == f"{path}: {message(torch.load(trained, map_location='cpu', weights_only=True))}"
    elif case == "transposed moment":
        assert "is not a plain dense tensor (a (" in text and "refused: a checkpoint stores every tensor contiguously" in text
    else:
        assert ".exp_avg shares its storage with model." in text


def test_the_aliases_are_refused_before_any_model_is_built(trained, tmp_path, monkeypatch):
    """Item 4: building 50,000 layers first took 91 s and 3.0 GB; the file is refused on reading."""
    import nmt.checkpoints.file_config as file_config

    path = crafted(trained, tmp_path, functools.partial(aliases, count=40_000))
    monkeypatch.setattr(file_config, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(CheckpointError, match="is stored once and named more than"):
        load_checkpoint(path)


def test_the_files_nmt_writes_pass(trained, tmp_path):
    """Tied weights (one tensor under 5 names), ModelCheckpoint's scores (one tensor under 2
    names), the files of tests/data/saved (an EMA run's: test_checkpoint_files.py resumes one)."""
    for path in (trained, ROOT / "tests" / "data" / "saved" / "transformer.ckpt",
                 ROOT / "tests" / "data" / "saved" / "lstm_luong.release.ckpt"):
        read_checkpoint(path)


def sgd_state(c: dict) -> None:
    """Every parameter's state as SGD with momentum keeps it."""
    state = c["optimizer_states"][0]["state"]
    for pid, values in state.items():
        state[pid] = {"momentum_buffer": torch.zeros_like(values["exp_avg"])}


RESUME_CASES = {
    "an SGD state in an Adam run (3)": (sgd_state, "optimizer_states[0].state is 'a state of momentum_buffer', not the "
                                                   "state torch.optim.Adam keeps for every parameter (exp_avg, "
                                                   "exp_avg_sq, step): the file was saved with another optimizer"),
    "an emptied optimizer state (3)": (lambda c: c["optimizer_states"][0].__setitem__("state", {}),
                                       None),
    "rng.python 'x' (item 10)": (lambda c: c["rng"].__setitem__("python", "x"),
                                 "rng.python is 'x', not Python's random state (version 3, 625 words, a Gaussian or null)"),
    "7-byte rng.torch (item 10)": (lambda c: c["rng"].__setitem__("torch", torch.zeros(7, dtype=torch.uint8)),
                                   f"rng.torch is a uint8 tensor of shape (7,), not torch's CPU generator state "
                                   f"({torch.get_rng_state().numel()} bytes)"),
    "counters.train_tokens 'lots' (item 10)": (lambda c: c["counters"].__setitem__("train_tokens", "lots"),
                                               "counters.train_tokens is 'lots', not a count"),
    "a moment of 4 values for 16 (item 1, dense)": (set_exp_avg(torch.zeros(4)), None),
    "a step of 16 values": (lambda c: param_state(c, 16)[1].__setitem__("step", torch.zeros(16)), None),
    "NumPy key out of range": (lambda c: c["rng"]["numpy"]["state"].__setitem__("key", torch.full((624,), -1)),
                               "rng.numpy.state.key is a int64 tensor of shape (624,), not 624 int64 words from 0 to 2**32"),
    "a scheduler attribute": (lambda c: c["lr_schedulers"][0].__setitem__("warmup_steps", "x"),
                              "lr_schedulers[0].warmup_steps is 'x', not a key of a torch scheduler's state"),
    "a negative loop count": (lambda c: c["loops"]["fit_loop"]["epoch_progress"]["total"].__setitem__("ready", -5),
                              "loops.fit_loop.epoch_progress.total.ready is -5, not a count from 0 or a flag"),
    "a data position 'x'": (lambda c: c["loops"]["fit_loop"]["state_dict"]["combined_loader"][0].__setitem__("epoch", "x"),
                            "loops.fit_loop.state_dict.combined_loader[0].epoch is 'x', not a count from 0 or a flag"),
    "a top-k file outside the run": (lambda c: next(v for k, v in c["callbacks"].items() if "ModelCheckpoint" in k)
                                     .__setitem__("best_k_models", {"/etc/hosts": torch.tensor(9.0)}), None),
    "fused with differentiable": (lambda c: c["optimizer_states"][0]["param_groups"][0].__setitem__(
        "differentiable", True), "optimizer_states[0].param_groups[0].differentiable is True, not false (nmt never "
                                 "trains with it)"),
    "world_size 0": (lambda c: c.__setitem__("world_size", 0), "world_size is 0, not a number of processes from 1"),
    "a CUDA state of 17 bytes": (lambda c: c["rng"].__setitem__("cuda", [torch.zeros(17, dtype=torch.uint8)]),
                                 "rng.cuda is a list, not a list of CUDA generator states (16 or 816 bytes each) or null"),
    "a loss scale 'x'": (lambda c: c.__setitem__("MixedPrecision", {"scale": "x", "_growth_tracker": 0}),
                         "MixedPrecision.scale is 'x', not a finite number above 0"),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_a_training_state_train_py_did_not_write_is_refused_before_resuming(trained, loaded, tmp_path, case):
    edit, message = RESUME_CASES[case]
    path = crafted(trained, tmp_path, edit)
    with pytest.raises(CheckpointError) as raised:
        check_resume(path, loaded.model, loaded.src_vocab, loaded.tgt_vocab)
    text = str(raised.value)
    assert "\n" not in text
    tail = "; refused: it was not written by nmt's train.py, resume from another checkpoint"
    if message is not None:
        assert text == f"ckpt_path={path}: {message}{tail}"
    else:
        assert text.startswith(f"ckpt_path={path}: ") and text.endswith(tail)
    if case.startswith("a moment of 4"):
        assert text == (f"ckpt_path={path}: optimizer_states[0].state[{pid16(trained)}].exp_avg is a float32 tensor of "
                        f"shape (4,), not a float tensor of its parameter's shape (16,){tail}")
    check_resume(trained, loaded.model, loaded.src_vocab, loaded.tgt_vocab)  # the file train.py wrote resumes


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_every_entry_point_refuses_a_crafted_file_in_one_line(trained, tmp_path, capsys):
    """Item 9's nested weight through translate, evaluate, serve's start-up, init_from, the three
    exports and average; item 10's step through average (ckpts= and run=); item 11's piece."""
    nested = crafted(trained, tmp_path, nested_weight, "nested.ckpt")
    message = f"{nested}: {first_layer_weight(read_checkpoint(trained))} is a nested tensor; refused: a checkpoint " \
              "holds plain dense tensors"
    source = ROOT / "tests" / "data" / "tiny" / "test.src"
    for result in (translate_here(capsys, f"ckpt={nested}", f"input={source}"),
                   evaluate_here(capsys, tmp_path / "eval", f"ckpts=[{nested}]")):
        assert result.returncode == EXIT_ERROR and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"error: {message}"
    with pytest.raises(CheckpointError) as raised:
        serve_load(serve_cfg(nested))
    assert str(raised.value) == message
    with pytest.raises(CheckpointError) as raised:
        read_init(nested)
    assert str(raised.value) == f"init_from={message}"
    for fmt in ("release", "ctranslate2", "huggingface"):
        with pytest.raises(CheckpointError) as raised:
            export(OmegaConf.create({"ckpt": str(nested), "weights": "stored", "allow_pickle": False, "format": fmt,
                                     "out": str(tmp_path / f"out-{fmt}")}))
        assert str(raised.value) == message and not (tmp_path / f"out-{fmt}").exists()
    base = {"weights": "raw", "allow_pickle": False, "last": 2, "best": None}
    with pytest.raises(CheckpointError) as raised:
        run_average(OmegaConf.create({**base, "ckpts": [str(trained), str(nested)], "out": str(tmp_path / "a.ckpt")}))
    assert str(raised.value) == message

    step = crafted(trained, tmp_path, lambda c: c.__setitem__("global_step", "abc"), "step.ckpt")
    refused = f"{step}: global_step is 'abc', not a count from 0 to 9007199254740992; refused: it was not written by nmt"
    with pytest.raises(CheckpointError) as raised:
        run_average(OmegaConf.create({**base, "ckpts": [str(trained), str(step)], "out": str(tmp_path / "a.ckpt")}))
    assert str(raised.value) == refused
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "a.ckpt").write_bytes(trained.read_bytes())
    (run / "checkpoints" / "b.ckpt").write_bytes(step.read_bytes())
    with pytest.raises(CheckpointError) as raised:
        run_average(OmegaConf.create({**base, "run": str(run), "ckpts": None, "out": None}))
    assert str(raised.value) == refused.replace(str(step), str(run / "checkpoints" / "b.ckpt"))


def test_a_piece_that_is_not_utf8_is_refused_naming_the_file(trained, tmp_path):
    """Item 11: the codec's message named neither the file nor the piece."""
    from sentencepiece import sentencepiece_model_pb2

    def edit(c: dict) -> None:
        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(c["tokenizers"]["tgt"])
        model.pieces[-1].piece = "zzzzQQ"
        c["tokenizers"]["tgt"] = model.SerializeToString().replace(b"zzzzQQ", b"zz\xff\xfeQQ")

    path = crafted(trained, tmp_path, edit)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    size = len(load_checkpoint(trained).tgt_vocab)
    assert str(raised.value) == (f"the tgt tokenizer saved in {path}: piece {size - 1} is not valid UTF-8 "
                                 r"(b'zz\xff\xfeQQ'); a SentencePiece model trained by nmt has none")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_exported_folder_gets_the_modes_the_umask_gives(tmp_path, umask):
    """Item 11: the Hugging Face export's folder was 0700 and its files 0600 whatever the umask
    (mkdtemp's folder, the writers' files); every export's folder now follows the umask."""
    before = os.umask(umask)
    try:
        with new_folder(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "weights").write_bytes(b"x")
            os.chmod(tmp / "sub" / "weights", 0o600)
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(before)
    out = tmp_path / "out"
    assert {stat.S_IMODE(p.stat().st_mode) for p in [out, out / "sub"]} == {0o777 & ~umask}
    assert {stat.S_IMODE(p.stat().st_mode) for p in [out / "sub" / "weights", out / "config.json"]} == {0o666 & ~umask}


def resume_command(path: Path, out: Path) -> list[str]:
    overrides = [o for o in TINY if o != "trainer.max_steps=-1"] + ["model=transformer", *heads("transformer")]
    return [sys.executable, str(ROOT / "train.py"), *overrides, "trainer.max_steps=6", "trainer.max_epochs=-1",
            "test=false", f"ckpt_path={path}", f"hydra.run.dir={out}"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ["fused", "small", "nested", "python", "torch", "counters"])
def test_train_py_refuses_a_crafted_resume_in_one_line_without_crashing(trained, tmp_path, case):
    """Item 1: a repeated (or too small) Adam moment under the fused kernel once crashed the process
    (SIGSEGV, then glibc's 'corrupted size'): the resume runs in its own process."""
    edit = {"fused": set_exp_avg(torch.zeros(1).expand(16)), "small": set_exp_avg(torch.zeros(4)),
            "nested": nested_weight, "python": RESUME_CASES["rng.python 'x' (item 10)"][0],
            "torch": RESUME_CASES["7-byte rng.torch (item 10)"][0],
            "counters": RESUME_CASES["counters.train_tokens 'lots' (item 10)"][0]}[case]
    path = crafted(trained, tmp_path, edit)
    command = [*resume_command(path, tmp_path / "run"), f"paths.cache_dir={trained.parents[3] / 'nmt-cache'}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == EXIT_ERROR, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {'ckpt_path=' if case not in ('fused', 'nested') else ''}{path}: "), last


def test_a_kept_optimizer_state_is_checked_as_a_resumed_one(trained, loaded, tmp_path):
    """init_optimizer=keep: a one-value moment passed the shape check (it held tensors of one or
    more dimensions to their parameter's shape), and the fused kernel wrote past it."""
    from nmt.checkpoints.finetune import load_optimizer_state

    saved = copy.deepcopy(torch.load(trained, map_location="cpu", weights_only=True)["optimizer_states"][0])
    pid, state = param_state({"optimizer_states": [saved]}, 16)
    state["exp_avg"] = torch.zeros(())
    optimizer = torch.optim.Adam(loaded.model.parameters(), fused=True)
    with pytest.raises(CheckpointError) as raised:
        load_optimizer_state(optimizer, saved, f"init_from={trained}")
    assert str(raised.value) == (
        f"init_optimizer=keep: init_from={trained}: optimizer_states[0].state[{pid}].exp_avg is a float32 tensor of "
        "shape (), not a float tensor of its parameter's shape (16,); refused: it was not written by nmt's train.py, "
        "set init_optimizer=fresh")


def ema_raw_repeated(c: dict) -> None:
    c["current_model_state"] = {k: v.clone() for k, v in c["state_dict"].items()}
    name = first_layer_weight(c)
    c["current_model_state"][name] = torch.zeros(1).expand_as(c["state_dict"][name])


# The same tricks where the review did not look: an EMA run's raw weights, the scheduler's state,
# the record of a fine-tuning run's origin (written to summary.json), a callback's score.
ELSEWHERE = {
    "EMA raw weights repeated": (ema_raw_repeated, "is not a plain dense tensor (it repeats 4 stored bytes"),
    "scheduler rates as a repeated tensor": (
        lambda c: c["lr_schedulers"][0].__setitem__("base_lrs", torch.zeros(1).expand(2**20)),
        "lr_schedulers[0].base_lrs is not a plain dense tensor"),
    "a callback score as a nested tensor": (
        lambda c: next(v for k, v in c["callbacks"].items() if "ModelCheckpoint" in k).__setitem__(
            "kth_value", torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])), "kth_value is a nested tensor"),
    "a tensor sharing a weight's storage in the loops": (
        lambda c: c["loops"].__setitem__("x", next(iter(c["state_dict"].values()))), "loops.x shares its storage with"),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ELSEWHERE)
def test_the_same_tricks_elsewhere_in_a_file_are_refused(trained, tmp_path, case):
    edit, message = ELSEWHERE[case]
    path = crafted(trained, tmp_path, edit)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_checkpoint(path)


@pytest.mark.parametrize("origin, shown", [({"path": torch.zeros(3)}, "a dict"), ("x", "'x'")])
def test_a_fine_tuning_origin_that_is_not_plain_is_refused_before_resuming(trained, loaded, tmp_path, origin, shown):
    path = crafted(trained, tmp_path, lambda c: c.__setitem__("init_from", origin))
    with pytest.raises(CheckpointError) as raised:
        check_resume(path, loaded.model, loaded.src_vocab, loaded.tgt_vocab)
    assert str(raised.value) == (
        f"ckpt_path={path}: init_from is {shown}, not a mapping of names to plain values (the file a fine-tuning run "
        "started from); refused: it was not written by nmt's train.py, resume from another checkpoint")
