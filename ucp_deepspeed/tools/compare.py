"""Compare two checkpoints of any topology, state by state: did a reshard or an export lose anything?

Either side may be a native DeepSpeed checkpoint (any ZeRO stage, TP/PP/EP; read through the same
merge as conversion), a universal folder, or a Check-N-Run tag (its chain replayed into a temporary
folder). Both are reduced to the full model's tensors by global name, so a TP2xPP2 checkpoint and
its DP4 reshard compare directly. One state of one parameter is in memory per side at a time.

For every parameter state and buffer both sides hold, the report gives the max absolute difference
and the max relative difference, taken against the largest magnitude in the first side's tensor
(so zeros do not blow it up). The step counters and each param group's hyperparameters and scalar
optimizer state (e.g. Adam's `step`) are compared as values.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ucp_deepspeed.convert.core import assemble, build_manifest
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import kind_of
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.paths import locate
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import NativeCheckpoint

Reader = Callable[[str, str], torch.Tensor]


@dataclass(frozen=True)
class StateDiff:
    """How one state of one tensor differs between the two checkpoints."""

    name: str
    key: str
    max_abs: float
    max_rel: float
    equal: bool
    note: str = ""


@dataclass(frozen=True)
class DiffReport:
    """Everything `diff` found."""

    states: tuple[StateDiff, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    values: tuple[str, ...]

    @property
    def identical(self) -> bool:
        """Same tensors (bit for bit), same names and keys, same counters and optimizer values."""
        return not self.only_a and not self.only_b and not self.values and all(s.equal for s in self.states)

    def within(self, atol: float) -> bool:
        """Same structure and values, and every tensor within `atol`."""
        return (
            not self.only_a
            and not self.only_b
            and not self.values
            and all(s.max_abs <= atol and not s.note for s in self.states)
        )


@contextlib.contextmanager
def opened(path: str, tag: str | None = None) -> Iterator[tuple[Manifest, Reader]]:
    """(manifest, read(name, key)) for any kind of checkpoint; a native tag's is the one a conversion would write."""
    found = locate(path, tag)
    kind = kind_of(found.path) if found.tag else None
    if kind is not None and found.tag is not None:  # e.g. a Check-N-Run chain, replayed into a scratch universal folder
        scratch = tempfile.mkdtemp(prefix="ucp_diff_")
        try:
            with opened(kind.materialize(found.root, found.tag, st.join(scratch, found.tag))) as result:
                yield result
        finally:
            st.delete(scratch)
        return
    if found.kind == "universal":
        with UniversalCheckpoint(found.path) as ckpt:

            def read_universal(name: str, key: str) -> torch.Tensor:
                if name in ckpt.buffers:
                    return ckpt.read_buffer(name)
                return ckpt.read(name, key).reshape(ckpt.params[name].shape)

            yield ckpt.manifest, read_universal
        return
    if found.kind != "native":
        raise CheckpointError(found.path, f"is a {found.kind} checkpoint, which `ucp diff` does not read")
    with NativeCheckpoint(found.root, found.tag) as src:
        tensors = {t.name: t for t in src.tensors}

        def read_native(name: str, key: str) -> torch.Tensor:
            t = tensors[name]
            return assemble(src, t, key) if t.kind == "param" else assemble(src, t)

        yield build_manifest(src), read_native
        src.check_reads()  # what was compared must be what was saved


def _entries(manifest: Manifest) -> dict[tuple[str, str], None]:
    out = {(name, key): None for name, rec in manifest.params.items() for key in rec.keys}
    out.update({(name, "buffer"): None for name in manifest.buffers})
    return out


def _compare(name: str, key: str, a: torch.Tensor, b: torch.Tensor) -> StateDiff:
    if tuple(a.shape) != tuple(b.shape):
        return StateDiff(name, key, float("inf"), float("inf"), False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    note = f"dtype {a.dtype} vs {b.dtype}" if a.dtype != b.dtype else ""
    equal = not note and torch.equal(a, b)
    if a.numel() == 0:
        return StateDiff(name, key, 0.0, 0.0, equal, note)
    fa, fb = a.double(), b.double()
    max_abs = float((fa - fb).abs().max())
    scale = float(fa.abs().max())
    return StateDiff(
        name, key, max_abs, max_abs / scale if scale else (0.0 if max_abs == 0 else float("inf")), equal, note
    )


def _value_differences(a: Manifest, b: Manifest) -> list[str]:
    out = []
    counters_a, counters_b = a.counters.encode(), b.counters.encode()
    for key, value in counters_a.items():
        if value != counters_b[key]:
            out.append(f"counter {key}: {value} vs {counters_b[key]}")
    if len(a.param_groups) != len(b.param_groups):
        out.append(f"param groups: {len(a.param_groups)} vs {len(b.param_groups)}")
    for i, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        for part, va, vb in (
            ("hyperparam", ga.hyperparams or {}, gb.hyperparams or {}),
            ("scalar", ga.scalars, gb.scalars),
        ):
            for key in sorted(set(va) | set(vb)):
                if va.get(key) != vb.get(key):
                    out.append(f"param group {i} {part} {key}: {va.get(key)} vs {vb.get(key)}")
    return out


def diff(
    path_a: str,
    path_b: str,
    tag_a: str | None = None,
    tag_b: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> DiffReport:
    """Compare every tensor state, counter and optimizer value of two checkpoints."""
    with opened(path_a, tag_a) as (man_a, read_a), opened(path_b, tag_b) as (man_b, read_b):
        entries_a, entries_b = _entries(man_a), _entries(man_b)
        states = []
        for name, key in entries_a:
            if (name, key) not in entries_b:
                continue
            if progress:
                progress(name)
            states.append(_compare(name, key, read_a(name, key), read_b(name, key)))
        return DiffReport(
            tuple(states),
            tuple(f"{n}:{k}" for n, k in entries_a if (n, k) not in entries_b),
            tuple(f"{n}:{k}" for n, k in entries_b if (n, k) not in entries_a),
            tuple(_value_differences(man_a, man_b)),
        )
