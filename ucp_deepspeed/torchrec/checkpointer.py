"""Universal checkpoints of a TorchRec `DistributedModelParallel` model, saved whole or as Check-N-Run chains.

A save is one tag folder in the universal format, written straight from the live model: each embedding table's
full weight and fused-optimizer state (gathered one table at a time to rank 0, which writes it), the dense
parameters with the dense optimizer's state, the buffers, and last the manifest, whose `torchrec` section records the
plan the save ran under (each table's sharding, shards, kernel optimizer and its arguments). Every save is a
Check-N-Run chain element (`checkn_run.chain`): a whole save is a baseline, a differential one holds only the rows
looked up since an earlier save, and fp32 rows can be quantized; their optimizer states stay exact.

A load reads, on each rank, the rows and columns of the shards the live plan gives it, at any world size and plan.
Weights and per-element states (exact Adagrad's `momentum1`) go anywhere. A per-row state (row-wise Adagrad's
`momentum1`) is kept per row and column shard, so it is exact where the column split is kept (table-wise to
table-wise or row-wise, column-wise to the same columns); elsewhere the load is refused by name, unless
`approximate_row_state` asks for the width-weighted mean of the saved shards a live shard covers (exact in real
arithmetic for merged column shards, an estimate for split ones).

    tables/<key>.safetensors    fp32 [rows, cols] (or its quantized codes), each state as [rows, *width], and
                                `rows` (int64) in a delta
    params/<name>.safetensors   a dense parameter (a data-parallel table among them) and its dense optimizer states
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ucp_deepspeed import compat
from ucp_deepspeed.checkn_run.chain import MARKER, ChainCheckpoint
from ucp_deepspeed.checkn_run.config import DifferentialConfig, QuantizeConfig
from ucp_deepspeed.checkn_run.differential import ChainPolicy, ChainStep, end_tag, start_tag
from ucp_deepspeed.checkn_run.live_save import TableSave, table_file, table_record, table_tensors
from ucp_deepspeed.compat.torchrec import LocalShard, TablePlacement, TableShard
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import (
    Counters,
    FileRecord,
    GroupRecord,
    Manifest,
    ParamRecord,
    SourceRecord,
    dtype_name,
)
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import MANIFEST, FolderReader, decode_value, encode_value, stream_tensors
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.collective import (
    all_ok,
    coordinated,
    coordination_group,
    every_rank,
    failure_of,
    from_rank0,
    gather_at,
    guarded,
    to_rank0,
)

SECTION = "torchrec"
POINTWISE, ROW_WISE = "pointwise", "row_wise"
DATA_PARALLEL = "data_parallel"


@dataclass(frozen=True)
class Resumed:
    """What a load restored besides the model and optimizers: the tag, the step it was saved at, its client state."""

    tag: str
    step: int
    client_state: dict[str, Any]


@dataclass(frozen=True)
class SavedTable:
    """A table as the manifest's `torchrec` section records it."""

    placement: TablePlacement
    states: dict[str, str]
    """State name -> `pointwise` or `row_wise`."""

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        p = self.placement
        return {
            "table": p.table,
            "sharding": p.sharding,
            "rows": p.rows,
            "cols": p.cols,
            "shards": [list(s) for s in p.shards],
            "optimizer": p.optimizer,
            "optimizer_args": p.optimizer_args,
            "states": self.states,
        }

    @classmethod
    def decode(cls, key: str, raw: Any) -> SavedTable:
        """Parse one table's record (ValueError on anything malformed)."""
        try:
            states = {str(k): str(v) for k, v in raw["states"].items()}
            if not set(states.values()) <= {POINTWISE, ROW_WISE}:
                raise ValueError(states)
            placement = TablePlacement(
                key=key,
                table=str(raw["table"]),
                sharding=str(raw["sharding"]),
                rows=int(raw["rows"]),
                cols=int(raw["cols"]),
                shards=tuple(TableShard(*(int(n) for n in s)) for s in raw["shards"]),
                kernel="fused",
                optimizer=None if raw["optimizer"] is None else str(raw["optimizer"]),
                optimizer_args=dict(raw["optimizer_args"]),
            )
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"table {key}: malformed record ({exc!r})") from None
        return cls(placement=placement, states=states)


