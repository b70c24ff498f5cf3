"""The worst a checkpoint can cost to read, built against the limits of ``nmt.checkpoints.files``:

    python scripts/bounded_reading.py [--ckpt tests/data/saved/transformer.ckpt] [--out docs/results/bounded_reading]
    python scripts/bounded_reading.py --folders     # the files of a folder made elsewhere (folder_limits)

Each case is the given checkpoint with one more entry under ``loops`` (training state, which every
reader reads through ``read_checkpoint``), crafted to make the most of one limit: references to
one list (operations), distinct empty lists (containers), one large byte string (structure
bytes), the same three past their limits, and lists nested 45 deep that name one list twice
each (2^45 paths: walked once). Each is read by ``read_checkpoint`` in a process of its own;
reported: the file's size, the outcome, the seconds and the process's peak memory over a read
of the plain checkpoint. Writes ``bounded_reading.{json,md}``.

``--folders``: the files ``nmt-import`` and ``nmt-evaluate``'s COMET reader take from a folder
(``nmt.checkpoints.folder_limits``), each a plain one and the worst built against each limit, within
it and past it: JSON (``vocab.json``: values, one long string, depth, size), SentencePiece models
(pieces), safetensors headers, pickled weights (``pytorch_model.bin`` with ``allow_pickle``),
a checkpoint's archive (its number of files, compression) and COMET's ``hparams.yaml`` (its
largest list, aliases). Each is read by its reader in a process of its
own (address space capped at 8 GB); reported: seconds and peak memory over the process's after its
imports. Writes ``bounded_reading_folders.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from nmt.checkpoints.files import MAX_CONTAINERS, MAX_STRUCTURE_BYTES, MAX_STRUCTURE_OPS

READ = """
import re, sys, time
from pathlib import Path
from nmt.checkpoints.files import CheckpointError, read_checkpoint
start = time.perf_counter()
try:
    read_checkpoint(sys.argv[1])
    outcome = "read"
except CheckpointError as e:
    outcome = "refused: " + str(e).split(": ", 1)[1][:90]
peak_kb = re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)  # this process's own peak
print(outcome, time.perf_counter() - start, peak_kb, sep="\\t")
"""


def nested(depth: int) -> list:
    inner: list = [0]
    for _ in range(depth):
        inner = [inner, inner]
    return inner


def cases() -> dict[str, object]:
    ops, containers = MAX_STRUCTURE_OPS - 100_000, MAX_CONTAINERS - 50_000
    return {
        "plain checkpoint": None,
        f"{ops:,} references to one list": [[]] * ops,
        f"{containers:,} distinct empty lists": [[] for _ in range(containers)],
        f"a {(MAX_STRUCTURE_BYTES >> 20) - 2} MB byte string": b"x" * (MAX_STRUCTURE_BYTES - (2 << 20)),
        "lists nested 45 deep, each naming one list twice": nested(45),
        f"{MAX_STRUCTURE_OPS + 100_000:,} references (over the limit)": [[]] * (MAX_STRUCTURE_OPS + 100_000),
        f"{MAX_CONTAINERS + 50_000:,} empty lists (over the limit)": [[] for _ in range(MAX_CONTAINERS + 50_000)],
        f"a {(MAX_STRUCTURE_BYTES >> 20) + 1} MB byte string (over the limit)": b"x" * (MAX_STRUCTURE_BYTES + (1 << 20)),
    }


READ_FOLDER = """
import re, sys, time
from pathlib import Path
from nmt.checkpoints.files import read_checkpoint
from nmt.checkpoints.marian import _json, _spm, read_weights
from nmt.evaluation.comet_files import read_head

def peak_mb():
    return int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024

kind, folder, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
tiny = dict(d_model=4, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=4, decoder_ffn_dim=4, vocab_size=8,
            decoder_vocab_size=8, max_position_embeddings=8)
before, start = peak_mb(), time.perf_counter()
try:
    {"json": lambda: _json(folder, name), "spm": lambda: _spm(folder, name), "yaml": lambda: read_head(folder / name),
     "safetensors": lambda: read_weights(folder, tiny), "bin": lambda: read_weights(folder, tiny, allow_pickle=True),
     "ckpt": lambda: read_checkpoint(folder / name)}[kind]()
    outcome = "read"
except ValueError as e:  # ImportRefused, CheckpointError, CometRefused
    outcome = "refused: " + str(e).split(": ", 1)[1][:90]
