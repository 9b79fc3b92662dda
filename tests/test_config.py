"""The checkpoint.universal config section and the partition geometry, without launching ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucp_deepspeed.format.metadata import ParamSlot
from ucp_deepspeed.geometry.fragments import Fragment, fragments
from ucp_deepspeed.runtime.config import load_config, split_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_configs_enable_universal(path):
    ds_config, options = split_config(load_config(str(path)))
    assert options.enabled
    assert "universal" not in ds_config.get("checkpoint", {}), "our key must not reach DeepSpeed"
    assert json.loads(path.read_text())["checkpoint"]["universal"], "the file itself is not modified"


def test_boolean_and_object_forms():
    assert not split_config({})[1].enabled
    assert split_config({"checkpoint": {"universal": True}})[1].enabled
    options = split_config({"checkpoint": {"universal": {"workers": 3, "keep": False}}})[1]
    assert options.enabled and options.workers == 3 and not options.keep


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"workrs": 2}, "workrs"),
        ({"workers": 0}, "greater than or equal to 1"),
        ("yes", "must be true/false or an object"),
        ({"key_prefixes": 1}, "one key prefix spreads nothing"),
        ({"key_prefixes": 2048}, "less than or equal to 1024"),
        ({"async_writer_cpus": []}, "name one CPU or more"),
        ({"async_writer_cpus": [-1]}, "each 0 or above"),
    ],
)
def test_bad_options_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        split_config({"checkpoint": {"universal": bad}})


def test_zero12_fragments_cut_at_partition_borders():
    slot = ParamSlot("w", (3, 5), group=0, flat=0, offset=7, partition=10)
    assert fragments(slot, zero_stage=2, dp=3) == [Fragment(0, 7, 0, 3), Fragment(1, 0, 3, 10), Fragment(2, 0, 13, 2)]


def test_zero3_fragments_are_per_rank_chunks():
    slot = ParamSlot("w", (7,), group=0, flat=1, offset=4, partition=3)
    assert fragments(slot, zero_stage=3, dp=3) == [Fragment(0, 4, 0, 3), Fragment(1, 4, 3, 3), Fragment(2, 4, 6, 1)]


def test_check_n_run_sections_sit_beside_universal():
    config = {
        "checkpoint": {
            "universal": True,
            "differential": {"policy": "intermittent"},
            "quantize": {"bits": 4, "method": "adaptive"},
        }
    }
    ds_config, options = split_config(config)
    assert ds_config["checkpoint"] == {}, "our keys must not reach DeepSpeed"
    assert options.extensions["differential"].policy == "intermittent" and options.extensions["quantize"].bits == 4
    assert (
        split_config({"checkpoint": {"universal": True, "quantize": {"expected_restores": 2}}})[1]
        .extensions["quantize"]
        .bits
        is None
    )


@pytest.mark.parametrize(
    "section,message",
    [
        ({"differential": {"policy": "sometimes"}}, "one_shot"),
        ({"quantize": {"method": "adaptive"}}, "give `bits`"),
        ({"quantize": {"bits": 5}}, "bits"),
        ({"universal": False, "differential": {}}, 'need "checkpoint.universal" enabled'),
    ],
)
def test_bad_check_n_run_options_are_clear_errors(section, message):
    with pytest.raises(ValueError, match=message):
        split_config({"checkpoint": {"universal": True, **section}})


def test_differential_refuses_optimizers_that_move_untouched_rows():
    import torch

    from ucp_deepspeed.checkn_run.tracking import check_optimizer

    model = torch.nn.Embedding(4, 2)
    check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    check_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1))
    for bad in (
        torch.optim.Adam(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adagrad(model.parameters(), weight_decay=0.01),
    ):
        with pytest.raises(NotImplementedError, match="leaves rows without gradient unchanged"):
            check_optimizer(bad)


def test_what_initialize_refuses_is_named():
    """bf16 at ZeRO-0 with a client optimizer is DeepSpeed's FP16_UnfusedOptimizer (BF16_Optimizer needs fp32
    gradient accumulation, and cannot be built on this CPU): refused at `initialize`, naming the wrapper and what
    to use instead. ZeRO-3 with parameters swapped to NVMe is refused by name (checked on the predicate: building
    one needs the async_io op)."""
    from types import SimpleNamespace

    import inprocess
    import torch
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    import ucp_deepspeed
    from ucp_deepspeed.runtime.capture import unsupported

    inprocess.one_rank()
    model = inprocess.Net()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "checkpoint": {"universal": True}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(
        NotImplementedError,
        match="bf16 at ZeRO stage 0, where DeepSpeed wraps the optimizer in its "
        "FP16_UnfusedOptimizer; use zero_optimization.stage 1",
    ):
        ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine = SimpleNamespace(
        module=model,
        zero_optimization_stage=lambda: 3,
        zero_offload_param=lambda: SimpleNamespace(device=OffloadDeviceEnum.nvme),
    )
    assert "ZeRO-3 with offload_param.device nvme" in unsupported(engine)
