"""A crafted checkpoint never runs code or reads the environment: its model and data configs build
nmt's own classes only (``nmt.checkpoints.file_config``), through every entry point that opens one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from hydra._internal.utils import _locate
from omegaconf import OmegaConf

from nmt.checkpoints.files import CheckpointError, read_checkpoint
from nmt.checkpoints.loading import load_checkpoint
from nmt.evaluate import load_test_split
from nmt.text_lines import read_lines
from nmt.export import export, export_release
from nmt.train import train
from tests.conftest import CONF_DIR, compose_train, evaluate_here, translate_here

O_TRUNC_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny Transformer's checkpoint in its run folder, with the run's test report."""
    tmp_path = tmp_path_factory.mktemp("security")
    cfg = compose_train(tmp_path, ["trainer.max_steps=3", "test_decoding.beam_size=2"], model="transformer")
    train(cfg)
    return Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "precious.txt"
    path.write_text("the user's data\n")
    return path


def crafted(trained: Path, tmp_path: Path, section: str, edit) -> Path:
    """A copy of ``trained`` whose ``section`` config is ``edit(config)``."""
    checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
    checkpoint["run_config"][section] = edit(json.loads(json.dumps(checkpoint["run_config"][section])))
    out = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, out)
    return out


def with_encoder(**changes):
    return lambda model: {**model, "encoder": {**model["encoder"], **changes}}


# Each way a model config once reached code: a _target_ walking from an allowed prefix through
# attribute access (torch -> os), plain foreign targets, call keys, resolvers.
def walks_to_os_open(victim: Path):
    return lambda model: {**model, "_target_": "nmt.models.base.torch.os.open", "_args_": [str(victim), O_TRUNC_WRITE]}


MODEL_ATTACKS = {
    "walk to os.open": (walks_to_os_open, "_args_: refused"),
    "walk to os.open, no args": (lambda v: lambda m: {**m, "_target_": "nmt.models.base.torch.os.open",
                                                       "path": str(v), "flags": O_TRUNC_WRITE},
                                 "'nmt.models.base.torch.os.open' is not one of the classes"),
    "walk to os.system": (lambda v: lambda m: {**m, "bridge": {"_target_": "nmt.models.base.torch.os.system",
                                                                "command": f"rm {v}"}},
                          "is not one of the classes"),
    "foreign class": (lambda v: lambda m: {**m, "bridge": {"_target_": "os.system", "command": f"rm {v}"}},
                      "'os.system' is not one of the classes"),
    "nmt function": (lambda v: lambda m: {**m, "_target_": "nmt.train.train"}, "'nmt.train.train' is not one"),
    "allowed class, _args_": (lambda v: lambda m: {**m, "_args_": [1]}, "model._args_: refused"),
    "_recursive_": (lambda v: lambda m: {**m, "_recursive_": False}, "model._recursive_: refused"),
    "_convert_": (lambda v: lambda m: {**m, "_convert_": "all"}, "model._convert_: refused"),
    "target not a string": (lambda v: lambda m: {**m, "_target_": 3}, "model._target_: refused, '3'"),
    "_partial_ not a bool": (lambda v: lambda m: {**m, "_partial_": "yes"}, "model._partial_: must be true or false"),
    "environment": (lambda v: with_encoder(dropout="${oc.env:HOME}"), "is an interpolation"),
    "nested environment": (lambda v: with_encoder(hidden_size="${pad_to:${oc.env:HOME},8}"), "is an interpolation"),
    "decode": (lambda v: with_encoder(dropout="${oc.decode:'1'}"), "is an interpolation"),
    "resolver named by a key": (lambda v: with_encoder(n="oc.env", dropout="${${.n}:HOME}"), "is an interpolation"),
    "resolver name in parts": (lambda v: with_encoder(e="env", dropout="${oc.${.e}:HOME}"), "is an interpolation"),
    "interpolation built from a key": (lambda v: with_encoder(d="$", dropout="${.d}{oc.env:HOME}"),
                                       "is an interpolation"),
    "doubling keys": (lambda v: with_encoder(**{"x0": "ab", **{f"x{i}": f"${{.x{i - 1}}}${{.x{i - 1}}}"
                                                               for i in range(1, 40)}}), "is an interpolation"),
    "root not a model": (lambda v: lambda m: m["encoder"], "a model config from a file builds nmt.models.base.Seq2Seq"),
    "non-string key": (lambda v: lambda m: {**m, 3: 1}, "key 3 is not a string"),
    "object value": (lambda v: lambda m: {**m, "dropout": b"x"}, "a bytes value"),
    "deep": (lambda v: lambda m: {**m, "extra": json.loads("[" * 100 + "]" * 100)}, "larger than any nmt config"),
    "huge layers": (lambda v: with_encoder(num_layers=10**7), "far more weight tensors than the"),
    "huge widths": (lambda v: with_encoder(ff_size=2**30), "does not match the model config"),
    "overflowing widths": (lambda v: with_encoder(hidden_size=2**40), "Storage size calculation overflowed"),
    "huge position table": (lambda v: with_encoder(max_len=10**10), "position tables larger than any model needs"),
    "bad value": (lambda v: with_encoder(dropout=-1), "its model config does not build"),
}


