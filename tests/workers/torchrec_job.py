"""A TorchRec DLRM job under `DistributedModelParallel`, saved and resumed through `TorchRecCheckpointer`.

`save` trains 8 steps and saves at steps 2 and 4, through one checkpointer per source (whole, one-shot, incremental
and quantized chains), writing each model's full state right after the step-4 save (`saved_<optimizer>.pt`, rank 0)
and the loss of every step. `load` builds the model under another plan at this world size, loads a source, writes the
full state right after the load (`loaded_<case>.pt`) and the next 4 losses; a refused load writes its error instead.

The global batch of each step is the same at every world size, each rank taking its share and the mean of its
losses: DDP averages the dense gradients over the ranks, and TorchRec divides the embedding gradients it sends back
to each table's owner by the world size (`comm_ops.set_gradient_division`, on by default), so every world size
takes the same steps and a resume's next losses compare with the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ucp_deepspeed import compat
from ucp_deepspeed.torchrec import TorchRecCheckpointer, export_dcp, import_dcp

TABLES = {"t1": 40, "t2": 60, "t3": 24}
FEATURES = {"t1": ["f1"], "t2": ["f2", "f3"], "t3": ["f4"]}
DIM, DENSE_IN, BATCH = 8, 4, 12
DTENSOR = False  # `--dtensor`: tables as DTensors in state_dict() (TorchRec's `output_dtensor`), not ShardedTensors
OPTIMIZERS = {"rowwise": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adagrad": EmbOptimType.EXACT_ADAGRAD}
# plans by name: table -> how it is sharded (ranks are this world's)
PLANS = {
    "saved": {"t1": ("table_wise", 0), "t2": ("column_wise", [0, 1]), "t3": ("data_parallel", None)},
    "moved": {"t1": ("table_wise", 1), "t2": ("column_wise", [1, 0]), "t3": ("data_parallel", None)},
    "one_rank": {"t1": ("table_wise", 0), "t2": ("column_wise", [0, 0]), "t3": ("data_parallel", None)},
    "one_rank_tw": {"t1": ("table_wise", 0), "t2": ("table_wise", 0), "t3": ("data_parallel", None)},
}


# the learning rate the saving job gives its tables (TorchRec's own state dict leaves it out): a load sets it; one
# rate for all, since tables that share a kernel at another plan share its rate
LR = 0.04


def build(optimizer: str, plan_name: str, lrs: bool = False) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """The DLRM under the named plan, with its fused kernel optimizer and a dense Adagrad over the dense parameters
    but one, left frozen; a buffer counts the steps. `lrs`: the tables' learning rate is `LR`, not 0.05."""
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=FEATURES[t])
        for t, n in TABLES.items()
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )
    model.register_buffer("steps_seen", torch.zeros(()))
    model.over_arch.model[1].bias.requires_grad_(False)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": OPTIMIZERS[optimizer], "learning_rate": 0.05})
    make = {
        "table_wise": lambda r: table_wise(rank=r, compute_kernel="fused"),
        "column_wise": lambda r: column_wise(ranks=r, compute_kernel="fused"),
        "data_parallel": lambda r: data_parallel(),
    }
    world = dist.get_world_size()
    per_table = {t: make[kind](arg) for t, (kind, arg) in PLANS[plan_name].items()}
    module_plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        env=ShardingEnv(world, dist.get_rank(), dist.GroupMember.WORLD, output_dtensor=DTENSOR),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}),
        sharders=[sharder],
    )
    trained = {n: p for n, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad}
    dense = KeyedOptimizerWrapper(trained, lambda params: torch.optim.Adagrad(params, lr=0.05))
    if lrs:  # as a user's schedule sets them (DCP's saves do not hold them)
        compat.set_dmp_fused_lrs(dmp, dict.fromkeys(dmp.fused_optimizer.params, LR))
    return dmp, dense


