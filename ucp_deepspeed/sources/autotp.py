"""Layouts of a checkpoint DeepSpeed's AutoTP saved, read from the record it writes into every model-states file.

DeepSpeed (0.17 on) writes `universal_checkpoint_info` for a model AutoTP partitioned: name patterns per category
(`tp_replicated`, `parameter_with_row_parallelism`, `vocabulary` with `original_vocab_size`, `parameter_with_sub_params`
for fused projections), since version 0.4 each fused part's per-rank widths (`sub_param_shard_widths`: AutoTP gives
whole heads to the first ranks, so splits can be uneven), the parameters its converter refuses
(`autotp_unsupported_parameter_patterns`, with the reason) and an `affine_map` that places every piece of every
rank's shard in the full tensor. Versions 0.2 and 0.3 have the categories only; their fused parts were split
evenly and an unfused split's per-rank sizes are the saved shapes.

A layout is derived from the categories and the shapes each tensor-parallel rank saved, then checked against the
affine map when there is one: both must put every element in the same place, or the checkpoint is refused. A
parameter no category names is split on dim 0, as DeepSpeed's converter merges it (AutoTP's column-parallel
linears); a piece held scaled (a pre-divided bias) is refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.geometry.layout import REPLICATED, Layout

Shape = tuple[int, ...]
KNOWN_VERSION = 0.4
AFFINE_VERSION = 1


def is_autotp_record(info: Any, ds_config: Mapping[str, Any]) -> bool:
    """Whether a model-states file's `universal_checkpoint_info` is AutoTP's (Megatron-DeepSpeed writes one too): the
    saving job's config asked for AutoTP (records before 0.4 carry no key of AutoTP's own), or the record has one."""
    autotp = int(((ds_config or {}).get("tensor_parallel") or {}).get("autotp_size") or 0) > 1
    return isinstance(info, dict) and (
        autotp or "autotp_unsupported_parameter_patterns" in info or "affine_map" in info
    )


def matches(patterns: Sequence[str], name: str) -> str | None:
    """The first of a record's patterns that matches the start of `name`, as DeepSpeed's converter matches them."""
    found = [p for p in patterns if re.match(p, name)]
    return found[0] if found else None


def autotp_layouts(info: Mapping[str, Any], shapes: Sequence[Mapping[str, Shape]], path: str) -> dict[str, Layout]:
    """Each parameter's layout from AutoTP's record and the local shapes of tensor-parallel ranks 0..tp-1.

    Args:
        info: the `universal_checkpoint_info` of a model-states file.
        shapes: per tensor-parallel rank, the local shape of every parameter it saved.
        path: the file the record came from, for errors.
    Returns:
        name -> Layout of every parameter rank 0 saved.
    """
    version = float(info.get("universal_checkpoint_version", 0.0))
    if version > KNOWN_VERSION:
        raise CheckpointError(path, f"AutoTP record version {version}; this reader knows up to {KNOWN_VERSION}")
    affine = info.get("affine_map") or {}
    if int(affine.get("version", AFFINE_VERSION)) > AFFINE_VERSION:
        raise CheckpointError(path, f"affine map version {affine['version']}; this reader knows {AFFINE_VERSION}")
    tp = len(shapes)
    out = {}
    for name in shapes[0]:
        local = [tuple(s[name]) for s in shapes if name in s]
        if len(local) != tp:
            raise CheckpointError(path, f"'{name}' is saved by {len(local)} of {tp} tensor-parallel ranks")
        reason = matches(list(info.get("autotp_unsupported_parameter_patterns") or {}), name)
        if reason is not None:
            raise CheckpointError(
                path,
                f"'{name}': DeepSpeed's AutoTP recorded that it cannot describe this split "
                f"({info['autotp_unsupported_parameter_patterns'][reason]}); its own converter refuses it too",
            )
        layout = category_layout(info, name, local, version, path)
        entry = next((e for p, e in (affine.get("params") or {}).items() if re.match(p, name)), None)
        if entry is not None:
            _check_affine(name, layout, local, entry, path)
        out[name] = layout
    return out


def category_layout(
    info: Mapping[str, Any],
    name: str,
    local: list[Shape],
    version: float,
    path: str,
    fused: Layout | None = None,
    keep_padding: bool = False,
) -> Layout:
    """The layout a `universal_checkpoint_info` record's name categories give (a split on dim 0 when none names it,
    as DeepSpeed's converter merges such a parameter), or `fused` when given, checked against every rank's shape;
    `keep_padding` keeps a vocabulary's padding rows (Megatron-DeepSpeed trains them)."""
    tp = len(local)
    if fused is not None:
        layout = fused
    elif matches(info.get("tp_replicated_parameter_patterns") or [], name):
        layout = REPLICATED
    elif matches(info.get("parameter_to_average_patterns") or [], name):
        layout = Layout("average")
    elif matches(info.get("parameter_with_2_sub_params_cat_dim_0") or [], name):
        layout = Layout("split", 0, parts=(local[0][0] * tp // 2,) * 2)
    elif (sub := _sub_params(info, name)) is not None:
        layout = _fused(info, name, sub, local, version, path)
    else:  # a column-parallel split is the category-less default, as in DeepSpeed's converter
        dim = 1 if matches(info.get("parameter_with_row_parallelism_patterns") or [], name) else 0
        layout = _plain_split(info, name, dim, local, path, keep_padding)
    try:
        full = {layout.full_shape(shape, tp) for shape in local}
        for rank, shape in enumerate(local):
            expected = list(local[0])
            if layout.shards:
                expected[layout.dim] = layout.local_length(rank)
            if list(shape) != expected:
                raise ValueError(f"tensor-parallel rank {rank} holds {list(shape)}, expected {expected}")
    except ValueError as exc:
        raise CheckpointError(path, f"'{name}': {exc}") from None
    if len(full) != 1:
        raise CheckpointError(path, f"'{name}': its ranks' shapes {local} make no one full tensor")
    return layout


def _sub_params(info: Mapping[str, Any], name: str) -> tuple[str, dict[str, Any]] | None:
    for entry in info.get("parameter_with_sub_params") or []:
        pattern = matches(entry.get("patterns") or [], name)
        if pattern is not None:
            return pattern, entry
    return None


def _fused(
    info: Mapping[str, Any], name: str, sub: tuple[str, dict[str, Any]], local: list[Shape], version: float, path: str
) -> Layout:
    """A fused projection (q|k|v, gate|up): parts along the partition dim, each split over the ranks."""
    pattern, entry = sub
    dim, tp = int(entry["partition_dim"]), len(local)
    spec = entry["shape"][dim]
    widths = (info.get("sub_param_shard_widths") or {}).get(pattern)
    if widths is None and version >= 0.4:
        raise CheckpointError(path, f"'{name}': a version {version} record without its sub-parameters' shard widths")
    if widths is None:
        total = sum(s[dim] for s in local)
        sizes = list(spec) if isinstance(spec, (list, tuple)) else [total // int(spec)] * int(spec)
        if sum(sizes) != total or any(size % tp for size in sizes):
            raise CheckpointError(
                path,
                f"'{name}': sub-parameter sizes {sizes} of a version {version} record (before per-rank widths) do "
                f"not split evenly over {tp} ranks into {total} rows",
            )
        widths = [[size // tp] * tp for size in sizes]
    shards = tuple(tuple(int(w) for w in part) for part in widths)
    if any(len(part) != tp for part in shards):
        raise CheckpointError(path, f"'{name}': shard widths {widths} are not one per rank of {tp}")
    return Layout.from_widths(dim, shards, fused=True)


def _plain_split(
    info: Mapping[str, Any], name: str, dim: int, local: list[Shape], path: str, keep_padding: bool = False
) -> Layout:
    """An unfused split along `dim`: the ranks' own sizes; a vocabulary keeps `original_vocab_size` rows, or with
    `keep_padding` every row (still marked as a vocabulary)."""
    widths = tuple(s[dim] if dim < len(s) else 0 for s in local)
    if 0 in widths and len(set(widths)) == 1:
        raise CheckpointError(path, f"'{name}' is split along dim {dim}, which its shape {list(local[0])} lacks")
    vocab = 0
    if matches(info.get("vocabulary_parameter_patterns") or [], name) and keep_padding:
        vocab = sum(widths)
    elif matches(info.get("vocabulary_parameter_patterns") or [], name) and info.get("original_vocab_size"):
        vocab = int(info["original_vocab_size"])
        vocab = 0 if vocab == sum(widths) else vocab
    if len(set(widths)) == 1:
        return Layout("split", dim, vocab=vocab)
    if vocab:
        raise CheckpointError(path, f"'{name}': a vocabulary split unevenly {list(widths)} and padded to {vocab} rows")
    return Layout.from_widths(dim, (widths,))


def _runs(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(full start, local start, length) runs sorted by local start, adjacent ones joined."""
    out: list[tuple[int, int, int]] = []
    for full, local, length in sorted(p for p in pieces if p[2]):
        if out and out[-1][0] + out[-1][2] == full and out[-1][1] + out[-1][2] == local:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + length)
        else:
            out.append((full, local, length))
    return out


def _strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _unravel(offset: int, shape: Sequence[int]) -> list[int]:
    return [(offset // stride) % dim if dim else 0 for stride, dim in zip(_strides(shape), shape)]


def _check_affine(name: str, layout: Layout, local: list[Shape], entry: Mapping[str, Any], path: str) -> None:
    """Refuse unless the affine map puts every piece of every rank where `layout` does (and holds none scaled)."""
    tp = len(local)
    logical = [int(d) for d in entry["logical_shape"]]
    full = list(layout.full_shape(local[0], tp))
    if logical != full:
        raise CheckpointError(path, f"'{name}': the affine map's full shape {logical}, its layout gives {full}")
    dim = layout.dim if layout.is_split else 0
    for rank in range(tp):
        spec = (entry.get("ranks") or {}).get(str(rank)) or (entry.get("ranks") or {}).get(rank)
        if spec is None or [int(d) for d in spec["shard_shape"]] != list(local[rank]):
            raise CheckpointError(path, f"'{name}': the affine map does not describe rank {rank}'s {list(local[rank])}")
        shard = list(local[rank])
        mapped = []
        for piece in spec.get("pieces") or []:
            (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
            if float(piece.get("scale", 1.0)) != 1.0:
                raise CheckpointError(
                    path, f"'{name}': rank {rank} holds it scaled by {piece['scale']}, which a layout cannot undo"
                )
            shape = [int(d) for d in piece["shape"]]
            if not logical or not shard:  # a scalar: one element, held whole
                mapped.append((0, 0, 1))
                continue
            if math.prod(shape) == 0:  # a rank beyond the head count holds nothing of this part
                continue
            at_full, at_shard = _unravel(int(src), logical), _unravel(int(dst), shard)
            plain = (
                list(src_strides) == _strides(logical)
                and list(dst_strides) == _strides(shard)
                and all(
                    at_full[i] == at_shard[i] == 0 and shape[i] == logical[i] == shard[i]
                    for i in range(len(shape))
                    if i != dim
                )
            )
            if not plain:
                raise CheckpointError(
                    path, f"'{name}': rank {rank}'s affine piece {piece} is not a run along dim {dim}"
                )
            mapped.append((at_full[dim], at_shard[dim], shape[dim]))
        ours = [(p.full_start, p.local_start, p.length) for p in layout.pieces(local[rank], rank, tp) if p.length]
        if _runs(mapped) != _runs(ours):
            raise CheckpointError(
                path,
                f"'{name}': DeepSpeed's affine map places rank {rank}'s shard at {_runs(mapped)} along dim {dim}, "
                f"its categories at {_runs(ours)}",
            )
