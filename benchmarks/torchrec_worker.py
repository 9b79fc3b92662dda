"""The TorchRec benchmark's job (benchmarks/bench_torchrec.py runs it under torchrun): a DLRM under
`DistributedModelParallel` with Zipf-distributed lookups, saved and loaded by ours and by DCP on the same state.

`save` trains, then times each save on the same state: TorchRec's `dcp.save`, ours whole, ours as an 8-bit and a
4-bit baseline; trains a few steps more and times the one-shot delta. `load` builds the model under the given plan
and times each load it can do: ours from the whole save, and DCP's own (which stops at another plan). Rank 0 writes
the JSON report; every time is taken between barriers, so it is the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ucp_deepspeed.torchrec import TorchRecCheckpointer

DENSE_IN, POOLING, ZIPF = 13, 4, 1.1


def build(args: argparse.Namespace, moved: bool, merged: bool = False) -> tuple[Any, Any]:
    """The DLRM: tables alternately table-wise on each rank, the last column-wise in two shards (`moved`: the ranks
    reversed; `merged`: the last table-wise); fused row-wise Adagrad, dense Adagrad."""
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.tables)]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[n])
            for n in names
        ],
        device=torch.device("meta"),
    )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[64, args.dim],
        over_arch_layer_sizes=[64, 1],
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    world = dist.get_world_size()
    ranks = list(range(world))[::-1] if moved else list(range(world))
    per_table = {n: table_wise(rank=ranks[i % world], compute_kernel="fused") for i, n in enumerate(names[:-1])}
    # two column shards at every world size, so that the per-row state keeps its split and every load is exact
    per_table[names[-1]] = column_wise(ranks=(ranks * 2)[: max(2, world)], compute_kernel="fused")
    if merged:  # the column-wise table in one table-wise shard: its per-row state has no exact conversion
        per_table[names[-1]] = table_wise(rank=0, compute_kernel="fused")
    plan = construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.05)
    )
    return dmp, dense


def batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch: Zipf-distributed ids (exponent 1.1) over a fixed random order of each table's rows."""
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    order = torch.randperm(args.rows, generator=torch.Generator().manual_seed(7))
    weights = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** ZIPF
    n = args.batch * POOLING
    keys = [f"t{i}" for i in range(args.tables)]
    values = torch.cat([order[torch.multinomial(weights, n, replacement=True, generator=g)] for _ in keys])
    lengths = torch.full((len(keys) * args.batch,), POOLING)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    return torch.randn(args.batch, DENSE_IN, generator=g), kjt, torch.randint(0, 2, (args.batch,), generator=g).float()


def train(model: Any, dense: Any, args: argparse.Namespace, steps: range) -> None:
    for step in steps:
        features, kjt, labels = batch(args, step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features, kjt).squeeze(-1), labels)
        loss.backward()
        dense.step()
        dense.zero_grad()


def timed(work: Any) -> float:
    """Seconds `work` takes on the slowest rank, after the disk has written back what came before (no save pays
    for the previous one's dirty pages)."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - start


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _dcp_state(model: Any, dense: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": CombinedOptimizer([model.fused_optimizer, dense]).state_dict()}


def save(args: argparse.Namespace) -> dict[str, Any]:
    model, dense = build(args, moved=False)
    train(model, dense, args, range(args.steps))
    savers = {
        "ours, whole": TorchRecCheckpointer(model, dense),
        "ours, one-shot chain": TorchRecCheckpointer(model, dense, differential={"policy": "one_shot"}),
        "ours, 8-bit": TorchRecCheckpointer(model, dense, quantize={"method": "symmetric", "bits": 8}),
        "ours, 4-bit adaptive": TorchRecCheckpointer(model, dense, quantize={"method": "adaptive", "bits": 4}),
    }
    folder = dict(zip(savers, ("whole", "chain", "q8", "q4")))
    seconds: dict[str, list[float]] = {"DCP dcp.save": [], **{name: [] for name in savers}}
    for _ in range(args.repeats):  # interleaved, each the median of its repeats
        seconds["DCP dcp.save"].append(
            timed(lambda: dcp.save(_dcp_state(model, dense), checkpoint_id=str(args.out / "dcp")))
        )
        for name, saver in savers.items():
            out = args.out / folder[name]
            seconds[name].append(timed(lambda saver=saver, out=out: saver.save(str(out), "base", step=args.steps)))
    report: dict[str, Any] = {
        "DCP dcp.save": {"seconds": statistics.median(seconds["DCP dcp.save"]), "bytes": size(args.out / "dcp")}
    }
    for name in savers:
        report[name] = {"seconds": statistics.median(seconds[name]), "bytes": size(args.out / folder[name] / "base")}
    train(model, dense, args, range(args.steps, args.steps + args.delta_steps))
    chain = savers["ours, one-shot chain"]
    seconds = timed(lambda: chain.save(str(args.out / "chain"), "delta", step=args.steps + args.delta_steps))
    manifest = json.loads((args.out / "chain" / "delta" / "manifest.json").read_text())
    report[f"ours, one-shot delta after {args.delta_steps} steps"] = {
        "seconds": seconds,
        "bytes": size(args.out / "chain" / "delta"),
        "rows": manifest["differential"]["changed_fraction"],
    }
    return report


def load(args: argparse.Namespace) -> dict[str, Any]:
    model, dense = build(args, moved=args.moved, merged=args.merged)
    saver = TorchRecCheckpointer(model, dense, approximate_row_state=args.merged)
    dense.init_state()  # a KeyedOptimizer's state exists only once it stepped: DCP loads into it in place
    runs: dict[str, list[float]] = {"ours, whole": [], "ours, one-shot chain": [], "DCP dcp.load": []}
    refused = None
    for _ in range(args.repeats):
        runs["ours, whole"].append(timed(lambda: saver.load(str(args.out / "whole"), "base")))
        runs["ours, one-shot chain"].append(timed(lambda: saver.load(str(args.out / "chain"), "delta")))
        try:
            runs["DCP dcp.load"].append(
                timed(lambda: dcp.load(_dcp_state(model, dense), checkpoint_id=str(args.out / "dcp")))
            )
        except dcp.api.CheckpointException as exc:
            refused = str(exc).strip().splitlines()[-1][:160]
    report: dict[str, Any] = {k: {"seconds": statistics.median(v)} for k, v in runs.items() if v}
    if refused is not None:
        report["DCP dcp.load"] = {"refused": refused}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delta-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moved", action="store_true")
    parser.add_argument("--merged", action="store_true")
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    report = save(args) if args.mode == "save" else load(args)
    if dist.get_rank() == 0:
        args.report.write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
