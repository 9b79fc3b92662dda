"""Optimizer state across kernels, in one process: which saved state each live state is read from, how steps are
kept, and what is refused. The multi-rank cells (ZeRO-Offload's CPU Adam against torch's AdamW, offload in and out)
are in `test_reshard.py`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucp_deepspeed import CheckpointError, UniversalCheckpoint
from ucp_deepspeed.compat import StepCount
from ucp_deepspeed.format.manifest import Counters, GroupRecord, Manifest, ParamRecord, SourceRecord
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import BUFFERS, STATE, param_file, write_manifest, write_object, write_tensors
from ucp_deepspeed.runtime.restore import StateMap, _step, state_map

CPU_ADAM = {"class": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam", "algorithm": "adamw", "states": {}}
CPU_ADAGRAD = {
    "class": "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad",
    "algorithm": "adagrad",
    "states": {"exp_avg_sq": "sum"},
}


def folder(
    root, states: tuple[str, ...], optimizer: dict | None, step=3, hyperparams: dict | None = None
) -> UniversalCheckpoint:
    """A one-parameter universal folder whose optimizer kept `states`, counted `step` and had `hyperparams`."""
    w = torch.arange(6.0)
    records = [
        write_tensors(str(root), param_file("w"), {"fp32": w} | {k: w + i for i, k in enumerate(states, 1)}),
        write_tensors(str(root), BUFFERS, {}),
        write_object(str(root), STATE, {"lr_scheduler": None, "client_state": {}, "optimizer_wrapper": {}}),
    ]
    manifest = Manifest(
        created_by={},
        source=SourceRecord("x", None, Topology(1, 1, "fp32")),
        counters=Counters(step, 2 * step, 0),
        param_groups=(GroupRecord({"lr": 0.1, **(hyperparams or {})}, {"step": step}),),
        params={"w": ParamRecord((6,), "float32", 0, True, param_file("w"), ("fp32", *states))},
        buffers={},
        extra={"optimizer": optimizer} if optimizer else {},
    )
    write_manifest(str(root), manifest, records)
    return UniversalCheckpoint(str(root))


def engine(opt: torch.optim.Optimizer) -> SimpleNamespace:
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt))


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(6))]


def test_cpu_adam_state_goes_to_torch_adamw_with_a_tensor_step(tmp_path):
    ckpt = folder(tmp_path, ("exp_avg", "exp_avg_sq"), CPU_ADAM)
    smap = state_map(engine(torch.optim.AdamW(params())), ckpt)
    assert smap == StateMap(keys={"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}, step=StepCount.TENSOR)
    step = _step(3, smap.step, torch.device("cpu"), "m")
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.item() == 3
    as_int = _step(torch.tensor(3.0), StepCount.INT, None, "m")
    assert as_int == 3 and type(as_int) is int
    with pytest.raises(CheckpointError, match="step 'x' is not a count"):
        _step("x", StepCount.INT, None, "m")


def test_adagrad_sum_is_deepspeed_exp_avg_sq(tmp_path):
    ckpt = folder(tmp_path, ("exp_avg_sq",), CPU_ADAGRAD)
    assert state_map(engine(torch.optim.Adagrad(params())), ckpt).keys == {"sum": "exp_avg_sq"}


def test_another_algorithm_is_refused(tmp_path):
    ckpt = folder(tmp_path, ("exp_avg", "exp_avg_sq"), CPU_ADAM)
    with pytest.raises(
        CheckpointError, match="DeepSpeedCPUAdam \\(adamw\\); this engine's torch.optim.sgd.SGD runs sgd"
    ):
        state_map(engine(torch.optim.SGD(params(), lr=0.1, momentum=0.9)), ckpt)


def test_adam_and_adamw_are_one_algorithm_only_without_weight_decay(tmp_path):
    ckpt = folder(tmp_path, ("exp_avg", "exp_avg_sq"), CPU_ADAM)
    assert state_map(engine(torch.optim.Adam(params(), weight_decay=0.0)), ckpt).step is StepCount.TENSOR
    with pytest.raises(CheckpointError, match="another algorithm"):
        state_map(engine(torch.optim.Adam(params(), weight_decay=0.1)), ckpt)


def test_a_missing_moment_is_refused_naming_parameter_and_state(tmp_path):
    """SGD saved without momentum, resumed with it: the momentum would silently start from zero."""
    ckpt = folder(tmp_path, (), {"class": "torch.optim.sgd.SGD", "algorithm": "sgd", "states": {}})
    with pytest.raises(CheckpointError, match="w: the checkpoint holds no momentum_buffer state"):
        state_map(engine(torch.optim.SGD(params(), lr=0.1, momentum=0.9)), ckpt)
    assert state_map(engine(torch.optim.SGD(params(), lr=0.1)), ckpt).keys == {}


def test_the_saved_hyperparameters_decide_what_is_needed(tmp_path):
    """The saved momentum of 0 is what the live SGD will run with, so no momentum state is needed."""
    ckpt = folder(
        tmp_path, (), {"class": "torch.optim.sgd.SGD", "algorithm": "sgd", "states": {}}, hyperparams={"momentum": 0.0}
    )
    assert state_map(engine(torch.optim.SGD(params(), lr=0.1, momentum=0.9)), ckpt).keys == {}


def test_a_save_before_the_first_step_has_no_state_to_need(tmp_path):
    ckpt = folder(tmp_path, (), CPU_ADAM, step=0)
    assert state_map(engine(torch.optim.AdamW(params())), ckpt).keys == {}


def test_a_saved_setting_the_live_kernel_cannot_apply_is_refused(tmp_path):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    ckpt = folder(
        tmp_path,
        ("exp_avg", "exp_avg_sq"),
        {"class": "torch.optim.adamw.AdamW", "algorithm": "adamw", "states": {}},
        hyperparams={"maximize": True},
    )
    with pytest.raises(CheckpointError, match="param group 0 was saved with maximize=True"):
        state_map(engine(DeepSpeedCPUAdam(params())), ckpt)


def test_deepspeed_cpu_adagrad_without_a_record_keeps_its_own_names(tmp_path):
    """Saved before the record existed: the states are taken to be named as the live kernel names them."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    ckpt = folder(tmp_path, ("exp_avg_sq",), None)
    assert state_map(engine(DeepSpeedCPUAdagrad(params())), ckpt).keys == {"exp_avg_sq": "exp_avg_sq"}


