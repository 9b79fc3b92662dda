"""A DeepSpeed checkpoint tag folder as the converter sees it: metadata plus lazily opened rank files."""

from __future__ import annotations

import contextvars
import functools
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import LOADER_FILE
from ucp_deepspeed.format.metadata import (
    FP32,
    ExtraTensor,
    ParamSlot,
    SaveMeta,
    meta_filename,
    read_meta,
)
from ucp_deepspeed.format.paths import optim_prefix, read_latest
from ucp_deepspeed.format.swap import SWAP_RECORD, read_swap_records
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.geometry.fragments import fragments_in
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.swap_file import SwapTensor
from ucp_deepspeed.io.torch_file import (
    IndexedArchive,
    LazyTensor,
    Span,
    StorageSpan,
    TorchFile,
    check_save_id,
    read_spans,
)
from ucp_deepspeed.naming.rules import parse_rules
from ucp_deepspeed.sources.consistency import (
    check_model_states,
    check_optim,
    check_steps,
    check_whole,
    fail,
    flat_layouts,
)
from ucp_deepspeed.sources.data_loaders import read_loader_records
from ucp_deepspeed.sources.infer import GroupOrder, Placement, infer_metas
from ucp_deepspeed.sources.model_states import LayerStatesFile, ModelStatesFile
from ucp_deepspeed.sources.optim_file import OptimRankFile
from ucp_deepspeed.sources.plan import full_tensors


def resolve_tag(ckpt_dir: str, tag: str | None = None) -> str:
    """The tag to use: the one given, or the one named in `latest`; a clear error otherwise."""
    return str(tag) if tag is not None else read_latest(ckpt_dir)


_T = TypeVar("_T")
_R = TypeVar("_R")

FILES_IN_FLIGHT = 16
"""How many rank files the rank that checks a tag on a store opens (or CRC-checks) at once: each costs round trips
(its tail, its pickle, a zip header per record), which at a thousand ranks add up to minutes one file at a time."""


def _spans_of(files: RankFiles, rank: int) -> dict[tuple[int, str], StorageSpan]:
    return files.optim(rank).spans()


def side_by_side(work: Callable[[_T], _R], items: Iterable[_T], paths: Sequence[str]) -> list[_R]:
    """`work` of each item, in order: on a store up to `FILES_IN_FLIGHT` at once, on a disk one after another (its
    reads need no round trips to hide). The first failure, in item order, is raised."""
    items = list(items)
    if len(items) <= 1 or not paths or not st.is_url(paths[0]):
        return [work(item) for item in items]
    with ThreadPoolExecutor(min(FILES_IN_FLIGHT, len(items)), thread_name_prefix="ucp-open") as pool:
        futures = [pool.submit(contextvars.copy_context().run, work, item) for item in items]
        return [future.result() for future in futures]


@dataclass(frozen=True)
class FileIndex:
    """Where one optimizer file holds each flat buffer's states, found by the rank that opened and checked it."""

    path: str
    spans: dict[tuple[int, str], StorageSpan]


class RankPaths(Sequence[str]):
    """The path of each data-parallel rank's file of one kind, made when asked for: a resuming rank of a 1024-rank
    job names only the files it opens."""

    def __init__(self, tag_dir: str, pattern: str, count: int, sp_named: int = 0):
        """`pattern` names data-parallel rank `{dp}` of model-parallel rank `{mp}`; `sp_named`: the sequence-parallel
        size of a Ulysses checkpoint DeepSpeed named by each rank's sequence-parallel rank (before its #8226)."""
        self.tag_dir, self.pattern, self.size, self.sp_named = tag_dir, pattern, count, sp_named

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        dp = index % self.size
        return st.join(self.tag_dir, self.pattern.format(dp=dp, mp=dp % self.sp_named if self.sp_named else 0))


def named_by_sp_rank(tag_dir: str, topo: Topology) -> bool:
    """Whether a Ulysses checkpoint names data-parallel rank 1's files by its sequence-parallel rank (DeepSpeed before
    #8226: `zero_pp_rank_1_mp_rank_01_...`) rather than model-parallel rank 0, as DeepSpeed does now."""
    if topo.sp == 1 or topo.dp == 1:
        return False
    name = f"{optim_prefix(topo.dtype)}zero_pp_rank_1_mp_rank_{{:02d}}_optim_states.pt"
    return not st.isfile(st.join(tag_dir, name.format(0))) and st.isfile(st.join(tag_dir, name.format(1)))


