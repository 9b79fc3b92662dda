"""Reshard a universal checkpoint into a live DeepSpeed engine: each rank reads only what it owns, all or nothing.

For every parameter the engine tells us which element range of the flattened parameter this
rank's fp32 partition holds (ZeRO-1/2: `_hp_mapping`; ZeRO-3: `ds_tensor` partition). We read
exactly that range of the fp32 master and of each optimizer state into memory apart from the
engine (`stage`), and only once every rank has read and checked its share write it in (`commit`),
then refresh the low-precision weights from the fp32 masters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ucp_deepspeed import compat
from ucp_deepspeed.convert.expert_names import ExpertNames, derivations
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import IMPLEMENTATION_KEYS, GroupRecord
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.universal import MANIFEST, TensorReader, decode_value
from ucp_deepspeed.io.stats import record as record_io
from ucp_deepspeed.naming.experts import expert_blocks
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime import rng
from ucp_deepspeed.runtime.capture import (
    LiveParam,
    attached_options,
    engine_dtype,
    expert_groups,
    live_params,
    model_parallel,
    namer,
    param_groups,
    topology,
)
from ucp_deepspeed.runtime.collective import from_rank0, guarded, to_rank0
from ucp_deepspeed.runtime.gate import Gate

log = logging.getLogger("ucp_deepspeed")

# structure, not hyperparameters: DeepSpeed names MoE groups after their expert-parallel size
_NON_PARAM_KEYS = ("params", "name", "moe")


@dataclass(frozen=True)
class LoadFlags:
    """The `load_checkpoint` arguments that shape what is restored, as DeepSpeed names them, and ours."""

    module_strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False
    custom_load_fn: Any = None
    data_loader: Any = None
    """This rank's data loader, to continue where the saved ranks' loaders stood (`runtime.data_position`)."""

    def native(self) -> dict[str, Any]:
        """The keyword arguments of DeepSpeed's own `load_checkpoint`."""
        return {
            "load_module_strict": self.module_strict,
            "load_optimizer_states": self.optimizer_states,
            "load_lr_scheduler_states": self.lr_scheduler_states,
            "load_module_only": self.module_only,
            "custom_load_fn": self.custom_load_fn,
        }


def _problems(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], module_only: bool
) -> tuple[list, set]:
    problems = []
    # a module-only load fills weights and nothing of the optimizer's: its groups do not matter
    groups = not module_only and not ckpt.manifest.weights_only
    live_groups = (
        {id(p): g for g, group in enumerate(compat.base_optimizer(engine).param_groups) for p in group["params"]}
        if groups
        else {}
    )
    stage3 = int(engine.zero_optimization_stage()) == 3
    names = set()
    for p, info in live.items():
        names.add(info.name)
        rec = ckpt.params.get(info.name)
        if rec is None:
            continue
        try:
            shape = list(info.layout.full_shape(info.shape, info.size))
        except ValueError as exc:
            problems.append(f"{info.name}: {exc}")
            continue
        stored = list(rec.shape)
        if stored != shape:
            hint = ""
            if (
                info.layout.is_split
                and len(shape) == len(stored)
                and [d for d in range(len(shape)) if shape[d] != stored[d]] == [info.layout.dim]
            ):
                hint = " (if this is vocabulary padding, set checkpoint.universal.vocab_size to the unpadded size)"
            problems.append(f"{info.name}: checkpoint shape {stored}, model shape {shape}{hint}")
        elif rec.trainable != p.requires_grad and not (module_only and not p.requires_grad):
            # a frozen copy of a trained model (a reference model) takes the trained weights in a module-only load
            problems.append(f"{info.name}: trainable={rec.trainable} in checkpoint, {p.requires_grad} in model")
        elif not stage3 and p.requires_grad and id(p) in live_groups and rec.group != live_groups[id(p)]:
            problems.append(f"{info.name}: param group {rec.group} in checkpoint, {live_groups[id(p)]} in model")
    sizes = expert_groups(engine)
    for block in expert_blocks(engine.module):
        saved = {block.expert_of(n) for n in ckpt.params if block.expert_of(n) is not None}
        live_count = sizes[block.group][0] * block.num_local
        if saved and len(saved) != live_count:
            problems.append(
                f"{block.prefix}*: checkpoint has {len(saved)} experts, the model has {live_count} "
                f"(expert-parallel size {sizes[block.group][0]} x {block.num_local} local experts)"
            )
    to_global = namer(engine)
    missing_buffers = sorted({to_global(n) for n in compat.buffer_names(engine)} - set(ckpt.buffers))
    if missing_buffers:
        problems.append(f"buffers not in checkpoint: {missing_buffers[:8]}")
    saved_groups = len(ckpt.manifest.param_groups)
    if groups and saved_groups != len(compat.base_optimizer(engine).param_groups):
        problems.append(
            f"{saved_groups} param groups in checkpoint, {len(compat.base_optimizer(engine).param_groups)} in optimizer"
        )
    return problems, names