print(outcome, time.perf_counter() - start, peak_mb() - before, sep="\\t")
"""
FOLDER_TIMEOUT = 600
CKPT = Path("tests/data/saved/transformer.ckpt")  # the archive the checkpoint cases add to


def _pieces(count: int, length: int) -> bytes:
    """A serialized SentencePiece ModelProto of ``count`` pieces of ``length`` bytes (a score each)."""
    out = bytearray()
    for i in range(count):
        text = (b"%x" % i).rjust(length, b"p")
        piece = b"\x0a" + bytes([len(text)]) + text + b"\x15\x00\x00\x80\xbf"  # piece, score -1.0
        out += b"\x0a" + bytes([len(piece)]) + piece
    return bytes(out)


def _safetensors(header: bytes, body: bytes = b"") -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body


def _empty_tensors(total: int) -> bytes:
    """A safetensors header of about ``total`` bytes declaring empty tensors."""
    parts, size, i = [], 2, 0
    while size < total - 64:
        parts.append('"t%x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i)
        size += len(parts[-1]) + 1
        i += 1
    return _safetensors(("{" + ",".join(parts) + "}").encode())


def _tiny_safetensors() -> bytes:
    from safetensors.torch import save

    from nmt.checkpoints.marian import _expected

    config = dict(d_model=4, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=4, decoder_ffn_dim=4)
    shapes = {**_expected(config), "model.shared.weight": (8, 4), "final_logits_bias": (1, 8)}
    return save({name: torch.zeros(shape) for name, shape in shapes.items()})


def _archive(extra: int = 0, compressed: bool = False) -> bytes:
    """The test checkpoint's archive with ``extra`` empty files added, or zipped again compressed."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(CKPT) as plain, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED if compressed
                                                         else zipfile.ZIP_STORED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info.filename))
        first = plain.namelist()[0].split("/")[0]
        for i in range(extra):
            packed.writestr(f"{first}/extra/{i}", b"")
    return out.getvalue()


