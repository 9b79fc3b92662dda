"""Every reader that holds files open is a context manager, as safetensors' `safe_open` is: `with` hands back the
reader itself and closes it when the block ends, by return or by error, so no descriptor outlives its block."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from synth_source import SynthSpec, synthesize
from test_format import _folder as write_universal_folder

from ucp_deepspeed.compat import DcpWriter
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.universal import (
    BUFFERS,
    STATE,
    CheckedFile,
    Folder,
    UniversalCheckpoint,
    read_manifest,
)
from ucp_deepspeed.interop.deepspeed import _ModuleTensors
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import IndexedArchive, TorchFile
from ucp_deepspeed.sources.dcp import DcpCheckpoint
from ucp_deepspeed.sources.model_states import LayerStatesFile, ModelStatesFile
from ucp_deepspeed.sources.native import NativeCheckpoint, RankFiles, tag_metas
from ucp_deepspeed.sources.optim_file import OptimRankFile

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


def _closed_when_the_block_ends(root: Path, make: Callable[[], Any], use: Callable[[Any], object]) -> None:
    """`with make()` hands back the reader, and nothing under `root` is left open after the block, also when
    the block raises."""
    reader = make()
    with reader as entered:
        assert entered is reader
        use(reader)
        assert _open_under(root), "the reader holds nothing open: the check below proves nothing"
    assert _open_under(root) == []
    with pytest.raises(RuntimeError, match="inside the block"), make() as reader:
        use(reader)
        raise RuntimeError("inside the block")
    assert _open_under(root) == []


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
    _closed_when_the_block_ends(tmp_path, lambda: make(root, manifest), use)


def test_a_native_checkpoint_in_a_with_block_is_closed_when_the_block_ends(tmp_path: Path) -> None:
    """Opening a tag checks every rank file against its metadata, and so holds each of them open."""
    synthetic = synthesize(tmp_path, SynthSpec(dp=2, zero_stage=1))
    with NativeCheckpoint(str(synthetic.ckpt_dir)) as src:
        assert src.tag == synthetic.tag
        assert _open_under(tmp_path)
    assert _open_under(tmp_path) == []


MODEL, OPTIM, LAYER = (
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "layer_01-model_states.pt",
)
SourceOpener = Callable[[Path, Path], Any]
SOURCE_READERS: dict[str, tuple[SourceOpener, Callable[[Any], object]]] = {
    "ModelStatesFile": (lambda tag, _: ModelStatesFile(str(tag / MODEL)), lambda f: f.module_names()),
    "LayerStatesFile": (lambda _, other: LayerStatesFile(str(other / LAYER)), lambda f: f.tensor("w").load()),
    "OptimRankFile": (lambda tag, _: OptimRankFile(str(tag / OPTIM), 1), lambda f: f.flat(0, FP32).load()),
    "IndexedArchive": (lambda tag, _: IndexedArchive(str(tag / OPTIM)), lambda f: f.pieces()),
    "RankFiles": (lambda tag, _: RankFiles(str(tag), 0, tag_metas(str(tag))[0][0]), lambda r: r.optim(0)),
    "DcpCheckpoint": (lambda _, other: DcpCheckpoint(str(other / "dcp")), lambda c: c.tensor("model.w")),
    "_ModuleTensors": (
        lambda tag, _: _ModuleTensors(str(tag), [ModelStatesFile(str(tag / MODEL))]),
        lambda m: m.check_reads(),
    ),
}


def _saved(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A native tag, a pipeline layer file and a DCP folder under one root: the root, the tag, the others' folder."""
    root = tmp_path_factory.mktemp("sources")
    synthetic = synthesize(root / "native", SynthSpec(dp=2, zero_stage=1))
    other = root / "other"
    other.mkdir()
    torch.save({"w": torch.ones(3)}, other / LAYER)
    weight = torch.arange(6.0).reshape(2, 3)
    writer = DcpWriter(str(other / "dcp"))
    writer.tensor("model.w", ("model", "w"), weight, _saved(weight))
    writer.finish()
    return root, synthetic.ckpt_dir / synthetic.tag, other


@pytest.mark.parametrize("kind", SOURCE_READERS)
def test_a_source_file_in_a_with_block_is_closed_when_the_block_ends(
    sources: tuple[Path, Path, Path], kind: str
) -> None:
    root, tag, other = sources
    make, use = SOURCE_READERS[kind]
    _closed_when_the_block_ends(root, lambda: make(tag, other), use)