def check_compatible(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], module_only: bool = False
) -> None:
    """Refuse a checkpoint of another model on every rank: names, shapes, layouts and groups (not for `module_only`,
    which loads weights alone) must match.

    Pipeline stages each hold part of the model, so names are compared over all ranks together.
    """
    problems, names = guarded(lambda: _problems(engine, ckpt, live, module_only))
    frozen = sorted(info.name for p, info in live.items() if not p.requires_grad)
    # a module reached under a second name (AutoEP's `gate` for its `router`): plain DeepSpeed saves the alias as a
    # tensor of its own, which the parameter's own name restores
    to_global = namer(engine)
    aliases = sorted({to_global(n) for n, _ in engine.module.named_parameters(remove_duplicate=False)} - names)
    everyone = to_rank0((problems, sorted(names), frozen, aliases))
    found = from_rank0(_all_problems(ckpt, everyone) if everyone is not None else None)
    if found:
        raise CheckpointError(
            f"{ckpt.root}/{MANIFEST}", "checkpoint does not match this model:\n  " + "\n  ".join(found)
        )


def _all_problems(ckpt: TensorReader, everyone: list[tuple[list[str], list[str], list[str], list[str]]]) -> list[str]:
    """What every rank found, and the names no rank has or the checkpoint lacks (on rank 0)."""
    problems = list(dict.fromkeys(p for part, _, _, _ in everyone for p in part))
    all_names = {n for _, part, _, _ in everyone for n in part}
    frozen = {n for _, _, part, _ in everyone for n in part}
    aliases = {n for *_, part in everyone for n in part if n in ckpt.params and not ckpt.params[n].trainable}
    skipped = frozen if ckpt.manifest.frozen_excluded else set()  # saved with exclude_frozen_parameters
    missing = sorted(all_names - set(ckpt.params) - skipped)
    # a foreign format that cannot tell a frozen parameter from a buffer (DCP) lists such a tensor as both
    untyped = {n for n, rec in ckpt.params.items() if not rec.trainable and n in ckpt.buffers}
    extra = sorted(set(ckpt.params) - all_names - untyped - aliases)
    if missing:
        problems.insert(0, f"parameters not in checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.insert(0, f"checkpoint parameters not in model: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return problems


@dataclass(frozen=True)
class StateMap:
    """Which saved state each of the live optimizer's states is read from, and how the live kernel counts steps.

    A checkpoint of one implementation of an algorithm resumes on another (torch's AdamW, DeepSpeed's
    FusedAdam and CPU Adam; torch's Adagrad and DeepSpeed's CPU Adagrad): the same numbers, under the
    live kernel's state names, with `step` as it keeps it (`compat.Kernel`).
    """

    keys: dict[str, str]
    step: compat.StepCount


_ALGORITHM_STATES = {
    "adam": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adamw": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adagrad": {"sum"},
    "lion": {"exp_avg"},
    "sgd": {"momentum_buffer"},
}
_NEUTRAL = {
    "amsgrad": False,
    "maximize": False,
    "bias_correction": True,
    "lr_decay": 0,
    "initial_accumulator_value": 0,
    "nesterov": False,
    "dampening": 0,
}
"""Group settings that change the update when not at these values: one the live kernel has no key for is refused."""


def _required(algorithm: str, groups: list[dict[str, Any]]) -> set[str]:
    """The states (the algorithm's names) without which the live optimizer would silently start from zero."""
    if algorithm in ("adam", "adamw"):
        return {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if any(g.get("amsgrad") for g in groups) else set())
    if algorithm == "sgd":
        return {"momentum_buffer"} if any(g.get("momentum") for g in groups) else set()
    return {"adagrad": {"sum"}, "lion": {"exp_avg"}}.get(algorithm, set())


def _saved_hyperparams(record: GroupRecord) -> dict[str, Any]:
    """A saved group's hyperparameters: what the algorithm computes with, not structure or a kernel's switches."""
    return {
        k: decode_value(v)
        for k, v in (record.hyperparams or {}).items()
        if k not in _NON_PARAM_KEYS and k not in IMPLEMENTATION_KEYS
    }


def _effective_groups(opt: Any, ckpt: TensorReader, where: str) -> list[dict[str, Any]]:
    """The live groups with the saved hyperparameters applied as `_apply_hyperparams` will apply them; refuses a
    saved setting that changes the update and that the live kernel has no place for."""
    out = []
    for i, (group, record) in enumerate(zip(opt.param_groups, ckpt.manifest.param_groups)):
        saved = _saved_hyperparams(record)
        for key, value in saved.items():
            if key not in group and key in _NEUTRAL and value != _NEUTRAL[key]:
                raise CheckpointError(
                    where, f"param group {i} was saved with {key}={value!r}, which {type(opt).__name__} cannot apply"
                )
        live = {k: v for k, v in group.items() if k != "params"}
        out.append(live | {k: v for k, v in saved.items() if k in group})
    return out


def state_map(engine: Engine, ckpt: TensorReader) -> StateMap:
    """The live optimizer's states from the saved ones; refuses another algorithm or a missing state, naming it."""
    opt = compat.base_optimizer(engine)
    target = compat.optimizer_kernel(opt)
    where = f"{ckpt.root}/{MANIFEST}"
    source = ckpt.manifest.optimizer
    groups = _effective_groups(opt, ckpt, where)
    algorithm = source["algorithm"] if source else target.algorithm
    # Adam and AdamW differ only in how weight decay is applied
    same_rule = {algorithm, target.algorithm} <= {"adam", "adamw"} and not any(g.get("weight_decay") for g in groups)
    if algorithm != target.algorithm and not same_rule:
        raise CheckpointError(
            where,
            f"saved by {source['class'] if source else '?'} ({algorithm}); this engine's {target.qualname} runs "
            f"{target.algorithm}: another algorithm's state cannot be carried over",
        )
    # a save that recorded no kernel (older, or plain DeepSpeed's) is taken to name states as the live kernel does
    aliases = source.get("states", {}) if source else target.states
    saved = {key: aliases.get(key, key) for key in _state_keys(ckpt)}  # saved name -> the algorithm's
    known = _ALGORITHM_STATES.get(target.algorithm)
    if known is not None and source and source.get("class") != target.qualname:
        # another kernel's extra state (DeepSpeed's CPU Lion allocates an unused exp_avg_sq) would only sit unused
        saved = {key: name for key, name in saved.items() if name in known}
    stepped = ckpt.manifest.counters.stepped
    missing = (_required(target.algorithm, groups) if stepped else set()) - set(saved.values())
    if missing:
        first = next((n for n, r in ckpt.params.items() if r.trainable), "?")
        raise CheckpointError(
            where,
            f"{first}: the checkpoint holds no {sorted(missing)[0]} state, which {target.qualname} needs; "
            "it would start from zero",
        )
    live_name = {v: k for k, v in target.states.items()}
    return StateMap(keys={live_name.get(c, c): key for key, c in saved.items()}, step=target.step)


def _step(value: Any, kind: compat.StepCount, device: Any, where: str) -> Any:
    """A saved step as the live kernel keeps it, the same count (torch's scalar dtype, as its optimizers make it)."""
    if kind is compat.StepCount.AS_SAVED:
        return value.clone() if isinstance(value, torch.Tensor) else value
    try:
        count = float(value.item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        raise CheckpointError(where, f"step {value!r} is not a count") from None
    if kind is compat.StepCount.INT:
        return int(count)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(count, dtype=dtype, device=device)


def _scalars(record_scalars: dict[str, Any], smap: StateMap, device: Any, where: str, group: int) -> dict[str, Any]:
    """A group's saved scalar states (`step` as the live kernel keeps it; none for SGD).

    A kernel that counts steps reads the count at its next step (torch's Adam: `state["step"]`), so moments without
    one are refused here rather than met as a `KeyError` inside `engine.step()`.
    """
    if smap.keys and smap.step in (compat.StepCount.TENSOR, compat.StepCount.INT) and "step" not in record_scalars:
        raise CheckpointError(
            where,
            f"param group {group} holds optimizer state ({', '.join(sorted(smap.keys.values()))}) but no step "
            "count, which the live optimizer needs to take its next step",
        )
    out = {}
    for key, raw in record_scalars.items():
        value = decode_value(raw)
        if key != "step":
            out[key] = value
        elif smap.step is not compat.StepCount.NONE:
            out[key] = _step(value, smap.step, device, where)
    return out


def _own(value: torch.Tensor) -> torch.Tensor:
    """`value`, or a copy when it is a view into a larger tensor (a reader's cached whole parameter), so that what a
    restore holds until its commit is no more than what it read."""
    if value.untyped_storage().nbytes() <= value.nbytes * 2:
        return value
    record_io(copied=value.nbytes)
    return value.clone()


def _copy(dest: torch.Tensor, value: torch.Tensor) -> None:
    """`dest.copy_(value)`, counted in `io.stats` (a load's memory traffic is measured, not assumed)."""
    dest.copy_(value)
    record_io(copied=value.nbytes)


@dataclass
class Staged:
    """What one rank read for a restore, held apart from the engine until every rank has read and checked its share.

    A load refused while reading (a damaged byte, a missing file, an error on another rank) then leaves the engine as
    it was. What is read is held in host memory, and the commit copies it into the engine's own tensors (optimizer
    states of the same shape included), so device memory never holds a second copy: per parameter of this rank's
    partition the host holds 4 bytes of fp32 master plus 4 per optimizer state (12 for Adam) until the commit.
    `copies` are (engine tensor, value read) pairs and `installs` put new optimizer state, hyperparameters,
    counters and the scheduler in place: both only touch memory. `refresh` runs last and may read again, but only
    bytes some rank has already read and checked: it rebuilds ZeRO-1/2's low-precision weights, whose other
    partitions are other ranks' (reading them is 3.5x faster on gloo than DeepSpeed's all-gather; elsewhere they
    are all-gathered after the commit: `refresh_by_gathering`).
    """

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    installs: list[Callable[[], None]] = field(default_factory=list)
    refresh: list[Callable[[], None]] = field(default_factory=list)
    client: dict[str, Any] = field(default_factory=dict)


def _host_like(flat: torch.Tensor) -> torch.Tensor:
    """A staging buffer for a state of `flat` in host memory: the device holds only the engine's own state, which
    the commit overwrites in place, so a restore needs no device memory beyond it. Not zero-filled: the reads fill
    it, and `_zero_uncovered` zeroes only the padding no parameter owns."""
    return torch.empty(flat.shape, dtype=flat.dtype, device="cpu")


def _zero_uncovered(bufs: dict[str, torch.Tensor], covered: list[tuple[int, int]]) -> None:
    """Zero what no (start, numel) range of `covered` fills in each staging buffer: the alignment padding of a flat
    partition, whose optimizer state a fresh optimizer holds as zeros."""
    for buf in bufs.values():
        flat, at = buf.view(-1), 0
        for start, numel in sorted(covered):
            if start > at:
                flat[at:start].zero_()
            at = max(at, start + numel)
        flat[at:].zero_()


def _state_install(
    optimizer: Any, group_index: int, key: torch.Tensor, ckpt: TensorReader, smap: StateMap, bufs: dict
) -> Callable[[], None]:
    """Putting one flat tensor's (or ZeRO-0 parameter's) new optimizer state in place; its scalars are checked now."""
    record = ckpt.manifest.param_groups[group_index]
    device = compat.scalar_device(optimizer.param_groups[group_index], key)
    scalars = _scalars(record.scalars, smap, device, f"{ckpt.root}/{MANIFEST}", group_index)

    def install() -> None:
        state = optimizer.state[key]
        # a live state tensor of the same shape is written in place: an NVMe swapper writes back the tensors it holds
        kept = {
            k: v
            for k, v in state.items()
            if k in bufs and torch.is_tensor(v) and v.shape == bufs[k].shape and v.dtype == bufs[k].dtype
        }
        state.clear()
        state.update(scalars)
        for k, buf in bufs.items():
            if k in kept:
                _copy(kept[k], buf)
                state[k] = kept[k]
            else:  # a fresh engine's state: the staged buffer itself on the CPU, moved once to a device
                state[k] = buf.to(key.device)
                record_io(copied=0 if state[k] is buf else buf.nbytes)

    return install


def _apply_hyperparams(engine: Engine, ckpt: TensorReader) -> None:
    """The saved groups' hyperparameters, where the live groups have them (another kernel's own are left out)."""
    for group, record in zip(compat.base_optimizer(engine).param_groups, ckpt.manifest.param_groups):
        group.update({k: v for k, v in _saved_hyperparams(record).items() if k in group})


def _state_keys(ckpt: TensorReader) -> list[str]:
    for rec in ckpt.params.values():
        if rec.trainable:
            return [k for k in rec.keys if k != FP32]
    return []


def _reader(ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam]) -> Any:
    """read(param, key, start, numel, out=None): a flat range of this rank's share (tensor- or expert-parallel) of a
    state; with `out`, filled in place, possibly only when the enclosing `ckpt.batch()` ends."""

    def read(p: torch.nn.Parameter, key: str, start: int, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        info = live[p]
        return ckpt.read_local(info.name, key, info.layout, info.shape, info.rank, info.size, start, numel, out)

    return read


def _stage_zero12(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], smap: StateMap | None, out: Staged
) -> None:
    opt = engine.optimizer
    groups = compat.zero12_groups(opt)
    read = _reader(ckpt, live)
    keys = smap.keys if smap is not None else {}
    for i, group in enumerate(groups):
        bufs = {k: _host_like(group.fp32) for k in keys}
        covered = []
        with ckpt.batch():  # a partition's fragments of one source file are read in one request per run
            for lp in group.params:
                piece = compat.zero12_fragment(lp)
                if piece is None:
                    continue
                value = torch.empty(piece.numel, dtype=torch.float32)
                out.copies.append((piece.fp32.data, read(lp, FP32, piece.start, piece.numel, value)))
                for k, saved in keys.items():
                    read(lp, saved, piece.start, piece.numel, bufs[k].narrow(0, piece.offset, piece.numel))
                covered.append((piece.offset, piece.numel))
        _zero_uncovered(bufs, covered)
        if smap is not None:
            out.installs.append(_state_install(opt.optimizer, i, group.fp32, ckpt, smap, bufs))
    if smap is not None:
        out.installs.append(lambda: compat.relink_optimizer_states(opt))
    if refresh_by_gathering(engine):
        return  # after the commit, on every rank at once (`restore`)

    def refresh() -> None:
        # Each rank rebuilds its whole low-precision weights, as DeepSpeed's native load reads the full model-states
        # file, instead of update_lp_params' all-gather of every partition (on gloo that all-gather was 2.3 s of a
        # 3.1 s restore at 300M parameters). Its own fragment of each parameter comes from the fp32 partition just
        # committed; only the other ranks' fragments are read (bytes they read and checked). copy_ rounds exactly as
        # update_lp_params does. The reads of up to REFRESH_CHUNK bytes of parameters go out as one batch:
        # neighbouring parameters are one request, not a round trip each. Those fragments' owners compared them with
        # their tensor-parallel replicas while staging, before any rank committed: they are not compared again.
        with ckpt.replicas_compared():
            _refresh_from_reads(ckpt, groups, read)

    out.refresh.append(refresh)


def _refresh_from_reads(ckpt: TensorReader, groups: list[Any], read: Any) -> None:
    """Each low-precision weight of `groups` rebuilt: this rank's fragment from its fp32 partition, the rest read."""
    for group in groups:
        chunk: list[tuple[torch.nn.Parameter, torch.Tensor, list[tuple[int, int]], compat.OwnedFragment | None]] = []
        held = 0
        for index, lp in enumerate(group.params):
            fragment = compat.zero12_fragment(lp)
            others = _others(lp.numel(), fragment)
            buf = torch.empty(lp.numel() if others else 0, dtype=torch.float32)
            chunk.append((lp, buf, others, fragment))
            held += sum(count for _, count in others) * 4
            if held < REFRESH_CHUNK and index + 1 < len(group.params):
                continue
            with ckpt.batch():
                for param, buf, others, _ in chunk:
                    for first, count in others:
                        read(param, FP32, first, count, buf.narrow(0, first, count))
            for param, buf, others, fragment in chunk:
                dest = param.data.view(-1)
                for first, count in others:
                    _copy(dest.narrow(0, first, count), buf.narrow(0, first, count))
                if fragment is not None:
                    _copy(dest.narrow(0, fragment.start, fragment.numel), fragment.fp32.view(-1))
            chunk, held = [], 0


def _others(numel: int, fragment: compat.OwnedFragment | None) -> list[tuple[int, int]]:
    """The (first, count) element ranges of a parameter of `numel` elements outside the fragment this rank owns
    (`compat.zero12_fragment`)."""
    if fragment is None:
        return [(0, numel)] if numel else []
    first, count = fragment.start, fragment.numel
    return [(a, b - a) for a, b in ((0, first), (first + count, numel)) if b > a]


REFRESH_CHUNK = 64 << 20
"""Bytes of fp32 masters a read refresh holds at once: its reads are merged, and its memory stays bounded."""


def refresh_by_gathering(engine: Engine) -> bool:
    """Whether a ZeRO-1/2 restore rebuilds the low-precision weights by all-gathering the partitions (the
    `refresh` option) rather than reading the rank's whole share of fp32 masters again."""
    if int(engine.zero_optimization_stage()) not in (1, 2) and not compat.is_bf16_optimizer(engine.optimizer):
        return False
    if not compat.trains(engine):  # its weights were written whole
        return False
    options = attached_options(engine)
    mode = options.refresh if options is not None else "auto"
    return mode == "gather" or (mode == "auto" and dist.get_backend() != "gloo")


def _stage_whole(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], smap: StateMap | None, out: Staged
) -> None:
    """ZeRO-0 fp32: DeepSpeed steps a torch optimizer on the parameters themselves, which are the fp32 masters.
    Each parameter gets its own step (torch's kernels step it in place)."""
    opt = engine.optimizer
    read = _reader(ckpt, live)
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            out.copies.append((p.data, _own(read(p, FP32, 0, p.numel())).view(p.shape)))
            if smap is not None:
                bufs = {k: read(p, saved, 0, p.numel()).view(p.shape) for k, saved in smap.keys.items()}
                out.installs.append(_state_install(opt, g, p, ckpt, smap, {k: _own(v) for k, v in bufs.items()}))


