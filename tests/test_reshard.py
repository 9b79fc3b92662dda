"""End-to-end reshard matrix: save at dp=2, load at other DP sizes and ZeRO stages, compare exactly.

All targets of one world size load in one torchrun launch (slow cases in a launch of their own; the default dp=3
cells in the session's shared dp=3 launch, `conftest.dp3_loads`), each target loading its source checkpoints in turn;
each test reads its target's results. Every
fp32 master weight, Adam moment, step, per-group hyperparameter, low-precision module weight,
buffer, frozen parameter, scheduler state, counter and client_state entry must be torch.equal to
what was gathered before saving; the next losses must match the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import case_args, load_results, nvme_unavailable, torchrun

from ucp_deepspeed import UniversalCheckpoint
from ucp_deepspeed.convert import convert
from ucp_deepspeed.runtime.restore import wrapper_state
from ucp_deepspeed.tools.compare import diff

FP32_LOSS_RTOL = 1e-6
BF16_LOSS_RTOL = 5e-3  # bf16 forward/backward at another DP size rounds differently

# the default run loads every DP=3 target (one launch): all stages, kernels and precisions; test_fake_world.py
# restores the same sources at worlds of 3 to 16 without a launch. The other world sizes are a launch each
SLOW = pytest.mark.slow
KERNELS = {"offz1": "cpu_adam", "offz2": "cpu_adam", "offz3": "cpu_adam", "fusedz1": "fused_adam"}
KERNELS |= {"adagradz0": "adagrad", "offadagradz2": "cpu_adagrad", "offlionz1": "cpu_lion", "offlionz2": "cpu_lion"}
KERNELS |= {"nvmez3": "cpu_adam", "wideoffz3": "cpu_adam"}
WIDE_KERNEL_LOSS_RTOL = 1e-5  # CPU Adam and torch's AdamW round apart on the 870k-parameter model (1.4e-6 measured)
NVME = pytest.mark.nvme
CASES = [
    pytest.param(
        "z1", 1, ("z1", "z2", "z3", "offz2", "fusedz1", "bf16z1"), id="z1-dp1<-z1,z2,z3,offz2,fused,bf16", marks=SLOW
    ),
    # ZeRO-Offload steps DeepSpeed's CPU Adam (steps as ints) on host memory; torch's AdamW elsewhere
    pytest.param("offz3", 1, ("offz3", "z2"), id="offz3-dp1<-offz3,z2", marks=SLOW),
    pytest.param("offz2", 3, ("offz2", "z1", "offz3", "fusedz1"), id="offz2-dp3<-offz2,z1,offz3,fused"),
    pytest.param("fusedz1", 3, ("offz2", "z1"), id="fused-dp3<-offz2,z1"),
    pytest.param("offadagradz2", 3, ("adagradz0",), id="cpu-adagrad-dp3<-torch-adagrad"),
    pytest.param("adagradz0", 1, ("offadagradz2",), id="torch-adagrad-dp1<-cpu-adagrad", marks=SLOW),
    pytest.param("offlionz1", 3, ("offlionz2",), id="cpu-lion-z1-dp3<-cpu-lion-z2"),
    pytest.param("bf16z1", 1, ("z1", "bf16z2"), id="bf16z1-dp1<-fp32,bf16-without-fp32-accumulation", marks=SLOW),
    # DeepSpeed's CPU accelerator has no fp16: this source is bf16z2's files reshaped as an fp16 run writes them
    pytest.param("bf16z2", 1, ("fp16z2",), id="bf16z2-dp1<-fp16-shaped", marks=SLOW),
    pytest.param("z2", 2, ("offz2",), id="z2-dp2<-offz2-same-size-other-kernel", marks=SLOW),
    pytest.param("offz1", 2, ("z1",), id="offz1-dp2<-z1-same-size-other-kernel", marks=SLOW),
    pytest.param("z2", 3, ("z1", "z2", "z3", "z0", "bf16z2"), id="z2-dp3<-z1,z2,z3,z0,bf16z2"),
    pytest.param("z0", 3, ("z0", "z1"), id="z0-dp3<-z0,z1"),  # ZeRO-0 fp32: a torch optimizer on whole tensors
    pytest.param("z3", 4, ("z1", "z2", "z3"), id="z3-dp4<-z1,z2,z3", marks=SLOW),
    pytest.param("z3", 1, ("z3",), id="z3-dp1<-z3", marks=SLOW),
    pytest.param("z1", 2, ("z1",), id="z1-dp2<-z1-native", marks=SLOW),
    # BF16_Optimizer saves its last partition with the alignment padding (147 elements in 2 x 74): it was refused
    pytest.param("bf16z1pad", 3, ("bf16z1pad",), id="bf16z1-dp3<-bf16z1-padded"),
    pytest.param("bf16z1gather", 3, ("bf16z1", "z2"), id="bf16z1-dp3-refresh-gather<-bf16z1,z2"),
    pytest.param("bf16z3", 1, ("bf16z1",), id="bf16z3-dp1<-bf16z1", marks=SLOW),
    pytest.param("bf16z2", 4, ("bf16z1",), id="bf16z2-dp4<-bf16z1", marks=SLOW),
    pytest.param("sgdz1", 3, ("sgdz2",), id="sgd-z1-dp3<-sgd-z2"),
    # NVMe offload: states read from the source's swap files, written into the live engine's; DeepSpeed's own load
    # gets the same-size cell wrong, and a one-rank NVMe engine of this DeepSpeed does not train (not a target)
    pytest.param("nvmez3", 3, ("nvmez3", "widez1"), id="nvme-z3-dp3<-nvme-z3,z1", marks=NVME),
    pytest.param("nvmez3", 2, ("nvmez3",), id="nvme-z3-dp2<-nvme-z3-same-size", marks=(NVME, SLOW)),
    pytest.param("widez1", 1, ("nvmez3",), id="z1-dp1<-nvme-z3", marks=(NVME, SLOW)),
    pytest.param("wideoffz3", 1, ("nvmez3",), id="cpu-offload-z3-dp1<-nvme-z3", marks=(NVME, SLOW)),
    pytest.param("z1", 3, ("z2nofrozen",), id="z1-dp3<-z2-exclude-frozen"),  # frozen param keeps its live value
]


def fp16_shaped(src: Path, out: Path) -> Path:
    """A copy of a bf16 ZeRO-2 checkpoint as an fp16 run with a dynamic loss scale writes it: fp16 module weights,
    fp16 in its ds_config and metadata, a `DynamicLossScaler` mid-run, the optimizer files' names without `bf16_`;
    the files re-bound to their save."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from ucp_deepspeed.io.torch_file import save_id_of, stamp

    shutil.copytree(src, out)
    tag = out / (out / "latest").read_text().strip()
    meta_path = tag / "ucp_meta_mp_rank_00.json"
    meta = json.loads(meta_path.read_text())
    meta["topology"]["dtype"] = "fp16"
    for extra in meta["extras"]:  # the frozen parameter is kept in the run's precision
        extra["dtype"] = extra["dtype"].replace("bfloat16", "float16")
    meta_path.write_text(json.dumps(meta))
    for path in sorted(tag.glob("*.pt")):
        save_id = save_id_of(str(path))
        sd = torch.load(path, weights_only=False)
        sd["ds_config"] = {**sd["ds_config"], "bf16": {"enabled": False}, "fp16": {"enabled": True}}
        if "module" in sd:
            sd["module"] = {k: v.half() if v.is_floating_point() else v for k, v in sd["module"].items()}
        else:
            scaler = DynamicLossScaler(1024.0, 1000, 1.0, 2, False)
            scaler.cur_iter, scaler.last_overflow_iter = 3, 1
            sd["optimizer_state_dict"] |= {"loss_scaler": scaler, "dynamic_loss_scale": True, "overflow": False}
        path.unlink()
        path = path.with_name(path.name.removeprefix("bf16_"))  # DeepSpeed names bf16 runs' ZeRO files apart
        torch.save(sd, path)
        stamp(str(path), save_id)
    return out