def _yaml_aliases() -> bytes:
    lines = ["class_identifier: regression_metric", "encoder_model: XLM-RoBERTa", "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 9)]
    return ("\n".join([*lines, f"hidden_sizes: [{', '.join(['*a8'] * 10)}]"]) + "\n").encode()


def folder_cases() -> dict[str, tuple[str, str, Callable[[], object]]]:
    """{case: (reader, file name, what makes the content: bytes, or an object for torch.save)}."""
    from nmt.checkpoints.files import MAX_MEMBERS
    from nmt.checkpoints.folder_limits import MAX_JSON_ITEMS, MAX_PIECES, MAX_SAFETENSORS_HEADER

    mb64 = 64 << 20
    keys = MAX_JSON_ITEMS - 100
    key_width = (mb64 - 1000) // keys - 5  # '"<key>":0,' fills the 64 MB
    return {
        "vocab.json: 60,000 pieces (OPUS-MT's)":
            ("json", "vocab.json", lambda: json.dumps({f"p{i}": i for i in range(60_000)}).encode()),
        f"vocab.json: {keys:,} distinct keys of {key_width} characters, 64 MB":
            ("json", "vocab.json", lambda: b"{" + b",".join(b'"%s":0' % (b"%x" % i).rjust(key_width, b"k")
                                                            for i in range(keys)) + b"}"),
        f"vocab.json: {MAX_JSON_ITEMS // 2 - 50:,} empty lists":
            ("json", "vocab.json", lambda: b'{"a":[' + b"[]," * (MAX_JSON_ITEMS // 2 - 51) + b"[]]}"),
        "vocab.json: one 63 MB string holding one character outside the BMP":
            ("json", "vocab.json", lambda: b'{"a":"' + b"x" * (mb64 - (1 << 20)) + "\U0001F600".encode() + b'"}'),
        "vocab.json: 64 MB of empty lists (over the values)":
            ("json", "vocab.json", lambda: b'{"a":[' + b"[]," * (mb64 // 3 - 10) + b"[]]}"),
        "vocab.json: 100,000 levels deep (over the depth)": ("json", "vocab.json", lambda: b"[" * 100_000),
        "vocab.json: 65 MB (over the size)": ("json", "vocab.json", lambda: b" " * (mb64 + (1 << 20))),
        "source.spm: 250,000 pieces (NLLB-200's)": ("spm", "source.spm", lambda: _pieces(250_000, 8)),
        f"source.spm: {MAX_PIECES:,} pieces of 56 bytes, 63 MB": ("spm", "source.spm", lambda: _pieces(MAX_PIECES, 56)),
        "source.spm: 32 million empty pieces (over the pieces)":
            ("spm", "source.spm", lambda: b"\x0a\x00" * (mb64 // 2)),
        "model.safetensors: a model's 49 tensors": ("safetensors", "model.safetensors", _tiny_safetensors),
        f"model.safetensors: a {MAX_SAFETENSORS_HEADER >> 20} MB header of empty tensors":
            ("safetensors", "model.safetensors", lambda: _empty_tensors(MAX_SAFETENSORS_HEADER - 8)),
        "model.safetensors: a 100 MB header of empty tensors (over the header)":
            ("safetensors", "model.safetensors", lambda: _empty_tensors(100_000_000 - 8)),
        "model.safetensors: a 4 GB tensor declared in a 1 KB file":
            ("safetensors", "model.safetensors", lambda: _safetensors(
            b'{"lm_head.weight":{"dtype":"F32","shape":[1048576,1024],"data_offsets":[0,4294967296]}}', b"\0" * 1000)),
        "pytorch_model.bin: 240,000 empty lists":
            ("bin", "pytorch_model.bin", lambda: {"x": [[] for _ in range(240_000)]}),
        "pytorch_model.bin: 3,000,000 empty lists (over the containers)":
            ("bin", "pytorch_model.bin", lambda: {"x": [[] for _ in range(3_000_000)]}),
        f"a checkpoint with {MAX_MEMBERS - 1000:,} empty files added to its archive":
            ("ckpt", "many.ckpt", lambda: _archive(MAX_MEMBERS - 1000)),
        "a checkpoint with 1,000,000 empty files added (over the files)": ("ckpt", "many.ckpt", lambda: _archive(1_000_000)),
        "a checkpoint zipped again compressed (over: compression)": ("ckpt", "packed.ckpt", lambda: _archive(compressed=True)),
        "hparams.yaml: a list of 32,000 numbers, 64 KB":
            ("yaml", "hparams.yaml", lambda: b"class_identifier: regression_metric\nhidden_sizes: [" + b"1," * 32_000 + b"1]\n"),
        "hparams.yaml: 10^9 values through aliases, 0.4 KB (over: aliases)":
            ("yaml", "hparams.yaml", _yaml_aliases),
    }


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def folder_rows() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for case, (kind, name, make) in folder_cases().items():
            path, content = folder / name, make()
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                torch.save(content, path)
            try:
                done = subprocess.run([sys.executable, "-c", READ_FOLDER, kind, str(folder), name], capture_output=True,
                                      text=True, timeout=FOLDER_TIMEOUT, preexec_fn=_capped)
                outcome, seconds, peak_mb = done.stdout.strip().split("\t") if done.returncode == 0 else (
                    f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:90]}", "nan", "0")
            except subprocess.TimeoutExpired:
                outcome, seconds, peak_mb = f"still reading after {FOLDER_TIMEOUT} s", "nan", "0"
            rows.append({"case": case, "file_mb": round(path.stat().st_size / 2**20, 1), "outcome": outcome,
                         "seconds": round(float(seconds), 2), "peak_mb": int(peak_mb)})
            print(rows[-1], flush=True)
            path.unlink()
    return rows


def write_folder_rows(rows: list[dict], out: Path) -> None:
    from nmt.checkpoints.folder_limits import MAX_JSON_ITEMS, MAX_PIECES, MAX_SAFETENSORS_HEADER

    out.mkdir(parents=True, exist_ok=True)
    (out / "bounded_reading_folders.json").write_text(json.dumps({"limits": {
        "json_values": MAX_JSON_ITEMS, "pieces": MAX_PIECES, "safetensors_header_bytes": MAX_SAFETENSORS_HEADER,
        "structure_operations": MAX_STRUCTURE_OPS, "containers": MAX_CONTAINERS}, "rows": rows}, indent=2) + "\n")
    lines = ["| file | size (MB) | outcome | seconds | peak memory over the reader's imports (MB) |",
             "|---|---:|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['file_mb']} | {r['outcome']} | {r['seconds']} | {r['peak_mb']:+d} |" for r in rows]
    (out / "bounded_reading_folders.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="tests/data/saved/transformer.ckpt")
    parser.add_argument("--out", type=Path, default=Path("docs/results/bounded_reading"))
    parser.add_argument("--folders", action="store_true", help="the files of a folder made elsewhere instead")
    args = parser.parse_args()
    if args.folders:
        return write_folder_rows(folder_rows(), args.out)
    base = torch.load(args.ckpt, weights_only=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, payload in cases().items():
            path = Path(tmp) / "crafted.ckpt"
            checkpoint = dict(base)
            if payload is not None:
                checkpoint["loops"] = {**checkpoint.get("loops", {}), "crafted": payload}
            torch.save(checkpoint, path)
            done = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, check=True)
            outcome, seconds, peak_kb = done.stdout.strip().split("\t")
            rows.append({"case": name, "file_mb": round(path.stat().st_size / 2**20, 1), "outcome": outcome,
                         "seconds": round(float(seconds), 2), "peak_mb": round(int(peak_kb) / 1024)})
            print(rows[-1], flush=True)
    plain = rows[0]["peak_mb"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bounded_reading.json").write_text(json.dumps({"limits": {
        "structure_bytes": MAX_STRUCTURE_BYTES, "operations": MAX_STRUCTURE_OPS, "containers": MAX_CONTAINERS},
        "rows": rows}, indent=2) + "\n")
    lines = ["| file | size (MB) | outcome | seconds | peak memory over the plain file's (MB) |", "|---|---:|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['file_mb']} | {r['outcome']} | {r['seconds']} | {r['peak_mb'] - plain:+d} |" for r in rows]
    (args.out / "bounded_reading.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
