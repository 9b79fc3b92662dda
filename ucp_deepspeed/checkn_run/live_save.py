"""Write a universal checkpoint straight from a live engine, with embedding tables optionally partial.

Check-N-Run checkpoints skip DeepSpeed's native files: every rank takes part in gathering each
parameter's full fp32 value and optimizer states (one parameter at a time), and rank 0 writes the
universal files. A table entry can hold only some rows (a differential checkpoint) and its fp32
rows can be quantized; optimizer states of those rows stay exact. Dense parameters are always whole.

    tables/<name>.safetensors   rows (int64, absent when all rows are saved), fp32 or
                                fp32.codes + fp32.params (quantized), and one tensor per state
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from ucp_deepspeed import compat
from ucp_deepspeed.checkn_run.quantize import quantize
from ucp_deepspeed.format.manifest import Counters, GroupRecord, SourceRecord, dtype_name, recorded_sections
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.universal import encode_value
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.capture import (
    live_params,
    model_parallel,
    model_spec,
    namer,
    optimizer_record,
    param_groups,
    topology,
)
from ucp_deepspeed.runtime.collective import all_ok, failure_of, guarded, to_rank0
from ucp_deepspeed.sources.keys import OPTIMIZER_WRAPPER_KEYS


@dataclass(frozen=True)
class TableSave:
    """What to store of one table: which rows (None: all) and how to quantize their fp32 values."""

    rows: torch.Tensor | None
    method: str | None = None
    bits: int | None = None


def table_file(name: str) -> str:
    """Relative path of a table's rows file."""
    return f"tables/{name}.safetensors"


def check_supported(engine: Engine) -> None:
    """Live saves gather whole parameters over data parallelism only."""
    if compat.is_unpartitioned(engine):
        raise NotImplementedError(
            "Check-N-Run checkpoints (differential or quantized) need a ZeRO optimizer (stage 1, 2 or 3) or bf16"
        )
    mp = model_parallel(engine)
    if mp.tp > 1 or mp.pp > 1 or topology(engine).ep > 1:
        raise NotImplementedError(
            "Check-N-Run checkpoints (differential or quantized) support data parallelism "
            "with any ZeRO stage; tensor, pipeline and expert parallelism are not supported"
        )


def _state_keys(engine: Engine) -> list[str]:
    for state in engine.optimizer.optimizer.state.values():
        return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
    return []


def _param_groups(engine: Engine) -> tuple[GroupRecord, ...]:
    base = engine.optimizer.optimizer
    # ZeRO-3 hands a group its flat sub-groups only while it steps them: between steps its "params" are empty
    flats: dict[int, list[torch.Tensor]] = {}
    if int(engine.zero_optimization_stage()) == 3:
        for sub in compat.zero3_subgroups(engine.optimizer):
            flats.setdefault(sub.group, []).append(sub.fp32)
    groups = []
    for index, group in enumerate(base.param_groups):
        scalars = {}
        for p in flats.get(index, group["params"]):
            if base.state.get(p):
                scalars = {k: v for k, v in base.state[p].items() if not (torch.is_tensor(v) and v.dim() > 0)}
                break
        groups.append(
            GroupRecord(
                {k: encode_value(v) for k, v in group.items() if k != "params"},
                {k: encode_value(v) for k, v in scalars.items()},
            )
        )
    return tuple(groups)


def _dtype(p: torch.Tensor) -> str:
    """The dtype a parameter is stored in (its low-precision one under mixed precision), as records name it."""
    return dtype_name(compat.storage_dtype(p))