def batch(step: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch, the same at every world size."""
    g = torch.Generator().manual_seed(1000 + step)
    dense = torch.randn(BATCH, DENSE_IN, generator=g)
    labels = torch.randint(0, 2, (BATCH,), generator=g).float()
    lengths = {f: torch.randint(0, 3, (BATCH,), generator=g) for fs in FEATURES.values() for f in fs}
    ids = {
        f: torch.randint(0, TABLES[t] // 2 if step % 2 else TABLES[t], (int(lengths[f].sum()),), generator=g)
        for t, fs in FEATURES.items()
        for f in fs
    }  # odd steps look up half the rows: deltas stay small
    world, rank = dist.get_world_size(), dist.get_rank()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    keys = [f for fs in FEATURES.values() for f in fs]
    values, lens = [], []
    for f in keys:
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].cumsum(0)])
        values.append(ids[f][starts[lo] : starts[hi]])
        lens.append(lengths[f][lo:hi])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lens))
    return dense[lo:hi], kjt, labels[lo:hi]


def train_step(model: Any, dense_opt: Any, step: int) -> float:
    """One step on the global batch; returns the global mean loss."""
    dense, kjt, labels = batch(step)
    logits = model(dense, kjt).squeeze(-1)
    losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    losses.mean().backward()  # the fused tables step in backward
    model.module.steps_seen += 1
    dense_opt.step()
    dense_opt.zero_grad()
    total = losses.detach().sum().reshape(1)
    dist.all_reduce(total)
    return float(total) / BATCH


def snapshot(model: Any, dense_opt: Any) -> dict[str, torch.Tensor] | None:
    """Every table, fused state, dense parameter and dense state, whole, on rank 0 (collective). Each rank sends the
    shards it holds, by their offsets: a rank without a shard of a table has no fused state of it to take part with."""
    mine: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]] = {}

    def add(name: str, value: Any) -> None:
        if hasattr(value, "local_shards"):
            shards = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
            mine[name] = (tuple(value.shape), shards)
        elif hasattr(value, "to_local"):  # a DTensor over TorchRec's LocalShardsWrapper
            local = value.to_local()
            shards = [(tuple(o), t.detach().clone()) for o, t in zip(local.local_offsets(), local.local_shards())]
            mine[name] = (tuple(value.shape), shards)
        else:
            value = torch.as_tensor(value).detach().clone()
            mine[name] = (tuple(value.shape), [((0,) * value.dim(), value)])

    for key, value in model.state_dict().items():
        add(key, value)
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            add(f"{key}/{name}", value)
    for key, lr in compat.dmp_fused_lrs(model).items():
        add(f"lr/{key}", torch.tensor(lr))
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in dense_opt.state.items():
        for name, value in state.items():
            add(f"{names[id(p)]}/{name}", value)
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for name, (shape, shards) in rank_pieces.items():
            for offsets, tensor in shards:
                full = out.setdefault(name, torch.zeros(shape, dtype=tensor.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    return out


SOURCES = {
    "full": {},
    "one_shot": {"differential": {"policy": "one_shot"}},
    "incremental": {"differential": {"policy": "incremental"}},
    "intermittent": {"differential": {"policy": "intermittent"}},
    "quantized": {"differential": {"policy": "one_shot"}, "quantize": {"method": "symmetric", "bits": 8}},
}


def save(out: Path, optimizers: list[str]) -> None:
    for optimizer in optimizers:
        model, dense = build(optimizer, "saved", lrs=True)
        savers = {name: TorchRecCheckpointer(model, dense, **cfg) for name, cfg in SOURCES.items()}
        # TorchRec's own record of the ids each rank looked up, to cross-check the rows a delta holds
        delta = model.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
        losses = {}
        for step in range(1, 9):
            losses[step] = train_step(model, dense, step)
            if step in (2, 4):
                for name, saver in savers.items():
                    saver.save(str(out / f"{optimizer}-{name}"), step=step, client_state={"epoch": step // 2})
                ids = {k: v.tolist() for k, v in delta.get_unique_ids().items()}  # since the last call
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, ids)
                if step == 4 and dist.get_rank() == 0:
                    union = {k: sorted({i for rank in every for i in rank.get(k, [])}) for k in set().union(*every)}
                    (out / f"delta_tracker_{optimizer}.json").write_text(json.dumps(union))
            if step == 4:  # and as a TorchRec user saves it with DCP, fused and dense optimizer in one
                state = {
                    "model": model.state_dict(),
                    "optim": CombinedOptimizer([model.fused_optimizer, dense]).state_dict(),
                }
                dcp.save({**state, "epoch": 2}, checkpoint_id=str(out / f"{optimizer}-dcp"))
                snap = snapshot(model, dense)
                if snap is not None:
                    torch.save(snap, out / f"saved_{optimizer}.pt")
        if dist.get_rank() == 0:
            (out / f"losses_{optimizer}.json").write_text(json.dumps(losses))


def _dcp_state(model: Any, dense: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": CombinedOptimizer([model.fused_optimizer, dense]).state_dict()}


def _resume(source: str, flags: list[str], model: Any, dense: Any, out: Path, saver: TorchRecCheckpointer) -> tuple:
    """Load `source` into the model by the case's route; returns the step it was saved at and the client state."""
    if "dcp_direct" in flags:  # TorchRec's own way back: DCP into this plan's tensors, in place
        dense.init_state()  # a KeyedOptimizer's state exists only once it stepped
        state = {**_dcp_state(model, dense), "epoch": 0}
        dcp.load(state, checkpoint_id=source)
        return 4, {"epoch": state["epoch"]}
    if "import" in flags:  # TorchRec's dcp.save, imported as our tag by one process, then loaded
        target = out / f"imported-{Path(source).name}"
        if dist.get_rank() == 0:
            import_dcp(source, str(target))
        dist.barrier()
        source = str(target)
    if "export" in flags:  # our tag, exported for dcp.load, loaded by DCP into this plan
        exported = out / f"exported-{Path(source).name}"
        if dist.get_rank() == 0:
            export_dcp(source, "global_step4", str(exported))
        dist.barrier()
        return _resume(str(exported), ["dcp_direct"], model, dense, out, saver)
    resumed = saver.load(source)
    return resumed.step, resumed.client_state


def load(out: Path, cases: list[str]) -> None:
    """Each case `<source dir>:<optimizer>:<plan>[:<flag>...]` loads into a fresh model and trains 4 steps. Flags:
    `approximate` (per-row states across a column split change), `import` (the source is TorchRec's dcp.save),
    `export` (loaded by DCP from our export), `dcp_direct` (DCP's own load of the source), `lrs` (the job sets the
    tables' learning rates itself: DCP's saves do not hold them). A refused load records its error and whether the
    model stayed as it was."""
    results = {}
    for case in cases:
        source, optimizer, plan, *flags = case.split(":")
        model, dense = build(optimizer, plan, lrs="lrs" in flags)
        saver = TorchRecCheckpointer(model, dense, approximate_row_state="approximate" in flags)
        name = "-".join([Path(source).name, plan, *flags])
        before = snapshot(model, dense)
        try:
            step, client_state = _resume(source, flags, model, dense, out, saver)
        except (Exception, dcp.api.CheckpointException) as exc:  # the refusal is the result (DCP's is no Exception)
            after = snapshot(model, dense)
            unchanged = None if after is None else all(torch.equal(before[k], after[k]) for k in before)
            results[name] = {"error": str(exc), "unchanged": unchanged}
            continue
        snap = snapshot(model, dense)
        if snap is not None:
            torch.save(snap, out / f"loaded_{name}.pt")
        losses = {s: train_step(model, dense, s) for s in range(step + 1, step + 5)}
        results[name] = {"step": step, "client_state": client_state, "losses": losses}
    if dist.get_rank() == 0:
        (out / f"results_{dist.get_world_size()}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--case", nargs="*", default=[])
    parser.add_argument("--dtensor", action="store_true")
    args = parser.parse_args()
    global DTENSOR
    DTENSOR = args.dtensor
    dist.init_process_group("gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "save":
        save(args.out, args.optimizers)
    else:
        load(args.out, args.case)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
