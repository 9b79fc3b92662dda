"""Checkpoints saved without ucp_deepspeed: plain DeepSpeed, and Hugging Face Trainer / Accelerate jobs.

Plain DeepSpeed checkpoints carry no ucp metadata; `ucp convert` rebuilds it from DeepSpeed's own
files (param_shapes, shared_params, flat partitions) and the result must load bit-exactly at another
DP size and ZeRO stage. Trainer and Accelerate jobs (launch/train_hf.py, unmodified but for
`ucp_deepspeed.install()`) resume at another world size or ZeRO stage with every fp32 weight and
Adam state torch.equal to a gather made at the save, the global step continuing, and the next
losses within 1e-5 of the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import types
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import (
    PLAIN_VARIANTS,
    ROOT,
    EnumsByName,
    OnDemand,
    load_results,
    popen_payload,
    swap_pickle,
    torch_env,
    torchrun,
)
from launching import torchrun_command

from ucp_deepspeed.runtime.native_io import safe_load
from ucp_deepspeed.tools.cli import main as cli_main
from ucp_deepspeed.tools.compare import diff


def test_plain_deepspeed_checkpoint_converts_and_reshards(plain_sources, dp3_loads, capsys):
    """DP 2->3 and ZeRO 1->3 from checkpoints DeepSpeed saved on its own (in the session's dp=2 source launch), in
    fp32 and in bf16 (ZeRO-1 through DeepSpeed's BF16_Optimizer, whose last partition keeps its padding, ZeRO-2 and
    ZeRO-3, every file named `bf16_zero_pp_rank_*`), converted with `ucp convert`, and loaded in the session's
    shared dp=3 launch."""
    plain = plain_sources
    for name in PLAIN_VARIANTS:
        if name == "z0":  # offline, TinyLM's numbered ZeRO-0 optimizer state cannot be named (test_faults.py)
            continue
        assert not list((plain / name).glob("*/ucp_meta_*")), "saved through ucp_deepspeed after all"
        assert cli_main(["inspect", str(plain / name)]) == 0
        assert "metadata: rebuilt from DeepSpeed's files" in capsys.readouterr().out
        assert cli_main(["convert", str(plain / name), "--no-progress"]) == 0
        assert cli_main(["verify", str(plain / name / "global_step3.universal")]) == 0
    results = load_results(dp3_loads.out / "plain.json")
    assert [(r["saved"], r["live"]) for r in results] == [
        ("zero1 dp=2 fp32", "zero1 dp=3 fp32"),
        ("zero3 dp=2 fp32", "zero1 dp=3 fp32"),
        ("zero1 dp=2 fp32", "zero3 dp=3 fp32"),
        ("zero0 dp=2 fp32", "zero2 dp=3 fp32"),
        ("zero0 dp=2 fp32", "zero0 dp=3 fp32"),
        ("zero1 dp=2 bf16", "zero2 dp=3 bf16"),
        ("zero3 dp=2 bf16", "zero2 dp=3 bf16"),
        ("zero2 dp=2 bf16", "zero1 dp=3 bf16"),
        ("zero1 dp=2 bf16", "zero3 dp=3 bf16"),
    ]
    for r in results:  # fp32 weights, Adam states, step, hyperparameters, buffer, frozen, tied, client_state
        assert r["mode"] == "resharded" and r["diffs"] == [] and r["tensors"] == 32, r
        # bf16 forward and backward at another DP size round differently (test_reshard.py's BF16_LOSS_RTOL)
        assert r["max_rel_loss"] < (1e-6 if r["saved"].endswith("fp32") else 5e-3), r


def test_a_checkpoint_saved_under_early_python_311_reads_as_any_other(plain_sources, tmp_path):
    """DeepSpeed's files record the ZeRO stage as an enum, which early Python 3.11 pickles by name through `getattr`:
    such a checkpoint converts to the same universal checkpoint as one saved under another Python, and DeepSpeed's
    own load (`safe_load`) reads the same stage. Any other `getattr` stays refused (test_hostile_pickles.py)."""
    early = types.SimpleNamespace(Pickler=EnumsByName, __name__="pickle")
    for name in ("z1", "bf16z2pad", "z3"):
        copy = tmp_path / name
        shutil.copytree(plain_sources / name, copy, ignore=shutil.ignore_patterns("*.universal"))
        optim = sorted(copy.glob("global_step3/*optim_states.pt"))
        assert optim, name
        for path in copy.glob("global_step3/*.pt"):
            torch.save(torch.load(path, weights_only=False), path, pickle_module=early)
        with zipfile.ZipFile(optim[0]) as archive:  # as Python 3.11.2 writes it, so the test can fail
            assert b"__builtin__\ngetattr" in archive.read(next(n for n in archive.namelist() if n.endswith(".pkl")))
        for path in optim:
            stage = safe_load(str(path))["optimizer_state_dict"]["zero_stage"]
            original = safe_load(str(plain_sources / name / "global_step3" / path.name))["optimizer_state_dict"]
            assert type(stage) is int and stage == original["zero_stage"] > 0, (name, stage)  # read as the int
        report = diff(str(plain_sources / name), str(copy))
        assert report.identical and report.states, name


HF_WORKER = ROOT / "launch" / "train_hf.py"
LOSS_TOL = 1e-5


def _hf(nproc: int, *args: str, module: str | None = None) -> None:
    torchrun(nproc, *args, worker=HF_WORKER, attempts=2, module=module)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """runs[kind]: an uninterrupted HF Trainer run at 2 ranks, ZeRO-2, 8 steps, a checkpoint every 4, launched the
    first time a test asks for it: the script untouched under `torchrun -m ucp_deepspeed.run` ("installed"), or
    plain ("plain": a checkpoint that carries no ucp metadata)."""
    out = tmp_path_factory.mktemp("trainer")

    def launch(kind: str) -> None:
        module = "ucp_deepspeed.run" if kind != "plain" else None
        # ALST: a Llama under Ulysses at SP 2 (one sample per step per rank: under sequence parallelism transformers'
        # loss views a shard of a larger batch's shifted labels, which is not contiguous, and fails)
        alst = ["--arch", "llama", "--sp", "2", "--grad-accum", "6"] if kind == "alst" else []
        bf16 = ["--bf16"] if kind == "plain" else []  # the plain job trains in bf16, as most jobs do
        _hf(2, "train", "--out", str(out / kind), "--zero", "2", "--no-install", *alst, *bf16, module=module)

    return OnDemand(out, ["installed", "plain", "alst"], lambda kind: kind, launch)


def _check_resume(
    source: Path, resumed: Path, saved: str, live: str, loss_tol: float = LOSS_TOL, samples: bool = True
) -> dict:
    """Bit-exact state after the load, counters and step continued, losses of the continuation."""
    ref = torch.load(source / "saved_step4.pt", weights_only=False)
    snap = torch.load(resumed / "resumed_step4.pt", weights_only=False)
    assert sorted(snap["fp32"]) == sorted(ref["fp32"]) and len(ref["state"]) == 2 * len(ref["fp32"])
    for part in ("fp32", "state"):
        different = [k for k in ref[part] if not torch.equal(ref[part][k], snap[part][k])]
        assert not different, f"{part} differs after the load: {different}"
    assert snap["steps"] == ref["steps"] == [4] and snap["counters"] == ref["counters"]
    run = json.loads((resumed / "losses.json").read_text())
    uninterrupted = json.loads((source / "losses.json").read_text())["losses"]
    assert run["load"] == {"mode": "resharded", "saved": saved, "live": live}
    assert run["global_step"] == 8 and sorted(run["losses"], key=int) == ["5", "6", "7", "8"]
    for step, loss in run["losses"].items():
        assert abs(loss - uninterrupted[step]) <= loss_tol, (step, loss, uninterrupted[step])
    if not samples:
        return run
    expected = _samples(source)
    seen = [i for step in range(1, 9) for i in expected[step]]
    assert len(set(seen)) == len(seen) == 48 and min(seen) >= 0, "the probe missed sequences, or saw one twice"
    assert _samples(resumed) == {step: expected[step] for step in (5, 6, 7, 8)}, "other samples after the resume"
    return run


def _samples(run: Path) -> dict[int, list[int]]:
    """The sequences each step of a Trainer run trained on, over all its ranks (launch/train_hf.py's probe)."""
    steps: dict[int, list[int]] = {}
    for path in run.glob("samples_rank*.json"):
        for step, rows in json.loads(path.read_text()):
            steps.setdefault(step, []).extend(rows)
    return {step: sorted(rows) for step, rows in sorted(steps.items())}


@pytest.mark.parametrize(
    "world,zero,accum",
    [
        pytest.param(1, 2, 1, id="dp1"),
        pytest.param(3, 2, 1, id="dp3", marks=pytest.mark.slow),
        pytest.param(2, 3, 1, id="zero3", marks=pytest.mark.slow),
        pytest.param(1, 2, 2, id="dp1-accum2", marks=pytest.mark.slow),
    ],
)
def test_trainer_resumes_at_another_world_size_or_stage(trainer_runs, tmp_path, world, zero, accum):
    """`trainer.train(resume_from_checkpoint=...)` at 1 or 3 ranks or ZeRO-3, from a 2-rank ZeRO-2 checkpoint;
    at 1 rank also with 2 accumulation steps of half the batch (the same global batch). Each step after the resume
    trains on the sequences the uninterrupted run's did: the Trainer's seeded sampler draws one permutation at any
    world size, and it skips the steps already taken."""
    source = trainer_runs["installed"]
    checkpoint = source / "checkpoint-4"
    assert (checkpoint / "global_step4" / "ucp_meta_mp_rank_00.json").is_file()
    _hf(
        world,
        "train",
        "--out",
        str(tmp_path),
        "--zero",
        str(zero),
        "--resume",
        str(checkpoint),
        "--grad-accum",
        str(accum),
    )
    _check_resume(source, tmp_path, "zero2 dp=2 fp32", f"zero{zero} dp={world} fp32")
    state = json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    # rank 0 continues from saved process 0's RNG state, also at one process, where the Trainer looks
    # for rng_state.pth and would restore nothing
    saved_rng = torch.load(checkpoint / "rng_state_0.pth", weights_only=False)["cpu"]
    assert torch.equal(torch.load(tmp_path / "rng_resumed.pt", weights_only=False), saved_rng)


@pytest.mark.slow
def test_trainer_at_another_global_batch_is_warned_of_the_samples_it_repeats(trainer_runs, tmp_path):
    """Resumed with half the global batch, the Trainer skips 4 steps of 3 sequences: it trains on sequences 12-23 of
    the permutation again, as the one warning says, and the first step after the resume is half of step 3's."""
    source = trainer_runs["installed"]
    cmd = ["train", "--out", str(tmp_path), "--resume", str(source / "checkpoint-4"), "--global-batch", "3"]
    proc = torchrun(1, *cmd, worker=HF_WORKER)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "a global batch of 6" in line]
    assert len(said) == 1 and "samples 12-23 are trained on again" in said[0], said
    assert set(_samples(tmp_path)[5]) < set(_samples(source)[3])


@pytest.mark.slow  # the suite's budget; Ulysses resumes stay in the default run (test_hf_parallel.py)
def test_alst_trainer_resumes_at_another_sequence_and_data_parallel_size(trainer_runs, tmp_path):
    """A Trainer job with `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` (Accelerate registers Ulysses and
    shards every sequence) saved at SP 2 x DP 1 resumes at SP 1 x DP 2 with the same global batch."""
    source = trainer_runs["alst"]
    resume = ["--resume", str(source / "checkpoint-4"), "--arch", "llama", "--grad-accum", "3"]
    _hf(2, "train", "--out", str(tmp_path), "--zero", "2", *resume)
    _check_resume(source, tmp_path, "zero2 dp=2 sp=2 fp32", "zero2 dp=2 fp32")


@pytest.mark.slow
def test_a_trainer_cannot_resume_into_ulysses_even_without_ucp(trainer_runs, tmp_path):
    """Resuming *into* an ALST Trainer job fails in the Trainer itself (accelerate 1.15's `skip_first_batches` reads
    `dataset` from DeepSpeed's `UlyssesSPDataLoaderAdapter`, which has none), with plain DeepSpeed at the saved
    layout too. When this test fails, the Trainer learned to: add the SP-on resumes to the matrix."""
    cmd = torchrun_command(2, HF_WORKER, "train", "--out", str(tmp_path), "--zero", "2", "--no-install")
    cmd += ["--resume", str(trainer_runs["alst"] / "checkpoint-4"), "--arch", "llama", "--sp", "2", "--grad-accum", "6"]
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "'UlyssesSPDataLoaderAdapter' object has no attribute 'dataset'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_trainer_resume_refuses_a_crafted_checkpoint(trainer_runs, tmp_path):
    """A Trainer resume at the saved layout runs DeepSpeed's own load, which reads through ucp_deepspeed's checks:
    a crafted pickle in the model states is refused on every rank, and nothing it names runs."""
    source = tmp_path / "source"
    shutil.copytree(trainer_runs["installed"] / "checkpoint-4", source)
    swap_pickle(source / "global_step4" / "mp_rank_00_model_states.pt", popen_payload(tmp_path / "pwned"))
    cmd = torchrun_command(
        2,
        HF_WORKER,
        "train",
        "--out",
        str(tmp_path / "out"),
        "--zero",
        "2",
        "--resume",
        str(source),
    )
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    refusal = "mp_rank_00_model_states.pt: refusing to unpickle global 'deepspeed.launcher.runner.subprocess.Popen'"
    assert (proc.stdout + proc.stderr).count(refusal) >= 2, (proc.stdout + proc.stderr)[-3000:]  # both ranks
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
@pytest.mark.parametrize("world,zero", [(1, 2), (3, 1)])
def test_trainer_resumes_a_bf16_checkpoint_saved_without_ucp(trainer_runs, tmp_path, world, zero):
    """A bf16 Trainer job that never had ucp_deepspeed installed (its optimizer files `bf16_zero_pp_rank_*`, which
    were refused as BF16_Optimizer's) resumes at 1 rank at ZeRO-2 and at 3 ranks at ZeRO-1 once it is installed."""
    source = trainer_runs["plain"]
    assert not list((source / "checkpoint-4" / "global_step4").glob("ucp_meta_*"))
    assert list((source / "checkpoint-4" / "global_step4").glob("bf16_zero_pp_rank_*"))
    cmd = ["train", "--out", str(tmp_path), "--zero", str(zero), "--bf16", "--resume", str(source / "checkpoint-4")]
    _hf(world, *cmd)
    _check_resume(source, tmp_path, "zero2 dp=2 bf16", f"zero{zero} dp={world} bf16", loss_tol=5e-3)


@pytest.mark.slow
def test_accelerate_resumes_at_another_world_size_and_stage(tmp_path):
    """A plain Accelerate loop with a DeepSpeed plugin: save_state at 2 ranks ZeRO-2, load_state at 3 ranks ZeRO-3."""
    _hf(2, "accelerate", "--out", str(tmp_path / "src"), "--zero", "2")
    _hf(3, "accelerate", "--out", str(tmp_path / "dst"), "--zero", "3", "--resume", str(tmp_path / "src" / "state-4"))
    # a plain Accelerate loop, which the Trainer's sample probe (launch/train_hf.py) does not watch
    _check_resume(tmp_path / "src", tmp_path / "dst", "zero2 dp=2 fp32", "zero3 dp=3 fp32", samples=False)
    # the third process has no random_states_2.pkl; it continues from saved process 0's step, on a stream of its own
    saved = [torch.load(tmp_path / "src" / "state-4" / f"random_states_{i}.pkl", weights_only=False) for i in (0, 1)]
    for rank in range(3):
        restored = torch.load(tmp_path / "dst" / f"restored_rank{rank}.pt", weights_only=False)
        assert restored["step"] == saved[rank % 2]["step"] == 4, rank
        own = [torch.equal(restored["rng"], s["torch_manual_seed"]) for s in saved]
        assert own[rank] if rank < 2 else not any(own), (rank, own)  # the saved processes may share one stream


def test_install_is_idempotent_and_undone_by_uninstall():
    import accelerate.accelerator
    import deepspeed
    import transformers.trainer

    import ucp_deepspeed
    from ucp_deepspeed.runtime.integrations import installed

    def patched() -> tuple:
        return (
            deepspeed.initialize,
            transformers.trainer.Trainer._load_rng_state,
            accelerate.accelerator.load_accelerator_state,
        )

    original = patched()
    assert not installed()
    try:
        ucp_deepspeed.install()
        first = patched()
        assert all(new is not old for new, old in zip(first, original))
        ucp_deepspeed.install()
        assert all(new is old for new, old in zip(patched(), first))
    finally:
        ucp_deepspeed.uninstall()
    assert all(new is old for new, old in zip(patched(), original))
    assert not installed()
    with pytest.raises(ValueError, match="workerz"):
        ucp_deepspeed.install(workerz=2)
    assert patched() == original and not installed()


def test_rng_file_for_another_world_size(tmp_path):
    from ucp_deepspeed.runtime.integrations import saved_rng_file

    for i in range(2):
        (tmp_path / f"rng_state_{i}.pth").write_bytes(b"")
    assert saved_rng_file(str(tmp_path), 0, 1) == str(tmp_path / "rng_state_0.pth")
    assert saved_rng_file(str(tmp_path), 1, 3) == str(tmp_path / "rng_state_1.pth")
    assert saved_rng_file(str(tmp_path), 2, 3) == str(tmp_path / "rng_state_0.pth")
    single = tmp_path / "single"
    single.mkdir()
    (single / "rng_state.pth").write_bytes(b"")
    assert saved_rng_file(str(single), 1, 2) == str(single / "rng_state.pth")
    assert saved_rng_file(str(tmp_path / "single"), 0, 1) == str(single / "rng_state.pth")