def _restore_zero3_in_place(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], smap: StateMap | None
) -> None:
    """ZeRO-3 with NVMe optimizer offload: each sub-group is swapped in, written as it is read, and swapped out.
    Staging every sub-group in memory first is what NVMe offload exists to avoid, so this runs inside the commit,
    where a failure leaves the engine refusing to step or save until a load succeeds."""
    opt = engine.optimizer
    read = _reader(ckpt, live)
    keys = smap.keys if smap is not None else {}
    for index, sub in enumerate(compat.zero3_subgroups(opt)):
        with compat.zero3_resident(opt, index):
            staged = Staged()
            _stage_subgroup(opt, sub, read, keys, ckpt, smap, staged)
            commit(staged)


def _stage_subgroup(
    opt: Any, sub: Any, read: Any, keys: dict[str, str], ckpt: TensorReader, smap: StateMap | None, out: Staged
) -> None:
    flat = sub.fp32
    bufs = {k: _host_like(flat) for k in keys}
    covered = []
    with ckpt.batch():
        for p in sub.params:
            piece = compat.zero3_fragment(opt, p)
            value = torch.empty(piece.numel, dtype=torch.float32)
            out.copies.append((piece.fp32.data, read(p, FP32, piece.start, piece.numel, value)))
            for k, saved in keys.items():
                read(p, saved, piece.start, piece.numel, bufs[k].narrow(0, piece.offset, piece.numel))
            covered.append((piece.offset, piece.numel))
    _zero_uncovered(bufs, covered)
    if smap is not None:
        out.installs.append(_state_install(opt.optimizer, sub.group, flat, ckpt, smap, bufs))
    out.installs.append(lambda: _copy(sub.lp.data, flat.data))