@pytest.fixture(scope="module")
def all_sources(sources, tmp_path_factory) -> dict[str, Path]:
    """The session's sources and the fp16-shaped one."""
    return {**sources, "fp16z2": fp16_shaped(sources["bf16z2"], tmp_path_factory.mktemp("fp16") / "fp16z2")}


def cells(dp: int, slow: bool) -> list[tuple[str, tuple[str, ...]]]:
    """Every cell of one world size, slow or default: (target, the sources it loads)."""
    return [
        (p.values[0], p.values[2])
        for p in CASES
        if p.values[1] == dp
        and any(m.name == "slow" for m in p.marks) == slow
        and not (nvme_unavailable() and any(m.name == "nvme" for m in p.marks))
    ]


@pytest.fixture(scope="module")
def launched(all_sources, tmp_path_factory, request):
    """results(dp, slow) -> every result of the one launch that loads all targets of that world size."""
    done: dict[tuple[int, bool], list[dict]] = {}

    def results(dp: int, slow: bool) -> list[dict]:
        if (dp, slow) == (3, False):  # loaded with the session's other dp=3 runs
            return load_results(request.getfixturevalue("dp3_loads").out / "reshard.json")
        if (dp, slow) not in done:
            out = tmp_path_factory.mktemp(f"reshard_dp{dp}") / "results.json"
            torchrun(dp, "load", *case_args(cells(dp, slow), lambda n: all_sources[n]), "--results", str(out))
            done[dp, slow] = load_results(out)
        return done[dp, slow]

    return results


