"""Files of one save are bound together, metadata is checked against DeepSpeed's files, every read is
checked, a source is never written, and a rerun trusts only what it can check.

Every refusal names the file and the reason, leaves the source unchanged (every file hashed) and
leaves no output that looks finished. The last test drives the same faults through a real
`load_checkpoint` on 2 ranks (native, resharded and universal-folder paths) and requires every
rank to raise the same error.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import load_results, nvme_unavailable, popen_payload, swap_pickle, torchrun

from ucp_deepspeed import CheckpointError, UniversalCheckpoint, convert
from ucp_deepspeed.convert.core import run_jobs
from ucp_deepspeed.convert.output import Journal, prepare_output
from ucp_deepspeed.convert.plan import plan_jobs
from ucp_deepspeed.format.metadata import meta_filename
from ucp_deepspeed.format.universal import MANIFEST
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.tools.cli import main as ucp

TAG = "global_step3"
OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_of(source: Path, dst: Path) -> Path:
    shutil.copytree(source, dst, ignore=shutil.ignore_patterns("*.universal", "*.lock", "reference.pt"))
    return dst


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def refused(capsys: pytest.CaptureFixture, *command: str) -> str:
    """Run a `ucp` command that must fail with one clear line; return that line."""
    assert ucp(list(command)) == 2, command
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "donor_tag,what", [(TAG, "another run of the same model, same step"), ("global_step2", "an older step")]
)
def test_rank_file_from_another_save_is_refused(sources, tmp_path, capsys, donor_tag, what):
    """z1b is z1 trained from another seed, saved at steps 2 and 3; one of its rank files is mixed in."""
    src = copy_of(sources["z1b"] if donor_tag != TAG else sources["z1"], tmp_path / "ckpt")
    shutil.copyfile(sources["z1b"] / donor_tag / OPTIM1, src / TAG / OPTIM1)
    before = digest(src)
    for command in (
        ["convert", str(src), "--output", str(tmp_path / "out"), "--no-progress"],
        ["verify", str(src)],
        ["inspect", str(src)],
    ):
        err = refused(capsys, *command)
        assert f"{src / TAG / OPTIM1}: belongs to another save" in err, (what, err)
    assert digest(src) == before and not (tmp_path / "out").exists()


@pytest.mark.nvme
@pytest.mark.parametrize("fault", ["flipped bit", "truncated", "link", "record missing", "record of another save"])
def test_nvme_swap_files_are_bound_and_checked(sources, tmp_path, capsys, fault):
    """A swap file carries nothing of its own to check: its save records its size, a CRC-32 per MiB and the optimizer
    file it completes (`offloaded_tensors/rank<NN>/ucp_swap_files.json`)."""
    if nvme_unavailable():
        pytest.skip(nvme_unavailable())
    src = copy_of(sources["nvmez3"], tmp_path / "ckpt")
    folder = src / TAG / "offloaded_tensors" / "rank01"
    record = json.loads((folder / "ucp_swap_files.json").read_text())
    master = next(name for name in record["files"] if "-" not in name)  # `<ds_id>.tensor.swp`; ds_ids vary per run
    assert sorted(record["files"]) == [master, f"exp_avg-{master}", f"exp_avg_sq-{master}"]
    moment = folder / f"exp_avg-{master}"
    size = moment.stat().st_size
    commands = ["convert", "verify", "inspect"]
    if fault == "flipped bit":
        flip(moment, 1000)
        commands, expected = ["convert"], f"{moment.name}: block 0 (bytes 0-1048575) fails its CRC-32 recorded at save"
        assert ucp(["verify", str(src)]) != 0
        assert expected in capsys.readouterr().out  # verify lists every bad file, one per line
    elif fault == "truncated":
        moment.write_bytes(moment.read_bytes()[:-100])
        commands, expected = ["convert"], f"{moment.name}: swap file is {size - 100} bytes, the save recorded {size}"
    elif fault == "link":  # a link could point anywhere on the machine: never followed
        shutil.move(moment, tmp_path / "elsewhere")
        moment.symlink_to(tmp_path / "elsewhere")
        commands, expected = ["convert"], f"{moment.name}: swap file cannot be opened"
    elif fault == "record missing":
        (folder / "ucp_swap_files.json").unlink()
        expected = "sub-group 0 was swapped to NVMe"
    else:
        (folder / "ucp_swap_files.json").write_text(json.dumps({**record, "save_id": "another-1"}))
        expected = "ucp_swap_files.json: belongs to save another-1"
    before = digest(src)
    for command in commands:
        output = ["--output", str(tmp_path / "out"), "--no-progress"] if command == "convert" else []
        err = refused(capsys, command, str(src), *output)
        assert expected in err, (command, err)
        assert not (tmp_path / "out" / MANIFEST).exists()
    assert digest(src) == before


def test_rank_file_of_an_older_step_without_our_metadata(sources, tmp_path, capsys):
    """Without save ids (a plain DeepSpeed checkpoint) an older step's file is still caught by its step count."""
    src = copy_of(sources["z1b"], tmp_path / "ckpt")
    for tag in ("global_step2", TAG):
        (src / tag / meta_filename(0)).unlink()
    shutil.copyfile(src / "global_step2" / OPTIM1, src / TAG / OPTIM1)
    err = refused(capsys, "convert", str(src), "--output", str(tmp_path / "out"), "--no-progress")
    assert "is at optimizer step 2" in err and "step 3" in err and OPTIM1 in err, err
    assert not (tmp_path / "out").exists()