def _stage_zero3(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], smap: StateMap | None, out: Staged
) -> None:
    opt = engine.optimizer
    read = _reader(ckpt, live)
    if compat.nvme_offload(engine):
        out.installs.append(lambda: _restore_zero3_in_place(engine, ckpt, live, smap))
    else:
        keys = smap.keys if smap is not None else {}
        for sub in compat.zero3_subgroups(opt):
            _stage_subgroup(opt, sub, read, keys, ckpt, smap, out)
    _stage_zero3_frozen(engine, ckpt, live, out)


def _weight(ckpt: TensorReader, name: str) -> str:
    """The saved tensor a parameter's weights come from: its fp32 master, or a frozen parameter's value."""
    return FP32 if ckpt.params[name].trainable else VALUE


def _stage_weights(engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], out: Staged) -> None:
    """An engine without an optimizer (`compat.trains`): only its module's weights, each rank its own, whole or its
    ZeRO-3 partition; the frozen parameters that a trained one's are read by `_stage_module_extras` and
    `_stage_zero3_frozen`."""
    read = _reader(ckpt, live)
    for p, info in live.items():
        if not p.requires_grad:
            continue
        if compat.is_zero3_param(p):
            part = compat.zero3_partition(p)
            value = _own(read(p, _weight(ckpt, info.name), part.start, part.numel))
            out.copies.append((part.tensor.data.narrow(0, 0, part.numel), value))
        else:
            out.copies.append((p.data, _own(read(p, _weight(ckpt, info.name), 0, p.numel())).view(p.shape)))