@pytest.mark.parametrize("target,dp,source_names", CASES)
def test_reshard(launched, request, target, dp, source_names):
    slow = request.node.get_closest_marker("slow") is not None
    if request.node.get_closest_marker("nvme") is not None and nvme_unavailable():
        pytest.skip(nvme_unavailable())
    results = [r for r in launched(dp, slow) if r["target"] == target]
    assert len(results) == len(source_names)
    for r in results:
        label = f"{r['source']} -> {target} dp={dp}"
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 20, label  # an empty snapshot would pass vacuously
        # DeepSpeed's own load hands state over as is, so it runs only for the same layout and optimizer kernel
        source = Path(r["source"]).name
        same_kernel = KERNELS.get(source, "torch_adamw") == KERNELS.get(target, "torch_adamw")
        nvme = "nvme" in target + source  # DeepSpeed's own load gets NVMe swap files wrong: never handed to it
        same_layout = r["saved"] == r["live"] and same_kernel and not nvme
        assert r["mode"] == ("native" if same_layout else "resharded"), label
        rtol = BF16_LOSS_RTOL if "bf16" in target + source else FP32_LOSS_RTOL
        if not same_kernel and {"nvmez3", "widez1", "wideoffz3"} & {source, target}:
            rtol = WIDE_KERNEL_LOSS_RTOL
        assert r["max_rel_loss"] <= rtol, f"{label}: losses {r['losses']} vs uninterrupted {r['reference_losses']}"


@SLOW
def test_checkpoint_of_another_model_is_refused(sources, tmp_path):
    results_file = tmp_path / "results.json"
    torchrun(2, "load", "--mismatch", "--variant", "z2", "--results", str(results_file), "--source", str(sources["z1"]))
    outcome = load_results(results_file)
    assert outcome["error"] is not None, "loading a checkpoint of a different model succeeded"
    assert (
        "manifest.json: checkpoint does not match this model" in outcome["error"]
        or "checkpoint does not match this model" in outcome["error"]
    )
    assert "up.weight: checkpoint shape [40, 24], model shape [48, 24]" in outcome["error"]
    assert outcome["untouched"], "state was modified before the mismatch was detected"


def test_fp16_shaped_checkpoint_converts_and_keeps_its_loss_scale_for_fp16_only(all_sources, tmp_path):
    """Masters and moments convert exactly; the dynamic loss scale is carried for an fp16 resume and left out of a
    bf16 or fp32 one (whose scaler stays as built). An fp16 engine itself cannot run on this machine."""
    out = convert(str(all_sources["fp16z2"]), output=str(tmp_path / "u"), progress=False)
    report = diff(str(all_sources["bf16z2"]), out)
    masters = [s for s in report.states if s.key != "value"]
    assert len(masters) >= 15 and all(s.equal for s in masters), [s for s in masters if not s.equal]
    ckpt = UniversalCheckpoint(out)
    scaler = wrapper_state(ckpt, "fp16")["loss_scaler"]
    assert (scaler["state"]["cur_scale"], scaler["state"]["cur_iter"]) == (1024.0, 3)
    assert wrapper_state(ckpt, "fp16")["dynamic_loss_scale"] is True
    assert wrapper_state(ckpt, "bf16") == {} == wrapper_state(ckpt, "fp32")