@pytest.mark.parametrize("attack", MODEL_ATTACKS)
def test_a_crafted_model_config_is_refused_and_runs_nothing(trained, tmp_path, victim, attack):
    edit, message = MODEL_ATTACKS[attack]
    path = crafted(trained, tmp_path, "model", edit(victim))
    with pytest.raises(ValueError, match=message):  # CheckpointError, or the shape mismatch (a ValueError)
        load_checkpoint(path)
    assert victim.read_text() == "the user's data\n"


def test_every_entry_point_refuses_the_os_open_walk(trained, tmp_path, victim, capsys):
    """translate, serve (load_checkpoint), export to a release file and to CTranslate2, evaluate."""
    path = crafted(trained, tmp_path, "model", walks_to_os_open(victim))
    with pytest.raises(CheckpointError, match="_args_: refused"):
        export_release(path, tmp_path / "release.ckpt")
    assert not (tmp_path / "release.ckpt").exists()
    base = {"ckpt": str(path), "weights": "stored", "allow_pickle": False}
    with pytest.raises(CheckpointError, match="_args_: refused"):
        export(OmegaConf.create({**base, "format": "ctranslate2", "out": str(tmp_path / "ct2")}))
    (tmp_path / "in.txt").write_text("a b\n")
    # the bodies of translate.py and evaluate.py (test_checkpoint_files.py runs translate.py itself on a crafted file)
    for result in (translate_here(capsys, f"ckpt={path}", f"input={tmp_path / 'in.txt'}"),
                   evaluate_here(capsys, tmp_path / "eval", f"ckpts=[{path}]")):
        assert result.returncode == 2 and "_args_: refused" in result.stderr, result.stderr[-2000:]
    assert victim.read_text() == "the user's data\n"