def state_kind(placement: TablePlacement, name: str, shape: tuple[int, ...]) -> str:
    """Whether a fused state holds one value per element (`pointwise`) or one per row and column shard (`row_wise`);
    NotImplementedError otherwise."""
    if shape == (placement.rows, placement.cols):
        return POINTWISE
    if shape == (placement.rows * len(placement.column_split),):
        return ROW_WISE
    raise NotImplementedError(
        f"TorchRec table {placement.key}: state {name!r} of {placement.optimizer} has shape {list(shape)}, neither "
        f"per element nor per row of its {len(placement.column_split)} column shards"
    )


def _matches(patterns: list[str] | None, placement: TablePlacement) -> bool:
    return patterns is None or any(re.fullmatch(p, placement.table) or re.fullmatch(p, placement.key) for p in patterns)


def _known_everywhere(tables: dict[str, TablePlacement]) -> dict[str, TablePlacement]:
    """The tables with each fused one's kernel optimizer as the ranks that hold a shard of it know it (collective)."""
    known: dict[str, tuple[str, dict[str, Any]]] = {}
    for found in every_rank({k: (p.optimizer, p.optimizer_args) for k, p in tables.items() if p.optimizer}):
        known.update(found)
    return {
        k: dataclasses.replace(p, optimizer=known[k][0], optimizer_args=known[k][1]) if k in known else p
        for k, p in tables.items()
    }


