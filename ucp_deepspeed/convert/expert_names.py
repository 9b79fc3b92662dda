"""AutoEP on at one end of a resume and off at the other: a checkpoint's tensors under the loading model's names.

DeepSpeed's AutoEP replaces a Hugging Face MoE block with a layer of its own, and the universal format keeps the
names of the job that saved. A job that turns AutoEP on or off reads the checkpoint through `ExpertNames`, which
presents each tensor as the loading module names it (per MoE block `P`, e.g. `model.layers.0.mlp.`):

    Hugging Face (AutoEP off)                    AutoEP
    P.experts.gate_up_proj  [E, 2F, H]           P.experts.w1 [E, F, H] (gate) over P.experts.w3 (up), on dim 1
    P.experts.down_proj     [E, H, F]            P.experts.w2
    P.gate.weight                                P.router.gate.weight

the same layouts DeepSpeed's own repacking converts between (`deepspeed/moe/ep_repack.py`, its "gate_up_first"
layout; the transposed one is refused by shape). The optimizer groups follow the loading engine: AutoEP gives the
experts a group of their own (`ep_size_<E>`). Each live group takes the saved group its parameters came from; one
that would gather parameters from saved groups with different hyperparameters or steps is refused, as no single
group could carry both.

A derived tensor is never assembled whole: a range of it is read as the runs of the saved tensors it is made of
(per expert, the gate's rows then the up's), so a read holds no more than what it returns, whatever the experts'
size; the names that need no derivation read straight through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import GroupRecord, ParamRecord
from ucp_deepspeed.format.universal import TensorReader
from ucp_deepspeed.geometry.layout import Layout

_NOT_HYPERPARAMS = ("name", "moe")
"""Group entries that name DeepSpeed's MoE groups, not what the optimizer computes."""


@dataclass(frozen=True)
class Derived:
    """A tensor of the loading model made of saved ones: `sources` concatenated along `dim`, or one source's run of
    `length` entries from `start` along `dim` (`length` 0: all of it)."""

    sources: tuple[str, ...]
    dim: int = 0
    start: int = 0
    length: int = 0


_RENAMED = {
    "experts.gate_up_proj": ("experts.w1", "experts.w3"),
    "experts.down_proj": ("experts.w2",),
    "gate.weight": ("router.gate.weight",),
    "experts.w2": ("experts.down_proj",),
    "router.gate.weight": ("gate.weight",),
}
"""A MoE block's tensor under one module's name -> the other's, stacked on dim 1 where there are two."""
_HALVES = {"experts.w1": 0, "experts.w3": 1}
"""AutoEP's gate and up stacks: which half of Hugging Face's fused `experts.gate_up_proj` along dim 1."""
_NAME = re.compile(r"(.*?\.)(experts\.(?:gate_up_proj|down_proj|w1|w2|w3)|gate\.weight|router\.gate\.weight)")


def derivations(live: Sequence[str], saved: dict[str, ParamRecord]) -> dict[str, Derived]:
    """The live names the checkpoint lacks that are an AutoEP (or Hugging Face) MoE block's tensors under the other
    module's names, and how each is made."""
    out: dict[str, Derived] = {}
    for name in live:
        m = _NAME.fullmatch(name) if name not in saved else None
        if m is None:
            continue
        block, leaf = m.groups()
        fused = saved.get(f"{block}experts.gate_up_proj")
        if leaf in _HALVES and fused is not None and len(fused.shape) == 3:
            half = fused.shape[1] // 2
            derived = Derived((f"{block}experts.gate_up_proj",), dim=1, start=_HALVES[leaf] * half, length=half)
        elif leaf in _RENAMED:
            sources = tuple(block + other for other in _RENAMED[leaf])
            derived = Derived(sources, dim=1 if len(sources) > 1 else 0)
        else:
            continue
        if all(s in saved for s in derived.sources):
            out[name] = derived
    return out