def _stage_zero3_frozen(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], out: Staged
) -> None:
    read = _reader(ckpt, live)
    for p in engine.module.parameters():
        if not p.requires_grad and compat.is_zero3_param(p) and live[p].name in ckpt.params:
            part = compat.zero3_partition(p)
            value = _own(read(p, _weight(ckpt, live[p].name), part.start, part.numel))
            out.copies.append((part.tensor.data.narrow(0, 0, part.numel), value))


def _stage_module_extras(
    engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam], out: Staged
) -> None:
    buffers = dict(engine.module.named_buffers())
    to_global = namer(engine)
    for name in compat.buffer_names(engine):
        out.copies.append((buffers[name].data, _own(ckpt.read_buffer(to_global(name)))))
    read = _reader(ckpt, live)
    for p in engine.module.parameters():
        if not p.requires_grad and not compat.is_zero3_param(p) and live[p].name in ckpt.params:
            out.copies.append((p.data, _own(read(p, _weight(ckpt, live[p].name), 0, p.numel())).view(p.shape)))


def _stage_training_state(engine: Engine, ckpt: TensorReader, load_lr_scheduler_states: bool, out: Staged) -> None:
    counters = ckpt.manifest.counters
    state = ckpt.load_state()
    scheduler = state.get("lr_scheduler") if load_lr_scheduler_states and engine.lr_scheduler is not None else None
    wrapper = {
        key: compat.rebuild(value)
        for key, value in wrapper_state(ckpt, engine_dtype(engine), state).items()
        if hasattr(engine.optimizer, key)
    }
    # where the data stands: DeepSpeed's sampler keeps one global position, which any data-parallel size continues
    sampler, position, rng = compat.data_sampler(engine), state.get("data_sampler"), state.get("data_sampler_rng")
    if sampler is not None and position is not None:  # refused here, not in the commit: the engine stays as it was
        compat.check_sampler(sampler, position, rng)

    def install() -> None:
        engine.global_steps = counters.global_steps
        engine.global_samples = counters.global_samples * compat.sample_copies(engine)  # counted as DeepSpeed does
        engine.skipped_steps = counters.skipped_steps
        if scheduler is not None:
            engine.lr_scheduler.load_state_dict(scheduler)
        for key, value in wrapper.items():
            setattr(engine.optimizer, key, value)
        if sampler is not None and position is not None:
            compat.restore_sampler(sampler, position, rng)

    out.installs.append(install)
    out.client = client_state(engine, ckpt, state)