def test_a_crafted_data_config_is_refused_by_evaluate(trained, tmp_path):
    """The data config (built by nmt-evaluate) walked to pathlib.Path.write_text."""
    written = tmp_path / "written.txt"
    data = read_checkpoint(trained)["run_config"]["data"]
    attacks = {
        "walk": {**data, "source": {"_target_": "nmt.data.sources.Path.write_text",
                                    "self": {"_target_": "nmt.data.sources.Path", "_args_": [str(written)]},
                                    "data": "pwned"}},
        "walk, keywords": {**data, "source": {"_target_": "nmt.data.sources.Path.write_text", "self": str(written),
                                              "data": "pwned"}},
        "env": {**data, "source": {**data["source"], "path": "${oc.env:HOME}"}},
        "remote code": {**data, "source": {**data["source"], "hub": {"path": "x/y", "trust_remote_code": True}}},
        "hub writes": {**data, "source": {**data["source"], "hub": {"path": "x/y", "cache_dir": str(tmp_path / "w")}}},
        "hub reads": {**data, "source": {**data["source"], "hub": {"path": "csv", "data_files": "/etc/passwd"}}},
        "hub not a mapping": {**data, "source": {**data["source"], "hub": ["x/y"]}},
        "hub data_dir up": {**data, "source": {**data["source"], "hub": {"path": "x/y", "data_dir": "a/../../etc"}}},
        # a source without a class, holding an interpolation Hydra would have resolved when building it
        "second resolution": {**data, "source": {"d": "$", "x": "${.d}{oc.create:{_target_: os.system, _args_: [id]}}"}},
        "no source class": {**data, "source": {"path": "x", "src_lang": "de", "tgt_lang": "en"}},
        "a trillion pairs": {**data, "source": {"_target_": "nmt.data.sources.SyntheticSource", "num_pairs": 10**12}},
        "endless sentences": {**data, "source": {"_target_": "nmt.data.sources.SyntheticSource", "max_len": 10**9}},
        "partial module": {**data, "_partial_": True},
    }
    messages = {"walk": "source.self._args_: refused", "walk, keywords": "is not one of the classes",
                "env": "is an interpolation", "remote code": "trust_remote_code: refused",
                "hub writes": r"source.hub.cache_dir: refused \(a config from a file names a hub dataset by path, name, "
                              r"revision, data_dir only, as strings\)",
                "hub data_dir up": r"source.hub.data_dir: refused, 'a/../../etc' leaves the dataset's folder",
                "hub reads": "source.hub.data_files: refused", "hub not a mapping": "source.hub: must be a mapping",
                "second resolution": "is an interpolation", "no source class": "data.source: must name its class",
                "a trillion pairs": "num_pairs: 1000000000000 is not a count",
                "endless sentences": r"max_len: 1000000000 is not a count from 0 to 1,000", "partial module": "builds nmt.data"}
    for name, config in attacks.items():
        with pytest.raises(CheckpointError, match=messages[name]):
            load_test_split(config, "crafted.ckpt")
    assert not written.exists() and not (tmp_path / "w").exists()


def test_evaluate_builds_the_checkpoints_own_data_config_with_its_own_tokenizers(trained, tmp_path, caplog):
    """No tokenizer is trained: the file's tokenizer options (here ones SentencePiece would refuse,
    and its vocab_from) are not read."""
    config = {**read_checkpoint(trained)["run_config"]["data"], "cache_dir": str(tmp_path / "cache"),
              "tokenizer": {"vocab_size": "many", "user_defined_symbols": 5}, "vocab_from": "/nonexistent.model"}
    with caplog.at_level(logging.INFO, logger="nmt"):
        sources, refs, unit = load_test_split(config, str(trained))
    tiny = Path(__file__).parent / "data" / "tiny"  # the corpus the checkpoint's data config names
    assert (sources, refs, unit) == (read_lines(tiny / "test.src", strip=True), read_lines(tiny / "test.tgt", strip=True), "words")
    assert "prepared" in caplog.text and "trained SentencePiece" not in caplog.text
    prepared = sorted(p.name for p in (tmp_path / "cache").rglob("*.npy"))
    assert prepared and all(name.startswith("test.") for name in prepared), prepared  # the test split alone


def test_evaluate_reads_the_training_text_for_word_counts_without_encoding_it(trained, tmp_path):
    """The frequency analysis counts the target words of the pairs the run trained on: read as
    text alone, they are the pairs a full preparation selects, and no training token is encoded."""
    from nmt.evaluate import load_data
    from nmt.evaluation.analyses import training_counts
    from nmt.training.builders import build_datamodule

    config = {**read_checkpoint(trained)["run_config"]["data"], "cache_dir": str(tmp_path / "alone")}
    alone = load_data(config, str(trained), "valid", train_text=True)
    names = {p.name for p in (tmp_path / "alone").rglob("*.npy")}
    assert "train.tgt.text.npy" in names and "valid.src.tokens.npy" in names
    assert not any(n.startswith("test.") or (n.startswith("train.") and "tokens" in n) for n in names), names
    full = build_datamodule(OmegaConf.create({**config, "cache_dir": str(tmp_path / "full")}))
    full.setup("fit")
    assert alone.train_rows().tolist() == full.train_rows().tolist()
    assert training_counts(alone) == training_counts(full) and sum(training_counts(full).values()) > 100
    assert alone.raw("valid") == full.raw("valid")
    with pytest.raises(ValueError, match="did not read the training split"):
        load_data(config, str(trained), "test").train_rows()