def test_a_checkpoint_without_an_optimizer_record_maps_by_name(tmp_path):
    """Saved by ucp_deepspeed before the record existed, or by plain DeepSpeed: state names are taken as they are."""
    ckpt = folder(tmp_path, ("exp_avg", "exp_avg_sq"), None)
    assert state_map(engine(torch.optim.AdamW(params())), ckpt).keys == {
        "exp_avg": "exp_avg",
        "exp_avg_sq": "exp_avg_sq",
    }


def test_an_fp16_loss_scaler_is_carried_to_fp16_only():
    """fp16 cannot run on this CPU, so the loss scaler's way through a reshard is checked alone: DeepSpeed's pickled
    DynamicLossScaler, read without running code, kept as plain data in the universal state, rebuilt as the same
    object for an fp16 engine (what the restore sets on its optimizer), and left out for a bf16 or fp32 one."""
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from ucp_deepspeed import compat
    from ucp_deepspeed.io.safe_pickle import loads
    from ucp_deepspeed.io.torch_file import plain
    from ucp_deepspeed.runtime.restore import wrapper_state

    scaler = DynamicLossScaler(2.0**16, scale_window=100, min_scale=4.0, delayed_shift=2, consecutive_hysteresis=False)
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 2.0**11, 57, 40, 1
    saved = {"loss_scaler": scaler, "dynamic_loss_scale": True, "overflow": False, "clip_grad": 1.0}
    universal = plain(loads(pickle.dumps(saved)))
    assert not isinstance(universal["loss_scaler"], DynamicLossScaler)  # plain data, as the universal state keeps it
    ckpt = SimpleNamespace(manifest=SimpleNamespace(source=SimpleNamespace(topology=SimpleNamespace(dtype="fp16"))))
    wrapper = {k: compat.rebuild(v) for k, v in wrapper_state(ckpt, "fp16", {"optimizer_wrapper": universal}).items()}
    assert type(wrapper["loss_scaler"]) is DynamicLossScaler and vars(wrapper["loss_scaler"]) == vars(scaler)
    assert {k: v for k, v in wrapper.items() if k != "loss_scaler"} == {
        "dynamic_loss_scale": True,
        "overflow": False,
        "clip_grad": 1.0,
    }
    assert wrapper["loss_scaler"].loss_scale == 2.0**11
    for live in ("bf16", "fp32"):
        assert wrapper_state(ckpt, live, {"optimizer_wrapper": universal}) == {}
