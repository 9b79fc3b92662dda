"""The reach into TorchRec: a `DistributedModelParallel` model's sharding plan, the local shards of its tables and of
its fused optimizer's state, the fbgemm kernel that steps each table, and the modules its sparse features enter.

TorchRec keeps a sharded table as a `ShardedTensor` whose local shards are views of the fused kernel's weights, and
the fused optimizer's state as `{"<table>.<state>": ShardedTensor}` per table, with no param groups. A row-wise state
(row-wise Adagrad's `momentum1`) of a table split into column shards is one vector of rows x column shards: the
shards sorted by column offset, shard i at entries [i * rows, (i + 1) * rows) (`batched_embedding_kernel.py`,
`EmbeddingFusedOptimizer`). torchrec is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class TableShard(NamedTuple):
    """One shard of a table: its first row and column, its size, and the rank that holds it."""

    row: int
    col: int
    rows: int
    cols: int
    rank: int


@dataclass(frozen=True)
class TablePlacement:
    """How a `DistributedModelParallel` model keeps one embedding table."""

    key: str
    """The table's key in `model.state_dict()` (`<module>.embedding_bags.<table>.weight`)."""
    table: str
    sharding: str
    """TorchRec's `ShardingType` value: `table_wise`, `column_wise`, `row_wise`, `data_parallel`, ..."""
    rows: int
    cols: int
    shards: tuple[TableShard, ...]
    """Every shard, in the plan's order; a data-parallel table has one per rank, each whole."""
    kernel: str
    """The plan's compute kernel: `fused` (fbgemm steps it), `dense` (the dense optimizer does), `fused_uvm_caching`,
    ..."""
    optimizer: str | None
    """The fbgemm kernel's fused optimizer (`exact_row_wise_adagrad`), as this rank's kernels know it: None on a rank
    that holds no shard of the table, or where the dense optimizer steps it."""
    optimizer_args: dict[str, Any] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """Whether a kernel of fbgemm's steps it, not the dense optimizer."""
        return self.kernel.startswith("fused")

    @property
    def column_split(self) -> tuple[int, ...]:
        """The first column of each column shard, in order: what a per-row state is kept per."""
        return tuple(sorted({s.col for s in self.shards}))


def is_dmp(model: Any) -> bool:
    """A TorchRec `DistributedModelParallel` model."""
    return any(
        c.__name__ == "DistributedModelParallel" and c.__module__.startswith("torchrec.distributed")
        for c in type(model).__mro__
    )


def _leaf_optimizers(optimizer: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, optimizer) of every leaf under TorchRec's nested `CombinedOptimizer`s."""
    members = getattr(optimizer, "optimizers", None)
    if members is None:
        yield path, optimizer
        return
    for name, member in members:
        yield from _leaf_optimizers(member, f"{path}.{name}" if path and name else path or name)


def _fused_kernels(model: Any) -> dict[str, Any]:
    """The fused optimizer of each table, by state-dict key: each leaf of `model.fused_optimizer`, matched to the
    model's keys by the parameters it steps."""
    owner: dict[int, str] = {id(p): k for k, p in model.fused_optimizer.params.items()}
    found: dict[str, Any] = {}
    for _, leaf in _leaf_optimizers(model.fused_optimizer):
        for local, p in getattr(leaf, "params", {}).items():
            key = owner.get(id(p)) or next((k for k in owner.values() if k.endswith("." + local)), None)
            if key is not None:
                found[key] = leaf
    return found


def dmp_tables(model: Any) -> dict[str, TablePlacement]:
    """Every embedding table of a `DistributedModelParallel` model, by its state-dict key, as its plan places it
    (the kernel optimizer as this rank's kernels know it)."""
    from torchrec.distributed.types import ShardingType

    kernels = _fused_kernels(model)
    keys = set(model.state_dict(keep_vars=True))
    world = model._env.world_size
    out: dict[str, TablePlacement] = {}
    for path, shardings in model.plan.plan.items():
        for table, ps in shardings.items():
            names = (f"{path}.embedding_bags.{table}.weight", f"{path}.embeddings.{table}.weight")
            key = next((k for k in names if k in keys), None)
            if key is None:
                raise NotImplementedError(f"TorchRec table {table!r} of {path!r} has no weight in the state dict")
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                weight = model.state_dict(keep_vars=True)[key]
                rows, cols = (int(n) for n in weight.shape)
                shards = tuple(TableShard(0, 0, rows, cols, r) for r in range(world))
            else:
                spec = ps.sharding_spec.shards
                shards = tuple(
                    TableShard(s.shard_offsets[0], s.shard_offsets[1], s.shard_sizes[0], s.shard_sizes[1], r)
                    for s in spec
                    for r in [s.placement.rank()]
                )
                rows = max(s.row + s.rows for s in shards)
                cols = max(s.col + s.cols for s in shards)
            kernel = kernels.get(key)
            module = getattr(kernel, "_emb_module", None)
            optimizer = getattr(module, "optimizer", None)
            args = getattr(module, "optimizer_args", None)
            out[key] = TablePlacement(
                key=key,
                table=table,
                sharding=str(ps.sharding_type),
                rows=rows,
                cols=cols,
                shards=shards,
                kernel=str(ps.compute_kernel),
                optimizer=None if optimizer is None else str(optimizer.value),
                optimizer_args={} if args is None else {k: v for k, v in args._asdict().items() if _plain(v)},
            )
    return out


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


