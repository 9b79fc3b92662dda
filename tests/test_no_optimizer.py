"""Engines built without an optimizer, as frameworks build them for reference, reward and evaluation models (TRL's
`prepare_deepspeed`, Lightning's validate/test/predict): `install()` must leave them working as DeepSpeed built them,
and they take a module-only load of a checkpoint saved by a training engine.

One process, one rank: DeepSpeed builds no optimizer at ZeRO-0 in fp32, only its parameter partitioner at ZeRO-3,
and its BF16_Optimizer over a `DummyOptim` in bf16 (ZeRO-1/2 refuse to run without an optimizer).
"""

from __future__ import annotations

import pytest
import torch
from inprocess import Net, build, one_rank, train

CONFIGS = {
    "fp32": {"train_micro_batch_size_per_gpu": 1},  # the example: no checkpoint key at all
    "zero0": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
    "bf16": {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}},
    "zero3": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
}


@pytest.fixture
def installed():
    import ucp_deepspeed

    one_rank()
    ucp_deepspeed.install()
    yield
    ucp_deepspeed.uninstall()


def _reference(config: dict, frozen: bool, **kwargs) -> object:
    """A model built as TRL builds its reference model: through `deepspeed.initialize` (replaced by install()),
    without an optimizer; its weights differ from any trained run's."""
    import deepspeed

    torch.manual_seed(123)
    model = Net()
    if frozen:
        model.requires_grad_(False)
    return deepspeed.initialize(model=model, config=dict(config), **kwargs)[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_install_leaves_an_engine_without_an_optimizer_working(installed, name):
    """`deepspeed.initialize` without an optimizer under install(): built (it was refused at ZeRO-0 in fp32, 'where
    DeepSpeed wraps the optimizer in its NoneType'), its forward runs, and it is given a checkpointer for loads."""
    engine = _reference(CONFIGS[name], frozen=True)
    _forward(engine)
    assert engine.ucp is not None and not engine.ucp.trains


def test_install_leaves_an_engine_given_no_parameters_working(installed):
    engine = _reference(CONFIGS["fp32"], frozen=False, optimizer=None, model_parameters=[])
    assert engine.optimizer is None and not engine.ucp.trains


def _forward(engine) -> None:
    """The engine computes (Net's fp32 buffer meets a bf16 engine's weights: its forward runs under autocast there)."""
    bf16 = engine.bfloat16_enabled()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        assert torch.isfinite(engine(torch.tensor([[1, 2], [3, 4]]))).all()


def _master_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master (a frozen one's value), copied."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = (safe_get_full_fp32_param(p) if p.requires_grad else p).detach().clone().float()
    return out


def _weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_a_reference_model_takes_the_weights_of_a_trained_checkpoint(installed, tmp_path, name, frozen):
    """A DPO job's reference model starts from the SFT run's checkpoint: a ZeRO-1 training engine's save loads into
    an engine without an optimizer (its parameters frozen, as TRL's are, or not), every weight the trained fp32
    master (rounded to bf16 in a bf16 engine) and the buffer as saved; the load is resharded by ours, and the
    engine's save stays DeepSpeed's own."""
    trained = build(stage=1)
    train(trained, 3)
    trained.module.scale.mul_(2.0)  # a buffer that differs from a fresh model's
    masters = _master_weights(trained)
    buffer = trained.module.scale.detach().clone()
    trained.save_checkpoint(str(tmp_path / "sft"))
    reference = _reference(CONFIGS[name], frozen=frozen)
    assert any(not torch.equal(w.float(), masters[n]) for n, w in _weights(reference).items())
    path, _ = reference.load_checkpoint(str(tmp_path / "sft"))
    assert path == str(tmp_path / "sft" / "global_step3")
    assert reference.ucp_last_load.mode == "resharded"
    loaded = _weights(reference)
    differ = [n for n, w in loaded.items() if not torch.equal(w, masters[n].to(w.dtype))]
    assert not differ, differ
    assert torch.equal(reference.module.scale, buffer)
    _forward(reference)
    if name in ("fp32", "zero0"):  # DeepSpeed's own save, no ucp metadata (ZeRO-3 without an optimizer has no saver)
        reference.save_checkpoint(str(tmp_path / "ref"))
        assert not list((tmp_path / "ref").glob("*/ucp_meta_*"))
        assert list((tmp_path / "ref").glob("*/mp_rank_00_model_states.pt"))
