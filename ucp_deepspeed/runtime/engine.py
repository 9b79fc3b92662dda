"""Wire universal checkpointing into a DeepSpeed engine: `initialize` is `deepspeed.initialize` plus `attach`, which
gives the engine a `UniversalCheckpointer` (`engine.ucp`) and routes its `save_checkpoint` / `load_checkpoint` through
it."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import deepspeed
from deepspeed.pipe import PipelineModule

from ucp_deepspeed import compat
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.capture import unsupported
from ucp_deepspeed.runtime.checkpointer import LoadReport, UniversalCheckpointer, checkpointer_of
from ucp_deepspeed.runtime.config import UniversalConfig, load_config, split_config
from ucp_deepspeed.runtime.mpu import MegatronMpu, megatron_initialized, megatron_moe_visible

__all__ = ["LoadReport", "attach", "initialize"]

# `ucp_deepspeed.install` replaces deepspeed.initialize; ours must still reach DeepSpeed's own.
_deepspeed_initialize = deepspeed.initialize


def initialize(
    args: Any = None,
    *,
    config: Any = None,
    config_params: Any = None,
    default_universal: bool | dict[str, Any] = False,
    **kwargs: Any,
) -> tuple:
    """`deepspeed.initialize` with universal checkpointing switched on by `"checkpoint": {"universal": true}`.

    `default_universal` applies when the config has no `checkpoint.universal` entry. With
    megatron-core's parallel_state initialised (or passed as `mpu`), DeepSpeed gets an adapter for
    it, so tensor/pipeline/data-parallel groups come from megatron-core; a `PipelineModule` keeps its
    own grid (megatron-core layers inside it use parallel_state for their tensor-parallel groups).
    """
    raw = config if config is not None else config_params
    if raw is None and getattr(args, "deepspeed_config", None) is not None:
        raw, args.deepspeed_config = args.deepspeed_config, None  # DeepSpeed refuses a config given twice
    ds_config, options = split_config(load_config(raw), default_universal)
    mpu = kwargs.get("mpu")
    autotp = int((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 0)
    ulysses = compat.is_ulysses_mpu(mpu) or int(ds_config.get("sequence_parallel_size") or 1) > 1
    if options.enabled and autotp > 1 and ulysses:
        raise NotImplementedError(
            "AutoTP (tensor_parallel.autotp_size) together with Ulysses sequence parallelism: DeepSpeed 0.19.8 "
            "replaces the sequence-parallel mpu with AutoTP's groups, so ZeRO would partition without the "
            "sequence-parallel ranks; train with one of the two"
        )
    piped = isinstance(kwargs.get("model"), PipelineModule)  # its grid is its mpu; DeepSpeed wants none
    if not piped and (
        (mpu is None and megatron_initialized())
        or (mpu is not None and mpu is sys.modules.get("megatron.core.parallel_state"))
    ):
        kwargs["mpu"] = MegatronMpu()
    with (
        megatron_moe_visible(kwargs.get("model"))
        if "mpu" in kwargs and kwargs.get("model") is not None
        else contextlib.nullcontext()
    ):
        result = _deepspeed_initialize(args=args, config=ds_config, **kwargs)
    if options.enabled:
        attach(result[0], options)
    return result


def attach(engine: Engine, options: UniversalConfig | None = None) -> Any:
    """Make an existing engine save ucp metadata and load checkpoints of any topology (`engine.ucp` owns them)."""
    if checkpointer_of(engine) is not None:
        return engine
    reason = unsupported(engine)
    if reason is not None:
        raise NotImplementedError(reason)  # refuse now rather than at the first save, mid-training
    checkpointer = UniversalCheckpointer(engine, options or UniversalConfig(enabled=True))
    engine.ucp = checkpointer
    engine.ucp_last_load = None
    engine.save_checkpoint = checkpointer.save
    engine.load_checkpoint = checkpointer.load
    engine.wait_for_checkpoint = checkpointer.wait
    return engine
