"""The frameworks that drive DeepSpeed for their users, with `ucp_deepspeed.install()`: TRL's preference and RL
trainers, PEFT's LoRA under the Trainer, and PyTorch Lightning's `DeepSpeedStrategy`, each saved at 2 ranks and
resumed at another world size or ZeRO stage by the framework's own resume.

Every resume compares the trained model's fp32 masters and Adam moments, gathered at the save and right after the
resume, with `torch.equal`, then the next losses with the uninterrupted run's; a reference model (TRL builds one
without an optimizer) must come back as it was built. Tiny models from configs, datasets made here, DeepSpeed on the
CPU with gloo under torchrun; one cell of each framework in the default run, the rest under `-m slow`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, OnDemand, torch_env, torchrun
from launching import torchrun_command

TRL = ROOT / "tests" / "workers" / "trl_jobs.py"
LOSS_TOL = 1e-5


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b) and a, (sorted(a)[:4], sorted(b)[:4])
    return [k for k in a if not torch.equal(a[k], b[k])]


def check_resume(
    source: Path,
    resumed: Path,
    saved: str,
    live: str,
    step: int = 4,
    losses: bool = True,
    uninterrupted: Path | None = None,
) -> dict:
    """The trained model's states are the saved ones, the reference model (if any) is as built, the counters and
    the step continue; with `losses`, the next losses are the uninterrupted run's (`source`, or `uninterrupted` when
    the source was killed)."""
    ref = torch.load(source / f"saved_step{step}.pt", weights_only=False)
    snap = torch.load(resumed / f"resumed_step{step}.pt", weights_only=False)
    for part in ("fp32", "state"):
        assert not _differ(ref[part], snap[part]), f"{part} differs after the load"
    assert not ref.get("frozen") or not _differ(ref["frozen"], snap["frozen"]), "a frozen parameter moved"
    assert snap["steps"] == ref["steps"] == [step] and snap["counters"] == ref["counters"]
    if (source / "reference_begin.pt").is_file():
        built = torch.load(source / "reference_begin.pt", weights_only=False)
        assert not _differ(built, torch.load(resumed / "reference_begin.pt", weights_only=False)), "reference moved"
    run = json.loads((resumed / "losses.json").read_text())
    assert run["load"] == {"mode": "resharded", "saved": saved, "live": live}
    reference = json.loads(((uninterrupted or source) / "losses.json").read_text())["losses"]
    assert sorted(run["losses"], key=int) == [str(s) for s in range(step + 1, 2 * step + 1)]
    for s, loss in run["losses"].items() if losses else ():
        assert abs(loss - reference[s]) <= LOSS_TOL, (s, loss, reference[s])
    return run


# --- TRL ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory) -> OnDemand:
    """runs[name]: an uninterrupted 2-rank TRL run of 8 steps, a checkpoint every 4 (`dpo-z2`, `dpo-z3`, `grpo-z2`,
    `grpo-z3`, `sft-z2`), launched the first time a test asks for it."""
    out = tmp_path_factory.mktemp("trl")

    def launch(name: str) -> None:
        mode, zero = name.split("-z")
        torchrun(2, mode, "--out", str(out / name), "--zero", zero, worker=TRL)

    return OnDemand(out, ["dpo-z2", "dpo-z3", "grpo-z2", "grpo-z3", "sft-z2"], lambda name: name, launch)


@pytest.mark.parametrize(
    "source,world,zero",
    [
        pytest.param("dpo-z2", 1, 2, id="dpo-z2-to-1-rank"),
        pytest.param("dpo-z3", 3, 3, id="dpo-z3-to-3-ranks", marks=pytest.mark.slow),
        pytest.param("dpo-z2", 3, 3, id="dpo-z2-to-3-ranks-z3", marks=pytest.mark.slow),
    ],
)
def test_a_dpo_job_resumes_at_another_world_size(trl_runs, tmp_path, source, world, zero):
    """DPOTrainer, its reference model a DeepSpeed engine without an optimizer (TRL's `prepare_deepspeed`: ZeRO-0,
    or ZeRO-3 at ZeRO-3), which `install()` refused at start-up; `resume_from_checkpoint` at 1 or 3 ranks."""
    torchrun(
        world,
        "dpo",
        "--out",
        str(tmp_path),
        "--zero",
        str(zero),
        "--resume",
        str(trl_runs[source] / "checkpoint-4"),
        worker=TRL,
    )
    check_resume(trl_runs[source], tmp_path, f"zero{source[-1]} dp=2 fp32", f"zero{zero} dp={world} fp32")


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,world,zero",
    [
        pytest.param("grpo-z2", 1, 2, id="z2-to-1-rank"),
        pytest.param("grpo-z2", 2, 3, id="z2-to-2-ranks-z3"),
        pytest.param("grpo-z2", 3, 2, id="z2-to-3-ranks"),
        pytest.param("grpo-z3", 1, 3, id="z3-to-1-rank"),
        pytest.param("grpo-z3", 3, 3, id="z3-to-3-ranks"),
        pytest.param("grpo-z3", 2, 2, id="z3-to-2-ranks-z2"),
    ],
)
def test_a_grpo_job_resumes_at_another_world_size(trl_runs, tmp_path, source, world, zero):
    """GRPOTrainer generating with transformers (no vLLM), a reference model (beta 0.04), saved at ZeRO-2 and ZeRO-3:
    every state exact at 1, 2 and 3 ranks. Its completions are sampled per process, so the next losses follow the
    uninterrupted run's only at its world size (2 ranks, at the other stage); at 1 and 3 ranks the same states draw
    other completions."""
    saved = trl_runs[source]
    torchrun(
        world, "grpo", "--out", str(tmp_path), "--zero", str(zero), "--resume", str(saved / "checkpoint-4"), worker=TRL
    )
    check_resume(saved, tmp_path, f"zero{source[-1]} dp=2 fp32", f"zero{zero} dp={world} fp32", losses=world == 2)


@pytest.mark.slow
def test_a_dpo_job_starts_from_an_sft_checkpoint_saved_at_another_size(trl_runs, tmp_path):
    """The SFT run's checkpoint (2 ranks) starts a DPO job at 1 rank: the policy through a module-only load when
    training begins, the reference model (no optimizer) through its own `load_checkpoint`; both hold the SFT run's
    fp32 masters exactly."""
    sft = trl_runs["sft-z2"]
    torchrun(1, "dpo", "--out", str(tmp_path), "--zero", "2", "--init-from", str(sft / "checkpoint-8"), worker=TRL)
    trained = torch.load(sft / "saved_step8.pt", weights_only=False)["fp32"]
    assert not _differ(trained, torch.load(tmp_path / "policy_begin.pt", weights_only=False))
    reference = {k: v.float() for k, v in torch.load(tmp_path / "reference_begin.pt", weights_only=False).items()}
    assert not _differ(trained, reference)


# --- PEFT LoRA under the Trainer ------------------------------------------------------------------------------------

HF = ROOT / "launch" / "train_hf.py"


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> OnDemand:
    """runs["z2"|"z3"]: an uninterrupted 2-rank Trainer run of a GPT-2 with LoRA adapters on its attention (the base
    frozen), 8 steps, a checkpoint every 4."""
    out = tmp_path_factory.mktemp("lora")

    def launch(zero: str) -> None:
        torchrun(2, "train", "--out", str(out / zero), "--zero", zero[-1], "--lora", worker=HF, attempts=2)

    return OnDemand(out, ["z2", "z3"], lambda name: name, launch)


@pytest.mark.parametrize(
    "source,world,zero",
    [pytest.param("z2", 1, 2, id="z2-to-1-rank"), pytest.param("z3", 3, 3, id="z3-to-3-ranks", marks=pytest.mark.slow)],
)
def test_a_lora_job_resumes_at_another_world_size(lora_runs, tmp_path, source, world, zero):
    """Every adapter master and moment exact and the frozen base as it was, at 1 or 3 ranks. The Trainer saves a PEFT
    model with `exclude_frozen_parameters=True` (our `save_checkpoint` takes it), so the base is not in the tag: not
    in the model states at ZeRO-2, not as every rank's fragment at ZeRO-3; the adapter's own files load in PEFT."""
    import importlib.util

    from peft import PeftModel

    spec = importlib.util.spec_from_file_location("train_hf", HF)
    train_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_hf)
    checkpoint = lora_runs[source] / "checkpoint-4"
    sizes = sum(f.stat().st_size for f in (checkpoint / "global_step4").iterdir())
    saved = torch.load(lora_runs[source] / "saved_step4.pt", weights_only=False)
    base_bytes = sum(t.numel() * 4 for t in saved["frozen"].values())
    assert sizes < base_bytes / 2, f"the tag holds {sizes} bytes, the frozen base alone {base_bytes}"
    torchrun(
        world, "train", "--out", str(tmp_path), "--zero", str(zero), "--lora", "--resume", str(checkpoint), worker=HF
    )
    resumed = torch.load(tmp_path / "resumed_step4.pt", weights_only=False)
    assert not _differ(saved["frozen"], resumed["frozen"]), "the frozen base moved"
    check_resume(lora_runs[source], tmp_path, f"zero{source[-1]} dp=2 fp32", f"zero{zero} dp={world} fp32")
    adapted = PeftModel.from_pretrained(train_hf.model(), str(checkpoint))
    adapters = {f"{n}": p.detach() for n, p in adapted.named_parameters() if "lora_" in n}
    assert sorted(adapters) == sorted(saved["fp32"]) and not _differ(saved["fp32"], adapters)


# --- PyTorch Lightning ----------------------------------------------------------------------------------------------

LIGHTNING = ROOT / "tests" / "workers" / "lightning_job.py"


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> OnDemand:
    """runs[name]: an uninterrupted 2-rank `Trainer(strategy=DeepSpeedStrategy(...)).fit` of 8 steps, a
    ModelCheckpoint every 4: `z2`; `z2-async` saving asynchronously and keeping the best one of its saves, each later
    save scoring better (`save_top_k=1`)."""
    out = tmp_path_factory.mktemp("lightning")

    def launch(name: str) -> None:
        extra = ["--async-save", "--top-k", "1"] if name.endswith("async") else []
        torchrun(2, "fit", "--out", str(out / name), "--zero", "2", *extra, worker=LIGHTNING)

    return OnDemand(out, ["z2", "z2-async"], lambda name: name, launch)


def _predicted_from(source: Path, evaluated_dir: Path) -> None:
    """validate, test and predict ran on a checkpoint of the 2-rank fit (its step 8): the weights they used are the
    fp32 masters trained, and every batch was predicted."""
    evaluated = json.loads((evaluated_dir / "evaluated.json").read_text())
    trained = torch.load(source / "saved_step8.pt", weights_only=False)["fp32"]
    assert not _differ(trained, {n: torch.tensor(v) for n, v in evaluated["weights"].items()})
    assert evaluated["predicted"] == 4 * 6 * 8 and evaluated["val_loss"] == evaluated["test_loss"]


@pytest.mark.parametrize(
    "world,zero", [pytest.param(1, 3, id="1-rank-z3"), pytest.param(3, 2, id="3-ranks-z2", marks=pytest.mark.slow)]
)
def test_a_lightning_fit_resumes_at_another_world_size_and_stage(lightning_runs, tmp_path, world, zero):
    """`fit(ckpt_path=...)` at 1 rank and ZeRO-3 (3 ranks, ZeRO-2: slow), from 2 ranks at ZeRO-2: every fp32 weight
    and Adam state exact, Lightning's own state (epoch, global step, the fit loop's count, the checkpoint callback's
    best) back from the client state, the next losses the uninterrupted run's. Then, in the same launch, validate,
    test and predict with `ckpt_path` of the 2-rank fit: Lightning builds an engine without an optimizer for them,
    which `install()` refused; it loads the checkpoint's weights (the fp32 masters)."""
    source = lightning_runs["z2"]
    evaluate = f"predict --out {tmp_path / 'evaluated'} --zero {zero} --ckpt {source / 'ckpt' / 'step8.ckpt'}"
    fit = ["fit", "--out", str(tmp_path), "--zero", str(zero), "--resume", str(source / "ckpt" / "step4.ckpt")]
    torchrun(world, *fit, "--each", evaluate, worker=LIGHTNING)
    run = check_resume(source, tmp_path, "zero2 dp=2 fp32", f"zero{zero} dp={world} fp32")
    uninterrupted = json.loads((source / "losses.json").read_text())["lightning"]
    assert (
        run["lightning"]
        == uninterrupted
        == {
            "epoch": 2,
            "batches_that_stepped": 8,
            "checkpoint_best": "step8.ckpt",
            "checkpoint_kept": [],
        }
    )
    _predicted_from(source, tmp_path / "evaluated")