def write_live(
    engine: Engine,
    out: str,
    client_state: dict[str, Any],
    tables: dict[str, TableSave],
    extra: dict[str, Any],
    data_loaders: list[dict[str, Any]] | None = None,
) -> tuple[str | None, int]:
    """Write `out` from the live engine (collective); returns the manifest path on rank 0 and bytes written.

    Rank 0 writes while every rank takes part in each parameter's gather: a write that fails there (a store that went
    down) stops the writing, not the gathers, and fails the save on every rank after them; nothing is committed."""
    check_supported(engine)
    rank0 = dist.get_rank() == 0
    failed: list[tuple[str, str]] = []

    def write(add: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        if failed:
            return
        try:
            add(*args, **kwargs)
        except Exception as exc:  # raised on every rank once the gathers are done
            failed.append(failure_of(exc))

    keys = _state_keys(engine)
    groups = param_groups(engine)
    placed = live_params(engine)
    whole = _gatherer(engine, keys)
    with UniversalWriter(root=out) as writer:  # only rank 0 adds files; every rank takes part in the gathers
        for p, info in placed.items():
            name = info.name
            shape = tuple(info.shape)
            if not p.requires_grad:
                with deepspeed.zero.GatheredParameters([p], enabled=compat.is_zero3_param(p)):
                    value = p.detach().cpu().clone()
                if rank0:
                    write(writer.add_frozen, name, value, dtype=_dtype(p))
                continue
            state = whole(p, shape)
            spec = tables.get(name)
            if state is not None:
                write(
                    writer.add_param,
                    name,
                    state if spec is None else table_tensors(state, spec),
                    group=groups[p],
                    dtype=_dtype(p),
                    shape=shape,
                    keys=(FP32, *keys),
                    file=None if spec is None else table_file(name),
                    extra=None if spec is None else {"table": table_record(spec, shape[0])},
                )
        all_ok(failed[0] if failed else None)
        return guarded(lambda: _finish(engine, writer, client_state, extra, data_loaders) if rank0 else (None, 0))


def _finish(
    engine: Engine,
    writer: UniversalWriter,
    client_state: dict[str, Any],
    extra: dict[str, Any],
    data_loaders: list[dict[str, Any]] | None,
) -> tuple[str, int]:
    """Rank 0's part after the gathers: buffers, the scheduler and client state, then the manifest, last."""
    to_global = namer(engine)
    buffers = dict(engine.module.named_buffers())
    writer.add_buffers({to_global(n): buffers[n].detach().cpu() for n in compat.buffer_names(engine)})
    writer.set_state(
        TrainingState(
            lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            client_state=client_state,
            optimizer_wrapper={
                k: getattr(engine.optimizer, k) for k in OPTIMIZER_WRAPPER_KEYS if hasattr(engine.optimizer, k)
            },
            data_sampler=sampler.state_dict() if (sampler := compat.data_sampler(engine)) is not None else None,
            data_sampler_rng=compat.sampler_rng(engine),
            data_loaders=data_loaders,
        )
    )
    path = writer.finish(
        source=SourceRecord(
            writer.root,
            st.basename(writer.root),
            topology(engine),
            {"base_optimizer": type(engine.optimizer.optimizer).__name__},
        ),
        counters=Counters(
            engine.global_steps, engine.global_samples // compat.sample_copies(engine), engine.skipped_steps
        ),
        param_groups=_param_groups(engine),
        extra={**extra, **recorded_sections(model_spec(engine), engine.ucp.hf_config, optimizer_record(engine))},
    )
    return path, writer.nbytes


def _gatherer(engine: Engine, keys: list[str]) -> Callable[[torch.nn.Parameter, tuple[int, ...]], dict | None]:
    """whole(p, shape): a parameter's fp32 value and optimizer states, whole in host memory on rank 0 (the writer)
    and None elsewhere (collective). Each rank sends only the piece it holds, so no rank but the writer ever holds
    a whole table, and the writer one parameter at a time; DeepSpeed's `safe_get_full_*` would build each whole
    value on every rank's device. An NVMe-offloaded optimizer keeps its states swapped out: there, DeepSpeed's."""
    if compat.nvme_offload(engine):

        def swapped(p: torch.nn.Parameter, shape: tuple[int, ...]) -> dict | None:
            state = {FP32: safe_get_full_fp32_param(p).detach().cpu().reshape(shape)}
            for key in keys:
                state[key] = safe_get_full_optimizer_state(p, key).detach().cpu().reshape(shape)
            return state if dist.get_rank() == 0 else None

        return swapped
    held = compat.owned_fragments(engine, keys)

    def gathered(p: torch.nn.Parameter, shape: tuple[int, ...]) -> dict | None:
        piece = held(p)
        pieces = to_rank0(
            None if piece is None else (piece.start, {k: v.detach().cpu() for k, v in piece.tensors.items()})
        )
        if pieces is None:
            return None
        numel = math.prod(shape)
        out = {k: torch.empty(numel, dtype=torch.float32) for k in (FP32, *keys)}
        filled = 0
        for start, values in filter(None, pieces):
            for key, value in values.items():
                out[key if key != "fp32" else FP32].narrow(0, start, value.numel()).copy_(value)
            filled += values["fp32"].numel()
        if filled != numel:
            raise RuntimeError(f"the ranks hold {filled} of the {numel} elements of a parameter of shape {shape}")
        return {k: v.view(shape) for k, v in out.items()}

    return gathered


def table_record(spec: TableSave, total: int, widths: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The manifest's record of a stored table: its rows, the rows stored, their quantization, and the row width of
    each state whose rows are not the table's (`widths`)."""
    return {
        "rows": total,
        "saved_rows": total if spec.rows is None else int(spec.rows.numel()),
        "partial": spec.rows is not None,
        "quantize": {"method": spec.method, "bits": spec.bits} if spec.method else None,
        **({"widths": widths} if widths else {}),
    }


def table_tensors(state: dict[str, torch.Tensor], spec: TableSave) -> dict[str, torch.Tensor]:
    """A table's tensors as stored: the rows kept (all, or `spec.rows` with their index), fp32 quantized if asked."""
    rows = spec.rows
    picked = {k: (v if rows is None else v[rows]) for k, v in state.items()}
    out = {} if rows is None else {"rows": rows.to(torch.int64)}
    for key, value in picked.items():
        if key == FP32 and spec.method and spec.bits:
            q = quantize(value.reshape(value.shape[0], math.prod(value.shape[1:])), spec.bits, spec.method)
            out.update({f"{FP32}.{k}": v for k, v in q.tensors().items()})
        else:
            out[key] = value.contiguous()
    return out
