"""Bad input fails loudly, naming the file; the source is never modified; nothing half-written looks finished."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_results, torchrun

from ucp_deepspeed import CheckpointError, UniversalCheckpoint, convert
from ucp_deepspeed.convert.core import run_jobs
from ucp_deepspeed.convert.output import prepare_output
from ucp_deepspeed.convert.plan import plan_jobs
from ucp_deepspeed.format.metadata import meta_filename
from ucp_deepspeed.format.universal import MANIFEST
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.tags import incomplete_reason, resume_tag
from ucp_deepspeed.tools.cli import main as ucp
from ucp_deepspeed.tools.compare import diff

TAG = "global_step3"


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def z3_copy(sources, tmp_path) -> Path:
    """A private copy of the ZeRO-3 source checkpoint that a test may damage."""
    dst = tmp_path / "z3"
    shutil.copytree(sources["z3"], dst, ignore=shutil.ignore_patterns("*.universal"))
    return dst


@pytest.fixture(scope="module")
def clean_conversion(sources, tmp_path_factory) -> Path:
    return Path(convert(str(sources["z3"]), output=str(tmp_path_factory.mktemp("clean") / "u"), progress=False))


def test_conversion_leaves_source_untouched(sources, tmp_path):
    before = tree_digest(sources["z1"] / TAG)
    out = convert(str(sources["z1"]), output=str(tmp_path / "u"), workers=2, progress=False)
    assert tree_digest(sources["z1"] / TAG) == before
    assert UniversalCheckpoint(out).verify() == []


def test_converted_tensors_match_reference(sources, clean_conversion):
    """The universal files hold exactly the states gathered before saving."""
    ref = torch.load(sources["z3"] / "reference.pt", weights_only=False)["snapshot"]
    ckpt = UniversalCheckpoint(str(clean_conversion))
    for name, value in ref["fp32"].items():
        assert torch.equal(ckpt.read(name, "fp32").view(value.shape), value), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ckpt.read(name, key).view(value.shape), ref["state"][f"{name}/{key}"]), (name, key)
    assert torch.equal(ckpt.read("scale", "value").view(-1), ref["lp"]["scale"])
    assert torch.equal(ckpt.read_buffer("calls"), ref["buffers"]["calls"])
    assert ckpt.manifest.tied == {"head.weight": "embed.weight"}


def test_missing_rank_file(z3_copy):
    (z3_copy / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="rank files are missing: zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        convert(str(z3_copy), progress=False)


def test_truncated_rank_file(z3_copy, tmp_path):
    path = z3_copy / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        convert(str(z3_copy), output=str(tmp_path / "u"), progress=False)
    assert err.value.path == str(path)
    assert not (tmp_path / "u" / MANIFEST).exists()


def test_garbage_rank_file(z3_copy, tmp_path):
    path = z3_copy / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        convert(str(z3_copy), output=str(tmp_path / "u"), progress=False)


def test_pickled_code_is_refused(z3_copy, tmp_path):
    """A model-states file whose pickle would call os.system is refused, not executed."""
    import pickle
    import zipfile

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = z3_copy / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = pickle.dumps({"module": {}, "evil": Exploit()}, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(CheckpointError, match="refusing to unpickle global 'posix.system'"):
        convert(str(z3_copy), output=str(tmp_path / "u"), progress=False)
    assert not (tmp_path / "pwned").exists()


def test_missing_latest_lists_tags(z3_copy):
    (z3_copy / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no 'latest' file.*tags present: global_step3"):
        convert(str(z3_copy), progress=False)


def test_missing_metadata_is_rebuilt_from_deepspeed_files(z3_copy, clean_conversion, tmp_path):
    """Without our metadata the conversion reads DeepSpeed's own bookkeeping, and gets the same tensors."""
    (z3_copy / TAG / meta_filename(0)).unlink()
    before = tree_digest(z3_copy / TAG)
    out = convert(str(z3_copy), output=str(tmp_path / "u"), progress=False)
    assert tree_digest(z3_copy / TAG) == before
    report = diff(out, str(clean_conversion))
    assert report.identical and len(report.states) == 23, report


