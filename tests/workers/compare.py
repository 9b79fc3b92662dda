"""Exact comparison of nested state snapshots, shared by the launch scripts' load checks."""

from __future__ import annotations

from typing import Any

import torch


def compare(ref: Any, got: Any, path: str = "") -> list[str]:
    """Exact comparison of nested snapshots; returns one line per difference."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor) or ref.dtype != got.dtype or ref.shape != got.shape:
            return [
                f"{path}: {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))} "
                f"vs saved {ref.dtype} {tuple(ref.shape)}"
            ]
        if not torch.equal(ref, got):
            return [f"{path}: max |diff| {(ref.double() - got.double()).abs().max().item():.3e}"]
        return []
    if isinstance(ref, dict):
        if set(ref) != set(got):
            return [f"{path}: keys {sorted(map(str, got))} vs saved {sorted(map(str, ref))}"]
        return [d for k in ref for d in compare(ref[k], got[k], f"{path}/{k}")]
    if isinstance(ref, (list, tuple)):
        if len(ref) != len(got) or type(ref) is not type(got):
            return [f"{path}: {got!r} vs saved {ref!r}"]
        return [d for i, (a, b) in enumerate(zip(ref, got)) for d in compare(a, b, f"{path}[{i}]")]
    return [] if ref == got else [f"{path}: {got!r} vs saved {ref!r}"]
