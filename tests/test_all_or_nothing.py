"""A load is all or nothing: a refused load leaves every state of the engine as it was (one process, real engines).

Each case trains a target engine past its initial state, snapshots everything it holds (module weights and
buffers, the optimizer's whole state dict with fp32 masters and moments, counters, the scheduler), then loads a
checkpoint with one byte flipped in the middle of a tensor and compares every state with the snapshot.
Multi-rank cases (the damage found by another rank's reads) are in tests/faults/test_integrity.py and
tests/test_load_paths.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import inprocess
import pytest
import torch
from inprocess import build, differences, state, train

from ucp_deepspeed import CheckpointError, convert

TAG2, TAG3 = "global_step2", "global_step3"


def _flip_mid_tensor(path: Path) -> None:
    """Flip one byte in the middle of the file, which in a torch archive or safetensors file is tensor data."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def one_rank() -> None:
    inprocess.one_rank()


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory) -> Path:
    """A ZeRO-1 run saved at steps 2 and 3."""
    out = tmp_path_factory.mktemp("saved")
    engine = build(1)
    train(engine, 2)
    engine.save_checkpoint(str(out / "z1"))
    train(engine, 1, 2)
    engine.save_checkpoint(str(out / "z1"))
    return out / "z1"


def _damaged(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    _flip_mid_tensor(ckpt / TAG3 / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return ckpt


def _refused_and_untouched(engine: Any, path: str, tag: str | None, match: str) -> None:
    before = state(engine)
    with pytest.raises(CheckpointError, match=match):
        engine.load_checkpoint(path, tag=tag)
    assert differences(before, state(engine)) == []
    train(engine, 1, 40)  # the engine is whole: it still trains and saves
    engine.save_checkpoint(path + ".after", tag="after")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "converted"])
