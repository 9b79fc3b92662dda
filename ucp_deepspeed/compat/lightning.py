"""The reach into PyTorch Lightning: its DeepSpeed strategy, which owns the engine and removes old checkpoint folders,
and whether its run ended normally (Lightning tears the strategy down after an error too)."""

from __future__ import annotations

from typing import Any


def lightning_deepspeed_strategy() -> Any:
    """Lightning's `DeepSpeedStrategy` class; None without Lightning."""
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:
        return None
    return DeepSpeedStrategy


def strategy_engine(strategy: Any) -> Any:
    """The DeepSpeed engine a Lightning strategy built (`strategy.model` once set up), or None."""
    model = getattr(strategy, "model", None)
    return model if hasattr(model, "save_checkpoint") and hasattr(model, "optimizer") else None


def run_ended_normally(strategy: Any) -> bool:
    """Whether the Lightning trainer that owns `strategy` is tearing down a run that ended normally: after an error it
    is `INTERRUPTED`, and another rank may be gone or elsewhere, so nothing waits on it."""
    from lightning.pytorch.trainer.states import TrainerStatus

    module = getattr(strategy, "_lightning_module", None)
    trainer = getattr(module, "_trainer", None)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING
