"""Check a tag's metadata against DeepSpeed's own files before a byte is converted.

Our metadata says where each parameter sits in the flat partitions; DeepSpeed's files say it too,
in their own words: `param_shapes`, `buffer_names` and `frozen_param_shapes` in the model states,
flat partition sizes, `partition_count`, `zero_stage` and (ZeRO-1/2) `param_slice_mappings` in each
optimizer file. Every statement both make must agree, and every optimizer file of a tag must be at
the same optimizer step. Only pickles are read, never tensor bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32, SaveMeta
from ucp_deepspeed.geometry.fragments import rank_fragment, saved_numel
from ucp_deepspeed.sources.model_states import ModelStatesFile
from ucp_deepspeed.sources.optim_file import OptimRankFile

_MAX_LISTED = 6


def _shapes(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _listed(items: Sequence[Any]) -> str:
    shown = ", ".join(map(str, list(items)[:_MAX_LISTED]))
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def check_model_states(meta: SaveMeta, states: ModelStatesFile, mp_size: int) -> list[str]:
    """Contradictions between one model-parallel rank's metadata and a model-states file."""
    topo = meta.topology
    problems = []
    dp = states.entry("dp_world_size")
    if dp is not None and int(dp) != topo.dp:
        problems.append(f"dp_world_size is {dp}, metadata says dp={topo.dp}")
    mp = states.entry("mp_world_size")
    if mp is not None and int(mp) != mp_size:
        problems.append(f"mp_world_size is {mp}, metadata describes {mp_size} model-parallel ranks")
    config = states.entry("ds_config") or {}
    stage = (config.get("zero_optimization") or {}).get("stage") if isinstance(config, dict) else None
    if stage is not None and int(stage) != topo.zero_stage:
        problems.append(f"ds_config has ZeRO stage {stage}, metadata says {topo.zero_stage}")
    for name in ("bf16", "fp16"):
        enabled = bool((config.get(name) or {}).get("enabled")) if isinstance(config, dict) else False
        if enabled != (topo.dtype == name):
            problems.append(f"ds_config has {name} {'on' if enabled else 'off'}, metadata says {topo.dtype}")
    version = states.entry("ds_version")
    if version is not None and meta.versions.get("deepspeed") and str(version) != meta.versions["deepspeed"]:
        problems.append(f"written by DeepSpeed {version}, metadata says {meta.versions['deepspeed']}")
    saved = states.entry("param_shapes")
    if saved is not None:
        theirs = {(i, n, _shapes(s)) for i, group in enumerate(saved) for n, s in group.items()}
        params = {(s.flat, s.local or s.name, tuple(s.shape)) for s in meta.params}
        if theirs != params:
            detail = [f"{n} {list(s)} in flat {i}" for i, n, s in sorted(params - theirs)]
            other = [f"{n} {list(s)} in flat {i}" for i, n, s in sorted(theirs - params)]
            problems.append(
                "param_shapes disagrees with the metadata: metadata has "
                + (_listed(detail) or "nothing")
                + "; the file has "
                + (_listed(other) or "nothing")
                + " instead"
            )
    buffers = states.entry("buffer_names")
    if buffers is not None:
        named = {e.local_name for e in meta.extras if e.kind == "buffer"}
        if set(buffers) != named:
            problems.append(f"buffer_names {sorted(buffers)} disagree with the metadata's buffers {sorted(named)}")
    frozen = states.entry("frozen_param_shapes")
    if frozen is not None:
        saved_frozen = {(n, _shapes(s)) for n, s in frozen.items()}
        ours = {(e.local_name, tuple(e.shape)) for e in meta.extras if e.kind == "frozen"}
        if saved_frozen != ours:
            problems.append(
                f"frozen_param_shapes {_listed(sorted(saved_frozen))} disagree with the metadata's frozen "
                f"parameters {_listed(sorted(ours))}"
            )
    return problems


def check_whole(meta: SaveMeta, states: ModelStatesFile) -> list[str]:
    """ZeRO-0 fp32: every parameter the metadata places has its states, shaped like it, in the saved optimizer."""
    problems = []
    try:
        keys = states.optimizer_state_keys()
        groups, _ = states.optimizer_groups()
    except CheckpointError as exc:
        return [exc.reason]
    if len(groups) != meta.num_groups:
        problems.append(f"optimizer has {len(groups)} param groups, metadata says {meta.num_groups}")
    indices = states.optimizer_group_indices()
    for slot in meta.params:
        if slot.group >= len(indices) or slot.flat not in indices[slot.group]:
            problems.append(f"'{slot.name}' is entry {slot.flat} of group {slot.group}, which the optimizer lacks")
            continue
        for key in keys:
            try:
                shape = tuple(states.optimizer_state(slot.flat, key).shape)
            except CheckpointError as exc:
                problems.append(exc.reason)
                break
            if shape != tuple(slot.shape):
                problems.append(
                    f"state {key} of parameter {slot.flat} ('{slot.name}') is {list(shape)}, "
                    f"metadata says {list(slot.shape)}"
                )
    # one step per group is what a universal checkpoint keeps: a parameter left behind (never given a gradient)
    # would be silently moved to its group's step
    for g, members in enumerate(indices):
        steps = {repr(states.optimizer_scalars(i).get("step")) for i in members}
        if len(steps) > 1:
            problems.append(f"the parameters of param group {g} are at different optimizer steps: {sorted(steps)}")
    return problems


@dataclass(frozen=True)
class FlatLayout:
    """What the metadata says of one flat buffer across a model-parallel rank's files, worked out once for all of
    them: checking each of a thousand files against every parameter would be quadratic in the tag's size."""

    slots: tuple[Any, ...]
    end: int
    """Element after the last parameter in the flat buffer."""
    partitions: frozenset[int]
    owners: frozenset[int]
    """Data-parallel sizes the metadata partitions it over."""
    overlaps: tuple[str, ...]
    """Parameters the metadata places over one another (ZeRO-1/2)."""
    by_position: dict[int, tuple[Any, ...]]
    """ZeRO-1/2: the parameters with elements in each partition."""


def flat_layouts(meta: SaveMeta) -> dict[int, FlatLayout]:
    """Per flat buffer, its `FlatLayout`: O(parameters + partitions they overlap)."""
    grouped: dict[int, list[Any]] = {}
    for slot in meta.params:
        grouped.setdefault(slot.flat, []).append(slot)
    return {index: _layout(meta, index, slots) for index, slots in grouped.items()}


def _layout(meta: SaveMeta, index: int, slots: list[Any]) -> FlatLayout:
    """One flat buffer's `FlatLayout`, from the parameters the metadata places in it."""
    spans = sorted((s.offset, s.offset + s.numel, s.name) for s in slots)
    overlaps = tuple(
        f"flat {index}: metadata overlaps {a} and {b}"
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:])
        if start_b < end_a
    )
    by_position: dict[int, list[Any]] = {}
    if meta.topology.zero_stage != 3:
        for slot in slots:
            if slot.partition > 0 and slot.numel > 0:
                first, last = slot.offset // slot.partition, (slot.offset + slot.numel - 1) // slot.partition
                for k in range(first, last + 1):
                    by_position.setdefault(k, []).append(slot)
    return FlatLayout(
        tuple(slots),
        max(s.offset + s.numel for s in slots),
        frozenset(s.partition for s in slots),
        frozenset(len(s.ranks) or meta.topology.dp for s in slots),
        overlaps,
        {k: tuple(v) for k, v in by_position.items()},
    )


def check_optim(
    meta: SaveMeta,
    optim: OptimRankFile,
    rank: int,
    layouts: dict[int, FlatLayout] | None = None,
) -> list[str]:
    """Contradictions between one model-parallel rank's metadata and data-parallel rank `rank`'s optimizer file;
    `layouts` is `flat_layouts(meta)`, made once when checking many files."""
    topo = meta.topology
    layouts = flat_layouts(meta) if layouts is None else layouts
    problems = []
    stage = optim.entry("zero_stage")
    if stage is not None and int(stage) != topo.zero_stage:
        problems.append(f"zero_stage is {stage}, metadata says {topo.zero_stage}")
    flats = {}
    for index, layout in layouts.items():
        held = [s for s in layout.slots if not s.ranks or rank in s.ranks]
        if len(held) == len(layout.slots):
            flats[index] = layout
        elif held:  # a flat whose parameters live in different files (experts): worked out for this file alone
            flats[index] = _layout(meta, index, held)
    if flats and max(flats) >= optim.num_flat:
        return problems + [f"{optim.num_flat} flat buffers, metadata places parameters in flat {max(flats)}"]
    counts = optim.entry("partition_count")
    mappings = optim.entry("param_slice_mappings") if topo.zero_stage < 3 else None
    for index, layout in sorted(flats.items()):
        slots = layout.slots
        size = optim.flat(index, FP32).shape[0]
        mine: tuple[Any, ...] = slots
        if topo.zero_stage == 3:
            need = sum(s.partition for s in slots)
            if need != size:
                problems.append(f"flat {index} holds {size} elements, metadata's partitions of its parameters {need}")
        else:
            files = slots[0].ranks or range(topo.dp)
            position = files.index(rank)
            expected = saved_numel(layout.end, min(layout.partitions), position, topo.padded)
            if len(layout.partitions) != 1 or size != expected:
                problems.append(
                    f"flat {index} holds {size} elements, metadata says {expected} (partitions of "
                    f"{sorted(layout.partitions)}, parameters up to element {layout.end})"
                )
            mine = layout.by_position.get(position, ())
            frags = [rank_fragment(s, topo.zero_stage, topo.dp, rank) for s in mine]
            ends = [f.src + f.numel for f in frags if f is not None]
            if ends and max(ends) > size:
                problems.append(
                    f"flat {index}: metadata places parameters up to element {max(ends)} of this rank's {size}"
                )
            problems += layout.overlaps
        if isinstance(counts, list) and index < len(counts) and int(counts[index]) not in layout.owners:
            problems.append(
                f"partition_count of flat {index} is {counts[index]}, metadata partitions it over "
                f"{sorted(layout.owners)} ranks"
            )
        elif isinstance(counts, int) and counts != topo.dp:  # ZeRO-3's one count: the whole data-parallel world's
            problems.append(f"partition_count is {counts}, metadata says {topo.dp} data-parallel ranks")
        limit = size if topo.zero_stage == 3 else max(size, *layout.partitions)
        for key in optim.state_keys(index):  # ZeRO-1/2 may keep a state's alignment padding, not the fp32's
            if not size <= optim.flat(index, key).shape[0] <= limit:
                problems.append(
                    f"state {key} of flat {index} has {optim.flat(index, key).shape[0]} elements, "
                    f"the fp32 partition {size}"
                )
        if mappings is not None and index < len(mappings):
            problems += _check_mapping(list(mine), mappings[index] or {}, index, rank, topo.zero_stage, topo.dp)
    return problems


def _check_mapping(slots: list[Any], mapping: dict[str, Any], index: int, rank: int, stage: int, dp: int) -> list[str]:
    """ZeRO-1/2 files say where each parameter's fragment on this rank starts and how long it is."""
    expected = {
        slot.local or slot.name: (frag.numel, frag.src)
        for slot in slots
        for frag in [rank_fragment(slot, stage, dp, rank)]
        if frag is not None
    }
    found = {name: (int(a.numel), int(a.start)) for name, a in mapping.items()}
    if found == expected:
        return []
    wrong = sorted(n for n in set(found) | set(expected) if found.get(n) != expected.get(n))
    shown = [f"{n}: file {found.get(n)}, metadata {expected.get(n)}" for n in wrong]
    return [
        f"param_slice_mappings of flat {index} disagree with the metadata ((numel, start) on this rank): "
        + _listed(shown)
    ]


def check_steps(optims: Sequence[OptimRankFile]) -> list[str]:
    """Every data-parallel rank's optimizer file must be at the same step (same scalar state per flat)."""
    problems = []
    first = optims[0]
    for other in optims[1:]:
        for index in range(min(first.num_flat, other.num_flat)):
            a, b = _scalar(first.scalars(index).get("step")), _scalar(other.scalars(index).get("step"))
            if a is not None and b is not None and a != b:
                problems.append(
                    f"{other.path} is at optimizer step {b}, {first.path} at step {a}: "
                    "files from different steps of training"
                )
                break
    return problems


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fail(where: str, problems: list[str]) -> None:
    """Raise one error listing the contradictions found, if any."""
    if problems:
        raise CheckpointError(
            where,
            "disagrees with the tag's metadata or its other files: "
            + "; ".join(problems[:8])
            + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""),
        )