@pytest.mark.slow
def test_a_lightning_async_save_is_committed_when_the_strategy_tears_down(lightning_runs, tmp_path):
    """Lightning never waits for a checkpoint: the last asynchronous save of a fit is committed when the strategy tears
    down (it was left uncommitted, `latest` not written, a save no load finds). `ModelCheckpoint(save_top_k=1)` removes
    the step-4 save once the better step-8 one is made (our next save commits the previous one first). The kept save
    holds the weights trained: validate, test and predict from it at 1 rank."""
    source = lightning_runs["z2-async"]
    assert sorted(p.name for p in (source / "ckpt").iterdir()) == ["step8.ckpt"], "only the best save is kept"
    assert (source / "ckpt" / "step8.ckpt" / "latest").read_text() == "checkpoint"
    assert json.loads((source / "losses.json").read_text())["lightning"]["checkpoint_kept"] == ["step8.ckpt"]
    torchrun(
        1,
        "predict",
        "--out",
        str(tmp_path),
        "--zero",
        "2",
        "--ckpt",
        str(source / "ckpt" / "step8.ckpt"),
        worker=LIGHTNING,
    )
    _predicted_from(source, tmp_path)


@pytest.mark.slow
def test_a_lightning_job_killed_while_saving_last_ckpt_again_resumes_from_last(lightning_runs, tmp_path):
    """`ModelCheckpoint(save_last=True)` saves `last.ckpt` again at each save, always as tag "checkpoint", the tag its
    `latest` names: a rank killed while writing it at step 8 leaves the step-4 save beside it, and
    `fit(ckpt_path="last")` at 1 rank resumes from that one, exact, the next losses the uninterrupted run's; its own
    save of `last.ckpt`, complete, leaves the one tag. Saved in place, the killed save left no complete checkpoint."""
    killed, ckpt = tmp_path / "killed", tmp_path / "killed" / "ckpt"
    args = ["fit", "--out", str(killed), "--zero", "2", "--save-last", "--die-in-save", "2"]
    first = subprocess.run(torchrun_command(2, LIGHTNING, *args), env=torch_env(), capture_output=True, timeout=300)
    assert first.returncode != 0 and (killed / "saved_step8.pt").is_file(), "meant to die saving last.ckpt at 8"
    assert (ckpt / "last.ckpt" / "latest").read_text() == "checkpoint"
    resumed = tmp_path / "resumed"
    torchrun(
        1,
        "fit",
        "--out",
        str(resumed),
        "--zero",
        "2",
        "--save-last",
        "--ckpt-dir",
        str(ckpt),
        "--resume",
        "last",
        worker=LIGHTNING,
    )
    check_resume(killed, resumed, "zero2 dp=2 fp32", "zero2 dp=1 fp32", uninterrupted=lightning_runs["z2"])
    assert sorted(p.name for p in (ckpt / "last.ckpt").iterdir() if p.is_dir()) == ["checkpoint"]