def test_every_class_a_config_names_is_buildable_by_its_exact_name():
    """The registry and the shipped configs agree, and each name resolves to the registered class."""
    from nmt.checkpoints import file_config

    for section, folder in (("model", "model"), ("data", "data")):
        targets = {line.split("_target_:")[1].split("#")[0].strip()
                   for f in (CONF_DIR / folder).rglob("*.yaml") for line in f.read_text().splitlines()
                   if "_target_:" in line}
        assert targets and targets <= set(file_config.BUILDABLE[section]), targets - set(file_config.BUILDABLE[section])
    for section in file_config.BUILDABLE:
        for name, cls in file_config.classes(section).items():
            assert _locate(name) is cls and f"{cls.__module__}.{cls.__qualname__}" == name


def test_a_stored_config_builds_the_same_model_as_hydra(trained):
    """The file builder gives the model hydra's instantiate gives from the same (trusted) config."""
    from nmt.training.builders import instantiate_model

    checkpoint = read_checkpoint(trained)
    loaded = load_checkpoint(trained)
    reference = instantiate_model(checkpoint["run_config"]["model"])
    assert [(n, p.shape) for n, p in loaded.model.named_parameters()] == \
           [(n, p.shape) for n, p in reference.named_parameters()]
    assert repr(loaded.model) == repr(reference)


def test_the_report_comes_from_the_run_folder_or_the_release_file(trained, tmp_path):
    """Never from a folder the checkpoint's config names (module.report_dir)."""
    from nmt.checkpoints.loading import run_report

    run = trained.parent.parent
    checkpoint = read_checkpoint(trained)
    report = run_report(checkpoint, trained)
    assert report["summary"] == json.loads((run / "bleu_by_length.json").read_text())
    assert report["png"] == (run / "bleu_by_length.png").read_bytes()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "bleu_by_length.json").write_text('{"bleu": 99}')
    moved = tmp_path / "model.ckpt"  # not in a run's checkpoints/ folder
    checkpoint["run_config"]["module"]["report_dir"] = str(elsewhere)
    torch.save(checkpoint, moved)
    assert run_report(read_checkpoint(moved), moved) is None
    assert load_checkpoint(moved).report is None

    released = export_release(trained, tmp_path / "release.ckpt")  # the report travels inside the file
    assert load_checkpoint(released).report == report
    forged = read_checkpoint(released)
    forged["report"] = {"summary": "[1]", "png": b"<script>"}
    torch.save(forged, tmp_path / "forged.ckpt")
    assert run_report(read_checkpoint(tmp_path / "forged.ckpt"), tmp_path / "forged.ckpt") is None
    forged["report"] = {"summary": {"bleu": 1.0}, "png": b"<script>"}
    assert run_report(forged, tmp_path / "forged.ckpt") == {"summary": {"bleu": 1.0}, "png": None}