def _edit_meta(root: Path, edit: callable) -> None:
    path = root / TAG / meta_filename(0)
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _slot(meta: dict, name: str) -> dict:
    return next(p for p in meta["params"] if p["name"] == name)


CONTRADICTIONS = {
    "shape widened": (lambda m: _slot(m, "up.weight").update(shape=[40, 25]), "param_shapes disagrees"),
    "shape transposed": (lambda m: _slot(m, "up.weight").update(shape=[24, 40]), "param_shapes disagrees"),
    "offset moved": (
        lambda m: _slot(m, "up.weight").update(offset=_slot(m, "up.weight")["offset"] + 1),
        "param_slice_mappings of flat 0 disagree",
    ),
    "partition size": (lambda m: [p.update(partition=p["partition"] + 8) for p in m["params"]], "flat 0 holds"),
    "ZeRO stage": (lambda m: m["topology"].update(zero_stage=1), "ds_config has ZeRO stage 2, metadata says 1"),
    "buffer renamed": (
        lambda m: next(e for e in m["extras"] if e["kind"] == "buffer").update(name="counts"),
        "buffer_names",
    ),
    "param group moved": (lambda m: _slot(m, "up.bias").update(flat=0, group=0), "param_shapes disagrees"),
}


@pytest.mark.parametrize("label", sorted(CONTRADICTIONS))
def test_metadata_that_contradicts_deepspeeds_files_is_refused(sources, tmp_path, capsys, label):
    edit, expected = CONTRADICTIONS[label]
    src = copy_of(sources["z2"], tmp_path / "ckpt")
    _edit_meta(src, edit)
    before = digest(src)
    err = refused(capsys, "convert", str(src), "--output", str(tmp_path / "out"), "--no-progress")
    assert expected in err and str(src / TAG) in err, err
    assert digest(src) == before and not (tmp_path / "out").exists()


def test_universal_folder_reads_are_checked(sources, tmp_path, capsys):
    """One flipped data byte in a converted copy: the read that touches it fails, naming the file and block."""
    out = Path(convert(str(sources["z1"]), output=str(tmp_path / "u"), progress=False))
    victim = out / "params" / "embed.weight.safetensors"
    flip(victim, victim.stat().st_size - 7)
    ckpt = UniversalCheckpoint(str(out))
    assert ckpt.read("up.weight", "fp32").numel() == 40 * 24  # other files read fine
    with pytest.raises(CheckpointError, match=r"block 0 .* fails its crc32 check") as err:
        ckpt.read("embed.weight", "exp_avg_sq", 0, 5)
    assert err.value.path == str(victim)
    assert ucp(["verify", str(out)]) == 1


@pytest.mark.parametrize("where", ["tag", "inside tag", "checkpoint dir", "other tag"])
def test_output_inside_a_source_is_refused(sources, tmp_path, capsys, where):
    src = copy_of(sources["z1b"], tmp_path / "ckpt")
    out = {
        "tag": src / TAG,
        "inside tag": src / TAG / "u",
        "checkpoint dir": src,
        "other tag": src / "global_step2" / "u",
    }[where]
    before = digest(src)
    for command in (
        ["convert", str(src), "--output", str(out), "--no-progress"],
        ["convert", str(src), "--output", str(out), "--format", "deepspeed", "--no-progress"],
        ["export-hf", str(src), str(out), "--arch", "llama", "--num-heads", "1", "--no-progress"],
    ):
        err = refused(capsys, *command)
        assert "never written" in err or "checkpoint folder" in err, (command, err)
    assert digest(src) == before