class ExpertNames(TensorReader):
    """A checkpoint read under the loading model's MoE names (see the module docstring).

    Args:
        inner: the checkpoint as saved.
        derived: `derivations(...)` for the loading model.
        live_groups: each live trainable parameter's optimizer group, by global name.
        group_count: how many param groups the live optimizer has.

    Example:
        view = ExpertNames(ckpt, derivations(names, ckpt.params), groups, len(optimizer.param_groups))
    """

    def __init__(self, inner: TensorReader, derived: dict[str, Derived], live_groups: dict[str, int], group_count: int):
        self.inner, self.derived = inner, derived
        self.root = inner.root
        where = f"{inner.root}: AutoEP on at one end and off at the other"
        consumed = {s for d in derived.values() for s in d.sources}
        params = {n: r for n, r in inner.params.items() if n not in consumed}
        for name, d in derived.items():
            first = inner.params[d.sources[0]]
            shapes = [inner.params[s].shape for s in d.sources]
            shape = list(first.shape)
            if len(d.sources) > 1:
                if any(len(s) != len(shape) or _without(s, d.dim) != _without(shape, d.dim) for s in shapes):
                    raise CheckpointError(where, f"{name}: {d.sources} have shapes {shapes} that do not stack")
                shape[d.dim] = sum(s[d.dim] for s in shapes)
            elif d.length:
                shape[d.dim] = d.length
            if len({inner.params[s].group for s in d.sources}) != 1:
                raise CheckpointError(where, f"{name}: {d.sources} were in different param groups")
            params[name] = dataclasses.replace(first, shape=tuple(shape), file="")
        groups = _regroup(inner, params, live_groups, group_count, where)
        self.params = {
            n: dataclasses.replace(r, group=live_groups.get(n, r.group)) if r.trainable else r
            for n, r in params.items()
        }
        self.manifest = dataclasses.replace(inner.manifest, params=self.params, param_groups=groups)
        self.buffers = inner.buffers

    def _segments(self, name: str) -> tuple[int, list[tuple[str, int, int, int]]]:
        """A derived tensor as runs of its saved ones: the elements of one index of the dims before `dim` (a row),
        and per row its segments in order, each (saved tensor, where in the saved tensor's row it starts, elements,
        the saved tensor's row)."""
        d = self.derived[name]
        trailing = math.prod(self.params[name].shape[d.dim + 1 :])
        saved = [self.inner.params[s].shape[d.dim] * trailing for s in d.sources]
        if d.length:
            return d.length * trailing, [(d.sources[0], d.start * trailing, d.length * trailing, saved[0])]
        return sum(saved), [(s, 0, n, n) for s, n in zip(d.sources, saved)]

    def _runs(self, name: str, start: int, numel: int) -> Iterator[tuple[str, int, int]]:
        """Elements [start, start+numel) of derived tensor `name`, flattened, as (saved tensor, start, elements)
        runs in order."""
        row, segments = self._segments(name)
        end = start + numel
        for r in range(start // row, -(-end // row)):
            at = r * row
            for source, offset, count, saved_row in segments:
                lo, hi = max(start, at), min(end, at + count)
                if lo < hi:
                    yield source, r * saved_row + offset + lo - at, hi - lo
                at += count

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state, flattened."""
        if name not in self.derived:
            return self.inner.read(name, key, start, numel)
        numel = math.prod(self.params[name].shape) - start if numel is None else numel
        runs = list(self._runs(name, start, numel)) if numel else [(self.derived[name].sources[0], 0, 0)]
        if len(runs) == 1:
            source, first, count = runs[0]
            return self.inner.read(source, key, first, count)
        out: torch.Tensor | None = None
        at = 0
        for source, first, count in runs:  # one run held at a time beside what is returned
            part = self.inner.read(source, key, first, count)
            out = torch.empty(numel, dtype=part.dtype) if out is None else out
            out[at : at + count] = part
            at += count
        assert out is not None  # two runs or more
        return out

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """A run of `length` entries from `start` along `dim`."""
        if name not in self.derived:
            return self.inner.read_slice(name, key, dim, start, length)
        d = self.derived[name]
        if dim != d.dim:  # slicing commutes with the stacking: slice each saved tensor, then stack or cut
            parts = [self.inner.read_slice(s, key, dim, start, length) for s in d.sources]
            whole = torch.cat(parts, dim=d.dim) if len(parts) > 1 else parts[0]
            return whole.narrow(d.dim, d.start, d.length).contiguous() if d.length else whole
        if d.length:
            return self.inner.read_slice(d.sources[0], key, dim, d.start + start, length)
        parts, at = [], 0
        for source in d.sources:
            extent = self.inner.params[source].shape[dim]
            lo, hi = max(start, at), min(start + length, at + extent)
            if lo < hi:
                parts.append(self.inner.read_slice(source, key, dim, lo - at, hi - lo))
            at += extent
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]

    def read_local(
        self,
        name: str,
        key: str,
        layout: Layout,
        local_shape: Sequence[int],
        rank: int,
        tp: int,
        start: int = 0,
        numel: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A range of a rank's share: the saved tensors' own fast reads, a derived one cut from its whole."""
        if name not in self.derived:
            return self.inner.read_local(name, key, layout, local_shape, rank, tp, start, numel, out)
        return super().read_local(name, key, layout, local_shape, rank, tp, start, numel, out)

    def read_buffer(self, name: str) -> torch.Tensor:
        """A persistent buffer, as saved."""
        return self.inner.read_buffer(name)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The saved checkpoint's batching of reads."""
        with self.inner.batch():
            yield

    def load_state(self) -> dict[str, Any]:
        """The training state, as saved."""
        return self.inner.load_state()

    def close(self) -> None:
        """Close the saved checkpoint."""
        self.inner.close()


def _without(shape: Sequence[int], dim: int) -> list[int]:
    return [n for d, n in enumerate(shape) if d != dim]


def _regroup(
    inner: TensorReader, params: dict[str, ParamRecord], live: dict[str, int], count: int, where: str
) -> tuple[GroupRecord, ...]:
    """The saved group each live group's parameters came from; refused when they came from groups that differ."""
    saved = inner.manifest.param_groups
    taken: dict[int, int] = {}
    for name, record in params.items():
        if not record.trainable or name not in live or record.group is None:
            continue
        group = taken.setdefault(live[name], record.group)
        if group != record.group and not _same(saved[group], saved[record.group]):
            raise CheckpointError(
                where,
                f"{name}: param group {live[name]} of this engine gathers saved groups {group} and {record.group}, "
                "whose hyperparameters or steps differ",
            )
        taken[live[name]] = min(group, record.group)  # the dense group's record, not a copy named for the experts
    if sorted(taken) != list(range(count)):
        raise CheckpointError(where, f"this engine's param groups {sorted(set(range(count)) - set(taken))} get none")
    return tuple(saved[taken[g]] for g in range(count))


def _same(a: GroupRecord, b: GroupRecord) -> bool:
    """Whether two saved groups compute the same update (names of DeepSpeed's MoE groups aside)."""

    def kept(record: GroupRecord) -> dict[str, Any]:
        return {k: v for k, v in (record.hyperparams or {}).items() if k not in _NOT_HYPERPARAMS}

    return kept(a) == kept(b) and a.scalars == b.scalars