MALFORMED = {
    "run config a list": (lambda c: {**c, "run_config": [1]}, "its run config is not a mapping"),
    "state_dict of strings": (lambda c: {**c, "state_dict": {"model.x": "y"}}, "its state_dict is not a mapping"),
    "tokenizers missing": (lambda c: {**c, "tokenizers": {"src": b"abc"}}, "its tokenizers are not two"),
    "tokenizers not models": (lambda c: {**c, "tokenizers": {"src": b"\x00" * 9, "tgt": b"\x01"}},
                              r"the src tokenizer saved in \S+/malformed.ckpt: not a SentencePiece model"),
    "empty tokenizers": (lambda c: {**c, "tokenizers": {"src": b"", "tgt": b""}},
                         "holds an empty byte string where nmt stores its tokenizers; refused: it was not written by nmt"),
    "no model section": (lambda c: {**c, "run_config": {"data": c["run_config"]["data"]}}, "has no model section"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_checkpoint_is_a_one_line_error(trained, tmp_path, case):
    edit, message = MALFORMED[case]
    path = tmp_path / "malformed.ckpt"
    torch.save(edit(torch.load(trained, map_location="cpu", weights_only=True)), path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_a_resumed_checkpoint_sets_only_the_modules_counters():
    """``counters`` once set any attribute it named (the run config, the decoding functions...)."""
    from nmt.training.lit_module import TranslationModule

    module = TranslationModule.__new__(TranslationModule)
    torch.nn.Module.__init__(module)
    module.on_load_checkpoint({"counters": {"skipped_steps": 3, "run_config": {"x": 1}, "val_decoding": print}})
    assert module.skipped_steps == 3
    assert not hasattr(module, "run_config") and not hasattr(module, "val_decoding")


SAVED_RELEASE = Path(__file__).parent / "data" / "saved" / "lstm_luong.release.ckpt"
SAVED = Path(__file__).parent / "data" / "saved" / "transformer.ckpt"  # a training checkpoint


def test_a_small_file_declaring_huge_weights_through_views_is_refused_before_any_memory_is_spent(tmp_path, capsys):
    """A weight stored as 16 values and declared as 4,000,000 rows of them (a zero stride), or
    weights that overlap in one storage, would be materialized by building the model: a file of
    under 1 MB asking for gigabytes. The file must store what it declares."""
    checkpoint = torch.load(SAVED_RELEASE, map_location="cpu", weights_only=True)
    name, weight = next((k, v) for k, v in checkpoint["state_dict"].items() if v.dim() == 2)
    checkpoint["state_dict"][name] = torch.zeros(weight.shape[1]).expand(4_000_000, weight.shape[1])
    torch.save(checkpoint, tmp_path / "expanded.ckpt")
    assert (tmp_path / "expanded.ckpt").stat().st_size < 2_000_000
    with pytest.raises(CheckpointError, match=rf"expanded.ckpt: {name} is not a plain dense tensor \(it repeats "
                                              rf"{weight.shape[1] * 4} stored bytes as a \(4000000, {weight.shape[1]}\) tensor\)"):
        read_checkpoint(tmp_path / "expanded.ckpt")
    result = translate_here(capsys, f"ckpt={tmp_path / 'expanded.ckpt'}", f"input={SAVED_RELEASE.parent.parent / 'tiny' / 'test.src'}")
    assert result.returncode != 0 and "is not a plain dense tensor" in result.stderr

    checkpoint = torch.load(SAVED_RELEASE, map_location="cpu", weights_only=True)
    shared = torch.zeros(1000)
    for i, key in enumerate([k for k, v in checkpoint["state_dict"].items() if v.dim() == 1][:3]):
        checkpoint["state_dict"][key] = shared[i:i + 900]  # each dense, together 2,700 values in 1,000
    torch.save(checkpoint, tmp_path / "overlapping.ckpt")
    with pytest.raises(CheckpointError, match=r"overlapping.ckpt: model\.\S+ and model\.\S+ overlap in one storage; "
                                              r"refused: a checkpoint stores every value once"):
        read_checkpoint(tmp_path / "overlapping.ckpt")

    # A file whose tied weights are one tensor under two names is a plain nmt file.
    checkpoint = torch.load(SAVED_RELEASE, map_location="cpu", weights_only=True)
    checkpoint["state_dict"]["model.extra_alias"] = checkpoint["state_dict"][name]
    torch.save(checkpoint, tmp_path / "tied.ckpt")
    assert read_checkpoint(tmp_path / "tied.ckpt")["state_dict"]["model.extra_alias"].shape == weight.shape


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated, still loadable from a file
@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_a_weight_that_is_not_a_dense_tensor_is_refused_in_one_line(tmp_path, capsys, kind):
    """Sparse, meta and quantized tensors load with weights_only=True; building a model from them
    raised torch's NotImplementedError or a multi-line RuntimeError."""
    checkpoint = torch.load(SAVED_RELEASE, map_location="cpu", weights_only=True)
    name, weight = next((k, v) for k, v in checkpoint["state_dict"].items() if v.dim() == 2)
    checkpoint["state_dict"][name] = {
        "sparse": lambda: weight.to_sparse(), "meta": lambda: torch.empty(weight.shape, device="meta"),
        "quantized": lambda: torch.quantize_per_tensor(weight.float(), 0.1, 0, torch.qint8)}[kind]()
    torch.save(checkpoint, tmp_path / f"{kind}.ckpt")
    message = f"{tmp_path / kind}.ckpt: {name} is a {kind} tensor; refused: a checkpoint holds plain dense tensors"
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(tmp_path / f"{kind}.ckpt")
    assert str(error.value) == message
    result = translate_here(capsys, f"ckpt={tmp_path / kind}.ckpt", f"input={SAVED_RELEASE.parent.parent / 'tiny' / 'test.src'}")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == f"error: {message}"


@pytest.mark.parametrize("section", ["loops", "hyper_parameters", "counters"])
def test_a_file_that_names_one_list_many_times_is_read_in_the_steps_its_objects_count(tmp_path, section, monkeypatch):
    """A list of two references to one list, 45 levels deep (46 lists in the file, 2^45 paths), under
    any key: the walk over the file's containers visits each object once, so reading it takes as many
    steps as the file holds objects (counted here: the walk's tensor tests), and it is read or refused
    in one line."""
    from nmt.checkpoints import files

    saved = torch.load(SAVED, map_location="cpu", weights_only=True)
    repeated: list = [1, 2]
    for _ in range(45):
        repeated = [repeated, repeated]
    saved[section] = {**(saved.get(section) or {}), "x": repeated}
    crafted = tmp_path / "repeats.ckpt"
    torch.save(saved, crafted)
    visits, is_tensor = [0], torch.is_tensor

    def counted(node) -> bool:
        visits[0] += 1
        if visits[0] > 100_000:
            raise AssertionError("the walk visits a path, not an object, at a time")
        return is_tensor(node)

    monkeypatch.setattr(files.torch, "is_tensor", counted)
    try:
        read_checkpoint(crafted)
    except CheckpointError as e:
        assert "\n" not in str(e)
    assert visits[0] < 20_000


def test_a_release_files_embedded_report_is_read_only_up_to_a_run_folders_limit(caplog):
    """A summary of text over 4 MB (a run folder's report limit) is left out with a warning, not parsed."""
    from nmt.checkpoints.loading import MAX_REPORT_BYTES, run_report

    released = torch.load(SAVED_RELEASE, map_location="cpu", weights_only=True)
    fits = '{"bleu": ' + " " * (MAX_REPORT_BYTES["json"] - 20) + "1.0}"
    released["report"] = {"summary": fits, "png": None}
    assert run_report(released, SAVED_RELEASE) == {"summary": {"bleu": 1.0}, "png": None}
    released["report"] = {"summary": fits + " " * 20, "png": None}
    with caplog.at_level(logging.WARNING, logger="nmt"):
        assert run_report(released, SAVED_RELEASE) is None
    assert f"more than a report's {MAX_REPORT_BYTES['json']:,}: left out" in caplog.text


SAVED = Path(__file__).parent / "data" / "saved" / "transformer.ckpt"


@pytest.mark.parametrize("payload, limit, message", [
    (lambda: [[]] * 3000, ("MAX_STRUCTURE_OPS", 2000), "holds over 2,000 operations or 250,000 containers, where a checkpoint's holds about 10,000 and 3,000"),
    (lambda: [[] for _ in range(3000)], ("MAX_CONTAINERS", 2000), "holds over 1,000,000 operations or 2,000 containers, where a checkpoint's holds about 10,000 and 3,000"),
    (lambda: b"x" * 300_000, ("MAX_STRUCTURE_BYTES", 200_000), "is over 0 MB, where a checkpoint's is about 1 MB"),
])
def test_a_file_whose_structure_is_over_the_limits_is_refused_before_it_is_built(tmp_path, monkeypatch, payload,
                                                                                    limit, message):
    """What ``torch.load`` would build from a file is counted first: past a limit the file is
    refused, one line naming it, and nothing is built (the limits lowered here to keep files small)."""
    from nmt.checkpoints import files

    checkpoint = torch.load(SAVED, weights_only=True)
    path = tmp_path / "crafted.ckpt"
    torch.save({**checkpoint, "loops": {**checkpoint.get("loops", {}), "crafted": payload()}}, path)
    read_checkpoint(path)  # within today's limits
    monkeypatch.setattr(files, limit[0], limit[1])
    built = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: built.append(a))
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(path)
    assert str(refused.value) == (f"{path}: its pickled structure (crafted/data.pkl) {message}"
                                  + (": refused, it was not written by nmt"))
    assert built == []


@pytest.mark.parametrize("extra", [2_000, pytest.param(70_000, marks=pytest.mark.slow)])  # past 65,535: ZIP64's record
def test_an_archive_of_more_files_than_the_limit_is_refused_before_its_list_is_read(tmp_path, monkeypatch, extra):
    """A checkpoint with 1,000,000 empty files added to its archive (109 MB) was read, in 38 s at
    +580 MB; the count in the archive's end record (its ZIP64 record past 65,535 files) is read
    first (the limit lowered here to keep the file small)."""
    import shutil
    import zipfile

    from nmt.checkpoints import files

    path = tmp_path / "many.ckpt"
    shutil.copy(SAVED, path)
    with zipfile.ZipFile(path, "a") as archive:
        first = archive.namelist()[0].split("/")[0]
        for i in range(extra):
            archive.writestr(f"{first}/extra/{i}", b"")
    count = len(zipfile.ZipFile(SAVED).namelist()) + extra
    assert files.zip_members(path) == count
    monkeypatch.setattr(files, "MAX_MEMBERS", extra - 500)
    monkeypatch.setattr(zipfile, "ZipFile", lambda *a, **k: pytest.fail("the archive's list was read"))
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(path)
    assert str(refused.value) == (f"{path}: its archive lists {count:,} files, over the {extra - 500:,} a checkpoint "
                                  "may hold (one per stored tensor): refused, it was not written by nmt")


def test_a_checkpoint_whose_archive_is_compressed_is_refused(tmp_path):
    """Zipped again with compression (a zip tool's default), the archive was read with every weight
    taken from the compressed bytes (all 45 differed), without a word."""
    import zipfile

    path = tmp_path / "deflated.ckpt"
    with zipfile.ZipFile(SAVED) as plain, zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info.filename))
        first = plain.infolist()[0].filename
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(path)
    assert str(refused.value) == (f"{path}: {first} is compressed in the archive, where torch.save stores every file "
                                  "as it is (its tensors would be read from the compressed bytes): refused; save it "
                                  "again with torch.save, or zip it with -0")


def test_a_wide_container_is_walked_in_memory_that_follows_the_depth(tmp_path):
    """A list of 200,000 references to one list: its names are made one at a time, never all at once."""
    import tracemalloc

    from nmt.checkpoints.files import file_tensors

    checkpoint = {"state_dict": {"w": torch.zeros(2)}, "loops": {"x": [[]] * 200_000 + [torch.ones(1)]}}
    tracemalloc.start()
    found = file_tensors(checkpoint, "f.ckpt")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [name for name, _, _ in found] == ["w", "loops.x[200000]"]
    assert peak < 2_000_000  # names pushed for every item took ~30 MB
