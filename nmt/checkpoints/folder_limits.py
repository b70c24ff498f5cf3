"""What reading a model folder made elsewhere may cost (``nmt-import``'s Marian, M2M100, NLLB-200 and
mBART-50 folders, ``nmt-evaluate``'s COMET folder): every file is bounded before it turns into work,
and a file past a limit is refused in one line naming the file and the limit.

- Each file's size: the readers' ``MAX_BYTES`` (1 MB for a config, 64 MB for a vocabulary or a
  SentencePiece model).
- JSON (``json_object``): at most ``MAX_JSON_ITEMS`` values, counted before parsing as the commas and
  opening brackets of the bytes (a ceiling: those inside strings count too), and nested no deeper
  than Python's parser goes (its recursion limit, 1,000 levels by default).
- SentencePiece models (``count_pieces``): at most ``MAX_PIECES`` pieces, counted on protobuf's wire
  format before anything is built.
- safetensors files (``check_safetensors_header``): a header of at most ``MAX_SAFETENSORS_HEADER``
  bytes that the file holds; safetensors itself checks that the tensors it declares tile the rest
  of the file, so their bytes are the file's.
- Pickled weights (``pytorch_model.bin`` with ``allow_pickle``, COMET's ``model.ckpt``):
  ``nmt.checkpoints.files.check_structure``, as for every checkpoint.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

MAX_JSON_ITEMS = 4_000_000  # NLLB-200's tokenizer.json: about 800,000 (a 256,000-piece vocabulary and its merges)
MAX_PIECES = 1_000_000  # the largest vocabulary a folder's config may declare (marian.LIMITS["vocab_size"])
MAX_SAFETENSORS_HEADER = 4 << 20  # 64+64 layers (the most marian.LIMITS allows): about 300 KB


def json_object(raw: bytes, path: Path, error: type[Exception]) -> dict[str, Any]:
    """The JSON object ``raw`` (the file ``path``), or ``error`` naming the file and the limit."""
    items = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if items > MAX_JSON_ITEMS:
        raise error(f"{path}: {items:,} JSON values or more (its commas and brackets), over the {MAX_JSON_ITEMS:,} "
                    "a model folder's file may hold; refused before parsing")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise error(f"{path}: JSON nested over {sys.getrecursionlimit():,} levels deep (a model folder's is a few); "
                    "refused") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{path}: not JSON ({str(e)[:100]})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: not a JSON object")
    return value


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[i]  # an IndexError past the end: a truncated message
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def count_pieces(raw: bytes, path: Path, error: type[Exception]) -> None:
    """``error`` naming the file when the serialized SentencePiece model ``raw`` holds more than
    ``MAX_PIECES`` pieces (``ModelProto`` field 1), counted field by field on the wire without
    building them (at most ``MAX_PIECES`` steps); a malformed message is left to the parser."""
    count = i = 0
    n = len(raw)
    try:
        while i < n:
            if raw[i] == 0x0A and raw[i + 1] < 0x80:  # a piece of under 128 bytes: the common case, at once
                i += 2 + raw[i + 1]
                count += 1
            else:
                tag, i = _varint(raw, i)
                wire = tag & 7
                if wire == 2:  # length-delimited: a piece, the trainer or normalizer spec
                    length, i = _varint(raw, i)
                    i += length
                    count += tag == 0x0A  # field 1, the pieces
                elif wire == 0:
                    _, i = _varint(raw, i)
                elif wire in (1, 5):
                    i += 8 if wire == 1 else 4
                else:
                    return
            if count > MAX_PIECES:
                raise error(f"{path}: over {MAX_PIECES:,} SentencePiece pieces, more than any vocabulary a model "
                            "folder may declare; refused before it is parsed")
    except IndexError:
        return


def check_safetensors_header(path: Path, error: type[Exception]) -> None:
    """``error`` naming the file when its header (the JSON after the 8-byte length) is longer than
    ``MAX_SAFETENSORS_HEADER`` or than the file, before safetensors parses it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise error(f"{path}: {size} bytes, too short for a safetensors file")
    length = struct.unpack("<Q", head)[0]
    if length > MAX_SAFETENSORS_HEADER:
        raise error(f"{path}: a safetensors header of {length:,} bytes, over the {MAX_SAFETENSORS_HEADER:,} a model's "
                    "list of tensors needs; refused before it is parsed")
    if length > size - 8:
        raise error(f"{path}: a safetensors header of {length:,} bytes in a file of {size:,}: truncated or not safetensors")