def test_missing_metadata_of_a_checkpoint_without_frozen_parameters(sources, tmp_path):
    """ZeRO-2 saved with exclude_frozen_parameters=True: DeepSpeed's files say so, and the conversion records it."""
    dst = tmp_path / "nofrozen"
    shutil.copytree(sources["z2nofrozen"], dst, ignore=shutil.ignore_patterns("*.universal", "*.lock"))
    (dst / TAG / meta_filename(0)).unlink()
    bare = convert(str(dst), output=str(tmp_path / "bare"), progress=False)
    with_meta = convert(str(sources["z2nofrozen"]), output=str(tmp_path / "meta"), progress=False)
    assert UniversalCheckpoint(bare).manifest.frozen_excluded is True
    report = diff(bare, with_meta)
    assert report.identical and "scale" not in {s.name for s in report.states}, report


def test_missing_metadata_and_a_rank_file(z3_copy):
    (z3_copy / TAG / meta_filename(0)).unlink()
    (z3_copy / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="rank files are missing: zero_pp_rank_1_mp_rank_00_model_states.pt"):
        convert(str(z3_copy), progress=False)


def test_missing_metadata_of_a_bf16_optimizer_checkpoint_is_rebuilt(sources, tmp_path):
    """Every bf16 engine's optimizer files are `bf16_zero_pp_rank_*`; BF16_Optimizer's (ZeRO-1 with fp32 gradient
    accumulation) lay out their flat groups as ZeRO-1's do but keep the alignment padding, which the metadata rebuilt
    from DeepSpeed's files says: without our metadata the conversion equals the one with it, tensor for tensor (it
    was refused as 'without a ZeRO optimizer')."""
    dst = tmp_path / "bf16"
    shutil.copytree(sources["bf16z1pad"], dst, ignore=shutil.ignore_patterns("*.universal"))
    (dst / TAG / meta_filename(0)).unlink()
    rebuilt = convert(str(dst), output=str(tmp_path / "rebuilt"), progress=False)
    recorded = convert(str(sources["bf16z1pad"]), output=str(tmp_path / "recorded"), progress=False)
    report = diff(str(recorded), str(rebuilt))
    assert report.identical and len(report.states) >= 20, report
    assert UniversalCheckpoint(str(rebuilt)).manifest.source.topology.optimizer == "BF16_Optimizer"


def test_missing_metadata_of_a_zero0_checkpoint(sources, tmp_path):
    """At ZeRO-0 DeepSpeed saves the torch optimizer's state dict, numbered, not named. Offline, shapes name a
    position only where one parameter has that shape; TinyLM's three 40-element vectors do not: refused, naming
    them and the way out (a load, where the engine's optimizer groups name them), not guessed."""
    dst = tmp_path / "z0"
    shutil.copytree(sources["z0"], dst, ignore=shutil.ignore_patterns("*.universal"))
    (dst / TAG / meta_filename(0)).unlink()
    with pytest.raises(CheckpointError, match="their shapes do not tell which is which") as refused:
        convert(str(dst), progress=False)
    assert "up.bias, norm.weight, norm.bias" in str(refused.value) and "engine.load_checkpoint" in str(refused.value)
    assert not list(tmp_path.glob("z0/*.universal"))
    # which of three alike vectors is which changes no file: inspect and verify describe and check it all the same
    assert ucp(["inspect", str(dst)]) == 0 and ucp(["verify", str(dst)]) == 0


def test_a_tensor_name_that_is_a_path_is_refused(z3_copy, tmp_path):
    """Names read from disk become output file names: one with a path separator never leaves the output folder."""
    path = z3_copy / TAG / meta_filename(0)
    meta = json.loads(path.read_text())
    meta["params"][0]["name"] = "../../escaped"
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="holds a path separator"):
        convert(str(z3_copy), progress=False)
    assert not list(tmp_path.rglob("escaped*"))