def test_a_damaged_reshard_leaves_the_engine_as_it_was(saved, tmp_path, direct):
    """ZeRO-1 tag into a ZeRO-2 engine: read in place, or converted first (which refuses the damage)."""
    ckpt = _damaged(saved, tmp_path)
    engine = build(2, seed=1, universal={"direct": direct})
    train(engine, 3)
    _refused_and_untouched(engine, str(ckpt), TAG3, "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_a_damaged_universal_folder_leaves_the_engine_as_it_was(saved, tmp_path):
    """The restore reads the converted copy's blocks one parameter after another: the bad one is found before any
    parameter is written, though the parameters of the first group were read before it."""
    folder = Path(convert(str(saved), TAG3, output=str(tmp_path / "folder"), progress=False))
    last = folder / "params" / "head.bias.safetensors"  # in the second param group
    _flip_mid_tensor(last)
    engine = build(2, seed=1)
    train(engine, 3)
    _refused_and_untouched(engine, str(folder), None, last.name)


def test_a_damaged_chain_leaves_the_engine_as_it_was(one_rank, tmp_path):
    """A Check-N-Run chain with its middle delta's table damaged, read in place by a ZeRO-2 engine."""
    differential = {"differential": {"policy": "incremental"}}
    source = build(1, adagrad=True, **differential)
    for step in range(3):
        train(source, 1, step)
        source.save_checkpoint(str(tmp_path / "chain"))
    middle = next((tmp_path / "chain" / TAG2 / "tables").iterdir())
    _flip_mid_tensor(middle)
    engine = build(2, seed=1, adagrad=True, **differential)
    train(engine, 3)
    _refused_and_untouched(engine, str(tmp_path / "chain"), TAG3, "fails its crc32 check")


def test_an_unnamed_damaged_tag_falls_back_to_the_older_one(saved, tmp_path):
    ckpt = _damaged(saved, tmp_path)
    engine = build(2, seed=1)
    train(engine, 3)
    engine.load_checkpoint(str(ckpt))
    report = engine.ucp_last_load
    assert report.refused == (TAG3,) and report.mode == "resharded" and engine.global_steps == 2, report


def test_when_every_tag_is_damaged_the_newest_tags_damage_is_raised(saved, tmp_path):
    """With no tag named and no older tag left to fall back to, the error is what was wrong with the newest tag
    (naming its file), not that nothing older loaded; the engine is as it was."""
    ckpt = _damaged(saved, tmp_path)
    _flip_mid_tensor(ckpt / TAG2 / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    engine = build(2, seed=1)
    train(engine, 3)
    _refused_and_untouched(engine, str(ckpt), None, f"{TAG3}/zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_a_native_load_that_fails_part_way_closes_the_engine_until_a_load_succeeds(saved, tmp_path):
    """DeepSpeed's own load (same layout) writes as it reads, so it cannot be staged: after it fails the engine
    refuses to step or save, and a successful load opens it again."""
    ckpt = _damaged(saved, tmp_path)
    engine = build(1, seed=1)
    train(engine, 3)
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        engine.load_checkpoint(str(ckpt), tag=TAG3)
    with pytest.raises(CheckpointError, match="refusing to step"):
        train(engine, 1)
    with pytest.raises(CheckpointError, match="refusing to save"):
        engine.save_checkpoint(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    engine.load_checkpoint(str(ckpt), tag=TAG2)
    assert engine.ucp_last_load.mode == "native" and engine.global_steps == 2
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "out"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_reshard_writes_into_the_engines_own_tensors(saved, stage):
    """The ZeRO-1 tag into a trained ZeRO-2 or ZeRO-3 engine: every optimizer state and fp32 partition is the same
    tensor after the load, its storage overwritten, none allocated beside it (what keeps a GPU's memory at the
    engine's own during a restore; the staged copy is in host memory)."""
    from ucp_deepspeed import compat

    engine = build(stage, seed=1)
    train(engine, 3)
    opt = compat.base_optimizer(engine)
    tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    tensors += [p for g in opt.param_groups for p in g["params"]]
    before = [(t.data_ptr(), t.clone()) for t in tensors]
    engine.load_checkpoint(str(saved), tag=TAG3)
    assert engine.ucp_last_load.mode == "resharded"
    after = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    after += [p for g in opt.param_groups for p in g["params"]]
    assert len(after) == len(tensors) >= 4
    assert [t.data_ptr() for t in after] == [ptr for ptr, _ in before]
    assert not all(torch.equal(t, old) for t, (_, old) in zip(after, before)), "nothing was loaded"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "converted"])
def test_a_reshard_that_would_drop_fp8_state_is_refused_by_name(saved, tmp_path, direct):
    """Transformer Engine saves each module's FP8 scales and amax history as `<module>._extra_state`, a byte tensor
    (empty without FP8): the universal format does not carry it, so a reshard of such a tag is refused, naming the
    entry, before anything is read or written."""
    from ucp_deepspeed.io.torch_file import save_id_of, stamp

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt, ignore=shutil.ignore_patterns("*.universal"))
    model_states = ckpt / TAG3 / "mp_rank_00_model_states.pt"
    save_id = save_id_of(str(model_states))
    sd = torch.load(model_states, weights_only=False)
    sd["module"]["norm._extra_state"] = torch.empty(0, dtype=torch.uint8)  # no FP8: nothing to carry
    sd["module"]["head._extra_state"] = torch.arange(200, dtype=torch.uint8)
    torch.save(sd, model_states)
    stamp(str(model_states), save_id)
    engine = build(2, seed=1, universal={"direct": direct})
    train(engine, 3)
    _refused_and_untouched(
        engine, str(ckpt), TAG3, r"mp_rank_00_model_states.pt: head._extra_state holds Transformer Engine FP8 state"
    )
    assert not list(ckpt.glob("*.universal"))


def test_staging_that_is_not_zero_filled_leaves_no_stale_bytes(saved, monkeypatch):
    """Staging buffers are allocated without zero-filling (the reads overwrite them): what no parameter owns, the
    alignment padding of a flat partition, must still come out as zeros, never as whatever the memory held."""
    from ucp_deepspeed import compat
    from ucp_deepspeed.runtime import restore

    monkeypatch.setattr(restore, "_host_like", lambda flat: torch.full(flat.shape, float("nan"), dtype=flat.dtype))
    engine = build(2, seed=1)
    train(engine, 3)
    engine.load_checkpoint(str(saved), tag=TAG3)
    assert engine.ucp_last_load.mode == "resharded"
    groups = compat.zero12_groups(engine.optimizer)
    owned = sum(f.numel for g in groups for p in g.params if (f := compat.zero12_fragment(p)) is not None)
    assert sum(g.fp32.numel() for g in groups) > owned, "no padding: this test could not fail"
    states = [s for s in compat.base_optimizer(engine).state.values()]
    assert states and all(torch.isfinite(v).all() for s in states for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_folder_with_moments_but_no_step_is_refused_by_group(saved, tmp_path, stage):
    """torch's Adam reads `state["step"]` at its next step: a universal folder whose group holds Adam moments but no
    step count (a foreign source that left it out) would load and then fail in `engine.step()` with `KeyError:
    'step'`. The load is refused, naming the group, and the engine is left as it was."""
    import json

    folder = Path(convert(str(saved), TAG3, output=str(tmp_path / "folder"), progress=False))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "step" in manifest["param_groups"][1]["scalars"]
    del manifest["param_groups"][1]["scalars"]["step"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    engine = build(stage, seed=1)
    train(engine, 3)
    _refused_and_untouched(engine, str(folder), None, "param group 1 holds optimizer state .* but no step count")


def test_a_check_n_run_save_records_frozen_parameters_without_a_group(one_rank, tmp_path):
    """The manifest's convention (`ParamRecord.group`: None for frozen parameters), which the DCP export and the
    expert-name view read, holds for Check-N-Run's live saves too: they recorded group 0."""
    from ucp_deepspeed.format.universal import read_manifest

    engine = build(1, adagrad=True, differential={"policy": "incremental"})
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "chain"))
    (tag,) = [d for d in (tmp_path / "chain").iterdir() if d.is_dir()]
    manifest = read_manifest(str(tag))
    assert manifest.params["frozen.weight"].group is None and not manifest.params["frozen.weight"].trainable
    assert manifest.params["head.weight"].group == 0
