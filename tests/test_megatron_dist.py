"""megatron-core's own `dist_checkpointing` (torch_dist) checkpoints resume under DeepSpeed, and export to HF.

One launch of 2 ranks: megatron-core alone trains launch/train_gpt.py's GPT with its own DDP and optimizers, built
as Megatron-LM builds them, and saves it with `dist_checkpointing.save` (model and optimizer `sharded_state_dict`s,
Megatron-LM's metadata and common entries); then, in the same launch, a ucp_deepspeed engine at another layout and
ZeRO stage loads each folder directly. The cases: the GPT at TP=2 (`FP32Optimizer`), the same in bf16
(`Float16OptimizerWithFloat16Params`), the MoE GPT at EP=2 (a `ChainedOptimizer`) and at EP=1 (experts in the dense
groups), and the `DistributedOptimizer` (bf16 GPT, fp32 MoE) at DP=2. Every fp32 weight, Adam moment, step and
hyperparameter is compared with megatron-core's own (TP shards gathered, DP shards joined) with `torch.equal`, and
the next 3 losses with megatron-core's uninterrupted run. `-m slow` adds TP=2 -> PP=2 x ZeRO-1 and PP=2 -> TP=2 x
ZeRO-3 in one launch (torch AdamW sharded as `FP32Optimizer` shards it, through pipeline stages), PP=2 x EP=2 at 4
ranks, DeepSpeed -> `ucp export-megatron` -> megatron-core (dense and MoE), and the import-megatron -> export-hf ->
`from_pretrained` path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import GPT_WORKER, ROOT, torchrun
from launching import each

from ucp_deepspeed.format.universal import UniversalCheckpoint, read_manifest
from ucp_deepspeed.sources.dcp import DcpCheckpoint
from ucp_deepspeed.tools.cli import main as ucp

WORKER = ROOT / "tests" / "workers" / "mcore_dist.py"
VOCAB = 70  # launch/train_gpt.py's, padded to 80 rows at TP=2


MOE = ["--arch", "llama", "--moe"]  # 4 experts, top-2, in every layer
# the DistributedOptimizer cases, each saved fully_reshardable and dp_reshardable; those in bf16
DISTRIBUTED = ("distributed", "moe-distributed", "tp-distributed", "pp-distributed", "wd0", "cp2")
BF16 = ("distributed", "tp-distributed")
# variants whose claims stay in the matrix, run under -m slow for the default run's budget (about 40 s of its launch)
SLOW = ("moe-ep1", "tp-distributed", "wd0", "cp2")


def _run(
    out: Path, cases: dict[str, tuple[list[str], list[str]]], world: int = 2, dp_reshardable: tuple[str, ...] = ()
) -> dict[str, dict]:
    """One launch of `world` ranks: for each case, megatron-core alone saves at its layout (into out/<case>), then
    DeepSpeed loads that folder at the target layout, if any (a DistributedOptimizer case in `dp_reshardable`: also
    its dp_reshardable save, as <case>-dp); every loaded case's results."""
    runs = []
    for case, (source, target) in cases.items():
        runs.append(["save", "--out", str(out / case), *source])
        if not target:  # saved only, for the import tests
            continue
        runs.append(["load", "--source", str(out / case), *target, "--results", str(out / f"{case}.json")])
        if case in dp_reshardable:
            runs.append(
                ["load", "--source", str(out / case), "--folder", "dp_reshardable", *target]
                + ["--results", str(out / f"{case}-dp.json")]
            )
    torchrun(world, *each(runs), worker=WORKER, timeout=600)
    names = [*(c for c, (_, target) in cases.items() if target), *(f"{case}-dp" for case in dp_reshardable)]
    return {case: json.loads((out / f"{case}.json").read_text()) for case in names}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("mcore")
    mcore = ["--megatron-optimizer"]  # megatron-core's own FP32Optimizer / Float16OptimizerWithFloat16Params
    cases = {
        "dense": ([*mcore, "--tp", "2"], ["--tp", "1", "--zero", "2"]),
        "float16": ([*mcore, "--bf16", "--tp", "2"], ["--pp", "2", "--zero", "1"]),
        "moe": ([*MOE, *mcore, "--ep", "2"], [*MOE, "--ep", "1", "--zero", "1"]),
        "distributed": (["--distributed-optimizer", "--bf16"], ["--tp", "2", "--zero", "1"]),
        "moe-distributed": ([*MOE, "--ep", "2", "--distributed-optimizer"], [*MOE, "--ep", "1", "--zero", "1"]),
        # llama (gated linear_fc1, no biases) at TP=2: each TP rank's buffer holds its shards
        "tp-distributed": (
            ["--arch", "llama", "--tp", "2", "--distributed-optimizer", "--bf16"],
            ["--arch", "llama", "--zero", "3"],
        ),
        # at EP=1 megatron-core trains experts in the dense groups; DeepSpeed's MoE keeps them apart
        "moe-ep1": ([*MOE, *mcore, "--ep", "1"], [*MOE, "--ep", "2", "--zero", "1"]),
        # megatron-core's own groups (wd_mult) at a weight decay of 0, as fine-tuning runs it; and with a decoupled
        # learning rate for the embedding (a third group, which train_gpt's two groups cannot take: import only)
        "wd0": (["--distributed-optimizer", "--megatron-groups", "0"], ["--tp", "2", "--zero", "2"]),
        "decoupled": (["--distributed-optimizer", "--megatron-groups", "0.1", "--decoupled-lr", "2e-4"], []),
        # pipeline stages: the tied embedding in a bucket of its own on the first and the last stage
        "pp-distributed": (["--pp", "2", "--distributed-optimizer"], ["--tp", "2", "--zero", "1"]),
        # context parallelism: the model replicated over 2 CP ranks, the optimizer sharded over DP x CP
        "cp2": (["--cp", "2", "--distributed-optimizer"], ["--tp", "2", "--zero", "1"]),
    }
    default = {c: v for c, v in cases.items() if c not in SLOW}
    return out / "dense", _run(out, default, dp_reshardable=tuple(c for c in DISTRIBUTED if c not in SLOW)), cases