def test_unknown_metadata_version(z3_copy):
    path = z3_copy / TAG / meta_filename(0)
    meta = json.loads(path.read_text())
    meta["version"] = 99
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unknown metadata version 99"):
        convert(str(z3_copy), progress=False)


def test_unknown_format_version(clean_conversion, tmp_path):
    out = tmp_path / "u"
    shutil.copytree(clean_conversion, out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["version"] = 99
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="unknown format version 99"):
        UniversalCheckpoint(str(out))


def test_checksum_mismatch_is_reported(clean_conversion, tmp_path, capsys):
    out = tmp_path / "u"
    shutil.copytree(clean_conversion, out)
    victim = out / "params" / "up.weight.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert ucp(["verify", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"{victim}: block 0" in printed and "fails its crc32 check" in printed and "1 bad files" in printed


def test_truncated_universal_file(clean_conversion, tmp_path):
    out = tmp_path / "u"
    shutil.copytree(clean_conversion, out)
    victim = out / "params" / "down.weight.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="differs from manifest") as err:
        UniversalCheckpoint(str(out)).read("down.weight", "fp32")
    assert err.value.path == str(victim)


def test_interrupted_conversion_is_never_used_and_resumes(sources, clean_conversion, tmp_path):
    out = tmp_path / "u"
    src = NativeCheckpoint(str(sources["z3"]))
    reusable = prepare_output(src, str(out))
    run_jobs(src, str(out), plan_jobs(src)[:3], reusable, progress=False)
    (out / "params" / "up.bias.safetensors.tmp.4242").write_bytes(b"half a file")
    src.close()
    with pytest.raises(CheckpointError, match="unfinished conversion"):
        UniversalCheckpoint(str(out))
    convert(str(sources["z3"]), output=str(out), progress=False)
    assert tree_digest(out) == tree_digest(clean_conversion)


def test_output_of_another_checkpoint_is_refused(sources, clean_conversion):
    with pytest.raises(CheckpointError, match="finished conversion of a different checkpoint"):
        convert(str(sources["z1"]), output=str(clean_conversion), progress=False)


def test_foreign_output_folder_is_refused(sources, tmp_path):
    (tmp_path / "mine.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="not a ucp_deepspeed output"):
        convert(str(sources["z1"]), output=str(tmp_path), progress=False)
    assert (tmp_path / "mine.txt").read_text() == "user data"


def test_cli_convert_inspect(sources, tmp_path, capsys):
    out = tmp_path / "u"
    assert ucp(["convert", str(sources["bf16z1"]), "--output", str(out), "--no-progress"]) == 0
    assert ucp(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "saved at: zero1 dp=2 tp=1 pp=1 ep=1 bf16 (BF16_Optimizer)" in text
    assert "global_steps=3" in text and "fp32,exp_avg,exp_avg_sq" in text
    assert ucp(["inspect", str(sources["z2"]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "deepspeed" and summary["source_topology"]["zero_stage"] == 2
    assert summary["params"]["embed.weight"]["shape"] == [37, 24]
    assert ucp(["convert", str(tmp_path / "nowhere")]) == 2


@pytest.mark.slow  # the default run proves it with a real kill: test_resume.py::test_killed_during_save_...
def test_checkpoint_torn_during_save_is_skipped_on_resume(sources, tmp_path):
    """A newer tag whose rank file was cut short by a kill is skipped even though `latest` names it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["z1"], ckpt, ignore=shutil.ignore_patterns("*.universal"))
    shutil.copytree(ckpt / TAG, ckpt / "global_step6")
    torn = ckpt / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    (ckpt / "latest").write_text("global_step6")
    assert "truncated or corrupt" in incomplete_reason(str(ckpt), "global_step6")
    assert incomplete_reason(str(ckpt), TAG) is None
    assert resume_tag(str(ckpt)) == TAG
    results_file = tmp_path / "results.json"
    torchrun(3, "load", "--variant", "z2", "--results", str(results_file), "--source", str(ckpt))
    [r] = load_results(results_file)
    assert r["path"].endswith(TAG), r["path"]
    assert r["diffs"] == [], "\n".join(r["diffs"])  # exactly the state saved at step 3
