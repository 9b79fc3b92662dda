"""Checkpoints on an S3-compatible store (moto's server on 127.0.0.1): a job saves to `s3://...`, and another resumes
from it at a different size and ZeRO stage, every state `torch.equal`; a torn save never counts as complete; no
secret reaches an object."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch_jobs, load_results, torchrun
from s3server import SECRET, S3Server, s3_server

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.commit import COMMIT, read_commit
from ucp_deepspeed.format.paths import list_tags
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.spread import KEYS, SPREAD, Spread
from ucp_deepspeed.sources.tags import incomplete_reason, resume_tag
from ucp_deepspeed.tools import cli

DLRM = ROOT / "tests" / "workers" / "train_dlrm.py"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def saved(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """A ZeRO-1 job (saved at steps 2 and 3) and a ZeRO-2 job on 2 ranks, saved to the store (the second spread over 4
    key prefixes), then loaded back into fresh engines, the first at the same layout and the second at ZeRO-1
    (configured without key prefixes: the tag says where its objects are), in one launch."""
    run = f"s3://{s3.bucket()}/run"
    reloaded = tmp_path_factory.mktemp("store") / "reloaded.json"
    # what a save of the same tag killed before it spread its objects left behind: the spread save replaces it
    st.write(f"{run}/z2keys/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", b"torn")
    torchrun(
        2, "save", "--out", run, "--variant", "z1b", "z2keys", "--reload", str(reloaded), "--reload-as", "z2keys=z1"
    )
    return run, json.loads(reloaded.read_text())


@pytest.fixture(scope="module")
def run(saved: tuple[str, list[dict]]) -> str:
    return saved[0]


def test_a_job_saved_to_the_store_resumes_at_the_same_layout_and_another_stage(saved: tuple[str, list[dict]]) -> None:
    run, found = saved
    assert [(r["source"], r["target"], r["mode"]) for r in found] == [
        (f"{run}/z1b", "z1b", "same-layout"),  # the same layout, read from the store by our reader
        (f"{run}/z2keys", "z1", "resharded"),
    ]
    for r in found:
        assert r["diffs"] == [] and r["max_rel_loss"] < 1e-5, r
    assert not Path("s3:").exists()  # never taken for a local folder


@pytest.mark.slow
def test_a_job_saved_to_the_store_resumes_at_another_size_and_stage(run: str, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    cases = [["--case", "z3", f"{run}/z1b"], ["--case", "z1", f"{run}/z2keys"]]
    torchrun(3, "load", *(a for c in cases for a in c), "--results", str(results))
    found = json.loads(results.read_text())
    assert [(r["target"], r["mode"], r["saved"], r["live"]) for r in found] == [
        ("z3", "resharded", "zero1 dp=2 fp32", "zero3 dp=3 fp32"),
        ("z1", "resharded", "zero2 dp=2 fp32", "zero1 dp=3 fp32"),
    ]
    for r in found:
        assert r["diffs"] == [] and r["tensors"] > 20, r
        assert r["max_rel_loss"] < 1e-5, r
    assert not Path("s3:").exists()  # never taken for a local folder


def test_a_save_commits_every_object_and_then_latest(run: str) -> None:
    ckpt = f"{run}/z1b"
    tag = st.read_text(st.join(ckpt, "latest"))
    record = read_commit(st.join(ckpt, tag))
    assert record is not None and record.save_id
    names = dict(record.objects)
    assert {"mp_rank_00_model_states.pt", "ucp_meta_mp_rank_00.json"} <= set(names)
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(names)
    sizes = st.storage_of(ckpt).sizes(st.join(ckpt, tag))
    assert all(sizes[name] == size for name, size in names.items())
    assert st.isfile(st.join(ckpt, "zero_to_fp32.py"))  # DeepSpeed's recovery script, sent through the store


def test_a_save_spread_over_key_prefixes_keeps_only_its_keys_object_in_the_tag_folder(run: str) -> None:
    ckpt = f"{run}/z2keys"
    tag = st.read_text(st.join(ckpt, "latest"))
    fs, key = st.storage_of(ckpt).fs, ckpt[len("s3://") :]  # type: ignore[attr-defined]
    assert fs.ls(f"{key}/{tag}", detail=False) == [f"{key}/{tag}/{KEYS}"]  # an earlier save's object deleted
    record = read_commit(st.join(ckpt, tag))
    assert record is not None and KEYS in dict(record.objects)
    spread = Spread(4)
    placed = {p.rsplit("/", 1)[1]: p for p in fs.find(f"{key}/{SPREAD}")}
    assert set(placed) == set(dict(record.objects)) - {KEYS} | {COMMIT}  # the metadata and commit object too
    for name, where in placed.items():
        assert where == f"{key}/{SPREAD}/{spread.prefix(name)}/{tag}/{name}"
    assert len({spread.prefix(n) for n in placed}) > 1
    assert {"global_step3", SPREAD} <= set(st.listdir(ckpt)) and list_tags(ckpt) == ["global_step3"]
    assert cli.main(["verify", ckpt]) == 0  # one lookup at a time, outside a load


def test_no_secret_reaches_an_object(run: str, s3: S3Server) -> None:
    bucket = run.split("/")[2]
    for rel in st.find(f"s3://{bucket}"):
        data = st.read(f"s3://{bucket}/{rel}")
        assert SECRET.encode() not in data and s3.env["AWS_ACCESS_KEY_ID"].encode() not in data, rel


def test_the_ucp_command_reads_and_writes_the_store(run: str, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = f"{run}/z1b"
    assert cli.main(["inspect", ckpt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "deepspeed" and summary["source_topology"]["dp"] == 2
    assert cli.main(["verify", ckpt]) == 0
    assert capsys.readouterr().out.startswith("ok:")
    out = f"{run}/converted/z1b"
    assert cli.main(["convert", ckpt, "--output", out, "--no-progress"]) == 0
    assert st.isfile(f"{out}/manifest.json")
    assert cli.main(["verify", out]) == 0
    capsys.readouterr()
    assert cli.main(["diff", ckpt, out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"]
    assert cli.main(["inspect", f"nosuch://{run[5:]}"]) == 2
    assert "'nosuch://' is not a storage scheme" in capsys.readouterr().err


@pytest.mark.slow
def test_a_megatron_tensor_parallel_model_resumes_from_the_store(s3: S3Server, tmp_path: Path) -> None:
    """A megatron-core GPT saved at TP=2 to the store resumes at TP=1 x DP=2, every state exact (one launch)."""
    run = f"s3://{s3.bucket()}/gpt"
    layout = ["--arch", "llama", "--zero", "1", "--pp", "1"]
    jobs = [
        ["save", *layout, "--tp", "2", "--out", run],
        ["load", *layout, "--tp", "1", "--results", str(tmp_path / "r.json"), "--source", run],
    ]
    launch_jobs(2, jobs)
    (found,) = load_results(tmp_path / "r.json")
    assert (found["mode"], found["diffs"], found["client_state_ok"]) == ("resharded", [], True), found
    assert found["tensors"] > 20 and found["max_rel_loss"] < 1e-5, found
    # a Hugging Face folder, exported to the store and imported back from it, holds the same weights
    assert cli.main(["export-hf", run, f"{run}-hf", "--no-progress"]) == 0
    assert "config.json" in st.listdir(f"{run}-hf") and any(n.endswith(".safetensors") for n in st.find(f"{run}-hf"))
    assert cli.main(["import-hf", f"{run}-hf", f"{run}-imported", "--no-progress"]) == 0
    tag = st.read_text(f"{run}/latest")
    exported = UniversalCheckpoint(f"{run}/{tag}.universal")  # the copy export-hf converted on the way
    imported = UniversalCheckpoint(f"{run}-imported")
    assert imported.manifest.params and set(imported.manifest.params) <= set(exported.manifest.params)
    for name in imported.manifest.params:
        assert torch.equal(imported.read(name, "fp32"), exported.read(name, "fp32")), name


@pytest.mark.slow
def test_a_check_n_run_chain_on_the_store_resumes_at_another_size(s3: S3Server) -> None:
    """An incremental chain saved every 2 steps at DP=2 ZeRO-2 to the store resumes at DP=1 ZeRO-1 from its newest
    delta, read in place from the store, every state exact."""
    ckpt = f"s3://{s3.bucket()}/dlrm"
    options = ["--policy", "incremental", "--keep", "10", "--snapshots"]
    launch_jobs(2, [["train", "--ckpt-dir", ckpt, *options, "--zero", "2", "--steps", "6"]], DLRM)
    assert st.read_text(f"{ckpt}/latest") == "global_step6"
    launch_jobs(1, [["train", "--ckpt-dir", ckpt, *options, "--zero", "1", "--steps", "7"]], DLRM)
    before = torch.load(io.BytesIO(st.read(f"{ckpt}/saved_step6.pt")), weights_only=False)
    after = torch.load(io.BytesIO(st.read(f"{ckpt}/resumed_step6.pt")), weights_only=False)
    for kind in ("fp32", "state"):
        assert sorted(before[kind]) == sorted(after[kind]) and before[kind], kind
        for key in before[kind]:
            assert torch.equal(before[kind][key], after[kind][key]), (kind, key)


def test_an_engine_reaches_the_store_through_its_config_and_refuses_an_unserved_scheme(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process: `storage_options` alone reach the store (no AWS_ENDPOINT_URL), an async save commits at the
    next step, with its data loader's position, the same layout reads both back exactly, and a URL nothing serves is
    refused before anything is written."""
    import inprocess
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(list(range(48)), batch_size=4, sampler=DistributedSampler(range(48), 1, 0, seed=3))

    inprocess.one_rank()
    bucket = s3.bucket()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = {"storage_options": {"endpoint_url": s3.endpoint}}
    engine = inprocess.build(1, universal={**options, "async_save": True})
    inprocess.train(engine, 2)
    run = f"s3://{bucket}/run"
    saving = loader()
    next(iter(saving))
    engine.save_checkpoint(run, data_loader=saving)
    saved = inprocess.state(engine)
    assert not st.exists(f"{run}/latest")  # not before every upload is acknowledged and committed
    engine.wait_for_checkpoint()
    assert st.read_text(f"{run}/latest") == "global_step2"
    commit = read_commit(f"{run}/global_step2")
    assert commit is not None and "data_loader.pt" in dict(commit.objects)
    with pytest.raises(CheckpointError, match=r"nosuch://b/run: 'nosuch://' is not a storage scheme"):
        engine.save_checkpoint("nosuch://b/run")
    assert not Path("nosuch:").exists()
    fresh, resumed = inprocess.build(1, seed=1, universal=options), loader()
    fresh.load_checkpoint(run, data_loader=resumed)
    assert fresh.ucp_last_load.mode == "same-layout" and inprocess.differences(saved, inprocess.state(fresh)) == []
    assert [x for b in resumed for x in b.tolist()] == list(DistributedSampler(range(48), 1, 0, seed=3))[4:]
    engine.destroy()
    fresh.destroy()


