"""Damaged and hostile foreign checkpoints: PyTorch DCP folders and megatron-core `torch_dist` folders (`common.pt`).

Each fault gets one clear error naming the file (and for an item of a `.distcp` file, the item), runs no code,
leaves the source unchanged and writes no finished output. The folders are real `dcp.save` output of one process,
so every case runs in this process in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_hostile_pickles import armed, payloads, torch_archive  # noqa: F401  (armed: autouse, no code ran)

from ucp_deepspeed import CheckpointError
from ucp_deepspeed.compat import DcpWriter
from ucp_deepspeed.format.universal import MANIFEST
from ucp_deepspeed.interop import import_dcp, import_megatron
from ucp_deepspeed.sources.dcp import METADATA, DcpCheckpoint
from ucp_deepspeed.tools.cli import main as ucp


def digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture
def folder(tmp_path) -> Path:
    """A DCP save of a model and its AdamW state after one step, as `get_state_dict` lays them out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    names = dict(zip(model.state_dict(), range(4)))
    osd = opt.state_dict()
    optim = {
        "state": {n: osd["state"][i] for n, i in names.items()},
        "param_groups": [{**osd["param_groups"][0], "params": list(names)}],
    }
    out = tmp_path / "dcp"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process", unless a group exists
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim, "epoch": 3}, checkpoint_id=str(out))
    return out


def refused(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """The error `ucp import-dcp` gives for `folder`, after checking it wrote nothing finished."""
    before = digest(folder)
    assert ucp(["import-dcp", str(folder), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out" / MANIFEST).exists()
    assert digest(folder) == before
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_a_healthy_folder_imports(folder, tmp_path, capsys):
    assert ucp(["import-dcp", str(folder), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / MANIFEST).exists()


def _rewrite_metadata(folder: Path, change) -> None:
    meta = pickle.loads((folder / METADATA).read_bytes())  # the test's own file, read with pickle to edit it
    change(meta)
    (folder / METADATA).write_bytes(pickle.dumps(meta))


def _drop_chunk(meta) -> None:
    meta.state_dict_metadata["model.0.weight"].chunks[0].sizes = torch.Size([1, 6])


def _move_item(meta) -> None:
    index = next(i for i in meta.storage_data if i.fqn == "model.0.weight")
    meta.storage_data[index].offset += 10**9


def _escape_folder(meta) -> None:
    index = next(i for i in meta.storage_data if i.fqn == "model.0.weight")
    meta.storage_data[index].relative_path = "../elsewhere.distcp"


@pytest.mark.parametrize(
    "label, damage, named, reason",
    [
        ("metadata missing", lambda f: (f / METADATA).unlink(), METADATA, "missing"),
        ("metadata not a pickle", lambda f: (f / METADATA).write_bytes(b"\x00garbage"), METADATA, "cannot unpickle"),
        ("metadata of another kind", lambda f: (f / METADATA).write_bytes(pickle.dumps({"a": 1})), METADATA, "DCP"),
        ("a chunk missing", lambda f: _rewrite_metadata(f, _drop_chunk), METADATA, "chunks hold"),
        ("an item past its file's end", lambda f: _rewrite_metadata(f, _move_item), ".distcp", "truncated"),
        ("an item outside the folder", lambda f: _rewrite_metadata(f, _escape_folder), METADATA, "bad file"),
        ("a data file missing", lambda f: (f / "__0_0.distcp").unlink(), "__0_0.distcp", "missing"),
        (
            "a data file truncated",
            lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:-700]),
            "__0_0.distcp",
            "",
        ),
    ],
)
def test_damaged_dcp_folders_are_refused(folder, tmp_path, capsys, label, damage, named, reason):
    damage(folder)
    err = refused(folder, tmp_path, capsys)
    assert named in err and reason in err, (label, err)


def test_a_flipped_byte_in_a_tensor_item_fails_its_crc(folder, tmp_path, capsys):
    ckpt = DcpCheckpoint(str(folder))
    item = ckpt.tensors["optim.state.0.weight.exp_avg"].chunks[0].item
    ckpt.close()
    data = bytearray((folder / item.file).read_bytes())
    data[item.start + item.length // 2] ^= 0x40  # inside the tensor's record: past the pickle, before the directory
    (folder / item.file).write_bytes(bytes(data))
    err = refused(folder, tmp_path, capsys)
    assert item.file in err and "optim.state.0.weight.exp_avg" in err, err


def test_hostile_pickles_in_dcp_files_run_nothing(folder, tmp_path):
    for label, data in payloads(tmp_path).items():
        (folder / METADATA).write_bytes(data)
        with pytest.raises(CheckpointError) as err:
            DcpCheckpoint(str(folder))
        assert err.value.path.endswith(METADATA), label
    for n, (label, data) in enumerate(payloads(tmp_path).items()):
        out = tmp_path / f"hostile{n}"
        writer = DcpWriter(str(out))
        weight = torch.ones(2)
        writer.tensor("model.w", ("model", "w"), weight, _saved(weight))
        writer.tensor("optim.state.w.exp_avg", ("optim", "state", "w", "exp_avg"), weight, _saved(weight))
        writer.object("optim.param_groups.0.params", ("optim", "param_groups", 0, "params"), _saved(["w"]))
        writer.object("optim.param_groups.0.lr", ("optim", "param_groups", 0, "lr"), _archive(tmp_path, data))
        writer.finish()
        with pytest.raises(CheckpointError) as err:
            import_dcp(str(out), str(tmp_path / f"imported{n}"))
        assert "__0_0.distcp" in err.value.path and "optim.param_groups.0.lr" in err.value.path, label


def _saved(value) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _archive(tmp_path: Path, data: bytes) -> bytes:
    return torch_archive(tmp_path / "item.pt", data).read_bytes()


def _megatron_folder(folder: Path, common: bytes) -> Path:
    """The DCP folder dressed as megatron-core's torch_dist: `metadata.json` and the given `common.pt`."""
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (folder / "common.pt").write_bytes(common)
    return folder


def test_a_hostile_common_pt_runs_nothing(folder, tmp_path):
    for n, (label, data) in enumerate(payloads(tmp_path).items()):
        _megatron_folder(folder, _archive(tmp_path, data))
        with pytest.raises(CheckpointError) as err:
            import_megatron(str(folder), str(tmp_path / f"out{n}"))
        assert err.value.path.endswith("common.pt"), label


@pytest.mark.parametrize(
    "label, common, reason",
    [
        ("truncated", lambda: _saved({"iteration": 1})[:-40], "truncated or corrupt"),
        ("model only", lambda: _saved({"iteration": 1}), "no optimizer param_groups"),
        (
            "groups it cannot place",
            lambda: _saved({"optimizer": {"param_groups": [{"weight_decay": 0.1}] * 3}}),
            "3 param groups",
        ),
    ],
)
def test_damaged_megatron_common_pt_is_refused(folder, tmp_path, capsys, label, common, reason):
    _megatron_folder(folder, common())
    before = digest(folder)
    assert ucp(["import-megatron", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "common.pt" in err and reason in err and err.count("\n") == 0, (label, err)
    assert digest(folder) == before and not (tmp_path / "out" / MANIFEST).exists()