def test_a_rerun_trusts_only_leftovers_that_check_out(sources, tmp_path):
    """After an interrupted conversion, a finished file damaged later and one missing from the journal are
    both written again; the result equals a clean conversion."""
    clean = Path(convert(str(sources["z1"]), output=str(tmp_path / "clean"), progress=False))
    out = tmp_path / "u"
    src = NativeCheckpoint(str(sources["z1"]))
    try:
        jobs = plan_jobs(src)
        run_jobs(src, str(out), jobs[:4], prepare_output(src, str(out)), progress=False)
    finally:
        src.close()
    finished = sorted(Journal.read(str(out)))
    assert len(finished) == 4
    damaged = out / finished[0]
    flip(damaged, damaged.stat().st_size - 3)
    unjournaled = out / "params" / "stray.safetensors"
    unjournaled.write_bytes(b"not from this conversion")
    convert(str(sources["z1"]), output=str(out), progress=False)
    assert digest(out) == digest(clean)
    assert UniversalCheckpoint(str(out)).verify() == []


def test_unfinished_conversion_is_named_as_such(sources, tmp_path, capsys):
    out = tmp_path / "u"
    src = NativeCheckpoint(str(sources["z1"]))
    try:
        run_jobs(src, str(out), plan_jobs(src)[:2], prepare_output(src, str(out)), progress=False)
    finally:
        src.close()
    for command in ("inspect", "verify"):
        assert "is an unfinished conversion (no manifest.json)" in refused(capsys, command, str(out))
        assert "does not exist" in refused(capsys, command, str(tmp_path / "nowhere"))
    assert ucp(["verify", str(sources["z1"] / TAG)]) == 0  # a tag folder named directly is read as that tag
    assert "carries this save's id" in capsys.readouterr().out


def test_faults_are_refused_on_every_load_path(sources, tmp_path):
    """On 2 ranks at z1 (the saved layout of z1): a crafted model-states pickle and a file from another save
    (native path), a damaged tensor record (native: raised on every rank after DeepSpeed's load, which has written
    into the engine by then, so the engine refuses to step), a damaged universal folder, and contradicting
    metadata (resharded path from z2), each refused with the engine as it was."""
    crafted = copy_of(sources["z1"], tmp_path / "crafted")
    swap_pickle(crafted / TAG / MODEL, popen_payload(tmp_path / "pwned"))
    mixed = copy_of(sources["z1"], tmp_path / "mixed")
    shutil.copyfile(sources["z1b"] / TAG / OPTIM1, mixed / TAG / OPTIM1)
    damaged = copy_of(sources["z1"], tmp_path / "damaged")
    flip(damaged / TAG / OPTIM1, (damaged / TAG / OPTIM1).stat().st_size // 2)
    folder = Path(convert(str(sources["z1"]), output=str(tmp_path / "folder"), progress=False))
    flip(folder / "params" / "up.weight.safetensors", 200)
    contradicting = copy_of(sources["z2"], tmp_path / "contradicting")
    _edit_meta(contradicting, CONTRADICTIONS["shape transposed"][0])
    cases = {
        f"{crafted}#{TAG}": "refusing to unpickle global 'deepspeed.launcher.runner.subprocess.Popen'",
        f"{mixed}#{TAG}": f"{mixed / TAG / OPTIM1}: belongs to another save",
        str(damaged): f"{damaged / TAG / OPTIM1}: record",
        str(folder): f"{folder / 'params' / 'up.weight.safetensors'}: block 0",
        str(contradicting): "param_shapes disagrees",
    }
    results = tmp_path / "results.json"
    torchrun(2, "load", "--variant", "z1", "--expect-error", "--results", str(results), "--source", *cases)
    for outcome in load_results(results):
        errors = outcome["errors"]
        assert errors[0] is not None and errors[0] == errors[1], outcome
        assert cases[outcome["source"]] in errors[0], outcome
        if outcome["source"] == str(damaged):  # DeepSpeed's own load writes as it reads: the engine stays closed
            assert all(refused and "refusing to step" in refused for refused in outcome["step"]), outcome
        else:  # refused before anything was written: the engine is as it was, and trains on
            assert outcome["changed"] == [[], []] and outcome["step"] == [None, None], outcome
    assert not (tmp_path / "pwned").exists()
    assert not list(tmp_path.glob("*/*.universal/" + MANIFEST))