def test_a_check_n_run_save_that_fails_on_the_store_commits_nothing(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Check-N-Run save whose upload fails after the gathers began: an error naming the object, raised after them
    (every rank takes part in each), no manifest, `latest` still names the previous save."""
    import inprocess

    import ucp_deepspeed.format.writer as writer

    inprocess.one_rank()
    run = f"s3://{s3.bucket()}/chain"
    engine = inprocess.build(1, adagrad=True, differential={"policy": "incremental"})
    inprocess.train(engine, 1)
    engine.save_checkpoint(run)
    assert st.read_text(f"{run}/latest") == "global_step1"
    inprocess.train(engine, 1, offset=1)
    real, calls = writer.write_tensors, []

    def second_upload_fails(root: str, relpath: str, tensors: dict) -> object:
        calls.append(relpath)
        if len(calls) == 2:
            raise CheckpointError(st.join(root, relpath), "storage request failed while writing it (injected)")
        return real(root, relpath, tensors)

    monkeypatch.setattr(writer, "write_tensors", second_upload_fails)
    with pytest.raises(CheckpointError, match=r"global_step2/params/.*storage request failed while writing it"):
        engine.save_checkpoint(run)
    assert len(calls) == 2  # nothing written after the failure
    assert not st.isfile(f"{run}/global_step2/manifest.json") and st.read_text(f"{run}/latest") == "global_step1"
    assert resume_tag(run) == "global_step1"
    engine.destroy()


def test_a_torn_or_damaged_save_on_the_store_is_never_complete(run: str) -> None:
    """Runs last: it damages the saved tags (the first one's objects spread over key prefixes)."""
    ckpt = f"{run}/z2keys"
    tag = st.read_text(st.join(ckpt, "latest"))
    tag_dir = st.join(ckpt, tag)
    assert incomplete_reason(ckpt, tag) is None
    optim = st.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = st.read(optim)
    st.write(optim, data[: len(data) // 2])  # truncated behind the save's back
    assert f"zero_pp_rank_1_mp_rank_00_optim_states.pt is {len(data) // 2} bytes, the save wrote {len(data)}" in str(
        incomplete_reason(ckpt, tag)
    )
    st.delete(optim)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt, written by the save, is missing" in str(
        incomplete_reason(ckpt, tag)
    )
    st.write(optim, data)
    assert incomplete_reason(ckpt, tag) is None
    # every rank file whole and `latest` naming it, but the save never committed: a restart takes the older tag
    ckpt = f"{run}/z1b"
    assert st.read_text(st.join(ckpt, "latest")) == "global_step3" and resume_tag(ckpt) == "global_step3"
    st.delete(st.join(ckpt, "global_step3", COMMIT))
    assert f"no {COMMIT}" in str(incomplete_reason(ckpt, "global_step3"))
    assert resume_tag(ckpt) == "global_step2"