class _KjtTracker:
    """Flags of each fused table's rows looked up since the last `take()`, set from the ids of the sparse features
    each sharded module is handed: TorchRec's fused kernels never call an `nn.EmbeddingBag` hook."""

    def __init__(self, model: Any, tables: dict[str, TablePlacement]) -> None:
        # on the device the ids come on, made now, so that every rank all-reduces flags on it from the first save
        device = compat.dense_device(model)
        self.flags = {k: torch.zeros(p.rows, dtype=torch.bool, device=device) for k, p in sorted(tables.items())}
        self._hooks = []
        for module, features in compat.dmp_sparse_modules(model):
            wanted = {f: k for f, k in features.items() if k in tables}
            if wanted:
                self._hooks.append(module.register_forward_pre_hook(self._hook(wanted), with_kwargs=True))

    def _hook(self, features: dict[str, str]) -> Callable[[torch.nn.Module, tuple, dict], None]:
        def mark(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            for feature, ids in compat.kjt_ids(args, kwargs).items():
                key = features.get(feature)
                if key is None:
                    continue
                flags = self.flags[key]
                inside = (ids >= 0) & (ids < flags.numel())
                flags[ids[inside].to(flags.device)] = True
                if not bool(inside.all()):  # fbgemm looks an id out of range up as row 0, and updates that row
                    flags[0] = True

        return mark

    def take(self) -> dict[str, torch.Tensor]:
        """Each table's rows looked up on any rank since the last call (collective); the flags restart."""
        out = {}
        for key, flags in self.flags.items():
            merged = flags.to(torch.uint8)
            dist.all_reduce(merged, op=dist.ReduceOp.MAX)
            out[key] = merged.cpu().bool()
            flags.zero_()
        return out

    def clear(self) -> None:
        """Forget what was looked up (after a restore)."""
        for flags in self.flags.values():
            flags.zero_()

    def remove(self) -> None:
        """Stop tracking."""
        for hook in self._hooks:
            hook.remove()


def _assemble(placement: TablePlacement, states: dict[str, str], pieces: list[Any]) -> dict[str, torch.Tensor]:
    """A table's full fp32 weight and states from every rank's shards; each element must come exactly once."""
    rows, cols, split = placement.rows, placement.cols, placement.column_split
    mine = [piece for rank_pieces in pieces for piece in rank_pieces]
    if len(placement.shards) == 1 and all(
        v.numel() == (rows * cols if n == FP32 or states[n] == POINTWISE else rows) for n, _, v in mine
    ):
        # one shard holds the whole table (a table-wise one, on its writer): its tensors as they are, with no copy
        return {n: v.reshape(rows, cols if n == FP32 or states[n] == POINTWISE else 1) for n, _, v in mine}
    out = {FP32: torch.empty(rows, cols)}
    for name, kind in states.items():
        out[name] = torch.empty(rows, cols) if kind == POINTWISE else torch.empty(rows, len(split))
    filled = dict.fromkeys(out, 0)
    for rank_pieces in pieces:
        for name, offsets, value in rank_pieces:
            if name == FP32 or states[name] == POINTWISE:
                (r, c), (n, m) = offsets, value.shape
                out[name][r : r + n, c : c + m] = value
            else:
                column, r = compat.row_state_place(placement, offsets[0])
                out[name][r : r + value.numel(), column] = value
            filled[name] += value.numel()
    short = {k: (n, out[k].numel()) for k, n in filled.items() if n != out[k].numel()}
    if short:
        raise RuntimeError(f"TorchRec table {placement.key}: the ranks hold {short} (elements held, needed)")
    return out


def _writers(tables: dict[str, SavedTable]) -> dict[str, int]:
    """The rank that writes each table: its owner if one rank holds it, else, of the ranks holding a shard, the one
    with the fewest bytes to write so far; the same answer on every rank, from the plan alone."""
    load: dict[int, int] = {}
    out: dict[str, int] = {}
    for key, table in sorted(tables.items(), key=lambda kv: len({s.rank for s in kv[1].placement.shards}) > 1):
        ranks = sorted({s.rank for s in table.placement.shards})
        out[key] = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[out[key]] = load.get(out[key], 0) + table.placement.rows * table.placement.cols
    return out


class TorchRecCheckpointer:
    """Saves and loads one TorchRec job's universal checkpoints (collective: every rank calls each method).

    Args:
        model: the `DistributedModelParallel` model.
        dense_optimizer: what steps its dense parameters (a torch optimizer, a `KeyedOptimizerWrapper`, or the
            `CombinedOptimizer` that also holds `model.fused_optimizer`); None when nothing dense is trained.
        differential: Check-N-Run's `"differential"` section (`policy`, `tables`); None saves whole tables.
        quantize: Check-N-Run's `"quantize"` section (`method`, `bits` or `expected_restores`, `tables`).
        approximate_row_state: load a per-row state across a change of column split as the width-weighted mean of
            the saved column shards, instead of refusing.
        wait_minutes: how long a rank waits for another during a save or load (rank 0 picking the tag, a rank writing
            its tables) before it fails on every rank; these waits run on a gloo group of their own, so NCCL's
            collective timeout does not bound them.

    Example:
        >>> ckpt = TorchRecCheckpointer(model, dense_optimizer, differential={"policy": "intermittent"})
        >>> ckpt.save("checkpoints", step=100)
        >>> resumed = ckpt.load("checkpoints")  # at any world size and plan
    """

    def __init__(
        self,
        model: Any,
        dense_optimizer: Any = None,
        *,
        differential: DifferentialConfig | dict[str, Any] | None = None,
        quantize: QuantizeConfig | dict[str, Any] | None = None,
        approximate_row_state: bool = False,
        wait_minutes: float = 60,
    ) -> None:
        if not compat.is_dmp(model):
            raise TypeError(f"TorchRecCheckpointer takes a DistributedModelParallel model, not {type(model).__name__}")
        if compat.is_2d_dmp(model):
            raise NotImplementedError(
                "TorchRec's DMPCollection (2D parallel) is not supported: its tables are also replicated across groups"
            )
        diff = DifferentialConfig.model_validate(differential) if isinstance(differential, dict) else differential
        quant = QuantizeConfig.model_validate(quantize) if isinstance(quantize, dict) else quantize
        self.model, self.approximate_row_state = model, approximate_row_state
        self.dense = compat.dense_optimizers(dense_optimizer, model)
        self._group = coordination_group(wait_minutes)
        with coordinated(self._group()):
            self._setup(model, diff, quant)

    def _setup(self, model: Any, diff: DifferentialConfig | None, quant: QuantizeConfig | None) -> None:
        """The tables, their states and the chain's policy, as every rank knows them (collective)."""
        self.tables = _known_everywhere(compat.dmp_tables(model))
        self.fused = {k: p for k, p in self.tables.items() if p.fused}
        names = self._named_dense()
        for opt in self.dense:
            for group in opt.param_groups:
                if any(id(p) not in names for p in group["params"]):
                    raise ValueError(
                        f"the dense optimizer ({type(opt).__name__}) steps a tensor that is not a dense parameter of "
                        "the model (a fused table's, whose kernel steps it, or another model's)"
                    )
        for key, placement in self.tables.items():
            if placement.fused and placement.kernel != "fused":
                raise NotImplementedError(
                    f"TorchRec table {key} runs the {placement.kernel} kernel: its cache is neither written back "
                    "before a save nor purged after a load here; use compute_kernel='fused'"
                )
            if not placement.fused and placement.sharding != DATA_PARALLEL:
                # its parameter is this rank's shard, stepped by the dense optimizer with a state of the shard's shape
                raise NotImplementedError(
                    f"TorchRec table {key} is {placement.sharding} with the dense compute kernel: only fused tables "
                    "and data-parallel ones are supported (shard it with compute_kernel='fused')"
                )
        shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        local = {k: {n: shape for n, (shape, _) in v.items()} for k, v in compat.dmp_fused_states(model).items()}
        for found in every_rank(local):  # a rank that holds no shard of a table has no state of it
            for key, states in found.items():
                shapes.setdefault(key, {}).update(states)
        self.states = {
            k: {n: state_kind(p, n, shape) for n, shape in sorted(shapes.get(k, {}).items())}
            for k, p in self.fused.items()
        }
        patterns = (diff.tables if diff else None) or (quant.tables if quant else None)
        self.chosen = {k for k, p in self.fused.items() if _matches(patterns, p)}
        if patterns and not self.chosen:
            raise ValueError(f"Check-N-Run found no fused TorchRec table matching {patterns}")
        self.policy = ChainPolicy(
            diff.policy if diff else None,
            quant.method if quant else None,
            quant.bits if quant else None,
            quant.expected_restores if quant else None,
        )
        chosen = {k: p for k, p in self.fused.items() if k in self.chosen}
        self.tracker = _KjtTracker(model, chosen) if self.policy.tracked else None
        self._run = from_rank0(uuid.uuid4().hex[:16] if dist.get_rank() == 0 else None)
        self._saves = 0

    # -- save -----------------------------------------------------------------------------------------------------

    def save(
        self,
        save_dir: str,
        tag: str | None = None,
        *,
        step: int,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
    ) -> str:
        """Write checkpoint `tag` (default `global_step<step>`) under `save_dir`; returns its folder (collective)."""
        tag = tag or f"global_step{step}"
        self._saves += 1
        save_id = f"{self._run}-{self._saves}"
        changed = self.tracker.take() if self.tracker is not None else {}
        with self.policy.saving(changed, tag, save_id) as chain_step, coordinated(self._group()):
            out = self._write(save_dir, tag, chain_step, save_id, step, client_state or {})
            end_tag(save_dir, tag, save_latest)
        return out

    def _write(
        self, save_dir: str, tag: str, chain_step: ChainStep, save_id: str, step: int, client_state: dict[str, Any]
    ) -> str:
        """Write the tag's files, each table by one rank, and last the manifest (collective); returns the folder."""
        out = start_tag(save_dir, tag)
        saved = {k: SavedTable(placement=p, states=self.states[k]) for k, p in sorted(self.fused.items())}
        groups = self._dense_groups()
        with UniversalWriter(root=out) as writer:
            # each table goes whole to one writer among the ranks that hold a shard of it: a table-wise table's owner
            # holds it already, so nothing crosses the network for it; every rank then writes its tables at once
            local = compat.dmp_local_weights(self.model, set(self.fused))
            fused_states = compat.dmp_fused_states(self.model)
            held: dict[str, tuple[list[Any], torch.dtype]] = {}
            writers = _writers(saved)
            for key in saved:
                # on the host: a piece pickled on one GPU would be unpickled onto that GPU's index on the writer
                mine = [(FP32, s.offsets, s.tensor.detach().float().cpu()) for s in local[key]]
                for name, (_, shards) in fused_states.get(key, {}).items():
                    mine += [(name, s.offsets, s.tensor.detach().float().cpu()) for s in shards]
                pieces = gather_at(mine, writers[key])
                if pieces is not None:  # the writer holds a shard: the dtype the kernel keeps the table in
                    held[key] = (pieces, local[key][0].tensor.dtype)
            written: list[tuple[str, FileRecord, ParamRecord]] = []
            failure = None
            try:
                for g, (key, table) in enumerate(saved.items(), start=len(groups)):
                    if key in held:
                        written.append(self._write_table(writer, table, *held.pop(key), chain_step, g))
                if dist.get_rank() == 0:
                    for name, tensors, group in self._dense_states():
                        if group is None:
                            writer.add_frozen(name, tensors[VALUE])
                        else:
                            writer.add_param(name, tensors, group=group)
            except Exception as exc:  # raised on every rank below, once each has written its share
                failure = failure_of(exc)
            answers = to_rank0((written, failure))
            lrs: dict[str, float] = {}
            for known in every_rank(compat.dmp_fused_lrs(self.model)):  # a rank knows the tables its kernels step
                lrs.update(known)
            all_ok(failure if answers is None else next((f for _, f in answers if f), None))
            extra = {
                "save_id": save_id,
                "differential": chain_step.section,
                SECTION: {
                    "world_size": dist.get_world_size(),
                    "tables": {k: s.encode() for k, s in saved.items()},
                    "dense_tables": sorted(set(self.tables) - set(self.fused)),
                    "dense_optimizers": [type(o).__name__ for o in self.dense],
                },
            }
            guarded(lambda: self._finish(writer, step, client_state, self._group_records(groups, lrs), extra, answers))
        return out

    def _write_table(
        self,
        writer: UniversalWriter,
        table: SavedTable,
        pieces: list[Any],
        dtype: torch.dtype,
        chain_step: ChainStep,
        group: int,
    ) -> tuple[str, FileRecord, ParamRecord]:
        """Write one table whole from every rank's shards (its writer's part); returns its file and record."""
        placement, key = table.placement, table.placement.key
        full = _assemble(placement, table.states, pieces)
        chosen = key in self.chosen
        spec = TableSave(
            chain_step.rows.get(key) if chosen else None,
            self.policy.method if chosen else None,
            chain_step.bits if chosen else None,
        )
        widths = {n: [len(placement.column_split)] for n, k in table.states.items() if k == ROW_WISE}
        tensors = table_tensors(full, spec)
        # widest dtype first, as safetensors orders them, so that every tensor starts aligned to its element size
        order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
        entries = [(k, tensors[k].dtype, tuple(tensors[k].shape)) for k in order]
        # streamed: each tensor's bytes go to the file as they are, with their CRCs, and no serialised copy
        file = stream_tensors(writer.root, table_file(key), entries, tensors.__getitem__)
        record = ParamRecord(
            shape=(placement.rows, placement.cols),
            dtype=dtype_name(dtype),
            group=group,
            trainable=True,
            file=table_file(key),
            keys=(FP32, *table.states),
            extra={"table": table_record(spec, placement.rows, widths)},
        )
        return key, file, record

    def _named_dense(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters() if n not in self.fused}

    def _dense_groups(self) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
        """Every dense optimizer's param groups, in order: their index is the manifest's group."""
        return [(opt, group) for opt in self.dense for group in opt.param_groups]

    def _dense_states(self) -> Iterator[tuple[str, dict[str, torch.Tensor], int | None]]:
        """(name, fp32 value and per-element states, group) of each dense parameter; a parameter no dense optimizer
        steps (frozen, or none given) comes with its value alone and no group."""
        names = self._named_dense()
        stepped = set()
        for g, (opt, group) in enumerate(self._dense_groups()):
            for p in group["params"]:
                stepped.add(id(p))
                tensors = {FP32: p.detach().float().cpu().clone()}
                for k, v in opt.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        if v.shape != p.shape:
                            raise NotImplementedError(
                                f"dense optimizer state {k!r} of {names[id(p)]} has shape {list(v.shape)}, not its "
                                f"parameter's {list(p.shape)}"
                            )
                        tensors[k] = v.detach().float().cpu().clone()
                yield names[id(p)], tensors, g
        for name, p in self.model.named_parameters():
            if id(p) in names and id(p) not in stepped:
                yield name, {VALUE: p.detach().cpu().clone()}, None

    def _group_records(
        self, groups: list[tuple[torch.optim.Optimizer, dict[str, Any]]], lrs: dict[str, float]
    ) -> list[GroupRecord]:
        """The dense optimizers' groups, in order, then one group per fused table: its kernel optimizer, its
        arguments and its learning rate (which TorchRec's own state dict leaves out)."""
        records = []
        for opt, group in groups:
            scalars: dict[str, Any] = next((opt.state[p] for p in group["params"] if opt.state.get(p)), {})
            records.append(
                GroupRecord(
                    {k: encode_value(v) for k, v in group.items() if k != "params"},
                    {k: encode_value(v) for k, v in scalars.items() if not (torch.is_tensor(v) and v.dim() > 0)},
                )
            )
        for key, placement in sorted(self.fused.items()):
            hyper = {"optimizer": placement.optimizer, "lr": lrs[key], **placement.optimizer_args}
            records.append(GroupRecord(hyper, {}))
        return records

    def _finish(
        self,
        writer: UniversalWriter,
        step: int,
        client_state: dict[str, Any],
        groups: list[GroupRecord],
        extra: dict[str, Any],
        answers: list[Any] | None,
    ) -> None:
        """Rank 0's part after the tables: their records, the buffers, the client state, then the manifest, last."""
        if answers is None:
            return
        for name, file, record in sorted(w for written, _ in answers for w in written):
            writer.add_written(name, file, record)
        writer.add_buffers({n: b.detach().cpu() for n, b in self._buffers().items()})
        writer.set_state(TrainingState(client_state=client_state))
        writer.finish(
            source=SourceRecord(
                writer.root,
                st.basename(writer.root),
                Topology(dp=dist.get_world_size(), zero_stage=0, dtype="fp32", optimizer=SECTION),
                {"torchrec": compat.torchrec_version()},
            ),
            counters=Counters(global_steps=step),
            param_groups=groups,
            extra=extra,
        )

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers: its state dict less its parameters and tables."""
        params = {n for n, _ in self.model.named_parameters()} | set(self.tables)
        return {k: v for k, v in self.model.state_dict().items() if k not in params and torch.is_tensor(v)}

    # -- load -----------------------------------------------------------------------------------------------------

    def load(self, load_dir: str, tag: str | None = None) -> Resumed:
        """Restore the model, its buffers, the fused and dense optimizers from `tag` (default: the latest) at this
        job's world size and plan; all or nothing: a refused load leaves every rank as it was (collective)."""
        with coordinated(self._group()):
            picked = from_rank0(guarded(lambda: self._tag(load_dir, tag) if dist.get_rank() == 0 else None))
            staged = guarded(lambda: self._read(load_dir, picked))
        for live, value in staged.copies:
            live.copy_(value)
        # in place, as every optimizer keeps them: a TorchRec KeyedOptimizer shares its wrapped optimizer's state and
        # groups, and its `load_state_dict` refuses a state into an optimizer that has not stepped
        for states, p, state in staged.dense_states:
            states[p] = state
        for group, hyper in staged.dense_groups:
            group.update(hyper)
        compat.set_dmp_fused_lrs(self.model, staged.lr)
        self.policy.restored(staged.manifest)
        if self.tracker is not None:
            self.tracker.clear()
        return Resumed(tag=picked, step=staged.manifest.counters.global_steps, client_state=staged.client_state)

    def _read(self, load_dir: str, tag: str) -> _Staged:
        """Open the tag (a chain's elements too) and stage what this rank loads from it."""
        with self._open(load_dir, tag) as ckpt:
            return self._stage(ckpt, st.join(load_dir, tag))

    @staticmethod
    def _tag(load_dir: str, tag: str | None) -> str:
        if tag is not None:
            return tag
        latest = st.join(load_dir, "latest")
        if not st.isfile(latest):
            raise CheckpointError(latest, "is missing: name the tag to load")
        return st.read(latest).decode().strip()

    @staticmethod
    def _open(load_dir: str, tag: str) -> ChainCheckpoint:
        if not st.isfile(st.join(load_dir, tag, MARKER)):
            raise CheckpointError(st.join(load_dir, tag), "is not a TorchRec checkpoint of ucp_deepspeed (no marker)")
        return ChainCheckpoint(load_dir, tag)

    def _stage(self, ckpt: ChainCheckpoint, root: str) -> _Staged:
        """Read and check everything this rank loads, into new tensors; nothing live changes here."""
        manifest = ckpt.manifest
        where = st.join(root, MANIFEST)
        section = manifest.section(SECTION)
        if not section:
            raise CheckpointError(where, "has no 'torchrec' section: not a TorchRec save")
        try:
            saved = {k: SavedTable.decode(k, v) for k, v in dict(section["tables"]).items()}
            dense_tables = [str(k) for k in section.get("dense_tables", [])]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(where, f"malformed 'torchrec' section ({exc})") from None
        staged = _Staged(manifest=manifest, client_state=ckpt.load_state().get("client_state") or {})
        local = compat.dmp_local_weights(self.model, set(self.fused))
        fused_states = compat.dmp_fused_states(self.model)
        for key, placement in sorted(self.fused.items()):
            if key not in saved:
                was = "saved data-parallel, stepped by the dense optimizer" if key in dense_tables else "not saved"
                raise CheckpointError(
                    where,
                    f"table {key} was {was}; the live plan fuses it ({placement.sharding}, {placement.optimizer})",
                )
            lr = _check_table(where, ckpt, saved[key])
            self._stage_table(ckpt, where, saved[key], placement, local[key], fused_states.get(key, {}), staged)
            if lr is not None:
                staged.lr[key] = lr
        extra = sorted(set(saved) - set(self.fused))
        if extra:
            raise CheckpointError(where, f"holds fused tables {extra} that the live model does not fuse")
        live_types = [type(o).__name__ for o in self.dense]
        saved_types = section.get("dense_optimizers", live_types)
        if saved_types != live_types:
            raise CheckpointError(where, f"was saved by dense optimizers {saved_types}; the live ones are {live_types}")
        self._stage_dense(ckpt, where, staged)
        self._stage_buffers(ckpt, where, staged)
        return staged

    def _stage_buffers(self, ckpt: FolderReader, where: str, staged: _Staged) -> None:
        """The model's persistent buffers, each of its saved shape and dtype."""
        saved = ckpt.manifest.buffers
        for name, live in self._buffers().items():
            if name not in saved:
                raise CheckpointError(where, f"has no buffer {name}; the live model has one")
            value = ckpt.read_buffer(name)
            if value.shape != live.shape:
                raise CheckpointError(where, f"buffer {name} is {list(value.shape)}; the live one {list(live.shape)}")
            staged.copies.append((live, value))

    def _stage_table(
        self,
        ckpt: FolderReader,
        where: str,
        saved: SavedTable,
        live: TablePlacement,
        weights: list[LocalShard],
        states: dict[str, tuple[tuple[int, ...], list[LocalShard]]],
        staged: _Staged,
    ) -> None:
        """One table's live shards, read from the saved full table."""
        key, was = live.key, saved.placement
        if (was.rows, was.cols) != (live.rows, live.cols):
            raise CheckpointError(
                where, f"table {key} is {was.rows} x {was.cols}; the live one is {live.rows} x {live.cols}"
            )
        if was.optimizer != live.optimizer:
            raise CheckpointError(
                where, f"table {key} was stepped by {was.optimizer}; the live plan steps it by {live.optimizer}"
            )
        kinds = self.states[key]
        if kinds != saved.states:
            raise CheckpointError(where, f"table {key} holds states {saved.states}; the live optimizer {kinds}")
        for shard in weights:
            staged.copies.append(
                (
                    shard.tensor,
                    _columns(
                        _rows(ckpt, key, FP32, shard.offsets[0], shard.tensor.shape[0], was.cols),
                        shard.offsets[1],
                        shard.tensor.shape[1],
                    ),
                )
            )
        for name, (_, shards) in states.items():
            for shard in shards:
                if kinds[name] == POINTWISE:
                    (r, c), (n, m) = shard.offsets, shard.tensor.shape
                    staged.copies.append((shard.tensor, _columns(_rows(ckpt, key, name, r, n, was.cols), c, m)))
                    continue
                column, r = compat.row_state_place(live, shard.offsets[0])
                value = self._row_state(where, ckpt, saved, live, name, column, r, shard.tensor.numel())
                staged.copies.append((shard.tensor, value))

    def _row_state(
        self,
        where: str,
        ckpt: FolderReader,
        saved: SavedTable,
        live: TablePlacement,
        name: str,
        column: int,
        row: int,
        rows: int,
    ) -> torch.Tensor:
        """Rows [row, row + rows) of a per-row state for the live column shard `column`."""
        was_split, split = saved.placement.column_split, live.column_split
        stored = _rows(ckpt, live.key, name, row, rows, len(was_split))
        if was_split == split:
            return stored[:, column].clone()
        if not self.approximate_row_state:
            raise CheckpointError(
                where,
                f"table {live.key}: {saved.placement.optimizer}'s {name!r} is kept per row and column shard, saved for "
                f"column shards at {list(was_split)} ({saved.placement.sharding}); the live plan's are at "
                f"{list(split)} ({live.sharding}): no exact conversion. Keep the column split, or pass "
                "approximate_row_state=True for the width-weighted mean of the saved shards",
            )
        lo = split[column]
        hi = split[column + 1] if column + 1 < len(split) else live.cols
        bounds = [*was_split, saved.placement.cols]
        weights = torch.tensor(
            [max(0, min(hi, b) - max(lo, a)) for a, b in zip(bounds, bounds[1:])], dtype=torch.float32
        )
        return (stored * weights).sum(dim=1) / weights.sum()

    def _stage_dense(self, ckpt: FolderReader, where: str, staged: _Staged) -> None:
        """The dense parameters and each dense optimizer's state dict, as `load_state_dict` takes them."""
        manifest = ckpt.manifest
        names = self._named_dense()
        params = {n: p for n, p in self.model.named_parameters() if n not in self.fused}
        groups = self._dense_groups()
        if len(manifest.param_groups) - len(self.fused) != len(groups):
            raise CheckpointError(
                where,
                f"has {len(manifest.param_groups) - len(self.fused)} dense param groups; the live optimizers have "
                f"{len(groups)}",
            )
        for g, (opt, group) in enumerate(groups):
            saved_group = manifest.param_groups[g]
            for p in group["params"]:
                name = names[id(p)]
                record = manifest.params.get(name)
                if record is None or record.group != g or tuple(record.shape) != tuple(p.shape):
                    raise CheckpointError(where, f"dense parameter {name} is not saved in group {g} at {list(p.shape)}")
                state = {k: ckpt.read(name, k).reshape(p.shape).to(p.device, p.dtype) for k in record.keys if k != FP32}
                if state:
                    state.update({k: decode_value(v) for k, v in saved_group.scalars.items()})
                staged.dense_states.append((opt.state, p, state))
            hyper = {k: decode_value(v) for k, v in (saved_group.hyperparams or {}).items()}
            staged.dense_groups.append((group, hyper))
        for name, p in params.items():  # every dense parameter's value, stepped or frozen
            record = manifest.params.get(name)
            if record is None or tuple(record.shape) != tuple(p.shape):
                raise CheckpointError(where, f"dense parameter {name} is not saved at {list(p.shape)}")
            staged.copies.append((p.data, ckpt.read(name, FP32 if record.trainable else VALUE).reshape(p.shape)))


def _check_table(where: str, ckpt: ChainCheckpoint, saved: SavedTable) -> float | None:
    """A fused table's record in the `torchrec` section checked against its parameter's record, row widths and
    group, which the reads index by; returns its saved learning rate (None where the save did not know it)."""
    p, manifest = saved.placement, ckpt.manifest
    record = manifest.params.get(p.key)
    if record is None or not record.trainable:
        raise CheckpointError(where, f"table {p.key} has no record among the parameters")
    widths = {n: (len(p.column_split),) if kind == ROW_WISE else (p.cols,) for n, kind in saved.states.items()}
    covered = sum(s.rows * s.cols for s in p.shards) == p.rows * p.cols
    if (
        tuple(record.shape) != (p.rows, p.cols)
        or not p.shards
        or not covered
        or tuple(record.keys) != (FP32, *saved.states)
        or any(ckpt.row_width(p.key, n) != w for n, w in widths.items())
    ):
        raise CheckpointError(where, f"table {p.key}: its torchrec record does not fit its parameter's record")
    if record.group is None or not 0 <= record.group < len(manifest.param_groups):
        raise CheckpointError(where, f"table {p.key} names no param group of the save")
    lr = (manifest.param_groups[record.group].hyperparams or {}).get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        raise CheckpointError(where, f"table {p.key}: its learning rate {lr!r} is not a number")
    return None if lr is None else float(lr)


@dataclass
class _Staged:
    """What a load will change, staged before anything live does."""

    manifest: Manifest
    client_state: dict[str, Any]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    dense_states: list[tuple[Any, torch.Tensor, dict[str, Any]]] = field(default_factory=list)
    """(an optimizer's `state`, a parameter, its new state)."""
    dense_groups: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    """(a live param group, its saved hyperparameters)."""
    lr: dict[str, float] = field(default_factory=dict)


def _rows(ckpt: FolderReader, key: str, state: str, start: int, count: int, width: int) -> torch.Tensor:
    """Rows [start, start + count) of a table's state whose rows hold `width` values."""
    return ckpt.read(key, state, start * width, count * width).reshape(count, width)


def _columns(rows: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Columns [start, start + count) of freshly read rows: a view, copied once, into the live shard."""
    return rows[:, start : start + count]
