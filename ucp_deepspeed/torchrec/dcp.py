"""TorchRec's own `dcp.save` of a `DistributedModelParallel` job, imported as a universal tag, and ours exported back.

A TorchRec job saves `{"model": model.state_dict(), "optim": optimizer.state_dict(), ...}` with DCP, where the
optimizer is the fused one or a `CombinedOptimizer` of it and a `KeyedOptimizerWrapper`. Each entry is flattened by
its path: a table's weight at `("model", <key>)`, a fused state at `("optim", "state", <key>, "<table>.<state>")`, a
dense state at `("optim", "state", <name>, <state>)`. DCP loads such a save only into the plan it was saved at, since
a per-row state of a column-wise table has rows x column shards entries (torchrec #2394, #2534). The files still
tell everything a load at another plan needs: the column split is where the weight's stored chunks start, and the
fused optimizer is the one whose states those are (`optimizer=` names it where they do not tell). What they do not
hold (the fused learning rate, the dense hyperparameters) the loading job keeps.

`export_dcp` writes the same layout from one of our tags, a per-row state back in TorchRec's rows x column shards, so
`dcp.load` reads it into a job at any plan with the saved column split.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import torch

from ucp_deepspeed import compat
from ucp_deepspeed.checkn_run.chain import MARKER, ChainCheckpoint
from ucp_deepspeed.checkn_run.live_save import TableSave, table_file, table_record, table_tensors
from ucp_deepspeed.compat.torchrec import TablePlacement, TableShard
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Counters, GroupRecord, SourceRecord, dtype_name
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.paths import check_output
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import decode_value, encode_value, torch_dtype
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources.dcp import DcpCheckpoint
from ucp_deepspeed.torchrec.checkpointer import POINTWISE, ROW_WISE, SECTION, SavedTable, state_kind

# the fused optimizer a table's states come from, where its states tell it: (state name, kind) pairs -> optimizer
_OPTIMIZER_OF = {
    (): "exact_sgd",
    (("momentum1", ROW_WISE),): "exact_row_wise_adagrad",
    (("momentum1", POINTWISE),): "exact_adagrad",
    (("momentum1", POINTWISE), ("momentum2", POINTWISE)): "adam",
}


def _placement(ckpt: DcpCheckpoint, key: str, weight_key: str, table: str, optimizer: str | None) -> TablePlacement:
    """A fused table's placement as the save's stored chunks of its weight tell it."""
    entry = ckpt.tensors[weight_key]
    if len(entry.shape) != 2:
        raise CheckpointError(ckpt.path, f"table {key} is not a 2-D weight ({list(entry.shape)})")
    rows, cols = entry.shape
    shards = tuple(
        TableShard(c.offsets[0], c.offsets[1], c.sizes[0], c.sizes[1], i) for i, c in enumerate(entry.chunks)
    )
    split = {s.col for s in shards}
    sharding = "column_wise" if len(split) > 1 else "row_wise" if len(shards) > 1 else "table_wise"
    return TablePlacement(
        key=key,
        table=table,
        sharding=sharding,
        rows=rows,
        cols=cols,
        shards=shards,
        kernel="fused",
        optimizer=optimizer,
    )


def _entries(ckpt: DcpCheckpoint, model_key: str, optim_key: str) -> tuple[dict, dict, list[str]]:
    """The model's tensors by key, each key's optimizer states by name, and every other entry."""
    model: dict[str, str] = {}
    states: dict[str, dict[str, str]] = {}
    rest: list[str] = []
    for flat, path in ckpt.paths.items():
        if len(path) == 2 and path[0] == model_key and flat in ckpt.tensors:
            model[str(path[1])] = flat
        elif len(path) == 4 and path[0] == optim_key and path[1] == "state":
            states.setdefault(str(path[2]), {})[str(path[3])] = flat
        else:
            rest.append(flat)
    return model, states, rest


def import_dcp(
    folder: str,
    save_dir: str,
    tag: str = "imported",
    *,
    model_key: str = "model",
    optim_key: str = "optim",
    optimizer: str | None = None,
) -> str:
    """Write TorchRec's `dcp.save` of a `DistributedModelParallel` job as tag `tag` of `save_dir`, which
    `TorchRecCheckpointer.load` resumes at any world size and plan; returns the tag's folder (one process).

    Args:
        folder: the DCP folder.
        save_dir: the checkpoint directory to add the tag to; `latest` names it.
        model_key, optim_key: the top-level keys of the model's and the optimizer's state dicts in the save.
        optimizer: the fused kernel optimizer (`exact_row_wise_adagrad`), where the states do not tell it.
    """
    folder = st.normalize(folder)
    out = st.join(save_dir, tag)
    check_output(out, [folder])
    with DcpCheckpoint(folder) as ckpt:
        model, states, rest = _entries(ckpt, model_key, optim_key)
        if not model:
            raise CheckpointError(ckpt.path, f"holds no tensor under {model_key!r}")
        st.makedirs(out)
        st.write(st.join(out, MARKER), b"")
        save_id = f"dcp-{uuid.uuid4().hex[:16]}"
        with UniversalWriter(root=out) as writer:
            tables, fused_states = _fused_tables(ckpt, model, states, optimizer)
            tables = dict(sorted(tables.items()))
            dense = [n for n in model if n not in tables]
            scalars = _write_dense(ckpt, writer, model, states, dense)
            stepped = any(states.get(n) for n in dense)
            for g, (key, saved) in enumerate(tables.items(), start=1 if stepped else 0):
                _write_table(ckpt, writer, model[key], fused_states[key], saved, g)
            client = {k: ckpt.tensor(k) if k in ckpt.tensors else ckpt.object(k) for k in rest}
            writer.set_state(TrainingState(client_state=client))
            step = scalars.get("step")
            writer.finish(
                source=SourceRecord(
                    folder,
                    None,
                    Topology(dp=1, zero_stage=0, dtype="fp32", optimizer=SECTION),
                    {"torch": str(ckpt.extra.get("version") or "")},
                    extra={"format": "dcp"},
                ),
                counters=Counters(global_steps=int(step) if step is not None else 0),
                param_groups=[
                    GroupRecord(None, {k: encode_value(v) for k, v in scalars.items()}),
                    *(
                        GroupRecord({"optimizer": t.placement.optimizer, "lr": None}, {})
                        for _, t in sorted(tables.items())
                    ),
                ],
                extra={
                    "save_id": save_id,
                    "differential": {
                        "kind": "baseline",
                        "policy": None,
                        "chain": [tag],
                        "chain_ids": [save_id],
                        "restores": 0,
                        "quantize": None,
                        "changed_fraction": None,
                    },
                    SECTION: {
                        "world_size": 0,
                        "tables": {k: t.encode() for k, t in tables.items()},
                        "dense_tables": [],
                    },
                    "notes": [
                        "imported from TorchRec's dcp.save: each table's column split from its weight's stored chunks, "
                        "its fused optimizer from its states; the fused learning rates and dense hyperparameters were "
                        "not saved, so a load keeps the live job's; global_steps is the dense optimizer's step"
                    ],
                },
            )
    st.write(st.join(save_dir, "latest"), tag.encode())
    return out


def _fused_tables(
    ckpt: DcpCheckpoint, model: dict[str, str], states: dict[str, dict[str, str]], optimizer: str | None
) -> tuple[dict[str, SavedTable], dict[str, dict[str, str]]]:
    """The tables a fused kernel stepped (those whose states carry their table's name, `t1.momentum1`), and each
    one's states by their own name."""
    found, fused_states = {}, {}
    for key, names in states.items():
        table = key.split(".")[-2] if key.count(".") >= 2 else ""
        fused = {n[len(table) + 1 :]: flat for n, flat in names.items() if table and n.startswith(table + ".")}
        if not fused or key not in model:
            continue
        placement = _placement(ckpt, key, model[key], table, optimizer)
        try:
            kinds = {n: state_kind(placement, n, ckpt.tensors[flat].shape) for n, flat in sorted(fused.items())}
        except (NotImplementedError, KeyError) as exc:
            raise CheckpointError(ckpt.path, f"table {key}: {exc}") from None
        inferred = optimizer or _OPTIMIZER_OF.get(tuple(sorted(kinds.items())))
        if inferred is None:
            raise CheckpointError(
                ckpt.path, f"table {key}: states {kinds} do not tell its fused optimizer; name it with optimizer="
            )
        found[key] = SavedTable(placement=dataclasses.replace(placement, optimizer=inferred), states=kinds)
        fused_states[key] = fused
    return found, fused_states


def _write_table(
    ckpt: DcpCheckpoint, writer: UniversalWriter, weight: str, states: dict[str, str], saved: SavedTable, group: int
) -> None:
    p = saved.placement
    n = len(p.column_split)
    full = {FP32: ckpt.tensor(weight).float()}
    for name, kind in saved.states.items():
        value = ckpt.tensor(states[name]).float()
        full[name] = value if kind == POINTWISE else value.reshape(n, p.rows).t().contiguous()
    widths = {name: [n] for name, kind in saved.states.items() if kind == ROW_WISE}
    spec = TableSave(None)
    writer.add_param(
        p.key,
        table_tensors(full, spec),
        group=group,
        dtype=dtype_name(ckpt.tensors[weight].dtype),
        shape=(p.rows, p.cols),
        keys=(FP32, *saved.states),
        file=table_file(p.key),
        extra={"table": table_record(spec, p.rows, widths)},
    )


def _write_dense(
    ckpt: DcpCheckpoint,
    writer: UniversalWriter,
    model: dict[str, str],
    states: dict[str, dict[str, str]],
    names: list[str],
) -> dict[str, Any]:
    """Write every dense tensor: one with optimizer state as a parameter of group 0, the rest (DCP does not say
    whether a buffer or a frozen parameter) as both, for the loading model to take as whichever it has. Returns
    group 0's scalar states."""
    scalars: dict[str, Any] = {}
    buffers = {}
    for name in names:
        value = ckpt.tensor(model[name])
        if not states.get(name):
            writer.add_frozen(name, value)
            buffers[name] = value
            continue
        tensors = {FP32: value.float()}
        for state, flat in sorted(states.get(name, {}).items()):
            got = ckpt.tensor(flat) if flat in ckpt.tensors else ckpt.object(flat)
            if isinstance(got, torch.Tensor) and got.dim() > 0:
                if got.shape != value.shape:
                    raise CheckpointError(ckpt.path, f"state {state!r} of {name} is not of its parameter's shape")
                tensors[state] = got.float()
                continue
            if state in scalars and not torch.equal(torch.as_tensor(scalars[state]), torch.as_tensor(got)):
                raise CheckpointError(ckpt.path, f"dense parameters hold different {state!r}: one group cannot")
            scalars[state] = got
        writer.add_param(name, tensors, group=0, dtype=dtype_name(value.dtype))
    writer.add_buffers(buffers)
    return scalars


def export_dcp(save_dir: str, tag: str, output: str, *, model_key: str = "model", optim_key: str = "optim") -> str:
    """Write one of our TorchRec tags as TorchRec's `dcp.save` would have; returns `output` (one process).

    `dcp.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=output)` then loads it
    at any plan that keeps the saved column split (any plan at all for weights and per-element states).
    """
    check_output(output, [st.join(save_dir, tag)])
    with ChainCheckpoint(save_dir, tag) as ckpt:
        section = ckpt.manifest.section(SECTION)
        try:
            tables = {k: SavedTable.decode(k, v) for k, v in dict(section["tables"]).items()}
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(st.join(save_dir, tag), f"no well-formed 'torchrec' section ({exc})") from None
        writer = compat.DcpWriter(output)
        try:
            for name in (n for n in ckpt.manifest.buffers if n not in ckpt.manifest.params):
                writer.put((model_key, name), ckpt.read_buffer(name))
            for name, record in ckpt.manifest.params.items():
                value = ckpt.read(name, FP32 if record.trainable else VALUE).reshape(record.shape)
                writer.put((model_key, name), value.to(torch_dtype(record.dtype)))
                if not record.trainable or record.group is None:
                    continue
                saved = tables.get(name)
                group = ckpt.manifest.param_groups[record.group]
                for key in (k for k in record.keys if k != FP32):
                    if saved is None:
                        writer.put((optim_key, "state", name, key), ckpt.read(name, key).reshape(record.shape))
                        continue
                    n = len(saved.placement.column_split)
                    stored = ckpt.read(name, key)
                    if saved.states[key] == ROW_WISE:
                        stored = stored.reshape(record.shape[0], n).t().reshape(-1)
                    else:
                        stored = stored.reshape(record.shape)
                    writer.put((optim_key, "state", name, f"{saved.placement.table}.{key}"), stored)
                if saved is None and len(record.keys) > 1:
                    for k, v in group.scalars.items():
                        writer.put((optim_key, "state", name, k), decode_value(v))
            for k, v in (ckpt.load_state().get("client_state") or {}).items():
                writer.put((str(k),), v)
        except BaseException:
            writer.abort()
            raise
        writer.finish()
    return output