@pytest.fixture(scope="module")
def slow_saved(saved: tuple[Path, dict, dict]) -> dict:
    """The cases of `SLOW`, in a launch of their own that `-m slow` pays for."""
    out, cases = saved[0].parent, {c: v for c, v in saved[2].items() if c in SLOW}
    return _run(out, cases, dp_reshardable=tuple(c for c in DISTRIBUTED if c in SLOW))


def _result(request: pytest.FixtureRequest, saved: tuple[Path, dict, dict], case: str) -> dict:
    """A case's resume, from the default launch or, for a slow case, from its own."""
    return request.getfixturevalue("slow_saved")[case] if case.removesuffix("-dp") in SLOW else saved[1][case]


def _cases(names: tuple[str, ...]) -> list:
    """The cases as parameters, the slow ones marked."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in names]


def _exact(result: dict, rtol: float = 1e-5, tensors: int = 100) -> None:
    assert result["mode"] == "imported"
    assert result["diffs"] == [] and result["tensors"] >= tensors, result
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=rtol), result


def test_a_megatron_core_save_resumes_in_deepspeed_at_another_tp_and_stage(saved):
    _exact(saved[1]["dense"])


def test_a_bf16_save_resumes_from_its_fp32_copies_at_another_layout(saved):
    """megatron-core in bf16 at TP=2 (`Float16Module`, `Float16OptimizerWithFloat16Params`: bf16 weights and their
    fp32 copies as `optimizer.state.fp32_param.<key>`) -> DeepSpeed at PP=2 ZeRO-1 in fp32: every fp32 copy and
    Adam moment exact, the next losses within 1e-3 of the bf16 run."""
    _exact(saved[1]["float16"], rtol=1e-3)


@pytest.mark.parametrize("case", _cases(("moe", "moe-ep1")))
def test_a_megatron_core_moe_save_resumes_in_deepspeed_at_another_ep_and_stage(saved, request, case):
    """megatron-core at EP=2 (a `ChainedOptimizer`'s dense and expert states, `chained_<i>.` keys) -> DeepSpeed at
    EP=1 x DP=2 ZeRO-1, its experts in a param group of their own; megatron-core at EP=1 (one optimizer, the experts
    in the dense groups, as it marks experts only under expert parallelism) -> DeepSpeed at EP=2, its experts in
    groups split from the dense ones: every expert's states exact, the steps and hyperparameters of the group each
    came from."""
    result = _result(request, saved, case)
    _exact(result)
    assert result["tensors"] >= 4 * 4 * 2 * 3, result  # 4 layers x 4 experts x 2 weights x 3 states


@pytest.mark.parametrize("case", _cases(DISTRIBUTED))
def test_a_distributed_optimizer_save_resumes_in_deepspeed_at_another_layout(saved, request, case):
    """megatron-core's `DistributedOptimizer` (each rank's shard of every state gathered into whole tensors by its
    `fully_reshardable` save: `optimizer.state.param.<key>`, each group's `step` in common.pt): a dense GPT at DP=2
    in bf16 (megatron-core's `Float16Module`; the optimizer's fp32 copies are the fp32 weights) -> DeepSpeed at
    TP=2 ZeRO-1 in fp32; an MoE GPT at EP=2 in fp32, a `ChainedOptimizer` of a dense and an expert
    `DistributedOptimizer` saved with Megatron-LM's `chained_optim_avoid_prefix` (no `chained_<i>.` keys) ->
    DeepSpeed at EP=1 ZeRO-1; a llama GPT (gated `linear_fc1`) at TP=2 in bf16 -> DeepSpeed at DP=2 ZeRO-3. Every
    fp32 weight and Adam moment exact, the next losses megatron-core's (bf16 against fp32: within 1e-3)."""
    _exact(_result(request, saved, case), rtol=1e-3 if case in BF16 else 1e-5, tensors=78)


@pytest.mark.parametrize("case", _cases(DISTRIBUTED))
def test_the_distributed_optimizers_default_format_resumes_in_deepspeed(saved, request, case):
    """The same jobs' `dp_reshardable` saves (Megatron-LM's default: flat per-bucket buffers that name no
    parameter) -> DeepSpeed at the same targets: the buckets' layout rebuilt from the stored model and the saving
    args, every fp32 weight and Adam moment `torch.equal` to the optimizer's own shards joined, the next losses."""
    _exact(_result(request, saved, f"{case}-dp"), rtol=1e-3 if case in BF16 else 1e-5, tensors=78)


@pytest.mark.parametrize("case", _cases(DISTRIBUTED))
def test_dp_reshardable_imports_as_fully_reshardable_does(saved, request, tmp_path, case):
    """One job, both formats: `ucp import-megatron` of its dp_reshardable save gives the universal checkpoint its
    fully_reshardable save gives, bit for bit."""
    if case in SLOW:
        request.getfixturevalue("slow_saved")
    folder = saved[0].parent / case
    for name in ("ckpt", "dp_reshardable"):
        assert ucp(["import-megatron", str(folder / name), str(tmp_path / name), "--vocab-size", str(VOCAB)]) == 0
    assert ucp(["diff", str(tmp_path / "ckpt"), str(tmp_path / "dp_reshardable")]) == 0


def test_megatron_cores_own_groups_are_placed_by_wd_mult_and_the_decoupled_lr(saved, tmp_path):
    """megatron-core's `_get_param_groups` with `--decoupled-lr`: three groups, told apart by `wd_mult` and the
    decoupled learning rate (not by `weight_decay` or `lr`, which the scheduler rewrites): the embedding in the
    decoupled group, the biases and norms in the `wd_mult` 0 group, the other weights in the default one; both
    formats import alike. (With a weight decay of 0, the `wd0` case resumes in DeepSpeed above.)"""
    folder = saved[0].parent / "decoupled"
    for name in ("ckpt", "dp_reshardable"):
        assert ucp(["import-megatron", str(folder / name), str(tmp_path / name), "--vocab-size", str(VOCAB)]) == 0
    assert ucp(["diff", str(tmp_path / "ckpt"), str(tmp_path / "dp_reshardable")]) == 0
    manifest = read_manifest(str(tmp_path / "ckpt"))
    groups = [(g.hyperparams["wd_mult"], g.hyperparams["initial_lr"]) for g in manifest.param_groups]
    group = {name: groups[record.group] for name, record in manifest.params.items()}
    assert sorted(groups) == [(0.0, 0.0005), (1.0, 0.0002), (1.0, 0.001)], groups
    assert group["embedding.word_embeddings.weight"] == (1.0, 0.0002)
    assert group["decoder.layers.0.self_attention.linear_qkv.weight"] == (1.0, 0.001)
    assert group["decoder.layers.0.self_attention.linear_qkv.bias"] == (0.0, 0.0005)


def _resaved(folder: Path, out: Path, change) -> Path:
    """A torch_dist folder saved again with `change(state, common)` applied to every tensor and object it holds."""
    import torch.distributed.checkpoint as dcp

    ckpt = DcpCheckpoint(str(folder))
    state = {k: ckpt.tensor(k) for k in ckpt.tensors} | {k: ckpt.object(k) for k in ckpt.objects}
    ckpt.close()
    common = torch.load(folder / "common.pt", weights_only=False)
    change(state, common)
    # each object pickled whole, as megatron-core writes it (not flattened into one entry per list item)
    dcp.save(state, checkpoint_id=str(out), planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    torch.save(common, out / "common.pt")
    (out / "metadata.json").write_bytes((folder / "metadata.json").read_bytes())
    return out


BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"


def _longer(state: dict, common: dict) -> None:
    (lengths,) = [v for k, v in state.items() if ".per_bucket_numel_unpadded/" in k]
    ((dtypes, numels),) = lengths[0][0].items()
    lengths[0][0][dtypes] = [numels[0] + 64]


def _stepless(state: dict, common: dict) -> None:
    (optimizer,) = [v for k, v in state.items() if k.endswith(".optimizer/shard_0_1")]
    for group in optimizer[0]["param_groups"]:
        del group["step"]


FAULTS = {  # what is changed in the dense bf16 job's dp_reshardable save -> what the refusal names
    "wrong bucket length": (_longer, "bucket_idx_0: 106176 elements recorded (per_bucket_numel_unpadded)"),
    "missing bucket": (
        lambda state, common: [state.pop(k) for k in list(state) if k.startswith(BUCKET)],
        "bucket_idx_0: the bucket is missing",
    ),
    "no step": (_stepless, "param group 0 has optimizer state (exp_avg, exp_avg_sq) but no step count"),
    "another layout's args": (
        lambda state, common: setattr(common["args"], "transformer_impl", "transformer_engine"),
        "does not hold the weights of",
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_dp_reshardable_save_is_refused_by_name(saved, tmp_path, capsys, fault):
    """The fault corpus of the bucket format: a bucket whose recorded length is not the rebuilt one, a bucket
    missing, param groups without their step, and args that describe another model layout (Transformer Engine's
    module order: the rebuilt ranges then miss the model's weights). Each is refused in one line naming the entry,
    and nothing is written."""
    change, reason = FAULTS[fault]
    folder = _resaved(saved[0].parent / "distributed" / "dp_reshardable", tmp_path / "damaged", change)
    capsys.readouterr()
    assert ucp(["import-megatron", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err
    assert reason in err and err.count("\n") == 1, err
    assert not (tmp_path / "u" / "manifest.json").exists()


@pytest.mark.slow
def test_megatron_core_saves_resume_across_the_pipeline(tmp_path):
    """One launch: a TP=2 save resumes at PP=2 x ZeRO-1; a save megatron-core made at PP=2 (each stage's layers
    stacked into one tensor at their global indices) resumes at TP=2 x ZeRO-3."""
    cases = {
        "tp2-pp2": (["--tp", "2"], ["--tp", "1", "--pp", "2", "--zero", "1"]),
        "pp2-tp2": (["--pp", "2"], ["--tp", "2", "--zero", "3"]),
    }
    for result in _run(tmp_path, cases).values():
        _exact(result)


@pytest.mark.slow
def test_a_moe_save_at_pp2_and_ep2_together_resumes_at_dp4(tmp_path):
    """4 ranks: megatron-core's MoE GPT at PP=2 x EP=2 (each stage's layers, each EP rank's experts, stacked at
    their global indices in one save) -> DeepSpeed at DP=4, EP=1, ZeRO-2: every state exact, the next losses."""
    cases = {"pp2-ep2": ([*MOE, "--pp", "2", "--ep", "2"], [*MOE, "--ep", "1", "--zero", "2"])}
    result = _run(tmp_path, cases, world=4)["pp2-ep2"]
    _exact(result)
    assert result["tensors"] >= 4 * 4 * 2 * 3, result


@pytest.mark.slow
def test_dp_reshardable_saves_at_tp_x_dp_and_pp_x_dp_resume_at_another_layout(tmp_path):
    """4 ranks, the DistributedOptimizer's shards over DP=2 and its buffers per TP or PP rank: llama at TP=2 x DP=2
    in bf16 -> DeepSpeed at PP=2 x DP=2 ZeRO-1; GPT at PP=2 x DP=2 -> TP=2 x DP=2 ZeRO-3; both formats, exact."""
    cases = {
        "tp2-dp2": (
            ["--arch", "llama", "--tp", "2", "--distributed-optimizer", "--bf16"],
            ["--arch", "llama", "--pp", "2", "--zero", "1"],
        ),
        "pp2-dp2": (["--pp", "2", "--distributed-optimizer"], ["--tp", "2", "--zero", "3"]),
    }
    for case, result in _run(tmp_path, cases, world=4, dp_reshardable=tuple(cases)).items():
        _exact(result, rtol=1e-3 if case.startswith("tp2") else 1e-5, tensors=78)


@pytest.mark.slow  # the HF exporter has its own default tests; this one imports transformers for 10 s
@pytest.mark.parametrize("source", ["dense/ckpt", "distributed/dp_reshardable"])
def test_import_megatron_then_export_hf(saved, tmp_path, source):
    """A torch_dist save (also the DistributedOptimizer's dp_reshardable) -> universal -> HF -> `from_pretrained`."""
    folder = saved[0].parent / source
    out = tmp_path / "universal"
    assert ucp(["import-megatron", str(folder), str(out), "--vocab-size", str(VOCAB)]) == 0
    manifest = read_manifest(str(out))
    assert manifest.source.extra["format"] == "megatron torch_dist" and manifest.counters.global_steps == 3
    assert manifest.model is not None and manifest.model.vocab_size == VOCAB and manifest.model.num_layers == 4
    assert manifest.params["embedding.word_embeddings.weight"].shape == (VOCAB, 64)
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in manifest.params
    assert ucp(["export-hf", str(out), str(tmp_path / "hf"), "--no-progress"]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ckpt = UniversalCheckpoint(str(out))
    embedding = ckpt.read("embedding.word_embeddings.weight", "fp32").reshape(VOCAB, 64)
    assert torch.equal(model.get_input_embeddings().weight.detach(), embedding)


def test_padding_rows_that_hold_weights_are_refused(saved, tmp_path, capsys):
    assert ucp(["import-megatron", str(saved[0] / "ckpt"), str(tmp_path / "u"), "--vocab-size", "60"]) == 2
    assert "not vocabulary padding" in capsys.readouterr().err


# megatron-core's DDP and DistributedOptimizer over its own param groups (wd_mult, ...), as Megatron-LM builds them
DIST_OPT = ["--distributed-optimizer", "--megatron-groups", "0.1"]
EXPORTS = {  # the DeepSpeed job's layout -> the layouts megatron-core loads the export at
    "dense": (["--tp", "2"], [["--tp", "1"], ["--tp", "2"], ["--pp", "2"], [*DIST_OPT]]),
    "moe": (
        [*MOE, "--ep", "2"],
        [[*MOE, "--ep", "1"], [*MOE, "--ep", "2"], [*MOE, "--ep", "2", *DIST_OPT]],
    ),
}


def _ep(layout: list[str]) -> list[str]:
    """export-megatron's arguments for a loading job at this layout: its expert-parallel size, for MoE, and its
    optimizer's layout."""
    out = ["--expert-model-parallel-size", layout[layout.index("--ep") + 1]] if "--ep" in layout else []
    return out + (["--distributed-optimizer"] if "--distributed-optimizer" in layout else [])


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(EXPORTS))
def test_a_deepspeed_job_exports_to_torch_dist_that_megatron_core_loads_at_any_layout(tmp_path, model):
    """A DeepSpeed job (dense at TP=2, MoE at EP=2; ZeRO-1) -> `ucp export-megatron` -> megatron-core alone,
    `dist_checkpointing.load` at TP=1, TP=2 and PP=2 (MoE: EP=1, the experts exported into the dense groups as
    megatron-core trains them there, and EP=2, as Megatron-LM's `ChainedOptimizer` shards it), and with
    `--distributed-optimizer` into megatron-core's DDP and `DistributedOptimizer` over its own groups at DP=2 (the
    `fully_reshardable` layout, found by `wd_mult`, ... which the export adds), in one launch: every state
    `torch.equal` to the DeepSpeed job's, and its next losses."""
    saved_at, loads = EXPORTS[model]
    source = tmp_path / "ds"
    torchrun(2, "save", "--out", str(source), *saved_at, "--zero", "1", worker=GPT_WORKER)
    runs = []
    for i, layout in enumerate(loads):
        out = tmp_path / f"megatron{i}"
        assert ucp(["export-megatron", str(source), str(out), "--padded-vocab-size", "80", *_ep(layout)]) == 0
        assert (out / "metadata.json").exists() and (out / "common.pt").exists()
        runs.append(
            ["native-load", "--source", str(out), "--reference", str(source / "reference.pt"), *layout]
            + ["--results", str(tmp_path / f"{i}.json")]
        )
    torchrun(2, *each(runs), worker=WORKER, timeout=600)
    for i, layout in enumerate(loads):
        result = json.loads((tmp_path / f"{i}.json").read_text())
        assert result["diffs"] == [] and result["tensors"] > 100, (layout, result)
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5), (layout, result)


# the keys megatron-core finds its groups by and its scheduler reads, which `export-megatron` adds to a group without
MEGATRON_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")


def _same_but_megatron_keys(a: Path, b: Path, capsys) -> None:
    """`ucp diff a b`: every tensor state bit-identical, and no difference but megatron-core's group keys in b."""
    capsys.readouterr()
    ucp(["diff", "--json", str(a), str(b)])
    report = json.loads(capsys.readouterr().out)
    assert report["states"] and all(s["equal"] for s in report["states"]) and not report["only_a"] + report["only_b"]
    assert all(
        v.split(" hyperparam ")[1].split(":")[0] in MEGATRON_GROUP_KEYS and ": None vs " in v for v in report["values"]
    ), report["values"]


def test_export_megatron_then_import_is_the_identity(saved, tmp_path, capsys):
    """universal -> torch_dist -> universal gives the same states: the restacking inverts the cut, the padding added
    for the loading model's vocabulary is dropped again; the groups gain megatron-core's own keys (`wd_mult`, ...),
    which the export adds. Where the data stands goes both ways: Megatron-LM's
    `args.consumed_train_samples` is the universal checkpoint's `global_samples`, and the export writes it back
    into an `args` namespace Megatron-LM reads with `getattr`."""
    first = tmp_path / "a"
    assert ucp(["import-megatron", str(saved[0] / "ckpt"), str(first), "--vocab-size", str(VOCAB)]) == 0
    assert read_manifest(str(first)).counters.global_samples == 3 * 12  # args.consumed_train_samples
    exported = tmp_path / "iter_0000003"
    assert ucp(["export-megatron", str(first), str(exported), "--padded-vocab-size", "80"]) == 0
    common = torch.load(exported / "common.pt", weights_only=False)
    args = common["args"]  # read back with getattr, as Megatron-LM does
    assert getattr(args, "consumed_train_samples", None) == 36 and getattr(args, "num_layers", None) == 4
    assert (
        common["opt_param_scheduler"]
        == torch.load(saved[0] / "ckpt" / "common.pt", weights_only=False)["opt_param_scheduler"]
    )
    again = tmp_path / "b"
    assert ucp(["import-megatron", str(exported), str(again), "--vocab-size", str(VOCAB)]) == 0
    _same_but_megatron_keys(first, again, capsys)


def test_experts_export_into_the_dense_groups_for_a_job_without_expert_parallelism(saved, tmp_path, capsys):
    """`export-megatron --expert-model-parallel-size 1` writes one optimizer whose dense groups hold the experts (as
    megatron-core builds it at EP=1); importing that gives the expert groups back, split from the dense ones as
    DeepSpeed's MoE keeps them: the same universal checkpoint. A group without a dense twin is refused."""
    first = tmp_path / "a"
    assert ucp(["import-megatron", str(saved[0].parent / "moe" / "ckpt"), str(first), "--vocab-size", str(VOCAB)]) == 0
    assert [g.hyperparams["is_expert_parallel"] for g in read_manifest(str(first)).param_groups] == [0, 0, 1]
    exported = tmp_path / "ep1"
    args = ["--padded-vocab-size", "80", "--expert-model-parallel-size", "1"]
    assert ucp(["export-megatron", str(first), str(exported), *args]) == 0
    optimizer = torch.load(exported / "common.pt", weights_only=False)["optimizer"]
    assert [g["is_expert_parallel"] for g in optimizer["param_groups"]] == [False, False]
    assert not any(k.startswith("chained_") for k in DcpCheckpoint(str(exported)).tensors)
    again = tmp_path / "b"
    assert ucp(["import-megatron", str(exported), str(again), "--vocab-size", str(VOCAB)]) == 0
    _same_but_megatron_keys(first, again, capsys)
    manifest = json.loads((first / "manifest.json").read_text())
    manifest["param_groups"][2]["hyperparams"]["lr"] = 0.5
    (first / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert ucp(["export-megatron", str(first), str(tmp_path / "refused"), *args]) == 2
    assert "expert param group 2 matches no dense group" in capsys.readouterr().err


def _rewritten(saved: Path, out: Path, master: str, optimizer, extra: dict | None = None) -> Path:
    """The real fp32 save rewritten in another megatron layout: bf16 weights with their fp32 copies as
    `optimizer.state.<master>.<key>`, `extra` tensors added, common.pt's optimizer entry as `optimizer` makes it."""
    import torch.distributed.checkpoint as dcp

    source = saved / "ckpt"
    ckpt = DcpCheckpoint(str(source))
    state = dict(extra or {})
    for key in ckpt.tensors:
        value = ckpt.tensor(key)
        if key.startswith("optimizer."):
            state[key] = value
        else:
            state[key] = value.to(torch.bfloat16)
            state[f"optimizer.state.{master}.{key}"] = value
    ckpt.close()
    dcp.save(state, checkpoint_id=str(out))
    common = torch.load(source / "common.pt", weights_only=False)
    common["optimizer"] = optimizer(common["optimizer"])
    torch.save(common, out / "common.pt")
    (out / "metadata.json").write_bytes((source / "metadata.json").read_bytes())
    return out


def _distributed(optim: dict) -> dict:
    """A DistributedOptimizer's common entry: each group keeps the step, there is no `common_step`."""
    step = int(optim["state"]["common_step"])
    return {"optimizer": {"param_groups": [{**g, "step": step} for g in optim["param_groups"]]}}


LAYOUTS = {  # optimizer -> the name of its fp32 copies, its common.pt entry (the other bf16 layouts: real saves, above)
    "DistributedOptimizer fully_sharded_model_space": ("fp32_param", _distributed),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_saves_import_the_fp32_copies(saved, tmp_path, layout):
    """The `DistributedOptimizer`'s deprecated `fully_sharded_model_space` stores bf16 weights' fp32 copies as
    `optimizer.state.fp32_param.<key>` and each group's `step`; megatron-core 0.16 no longer saves it, so the folder
    is the real fp32 save rewritten in that layout (keys as its `sharded_state_dict` made them): the import takes
    the fp32 copies, not the rounded weights, and the step."""
    bf16 = _rewritten(saved[0], tmp_path / "bf16", *LAYOUTS[layout])
    a, b = tmp_path / "a", tmp_path / "b"
    assert ucp(["import-megatron", str(saved[0] / "ckpt"), str(a), "--vocab-size", str(VOCAB)]) == 0
    assert ucp(["import-megatron", str(bf16), str(b), "--vocab-size", str(VOCAB)]) == 0
    fp32, mixed = UniversalCheckpoint(str(a)), UniversalCheckpoint(str(b))
    assert mixed.manifest.source.topology.dtype == "bf16"
    assert [g.scalars for g in mixed.manifest.param_groups] == [g.scalars for g in fp32.manifest.param_groups]
    assert set(mixed.manifest.params) == set(fp32.manifest.params)
    for name, record in fp32.manifest.params.items():
        assert mixed.manifest.params[name].keys == record.keys, name
        for key in record.keys:
            assert torch.equal(mixed.read(name, key), fp32.read(name, key)), (name, key)


def test_distributed_optimizer_buffers_are_refused(saved, tmp_path, capsys):
    """The DistributedOptimizer's formats tied to the saving DP layout (`dp_reshardable`: its flat buffers) are
    refused naming the entry, not imported without their Adam moments."""
    buffer = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg"
    master, optimizer = LAYOUTS["DistributedOptimizer fully_sharded_model_space"]
    folder = _rewritten(saved[0], tmp_path / "flat", master, optimizer, {buffer: torch.zeros(8)})
    assert ucp(["import-megatron", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err
    assert buffer in err and "not a model tensor's optimizer state" in err and err.count("\n") == 1, err
    assert not (tmp_path / "u" / "manifest.json").exists()


def test_a_save_without_its_step_count_is_refused(saved, tmp_path, capsys):
    """Adam moments without `state.common_step` (or a group's `step`) would import, then fail in the first
    `engine.step()` inside torch's Adam (`KeyError: 'step'`): refused, naming common.pt and the group."""
    folder = tmp_path / "stepless"
    shutil.copytree(saved[0] / "ckpt", folder)
    common = torch.load(folder / "common.pt", weights_only=False)
    del common["optimizer"]["state"]["common_step"]
    torch.save(common, folder / "common.pt")
    assert ucp(["import-megatron", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err
    assert "common.pt" in err and "param group 0 has optimizer state" in err and "no step count" in err, err
    assert not (tmp_path / "u" / "manifest.json").exists()


def _group(wd_mult: float, expert: bool = False, **extra) -> dict:
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert, "weight_decay": 0.0, **extra}


def test_the_group_rule_follows_megatron_cores_keys_not_the_current_values():
    """`_get_param_groups`' own keys place the parameters (no launch: the rule on names and shapes). Under
    `apply_wd_to_qk_layernorm` (Qwen3-Next) the q/k layer norms decay though 1-D; a decoupled-lr group (megatron-core
    0.16 marks it `default_config` False) takes the embedding and output layer; two groups of one kind are refused."""
    from ucp_deepspeed.errors import CheckpointError
    from ucp_deepspeed.interop.megatron import Grouping, Kind, _placement

    qk = "decoder.layers.0.self_attention.q_layernorm.weight"
    norm = "decoder.layers.0.input_layernorm.weight"
    embedding = "embedding.word_embeddings.weight"
    groups = [_group(1.0), _group(0.0), _group(1.0, default_config=False, max_lr=2e-4)]
    for qk_decay, want in ((False, 1), (True, 0)):
        grouping = Grouping(qk_decay=qk_decay, decoupled=True)
        present = {grouping.kind(n, s) for n, s in ((qk, (8,)), (norm, (8,)), (embedding, (70, 8)))}
        slots, group_of = _placement(groups, present, "common.pt", grouping)
        assert slots == [(0, False), (1, False), (2, False)]
        assert (group_of(qk, (8,)), group_of(norm, (8,)), group_of(embedding, (70, 8))) == (want, 1, 2)
    assert Grouping().kind(embedding, (70, 8)) == Kind(expert=False, decays=True, decoupled=False)
    with pytest.raises(CheckpointError, match="param groups 0 and 1 hold the same kind"):
        _placement([_group(1.0), _group(1.0, lr_mult=0.5)], set(), "common.pt", Grouping())
