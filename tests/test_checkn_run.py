"""Check-N-Run on the universal format, end to end: a DLRM-like model trained under torchrun saves
differential (and quantized) checkpoints, then resumes at another DP size or ZeRO stage.

Without quantization the resumed fp32 weights and optimizer states are torch.equal to those saved;
with it, dense parameters and optimizer states still are, and every table row is within the
quantizer's bound. A missing or corrupt chain element is an error, never a partial restore.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch_jobs

from ucp_deepspeed.checkn_run.chain import ChainCheckpoint, chain, materialize
from ucp_deepspeed.checkn_run.differential import ChainPolicy, new_baseline_pays
from ucp_deepspeed.checkn_run.quantize import dequantize, quantize
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.sources.tags import prune, resume_tag

DLRM = ROOT / "tests" / "workers" / "train_dlrm.py"
TABLES = ("tables.0.weight", "tables.1.weight", "tables.2.weight")
CASES = {  # name: (policy, extra options, saved at (dp, zero), resumed at (dp, zero))
    "one_shot": ("one_shot", ["--loader", "480"], (2, 1), (1, 2)),  # an epoch of 10 steps, from a data loader
    "incremental": ("incremental", ["--loader", "480"], (2, 2), (3, 1)),
    "intermittent": ("intermittent", [], (2, 1), (2, 3)),
    "quantized": ("intermittent", ["--bits", "4", "--method", "adaptive"], (2, 3), (1, 1)),  # saved from ZeRO-3
}


def _job(ckpt: Path, policy: str, extra: list[str], zero: int, steps: int) -> list[str]:
    options = ["--policy", policy, "--zero", str(zero), "--steps", str(steps), "--keep", "10", "--snapshots"]
    return ["train", "--ckpt-dir", str(ckpt), *options, "--results", f"{ckpt}.json", *extra]


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For each case, a checkpoint directory after 8 steps with a save every 2 steps (one launch: all are
    saved at dp=2)."""
    out = {name: tmp_path_factory.mktemp(name) for name in CASES}
    assert {dp for _, _, (dp, _), _ in CASES.values()} == {2}
    jobs = [_job(out[name], policy, extra, zero, 8) for name, (policy, extra, (_, zero), _) in CASES.items()]
    launch_jobs(2, jobs, DLRM)
    return out