class RankFiles(st.Closeable):
    """The files of one model-parallel rank (one tensor/pipeline coordinate), opened lazily."""

    def __init__(self, tag_dir: str, mp_rank: int, meta: SaveMeta, verify: bool = True, by_sp_rank: bool = False):
        """`by_sp_rank`: the tag names data-parallel ranks' files by their sequence-parallel rank
        (`named_by_sp_rank`)."""
        self.tag_dir, self.mp_rank, self.meta, self.verify = tag_dir, mp_rank, meta, verify
        topo = meta.topology
        prefix = optim_prefix(topo.dtype)
        sp_named = topo.sp if by_sp_rank else 0
        mp = "{mp:02d}" if sp_named else f"{mp_rank:02d}"
        self.optim_paths = RankPaths(
            tag_dir, f"{prefix}zero_pp_rank_{{dp}}_mp_rank_{mp}_optim_states.pt", topo.dp, sp_named
        )
        self.model_paths: Sequence[str] = (
            RankPaths(tag_dir, f"zero_pp_rank_{{dp}}_mp_rank_{mp}_model_states.pt", topo.dp, sp_named)
            if topo.zero_stage == 3
            else [st.join(tag_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")]
        )
        files = {s.file for s in meta.params} | {e.file for e in meta.extras}
        self.layer_paths = sorted(st.join(tag_dir, f) for f in files if f)
        self.swaps = read_swap_records(tag_dir) if topo.zero_stage == 3 else {}
        self.index: dict[str, FileIndex] = {}
        self._archives: dict[int, IndexedArchive] = {}
        self._lock = threading.Lock()
        self._optim: dict[int, OptimRankFile] = {}
        self._model: dict[int, ModelStatesFile] = {}
        self._layers: dict[str, LayerStatesFile] = {}

    @property
    def needed(self) -> list[str]:
        """Every file of this model-parallel rank a conversion reads (built on request: it lists every DP rank's)."""
        topo = self.meta.topology
        swap_files = [
            st.join(folder, name)
            for path in self.optim_paths
            if st.basename(path) in self.swaps
            for folder, record in [self.swaps[st.basename(path)]]
            for name in [SWAP_RECORD, *sorted(record.files)]
        ]
        optim = [] if topo.unpartitioned else list(self.optim_paths)
        return [*self.model_paths, *optim, *self.layer_paths, *swap_files]

    def optim(self, rank: int) -> OptimRankFile:
        """The optimizer file of data-parallel rank `rank`, opened once."""
        with self._lock:
            found = self._optim.get(rank)
        if found is not None:
            return found
        # opened outside the lock: the rank checking a tag on a store opens many side by side (`side_by_side`)
        path = self.optim_paths[rank]
        swap = self.swaps.get(st.basename(path))
        opened = self._bound(OptimRankFile(path, self.meta.topology.zero_stage, self.verify, swap))
        with self._lock:
            found = self._optim.setdefault(rank, opened)
        if found is not opened:
            opened.close()
        return found

    def model_states(self, rank: int = 0) -> ModelStatesFile:
        """The model-states file of data-parallel rank `rank` (there is only one below ZeRO-3)."""
        with self._lock:
            found = self._model.get(rank)
        if found is not None:
            return found
        opened = self._bound(ModelStatesFile(self.model_paths[rank], self.verify))  # outside the lock, as `optim`
        with self._lock:
            found = self._model.setdefault(rank, opened)
        if found is not opened:
            opened.close()
        return found

    def layer(self, path: str) -> LayerStatesFile:
        """A pipeline layer file of this rank, opened once."""
        with self._lock:
            if path not in self._layers:
                self._layers[path] = self._bound(LayerStatesFile(path, self.verify))
            return self._layers[path]

    def _bound(self, opened: Any) -> Any:
        """A file is used only if it carries this save's id (when the save recorded one)."""
        try:
            check_save_id(opened.path, opened.save_id, self.meta.save_id)
        except CheckpointError:
            opened.close()
            raise
        return opened

    def archive(self, rank: int) -> IndexedArchive:
        """The optimizer file of data-parallel rank `rank` as indexed by the rank that checked it, opened once."""
        with self._lock:
            if rank not in self._archives:
                self._archives[rank] = IndexedArchive(self.optim_paths[rank], self.verify)
            return self._archives[rank]

    def files(self) -> list[Any]:
        """Every rank file opened so far."""
        with self._lock:
            return [*self._optim.values(), *self._model.values(), *self._layers.values(), *self._archives.values()]

    def read_param(self, slot: ParamSlot, state: str) -> torch.Tensor:
        """One state (`fp32` or an optimizer key) of this rank's share of a parameter, from every DP rank."""
        if self.meta.topology.unpartitioned:
            return self._read_whole(slot, state)
        return self.read_param_range(slot, state, 0, slot.numel).view(slot.shape)

    def read_param_range(self, slot: ParamSlot, state: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start+numel) of one state of this rank's share of a parameter, flattened: only the
        fragments that overlap them are read, and only their overlapping part."""
        out = torch.empty(numel, dtype=torch.float32)
        read_spans(self.param_range_spans(slot, state, start, out))
        return out

    def param_range_spans(
        self, slot: ParamSlot, state: str, start: int, out: torch.Tensor
    ) -> dict[TorchFile | IndexedArchive, list[Span]]:
        """Where elements [start, start+len(out)) of one state of a parameter lie, by archive, for a merged read into
        `out` (`TorchFile.read_spans`); parts not held as plain archive bytes (ZeRO-0, NVMe swap files) are read now."""
        topo = self.meta.topology
        numel = out.numel()
        if topo.unpartitioned:
            out.copy_(self._read_whole(slot, state).reshape(-1)[start : start + numel])
            return {}
        spans: dict[TorchFile | IndexedArchive, list[Span]] = {}
        for frag in fragments_in(slot, topo.zero_stage, topo.dp, start, start + numel):
            dest = out[frag.dst - start : frag.dst - start + frag.numel]
            indexed = self.index.get(st.basename(self.optim_paths[frag.rank]))
            where = indexed.spans.get((slot.flat, state)) if indexed is not None else None
            if where is not None:  # else a state kept in NVMe swap files, or none: the file itself says which
                archive = self.archive(frag.rank)
                if where.dtype != "float32" or frag.src + frag.numel > where.numel:
                    raise CheckpointError(
                        archive.path,
                        f"{state} of flat buffer {slot.flat} is {where.numel} {where.dtype} elements, metadata reads "
                        f"float32 elements up to {frag.src + frag.numel}",
                    )
                begin = frag.src * 4
                spans.setdefault(archive, []).append(
                    (where.record, where.record_offset + begin, where.file_offset + begin, dest)
                )
                continue
            lazy = self.optim(frag.rank).flat(slot.flat, state)
            if lazy.dtype != torch.float32:
                raise CheckpointError(
                    self.optim_paths[frag.rank], f"{state} of flat buffer {slot.flat} is {lazy.dtype}, expected float32"
                )
            if isinstance(lazy, LazyTensor) and lazy.is_contiguous():
                span = lazy.file.storage_span(lazy.key, lazy.dtype, lazy.storage_offset + frag.src, frag.numel)
                spans.setdefault(lazy.file, []).append((*span, dest))
            else:
                lazy.read(frag.src, frag.numel, out=dest)
        return spans

    def _read_whole(self, slot: ParamSlot, state: str) -> torch.Tensor:
        """ZeRO-0 fp32: the parameter itself (its fp32 master) or its entry in the saved torch optimizer state."""
        path = st.join(self.tag_dir, slot.file) if slot.file else self.model_paths[0]
        if state != FP32:
            lazy = self.model_states(0).optimizer_state(slot.flat, state)
        elif slot.file:
            lazy = self.layer(path).tensor(slot.key)
        else:
            lazy = self.model_states(0).module_tensor(slot.local or slot.name)
        if tuple(lazy.shape) != tuple(slot.shape) or lazy.dtype != torch.float32:
            raise CheckpointError(
                path,
                f"{state} of '{slot.name}' is {tuple(lazy.shape)} {lazy.dtype}, metadata says {slot.shape} float32",
            )
        return lazy.load()

    def read_extra(self, extra: ExtraTensor) -> torch.Tensor:
        """A frozen parameter or buffer, gathered from ZeRO-3 fragments when it was partitioned."""
        dtype = getattr(torch, extra.dtype)
        if extra.kind == "frozen" and extra.partition:
            numel = math.prod(extra.shape)
            out = torch.empty(numel, dtype=dtype)
            for rank in range(self.meta.topology.dp):
                start = rank * extra.partition
                n = min(extra.partition, numel - start)
                if n > 0:
                    self.model_states(rank).frozen_fragment(extra.local_name).read(0, n, out=out[start : start + n])
            return out.view(extra.shape)
        if extra.file:
            path = st.join(self.tag_dir, extra.file)
            lazy = self.layer(path).tensor(extra.key)
        else:
            path = self.model_paths[0]
            lazy = self.model_states(0).module_tensor(extra.local_name)
        if tuple(lazy.shape) != tuple(extra.shape) or lazy.dtype != dtype:
            raise CheckpointError(
                path,
                f"'{extra.key or extra.local_name}' is {tuple(lazy.shape)} {lazy.dtype}, "
                f"metadata says {tuple(extra.shape)} {dtype}",
            )
        return lazy.load()

    def close(self) -> None:
        """Release every opened file."""
        for f in self.files():
            f.close()


class ClientStates(Sequence[dict[str, Any]]):
    """Each model-parallel rank's client state, read when asked for: a resuming rank reads its own rank's model-states
    file, not every one of a 512-way tensor x pipeline-parallel save."""

    def __init__(self, ranks: list[RankFiles]):
        self.ranks = ranks

    def __len__(self) -> int:
        return len(self.ranks)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        rank = self.ranks[index]
        return rank.model_states(0).client_state(rank.meta.client_state_keys)


def tag_metas(
    tag_dir: str, layout_rules: Any = None, order: GroupOrder | Placement | None = None
) -> tuple[list[SaveMeta], bool]:
    """Every model-parallel rank's metadata, and whether it was inferred from DeepSpeed's files alone.

    A tag saved through ucp_deepspeed has our metadata files; one saved by plain DeepSpeed (or HF
    Trainer, Accelerate) gets metadata rebuilt from DeepSpeed's own bookkeeping, which needs
    `layout_rules` when it is tensor-parallel, and names a ZeRO-0 save's numbered optimizer state by the
    loading engine's groups (`order`) when they are given.
    """
    metas, inferred = _read_metas(tag_dir, layout_rules, order)
    counts = sorted({m.num_groups for m in metas})
    if len(counts) > 1:
        raise CheckpointError(
            tag_dir,
            f"its model-parallel ranks have {counts} optimizer param groups: DeepSpeed drops a stage's empty "
            "groups, so their numbers cannot be matched across stages. Give every stage a parameter of every group",
        )
    return metas, inferred


def _read_metas(tag_dir: str, layout_rules: Any, order: GroupOrder | Placement | None) -> tuple[list[SaveMeta], bool]:
    if not st.isfile(st.join(tag_dir, meta_filename(0))):
        try:
            return infer_metas(tag_dir, _rules(layout_rules, tag_dir), order), True
        except ValueError as exc:  # a name in DeepSpeed's files that cannot be a tensor's (see check_name)
            raise CheckpointError(tag_dir, str(exc)) from None
    first = read_meta(tag_dir, 0)
    topo = first.topology
    missing = [
        meta_filename(r) for r in range(1, topo.tp * topo.pp) if not st.isfile(st.join(tag_dir, meta_filename(r)))
    ]
    if missing:
        raise CheckpointError(
            tag_dir,
            f"saved at {topo.describe()} ({topo.tp * topo.pp} model-parallel "
            f"ranks) but metadata is missing: {', '.join(missing)}",
        )
    metas = [first] + [read_meta(tag_dir, r) for r in range(1, topo.tp * topo.pp)]
    for r, meta in enumerate(metas):
        if meta.topology != topo or meta.pp_rank * topo.tp + meta.tp_rank != r:
            raise CheckpointError(
                st.join(tag_dir, meta_filename(r)),
                f"metadata of model-parallel rank {r} says {meta.topology.describe()} "
                f"tp_rank={meta.tp_rank} pp_rank={meta.pp_rank}; rank 0 says {topo.describe()}",
            )
    return metas, False


def _rules(layout_rules: Any, where: str) -> tuple[Any, ...]:
    try:
        return parse_rules(layout_rules)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            str(layout_rules) if isinstance(layout_rules, str) else where, f"bad layout rules: {exc}"
        ) from None


class NativeCheckpoint(st.Closeable):
    """A DeepSpeed checkpoint tag: every model-parallel rank's metadata and lazily opened files.

    With `check` (the default) every rank file must exist and its pickle is read at once and checked
    against the metadata; a loading job does that on one rank only, and the other ranks touch only the
    files they read. `metas` are the tag's metadata as `tag_metas` returns them, read by one rank and
    shared, so a thousand ranks do not each read every model-parallel rank's metadata; `by_sp_rank`, how the tag
    names a Ulysses job's files (`named_by_sp_rank`), likewise. `verify=False`
    skips the CRC checks of tensor reads, to measure their cost.
    """

    def __init__(
        self,
        ckpt_dir: str,
        tag: str | None = None,
        layout_rules: Any = None,
        check: bool = True,
        verify: bool = True,
        metas: tuple[list[SaveMeta], bool] | None = None,
        by_sp_rank: bool | None = None,
    ):
        self.ckpt_dir = st.normalize(ckpt_dir)
        self.tag = resolve_tag(self.ckpt_dir, tag)
        self.tag_dir = st.join(self.ckpt_dir, self.tag)
        if not st.isdir(self.tag_dir):
            raise CheckpointError(self.tag_dir, "checkpoint tag folder does not exist")
        self.metas, self.inferred = metas if metas is not None else tag_metas(self.tag_dir, layout_rules)
        self.meta = self.metas[0]
        topo = self.meta.topology
        self.tensors = full_tensors(self.metas, st.join(self.tag_dir, meta_filename(0)))
        if by_sp_rank is None:  # asked here unless the rank that read the metadata answered it (a store's requests)
            by_sp_rank = named_by_sp_rank(self.tag_dir, topo)
        self.ranks = [RankFiles(self.tag_dir, r, meta, verify, by_sp_rank) for r, meta in enumerate(self.metas)]
        if check:
            needed = [p for rank in self.ranks for p in rank.needed]
            missing = [p[len(self.tag_dir) + 1 :] for p in needed if not st.isfile(p)]
            if missing:
                raise CheckpointError(
                    self.tag_dir, f"saved at {topo.describe()} but rank files are missing: {', '.join(missing)}"
                )
            try:
                self._check_files()
            except (CheckpointError, ValueError):
                self.close()
                raise

    def _check_files(self) -> None:
        """Open every rank file (pickles only) and check it against the metadata: bound to this save,
        shapes, partitions and steps agreeing. Raises before anything is converted."""
        for rank in self.ranks:
            topo = rank.meta.topology
            problems = [
                (rank.model_paths[d], p)
                for d, states in enumerate(
                    side_by_side(rank.model_states, range(len(rank.model_paths)), rank.model_paths)
                )
                for p in check_model_states(rank.meta, states, len(self.ranks))
            ]
            in_layers: list[tuple[ExtraTensor | ParamSlot, str]] = [
                (t, t.dtype) for t in rank.meta.extras if t.file
            ] + [(t, "float32") for t in rank.meta.params if t.file]  # ZeRO-0 fp32: a trainable weight is its master
            for extra, dtype in in_layers:
                path = st.join(rank.tag_dir, extra.file)
                try:
                    lazy = rank.layer(path).tensor(extra.key)
                except CheckpointError as exc:
                    problems.append((path, exc.reason))
                    continue
                if tuple(lazy.shape) != tuple(extra.shape) or lazy.dtype != getattr(torch, dtype):
                    problems.append(
                        (
                            path,
                            f"'{extra.key}' is {tuple(lazy.shape)} {lazy.dtype}, metadata says "
                            f"{tuple(extra.shape)} {dtype}",
                        )
                    )
            if topo.unpartitioned:
                problems += [(rank.model_paths[0], p) for p in check_whole(rank.meta, rank.model_states(0))]
            else:
                optims = side_by_side(rank.optim, range(topo.dp), rank.optim_paths)
                try:
                    layouts = flat_layouts(rank.meta)
                    problems += [
                        (o.path, p) for d, o in enumerate(optims) for p in check_optim(rank.meta, o, d, layouts)
                    ]
                except ValueError as exc:  # fragments that cannot cover a parameter
                    problems.append((rank.optim_paths[0], str(exc)))
                problems += [(self.tag_dir, p) for p in check_steps(optims)]
            if problems:
                first = problems[0][0]
                fail(first, [p if path == first else f"{st.basename(path)}: {p}" for path, p in problems])

    def file_index(self) -> dict[int, dict[str, FileIndex]]:
        """Per model-parallel rank, by file name, where every optimizer file holds its flat buffers' states: made by
        the rank that checks the tag (it opens and parses every file) and handed to the others (`use_index`), so a
        resuming rank reads its ranges without opening a zip directory or parsing a pickle."""
        out: dict[int, dict[str, FileIndex]] = {}
        for mp_rank, rank in enumerate(self.ranks):
            if rank.meta.topology.unpartitioned:
                continue
            found = side_by_side(functools.partial(_spans_of, rank), range(len(rank.optim_paths)), rank.optim_paths)
            for path, spans in zip(rank.optim_paths, found):
                out.setdefault(mp_rank, {})[st.basename(path)] = FileIndex(path, spans)
        return out

    def use_index(self, index: dict[int, dict[str, FileIndex]]) -> None:
        """Read optimizer files at the offsets another rank indexed (`file_index`) instead of parsing them."""
        for mp_rank, files in index.items():
            self.ranks[mp_rank].index = files

    def pieces(self) -> dict[str, dict[str, list[tuple[int, int, int]]]]:
        """What was read from each rank file, by path and record, for a CRC check here or on another rank."""
        return {f.path: f.file.pieces() for rank in self.ranks for f in rank.files()}

    def check_reads(self, more: Sequence[dict[str, dict[str, list[tuple[int, int, int]]]]] = ()) -> None:
        """Raise if anything read from the rank files (here, or by other processes: `more`) fails its CRC-32."""
        opened = {f.path: f for rank in self.ranks for f in rank.files()}
        extra: dict[str, dict[str, list[tuple[int, int, int]]]] = {}
        for part in more:
            for path, records in part.items():
                for name, pieces in records.items():
                    extra.setdefault(path, {}).setdefault(name, []).extend(pieces)
        paths = sorted(set(opened) | set(extra))

        def check(path: str) -> None:
            handle = opened.get(path) or self._open_path(path)
            handle.file.check_reads(extra.get(path))

        side_by_side(check, paths, paths)

    def _open_path(self, path: str) -> Any:
        for rank in self.ranks:
            for r, p in enumerate(rank.optim_paths):
                if p == path:
                    return rank.optim(r)
            for r, p in enumerate(rank.model_paths):
                if p == path:
                    return rank.model_states(r)
            if path in rank.layer_paths:
                return rank.layer(path)
        raise CheckpointError(path, "is not a file of this checkpoint")

    def source_files(self) -> list[str]:
        """Every file conversion reads, for fingerprinting."""
        metas = [] if self.inferred else [st.join(self.tag_dir, meta_filename(r)) for r in range(len(self.ranks))]
        loaders = [st.join(self.tag_dir, LOADER_FILE)] if self.meta.data_loaders is not None else []
        return [p for rank in self.ranks for p in rank.needed] + metas + loaders

    def verify(self) -> list[str]:
        """Every problem with the tag's files: missing, unreadable, a record failing its zip CRC-32, or a swap file
        failing the CRC-32 its save recorded."""
        problems = []
        for path in self.source_files():
            if not path.endswith(".pt"):
                continue
            try:
                tfile = TorchFile(path)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            with tfile:
                problems += tfile.verify()
        swaps = {folder: record for rank in self.ranks for folder, record in rank.swaps.values()}
        for folder, record in sorted(swaps.items()):
            for name, entry in sorted(record.files.items()):
                path = st.join(folder, name)
                try:
                    SwapTensor(path, torch.uint8, 0, entry.nbytes, entry.blocks).check()
                except CheckpointError as exc:
                    problems.append(str(exc))
        return problems

    def check_everything(self) -> None:
        """Raise the first problem `verify` finds: a resumed conversion reuses files made from reads nobody checked."""
        problems = self.verify()
        if problems:
            path, _, reason = problems[0].partition(": ")
            raise CheckpointError(path, reason)

    def model_states(self, rank: int = 0) -> ModelStatesFile:
        """Model-states file of data-parallel rank `rank` of the first model-parallel rank."""
        return self.ranks[0].model_states(rank)

    def refuse_fp8_state(self) -> None:
        """Refuse a reshard of a tag whose modules saved Transformer Engine FP8 state, naming the first entry: the
        universal format does not carry it, and a resumed FP8 run would restart its scaling from nothing."""
        for rank in self.ranks:
            states = rank.model_states(0).fp8_states()
            if states:
                name, size = next(iter(states.items()))
                raise CheckpointError(
                    rank.model_paths[0],
                    f"{name} holds Transformer Engine FP8 state ({size} bytes of scales and amax history; "
                    f"{len(states)} such entries in this file), which a reshard cannot carry to another layout; "
                    "resume at the saved layout, where DeepSpeed's own load restores it",
                )

    def optim(self, rank: int) -> OptimRankFile:
        """Optimizer file of data-parallel rank `rank` of the first model-parallel rank."""
        return self.ranks[0].optim(rank)

    def training_state(self) -> dict[str, Any]:
        """The non-tensor training state: the LR scheduler, the optimizer wrapper's state, DeepSpeed's data sampler
        state, each rank's data-loader record (`format.data_position`), and the client state of each model-parallel
        rank (`client_states`, by model-states file index; `client_state` is rank 0's)."""
        clients = ClientStates(self.ranks)
        return {
            "lr_scheduler": self.model_states(0).lr_scheduler(),
            "client_state": clients[0],
            "client_states": clients,
            "optimizer_wrapper": self.optim(0).wrapper_state() if self.meta.topology.zero_stage > 0 else {},
            "data_sampler": self.model_states(0).data_sampler(),
            "data_sampler_rng": self.meta.data_sampler_rng,
            "data_loaders": read_loader_records(
                self.tag_dir, self.meta.data_loaders, self.meta.save_id, self.ranks[0].verify
            ),
        }

    def state_keys(self) -> list[str]:
        """Per-element optimizer state keys, e.g. `exp_avg`, `exp_avg_sq`."""
        rank = next((r for r in self.ranks if r.meta.params), None)
        if rank is None:
            return []
        return (
            rank.model_states(0).optimizer_state_keys()
            if self.meta.topology.unpartitioned
            else rank.optim(0).state_keys(0)
        )

    def optimizer_groups(self) -> tuple[list[dict[str, Any]] | None, dict[int, dict[str, Any]]]:
        """Hyperparameters per param group, and the scalar state (e.g. `step`) per param group.

        A pipeline stage may hold no parameter of some group, so scalars come from the first
        model-parallel rank that has them.
        """
        scalars: dict[int, dict[str, Any]] = {}
        hyperparams = None
        for rank in self.ranks:
            if not rank.meta.params:
                continue
            if self.meta.topology.unpartitioned:
                groups, found = rank.model_states(0).optimizer_groups()
                hyperparams = hyperparams or groups
                scalars = {**found, **scalars}
                continue
            first = rank.optim(0)
            hyperparams = hyperparams or first.hyperparams()
            for index in range(first.num_flat):
                group = first.group_of_flat(index)
                if group not in scalars and first.scalars(index):
                    scalars[group] = first.scalars(index)
        return hyperparams, scalars

    def close(self) -> None:
        """Release every opened file."""
        for rank in self.ranks:
            rank.close()


def refuse_fp8_state(ckpt_dir: str, tag: str, layout_rules: Any, metas: Any) -> None:
    """Refuse a reshard of `tag` whose modules saved Transformer Engine FP8 state (`NativeCheckpoint.refuse_fp8_state`),
    before a conversion writes anything."""
    with NativeCheckpoint(ckpt_dir, tag, layout_rules, check=False, metas=metas) as src:
        src.refuse_fp8_state()