class LocalShard(NamedTuple):
    """The piece of a global tensor this rank holds: its offsets in the global tensor, and the live tensor itself
    (a view of the kernel's storage: writing it changes the model)."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


def _local(value: Any) -> list[LocalShard]:
    if hasattr(value, "local_shards"):
        return [LocalShard(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor (TorchRec's `output_dtensor`): its local shards and their offsets
        local = value.to_local()
        if hasattr(local, "local_shards"):  # TorchRec's LocalShardsWrapper: every shard this rank holds
            return [LocalShard(tuple(o), t) for o, t in zip(local.local_offsets(), local.local_shards())]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [LocalShard(tuple(offsets), local)]
    return [LocalShard((0,) * value.dim(), value)]


def dmp_local_weights(model: Any, keys: set[str]) -> dict[str, list[LocalShard]]:
    """This rank's shards of the tables named by `keys` (a data-parallel table's whole replica)."""
    state = model.state_dict(keep_vars=True)
    return {k: [s._replace(tensor=s.tensor.detach()) for s in _local(state[k])] for k in keys}


def dmp_fused_states(model: Any) -> dict[str, dict[str, tuple[tuple[int, ...], list[LocalShard]]]]:
    """This rank's shards of each fused table's optimizer states: table key -> state name (`momentum1`, without
    the table's prefix) -> (the state's global shape, local shards)."""
    tables = {p.key: p.table for p in dmp_tables(model).values()}
    out: dict[str, dict[str, tuple[tuple[int, ...], list[LocalShard]]]] = {}
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        prefix = f"{tables.get(key, '')}."
        out[key] = {
            name.removeprefix(prefix): (tuple(int(n) for n in value.shape), _local(value))
            for name, value in states.items()
        }
    return out


def row_state_place(placement: TablePlacement, offset: int) -> tuple[int, int]:
    """Where a row-wise state's local shard starting at `offset` sits: (column shard index, first row)."""
    return offset // placement.rows, offset % placement.rows


def dmp_fused_lrs(model: Any) -> dict[str, float]:
    """The learning rate of each table this rank's fused kernels step, by state-dict key."""
    return {k: float(leaf.param_groups[0]["lr"]) for k, leaf in _fused_kernels(model).items()}


def set_dmp_fused_lrs(model: Any, lrs: dict[str, float]) -> None:
    """Give each of this rank's fused kernels the learning rate of its first table in `lrs`, in its param groups
    and in the kernel itself (which takes its groups' rate only at the next `step` or `zero_grad`)."""
    kernels = _fused_kernels(model)
    for leaf in {id(k): k for k in kernels.values()}.values():
        lr = next((lrs[k] for k, v in sorted(kernels.items()) if v is leaf and k in lrs), None)
        if lr is None:
            continue
        for group in leaf.param_groups:
            group["lr"] = lr
        leaf._emb_module.set_learning_rate(lr)


def dmp_sparse_modules(model: Any) -> list[tuple[torch.nn.Module, dict[str, str]]]:
    """Every sharded embedding module of the model and, for each feature it takes, the state-dict key of the table
    that feature looks up: the ids a forward looks up are the features' ids in the `KeyedJaggedTensor` it is given.
    Each module is found at its path in the plan, so two modules with tables of one name stay apart."""
    tables = dmp_tables(model)
    out = []
    for path in model.plan.plan:
        module = model.module.get_submodule(path)  # the unwrapped model: no DMP or DDP prefix
        configs = getattr(module, "_embedding_bag_configs", None) or getattr(module, "_embedding_configs", None)
        if configs is None:
            continue
        mine = {p.table: k for k, p in tables.items() if k.startswith(path + ".")}
        out.append((module, {f: mine[c.name] for c in configs for f in c.feature_names if c.name in mine}))
    return out


def is_2d_dmp(model: Any) -> bool:
    """TorchRec's `DMPCollection` (2D parallel: tables sharded within groups, replicated across them)."""
    return any(c.__name__ == "DMPCollection" for c in type(model).__mro__)


def dense_device(model: Any) -> torch.device:
    """The device the model's dense part (and the ids of its features) live on."""
    device: torch.device = next(model.module.parameters()).device
    return device


def kjt_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The ids of each feature in the `KeyedJaggedTensor` a sharded module's forward was called with."""
    features = args[0] if args else kwargs.get("features")
    return {} if features is None else {k: v.values() for k, v in features.to_dict().items()}


def dense_optimizers(optimizer: Any, model: Any) -> list[torch.optim.Optimizer]:
    """The optimizers that step the model's dense parameters: `optimizer` itself, or the members of a TorchRec
    `CombinedOptimizer` other than the model's fused one."""
    if optimizer is None:
        return []
    fused = {id(o) for _, o in _leaf_optimizers(model.fused_optimizer)} | {id(model.fused_optimizer)}
    return [o for _, o in _leaf_optimizers(optimizer) if id(o) not in fused]


def torchrec_version() -> str:
    """The installed torchrec's version, for the manifest."""
    from importlib.metadata import version

    return version("torchrec")