def client_state(engine: Engine, ckpt: TensorReader, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's client state. DeepSpeed saves one per model-parallel rank (Megatron-DeepSpeed keeps each rank's
    RNG streams there): a rank that keeps its role, because the tensor- and pipeline-parallel sizes are unchanged,
    gets its own rank's. At other sizes every rank gets model-parallel rank 0's, with the random states in it
    re-seeded for the rank's role (`runtime.rng`); other entries that differed between the saved ranks are named in
    a warning, since no rank's own value can follow it."""
    per_rank = state.get("client_states") or []
    saved = ckpt.manifest.source.topology
    live = topology(engine)
    index = int(engine.checkpoint_mp_rank)
    if (saved.tp, saved.pp) == (live.tp, live.pp) and index < len(per_rank):
        return per_rank[index]
    first = state.get("client_state", {})
    mp = model_parallel(engine)
    role = rng.Role(mp.pp_rank, mp.tp_rank, max((r for _, r in expert_groups(engine).values()), default=0))
    mine = rng.reseeded(first, role, f"{ckpt.root}/{MANIFEST}")
    if dist.get_rank() != 0:  # the same warning on every rank: only one reads every rank's client state for it
        return mine
    varying = sorted(
        {
            k
            for other in per_rank[1:]
            for k in first
            if k not in rng.RNG_KEYS and not rng.holds_rng(first[k]) and not _same_value(first[k], other.get(k))
        }
    )
    if varying:
        log.warning(
            "ucp: client_state entries %s differ between the saved model-parallel ranks; at this tensor/pipeline-"
            "parallel size every rank gets model-parallel rank 0's",
            varying,
        )
    return mine


