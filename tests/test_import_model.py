"""nmt-import's checks before any work: the release file is never written into the folder it
imports, nor under a name other readers take for another format."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nmt.import_model import import_model


@pytest.mark.parametrize("out", ["config.json", "model.safetensors", "sub/../model.ckpt", "link/model.ckpt"])
def test_the_release_file_is_never_written_into_the_folder_it_imports(tmp_path, out):
    """``out`` inside ``src`` (also through ``..`` or a link to the folder) or named ``.safetensors``:
    one line, and every file of the folder as it was."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "marian"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "link").symlink_to(folder)
    target = tmp_path / out if out.startswith("link") else folder / out
    with pytest.raises(ValueError) as refused:
        import_model(OmegaConf.create({"format": "huggingface", "src": str(folder), "out": str(target),
                                       "allow_pickle": False}))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"out={target}: ")
    assert ("a .safetensors name" in message) == out.endswith(".safetensors")
    assert (folder / "config.json").read_text() == '{"model_type": "marian"}'
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