def _manifest(ckpt: Path, step: int) -> dict:
    return json.loads((ckpt / f"global_step{step}" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def resumed(saved: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """resumed(case, converted): the case resumed at its target layout, reading the chain in place (direct, the
    default) or through its full universal copy (`--converted`). Both of every case of a world size resume in one
    launch, run when a test first asks for one of them."""
    out: dict[tuple[str, bool], Path] = {}
    launched: set[int] = set()

    def get(name: str, converted: bool) -> Path:
        world = CASES[name][3][0]
        if world not in launched:
            launched.add(world)
            jobs = []
            for case, (policy, extra, _, (dp, zero)) in CASES.items():
                for copy in (False, True) if dp == world else ():
                    ckpt = tmp_path_factory.mktemp(f"{case}-{'converted' if copy else 'direct'}") / "ckpt"
                    shutil.copytree(saved[case], ckpt)
                    out[case, copy] = ckpt
                    jobs.append(_job(ckpt, policy, extra, zero, steps=10) + (["--converted"] if copy else []))
            launch_jobs(world, jobs, DLRM)
        if (name, converted) not in out:
            pytest.fail(f"the launch that resumes {name} failed")
        return out[name, converted]

    return get


# the default run resumes the cases that resume at one rank (one launch); the others take a launch per world size
RESUMES = [pytest.param(n, marks=[pytest.mark.slow] if CASES[n][3][0] != 1 else []) for n in CASES]


@pytest.mark.parametrize("name", [n for n in RESUMES if "--loader" in CASES[n.values[0]][1]])
def test_resumed_dlrm_continues_its_data_at_another_size(saved, resumed, name):
    """Check-N-Run's DLRM job reading a StatefulDataLoader over a DistributedSampler, saved at 2 ranks after 8 of an
    epoch's 10 steps and resumed at 1 (3 with -m slow): every step, before and after, trains on the next global batch
    of the sampler's permutation, so the epoch covers each of its 480 samples once."""
    before = json.loads(Path(f"{saved[name]}.json").read_text())["log"]
    after = json.loads(Path(f"{resumed(name, False)}.json").read_text())["log"]
    order = torch.randperm(480, generator=torch.Generator().manual_seed(11)).tolist()  # DistributedSampler's, epoch 0
    expected = [sorted(order[s * 48 : (s + 1) * 48]) for s in range(10)]
    assert [sorted(e["ids"]) for e in before + after] == expected


@pytest.mark.parametrize("name", RESUMES)
def test_resume_from_chain_at_another_layout(resumed, name):
    ckpt = resumed(name, False)
    before = torch.load(ckpt / "saved_step8.pt", weights_only=False)
    after = torch.load(ckpt / "resumed_step8.pt", weights_only=False)
    assert sorted(before["fp32"]) == sorted(after["fp32"]) and len(before["fp32"]) == 11
    assert sorted(before["state"]) == sorted(after["state"]) and len(before["state"]) == 11  # Adagrad's sum
    for key in before["state"]:
        assert torch.equal(before["state"][key], after["state"][key]), key
    for key in before["fp32"]:
        if name != "quantized" or key not in TABLES:
            assert torch.equal(before["fp32"][key], after["fp32"][key]), key
            continue
        exact, restored = before["fp32"][key], after["fp32"][key]
        assert not torch.equal(exact, restored), "4-bit rows cannot all be exact"
        asym = dequantize(quantize(exact, 4, "asymmetric"))
        err, bound = (restored - exact).pow(2).sum(1), (asym - exact).pow(2).sum(1)
        assert (err <= bound * (1 + 1e-4) + 1e-10).all(), f"{key}: adaptive error above the asymmetric bound"


@pytest.mark.parametrize("name", RESUMES)
def test_direct_chain_restore_equals_the_full_copy(resumed, name):
    """Reading the chain in place restores exactly what its materialized copy restores (quantized rows included),
    trains on to the same losses, and writes no copy."""
    direct, converted = resumed(name, False), resumed(name, True)
    a = torch.load(direct / "resumed_step8.pt", weights_only=False)
    b = torch.load(converted / "resumed_step8.pt", weights_only=False)
    for part in ("fp32", "state"):
        assert sorted(a[part]) == sorted(b[part])
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)
    assert torch.equal(
        torch.load(direct / "saved_step10.pt", weights_only=False)["fp32"][TABLES[0]],
        torch.load(converted / "saved_step10.pt", weights_only=False)["fp32"][TABLES[0]],
    ), "training on from the two restores diverged"
    assert not list(direct.glob("*.universal")), "a direct load wrote a copy"
    assert list(converted.glob("*.universal")), "the converted load read no copy"


@pytest.mark.parametrize("name", ["one_shot", "incremental", "quantized"])
def test_chain_read_in_place_equals_its_full_copy(saved, tmp_path, name):
    """Every range a rank may read of a chain (whole tables, row windows, element ranges that cut rows, other dims)
    equals the same read of its materialized copy."""
    from ucp_deepspeed.format.universal import UniversalCheckpoint

    copy = UniversalCheckpoint(materialize(str(saved[name]), "global_step8", str(tmp_path / "full")))
    direct = ChainCheckpoint(str(saved[name]), "global_step8")
    assert direct.params == copy.params and direct.buffers == copy.buffers
    assert direct.manifest.source == copy.manifest.source
    generator = torch.Generator().manual_seed(0)
    for param, record in copy.params.items():
        total = math.prod(record.shape)
        for key in record.keys:
            assert torch.equal(direct.read(param, key), copy.read(param, key)), (param, key)
            for _ in range(5):
                start = int(torch.randint(0, total, (1,), generator=generator))
                numel = int(torch.randint(0, total - start + 1, (1,), generator=generator))
                assert torch.equal(direct.read(param, key, start, numel), copy.read(param, key, start, numel))
            if len(record.shape) == 2 and record.shape[0] > 3:
                for dim in (0, 1):
                    got = direct.read_slice(param, key, dim, 1, 2)
                    assert torch.equal(got, copy.read_slice(param, key, dim, 1, 2)), (param, key, dim)
    with pytest.raises(CheckpointError, match="outside"):
        direct.read(TABLES[0], "fp32", 0, math.prod(copy.params[TABLES[0]].shape) + 1)
    assert direct.verify() == []
    direct.close()
    copy.close()


def test_chain_shapes_follow_the_policy(saved):
    one_shot = [_manifest(saved["one_shot"], s)["differential"] for s in (2, 4, 6, 8)]
    assert [d["kind"] for d in one_shot] == ["baseline", "delta", "delta", "delta"]
    assert all(d["chain"] == ["global_step2", f"global_step{s}"] for d, s in zip(one_shot[1:], (4, 6, 8)))
    incremental = _manifest(saved["incremental"], 8)
    assert incremental["differential"]["chain"] == [f"global_step{s}" for s in (2, 4, 6, 8)]
    for name, rec in incremental["params"].items():
        if name in TABLES:
            assert 0 < rec["table"]["saved_rows"] < rec["table"]["rows"] / 2, "a delta holds only changed rows"
    sizes = {s: sum(f["bytes"] for f in _manifest(saved["one_shot"], s)["files"].values()) for s in (2, 4, 8)}
    assert sizes[4] < sizes[2] / 2 and sizes[4] <= sizes[8] < sizes[2], "one-shot deltas grow, below a baseline"
    quantized = _manifest(saved["quantized"], 2)
    assert quantized["differential"]["quantize"] == {"method": "adaptive", "bits": 4}


def test_intermittent_takes_a_baseline_when_the_average_stops_falling():
    history: list[float] = []
    kinds = []
    for fraction in (0.1, 0.2, 0.3, 0.45, 0.1):
        if new_baseline_pays(history, fraction):
            kinds.append("baseline")
            history = []
        else:
            kinds.append("delta")
            history.append(fraction)
    assert kinds == ["delta", "delta", "delta", "baseline", "delta"]


def test_missing_or_corrupt_delta_is_an_error(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["incremental"], ckpt)
    assert resume_tag(str(ckpt)) == "global_step8"
    shutil.rmtree(ckpt / "global_step4")
    with pytest.raises(CheckpointError, match=r"global_step4.*manifest missing"):
        materialize(str(ckpt), "global_step8", str(tmp_path / "out"))
    assert resume_tag(str(ckpt)) == "global_step2", "tags whose chain is broken are skipped"

    shutil.copytree(saved["incremental"], ckpt, dirs_exist_ok=True)
    table = next((ckpt / "global_step6" / "tables").iterdir())
    data = bytearray(table.read_bytes())
    data[-3] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"global_step6/tables/.*fails its crc32 check"):
        materialize(str(ckpt), "global_step8", str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    reader = ChainCheckpoint(str(ckpt), "global_step8")  # a direct load replays the same element
    with pytest.raises(CheckpointError, match=r"global_step6/tables/.*fails its crc32 check"):
        for name in TABLES:
            reader.read(name, "fp32", 0, 8)
    reader.close()


def test_retention_keeps_what_the_kept_deltas_need(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["one_shot"], ckpt)
    deleted = prune(str(ckpt), keep=1)
    assert sorted(deleted) == ["global_step4", "global_step6"]
    assert [t for t, _ in chain(str(ckpt), "global_step8")] == ["global_step2", "global_step8"]


def test_inspect_shows_the_chain_and_convert_materializes(saved, tmp_path, capsys):
    from ucp_deepspeed.tools.cli import main as cli_main

    ckpt = saved["incremental"]
    assert cli_main(["inspect", str(ckpt / "global_step8")]) == 0
    shown = capsys.readouterr().out
    assert "delta (incremental)" in shown and "global_step2 -> global_step4 -> global_step6 -> global_step8" in shown
    out = tmp_path / "full"
    assert cli_main(["convert", str(ckpt), "--tag", "global_step8", "--output", str(out), "--no-progress"]) == 0
    assert cli_main(["verify", str(out)]) == 0, capsys.readouterr()


def test_reused_full_copy_and_replaced_elements_are_caught(saved, tmp_path, capsys):
    """A load reuses `<tag>.universal`, the chain's full copy: its reads are checked like any universal folder's,
    and `ucp verify` covers it. An element replaced by another run's save of the same tag breaks the chain."""
    from ucp_deepspeed.format.universal import UniversalCheckpoint
    from ucp_deepspeed.tools.cli import main as cli_main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["one_shot"], ckpt)
    copy = Path(materialize(str(ckpt), "global_step8", str(ckpt / "global_step8.universal")))
    victim = copy / "params" / f"{TABLES[0]}.safetensors"
    data = bytearray(victim.read_bytes())
    data[-9] ^= 0x10
    victim.write_bytes(bytes(data))
    assert materialize(str(ckpt), "global_step8", str(copy)) == str(copy), "an unchanged chain reuses its copy"
    with pytest.raises(CheckpointError, match="fails its crc32 check") as err:
        UniversalCheckpoint(str(copy)).read(TABLES[0], "fp32")
    assert err.value.path == str(victim)
    assert cli_main(["verify", str(ckpt), "--tag", "global_step8"]) == 1
    assert str(victim) in capsys.readouterr().out

    shutil.rmtree(ckpt / "global_step2")
    shutil.copytree(saved["intermittent"] / "global_step2", ckpt / "global_step2")  # another run's baseline
    with pytest.raises(CheckpointError, match="was replaced after the chain was written"):
        chain(str(ckpt), "global_step8")


def test_a_load_that_is_not_a_chain_restarts_the_chain():
    """`load_checkpoint` of a plain tag or universal folder tells the saver `restored(None)`: the next save must
    be a baseline, and no lossy restore is counted (it used to fail on None)."""
    policy = ChainPolicy("intermittent", None, None, None)
    policy.chain, policy.chain_ids, policy.restores, policy.history = ["global_step2"], ["run-1"], 2, [0.1]
    policy.restored(None)
    assert (policy.chain, policy.chain_ids, policy.history, policy.restores) == ([], [], [], 0)


def test_a_failed_save_makes_the_next_one_a_baseline():
    """The rows a failed save took from the tracker are in no element: an incremental delta written next, on top of
    the last element, would restore them as they were there (it used to)."""
    policy = ChainPolicy("incremental", None, None, None)
    rows = torch.zeros(10, dtype=torch.bool)
    policy.saved(policy.step({"t": rows.clone()}, "s1", "run-1"))
    lost = rows.clone()
    lost[3] = True
    policy.step({"t": lost}, "s2", "run-2")  # then the save fails
    policy.abandoned()
    assert policy.step({"t": rows.clone()}, "s3", "run-3").kind == "baseline"


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(40, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).pow(2).mean()


def _step_and_save(engine, ckpt: Path, step: int) -> dict:
    engine.backward(engine(torch.tensor([[step % 40, (7 * step) % 40]])))
    engine.step()
    engine.save_checkpoint(str(ckpt))
    manifest = ckpt / f"global_step{engine.global_steps}" / "manifest.json"  # a plain DeepSpeed tag has none
    return json.loads(manifest.read_text())["differential"] if manifest.exists() else {}


def test_a_direct_reshard_of_a_plain_tag_restarts_the_chain(tmp_path, monkeypatch):
    """An engine with deltas on its chain reshards a plain DeepSpeed tag in place (ZeRO-1 to ZeRO-2, one process):
    the weights no longer match its chain, so its next save must be a baseline, not a delta on top of the old chain."""
    import torch.distributed as dist

    import ucp_deepspeed

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)

    def engine(stage: int, checkpoint: dict):
        torch.manual_seed(0)
        model = _Lookup()
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "checkpoint": {"universal": {"enabled": True, "progress": False}, **checkpoint},
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]

    plain = engine(1, {})
    for step in range(3):
        _step_and_save(plain, tmp_path / "plain", step)
    chained = engine(2, {"differential": {"policy": "one_shot"}})
    kinds = [_step_and_save(chained, tmp_path / "chain", step)["kind"] for step in range(2)]
    assert kinds == ["baseline", "delta"]
    chained.load_checkpoint(str(tmp_path / "plain"))
    report = chained.ucp_last_load
    assert report.mode == "resharded" and report.in_place and report.kind is None, report
    assert _step_and_save(chained, tmp_path / "chain", 5)["kind"] == "baseline"