def _same_value(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return False


def wrapper_state(ckpt: TensorReader, live_dtype: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The saved loss scaler and clipping state, if it belongs to the live precision: an fp16 run's dynamic loss
    scale means nothing to a bf16 or fp32 one (whose own scaler stays as built)."""
    if ckpt.manifest.source.topology.dtype != live_dtype:
        return {}
    return dict((state if state is not None else ckpt.load_state()).get("optimizer_wrapper", {}))


def stage(
    engine: Engine,
    ckpt: TensorReader,
    live: dict[torch.nn.Parameter, LiveParam],
    smap: StateMap | None,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> Staged:
    """Read everything this rank restores into memory apart from the engine, which is not touched."""
    out = Staged()
    stage3 = int(engine.zero_optimization_stage()) == 3
    if not compat.trains(engine):  # no flat partitions to fill (BF16_Optimizer builds none over a DummyOptim)
        _stage_weights(engine, ckpt, live, out)
        if stage3:
            _stage_zero3_frozen(engine, ckpt, live, out)
    elif stage3:
        _stage_zero3(engine, ckpt, live, smap, out)
    elif compat.is_unpartitioned(engine):
        _stage_whole(engine, ckpt, live, smap, out)
    else:
        _stage_zero12(engine, ckpt, live, smap, out)
    if smap is not None:
        out.installs.append(lambda: _apply_hyperparams(engine, ckpt))
    _stage_module_extras(engine, ckpt, live, out)
    if not load_module_only:
        _stage_training_state(engine, ckpt, load_lr_scheduler_states, out)
    else:  # the user's client state all the same, as DeepSpeed's own module-only load returns it (Lightning reads it)
        out.client = client_state(engine, ckpt, ckpt.load_state())
    return out


def commit(staged: Staged) -> None:
    """Write what `stage` read into the engine: copies, then installs, then the refresh."""
    for dest, value in staged.copies:
        _copy(dest, value)
    staged.copies.clear()  # the values read are in the engine now: free them before the refresh reads again
    for install in staged.installs:
        install()
    for refresh in staged.refresh:
        refresh()


def _under_live_names(engine: Engine, ckpt: TensorReader, live: dict[torch.nn.Parameter, LiveParam]) -> TensorReader:
    """The checkpoint as this engine names its tensors: itself, or, where AutoEP is on at one end of the resume and
    off at the other, `ExpertNames` over it."""
    derived = derivations([info.name for info in live.values()], ckpt.params)
    if not derived:
        return ckpt
    groups = {live[p].name: g for p, g in param_groups(engine).items()}
    return ExpertNames(ckpt, derived, groups, len(compat.base_optimizer(engine).param_groups))


def restore(
    engine: Engine,
    ckpt: TensorReader,
    flags: LoadFlags | None = None,
    *,
    check_reads: Callable[[], None] | None = None,
    gate: Gate | None = None,
) -> dict[str, Any]:
    """Load a universal checkpoint into `engine` at its current layout, all or nothing; return the client state.

    Every rank reads its share apart from the engine (`stage`); `check_reads` (collective) then checks what all
    ranks read where the reader checks it afterwards; only when every rank has succeeded is anything written
    (`commit`). Ranks read different parts of the checkpoint, so a damaged block may fail on some ranks only: the
    first failure is raised on all ranks, with the engine as it was. A failure inside the commit (out of memory,
    or the NVMe path, which cannot stage) leaves `gate` closed: the engine refuses to step or save until a load
    succeeds. `flags` says what to restore, as `load_checkpoint`'s arguments do (everything, by default).
    """
    flags = flags or LoadFlags()
    live = guarded(lambda: live_params(engine))
    ckpt = guarded(lambda: _under_live_names(engine, ckpt, live))
    check_compatible(engine, ckpt, live, flags.module_only)
    # an import (e.g. from Hugging Face) carries weights only: the optimizer starts fresh
    load_optimizer_states = flags.optimizer_states and not flags.module_only and not ckpt.manifest.weights_only
    smap = guarded(lambda: state_map(engine, ckpt)) if load_optimizer_states else None
    staged = guarded(lambda: stage(engine, ckpt, live, smap, flags.lr_scheduler_states, flags.module_only))
    if check_reads is not None:
        check_reads()
    with (gate or Gate()).writing(ckpt.root):
        guarded(lambda: commit(staged))
        if int(engine.zero_optimization_stage()) == 3:
            compat.zero3_regather(engine.optimizer)  # persistent parameters from the new partitions (collective)
        elif refresh_by_gathering(engine):
            compat.update_lp_params(engine.optimizer)  # collective: outside `guarded`, which every rank has passed
    return staged.client
