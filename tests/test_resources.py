"""Every reader that holds files open is a context manager, as safetensors' `safe_open` is: `with` hands back the
reader itself and closes it when the block ends, by return or by error, so no descriptor outlives its block."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from synth_source import SynthSpec, synthesize
from test_format import _folder as write_universal_folder

from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.universal import (
    BUFFERS,
    STATE,
    CheckedFile,
    Folder,
    UniversalCheckpoint,
    read_manifest,
)
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import TorchFile
from ucp_deepspeed.sources.native import NativeCheckpoint

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")


def _open_under(root: Path) -> list[str]:
    """The files under `root` this process holds a descriptor of."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor of the listing itself, closed by now
            continue
        if target.startswith(f"{root}{os.sep}"):
            found.append(target)
    return found


Opener = Callable[[str, Manifest], Any]
READERS: dict[str, tuple[Opener, Callable[[Any], object]]] = {
    "Blob": (lambda root, _: st.open_blob(st.join(root, BUFFERS)), lambda blob: blob.read(0, 8)),
    "CheckedFile": (lambda root, m: CheckedFile(root, m.files[BUFFERS]), lambda f: f.full("b")),
    "Folder": (lambda root, m: Folder(root, m), lambda folder: folder.file(BUFFERS).full("b")),
    "TensorReader": (lambda root, _: UniversalCheckpoint(root), lambda ckpt: ckpt.read("w", "exp_avg")),
    "TorchFile": (lambda root, _: TorchFile(st.join(root, STATE)), lambda tfile: tfile.check_reads()),
}


@pytest.mark.parametrize("kind", READERS)
def test_a_reader_in_a_with_block_is_closed_when_the_block_ends(tmp_path: Path, kind: str) -> None:
    write_universal_folder(tmp_path)
    root, manifest = str(tmp_path), read_manifest(str(tmp_path))
    make, use = READERS[kind]
    reader = make(root, manifest)
    with reader as entered:
        assert entered is reader
        use(reader)
        assert _open_under(tmp_path), "the reader holds nothing open: the check below proves nothing"
    assert _open_under(tmp_path) == []
    with pytest.raises(RuntimeError, match="inside the block"), make(root, manifest) as reader:
        use(reader)
        raise RuntimeError("inside the block")
    assert _open_under(tmp_path) == []


def test_a_native_checkpoint_in_a_with_block_is_closed_when_the_block_ends(tmp_path: Path) -> None:
    """Opening a tag checks every rank file against its metadata, and so holds each of them open."""
    synthetic = synthesize(tmp_path, SynthSpec(dp=2, zero_stage=1))
    with NativeCheckpoint(str(synthetic.ckpt_dir)) as src:
        assert src.tag == synthetic.tag
        assert _open_under(tmp_path)
    assert _open_under(tmp_path) == []
