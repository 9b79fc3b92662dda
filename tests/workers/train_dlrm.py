"""Train a DLRM-like recommendation model with Check-N-Run checkpoints, resuming at any DP size or ZeRO stage.

    train --ckpt-dir DIR --steps N --ckpt-every K [--policy P] [--bits B --method M] [--zero Z]

The model: several embedding tables (`nn.EmbeddingBag`, sum of a few lookups per sample), a bottom
MLP over dense features, and a top MLP over their concatenation, predicting a click. The data is
synthetic and deterministic: global batch `s` is drawn from a generator seeded with `s`, row ids
follow a Zipf law (so a few rows are hot and most are rarely touched), and the label comes from a
fixed random "teacher" over the same features, so the model has something to learn. Every
data-parallel size sees the same global batches.

With --loader N the samples come from a dataset of N instead, through torchdata's `StatefulDataLoader` over a
`DistributedSampler`, whose position every save keeps and every resume continues; the log records each step's sample
ids.

Rank 0 logs `step N loss L auc A world W` and, with --results, writes a JSON report. With
--snapshots it stores the full fp32 weights and optimizer states at every save and after a resume.
"""

from __future__ import annotations

import argparse
import io
import json
import time

import common  # tests/workers/common.py, next to this script
import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import list_tags

DENSE = 8
BAG = 3  # lookups per table per sample
LOADER_SEED = 11


class DLRM(torch.nn.Module):
    """Embedding tables + bottom MLP -> concatenation -> top MLP -> click logit."""

    def __init__(self, rows: list[int], dim: int) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, 32), torch.nn.ReLU(), torch.nn.Linear(32, dim))
        width = dim * (len(rows) + 1)
        self.top = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        for table in self.tables:
            torch.nn.init.uniform_(table.weight, -0.05, 0.05)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = [table(ids[:, t]) for t, table in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], 1)).squeeze(1)


def zipf_ids(g: torch.Generator, n: int, rows: int, alpha: float) -> torch.Tensor:
    """`n` row ids in [0, rows) with P(rank k) ~ 1/k^alpha, hot rows scattered over the table."""
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if alpha == 1.0:
        ranks = torch.exp(u * torch.log(torch.tensor(float(rows))))
    else:
        ranks = (1 + u * ((rows ** (1 - alpha)) - 1)) ** (1 / (1 - alpha))
    ranks = ranks.long().clamp_(1, rows) - 1
    return (ranks * 2654435761) % rows  # a fixed permutation (the multiplier is prime): spreads hot rows


def draw(seed: int, n: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` samples from a generator seeded with `seed`: dense features, ids, labels."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, DENSE, generator=g)
    ids = torch.stack([torch.stack([zipf_ids(g, n, rows, args.alpha) for _ in range(BAG)], 1) for rows in args.rows], 1)
    teacher = torch.Generator().manual_seed(7)
    w_dense = torch.randn(DENSE, generator=teacher)
    score = dense @ w_dense
    for t, rows in enumerate(args.rows):
        row_value = torch.randn(rows, generator=teacher)
        score = score + row_value[ids[:, t]].sum(1) * 0.5
    labels = (score + 0.5 * torch.randn(n, generator=g) > 0).float()
    return dense, ids, labels


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of global batch `step`: dense features, ids, labels."""
    dense, ids, labels = draw(10_000 + step, args.batch, args)
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = args.batch // dp
    part = slice(rank * per, (rank + 1) * per)
    return dense[part], ids[part], labels[part]


class Records(torch.utils.data.Dataset):
    """--loader N: N samples, sample i drawn from its own seed, with its index."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __len__(self) -> int:
        return self.args.loader

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        dense, ids, labels = draw(3_000_000 + i, 1, self.args)
        return dense[0], ids[0], labels[0], torch.tensor(i)


def data_loader(args: argparse.Namespace):
    """torchdata's StatefulDataLoader over a shuffling DistributedSampler: each rank's share of each global batch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = torch.utils.data.DistributedSampler(Records(args), shuffle=True, seed=LOADER_SEED)
    return StatefulDataLoader(Records(args), batch_size=args.batch // dist.get_world_size(), sampler=sampler)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (rank statistic)."""
    order = scores.argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def build(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = DLRM(args.rows, args.dim)
    checkpoint: dict = {
        "universal": {"enabled": True, "progress": False, "direct": not args.converted, "keep_last": args.keep}
    }
    if args.policy:
        checkpoint["differential"] = {"policy": args.policy}
    if args.bits or args.expected_restores is not None:
        checkpoint["quantize"] = {
            "method": args.method,
            **({"bits": args.bits} if args.bits else {}),
            **({"expected_restores": args.expected_restores} if args.expected_restores is not None else {}),
        }
    optimizer = (
        torch.optim.Adagrad(model.parameters(), lr=args.lr)
        if args.optimizer == "adagrad"
        else torch.optim.SGD(model.parameters(), lr=args.lr)
    )
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch // dist.get_world_size(),
        "zero_optimization": {"stage": args.zero},
        "zero_allow_untested_optimizer": True,
        "checkpoint": checkpoint,
    }
    engine, _, _, _ = ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict:
    """Full fp32 weights and per-element optimizer states by parameter name (collective)."""
    states = list(engine.optimizer.optimizer.state.values())
    keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0] if states else []
    out: dict = {"fp32": {}, "state": {}, "step": engine.global_steps}
    for name, p in engine.module.named_parameters():
        out["fp32"][name] = safe_get_full_fp32_param(p).detach().clone()
        for key in keys:
            out["state"][f"{name}:{key}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    return out


def evaluate(engine: deepspeed.DeepSpeedEngine, args: argparse.Namespace) -> tuple[float, float]:
    """Loss and AUC on a fixed held-out global batch (the same on every layout)."""
    dense, ids, labels = batch(10**6, args)
    with torch.no_grad():
        logits = engine(dense, ids)
    gathered = [torch.zeros_like(logits) for _ in range(dist.get_world_size())]
    all_labels = [torch.zeros_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, logits)
    dist.all_gather(all_labels, labels)
    scores, truth = torch.cat(gathered), torch.cat(all_labels)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, truth).item()
    return loss, auc(scores, truth)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train"])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1001, 2001, 501])
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of row popularity")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="adagrad")
    parser.add_argument("--policy", choices=["full", "one_shot", "incremental", "intermittent"])
    parser.add_argument("--method", default="adaptive")
    parser.add_argument("--bits", type=int)
    parser.add_argument("--expected-restores", type=int)
    parser.add_argument("--snapshots", action="store_true")
    parser.add_argument(
        "--converted", action="store_true", help='resume through a full universal copy of the chain ("direct": false)'
    )
    parser.add_argument("--no-save", action="store_true", help="train without checkpoints (reference runs)")
    parser.add_argument("--stop-at", type=int, default=0, help="exit after this step (a simulated failure)")
    parser.add_argument("--results")
    parser.add_argument("--loader", type=int, default=0, help="samples of a dataset read through a StatefulDataLoader")
    parser.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; unused")
    common.add_each(parser)
    jobs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        run(job)
    dist.destroy_process_group()


def put(obj: object, location: str) -> None:
    """`torch.save` to a folder or an object-store URL."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    st.write(location, buffer.getvalue())


def run(args: argparse.Namespace) -> None:
    """Train (resuming from the newest complete tag of --ckpt-dir if there is one), saving as configured."""
    engine = build(args)
    loader = data_loader(args) if args.loader else None
    resumed = None
    if not args.no_save and list_tags(args.ckpt_dir):
        engine.load_checkpoint(args.ckpt_dir, data_loader=loader)
        report = engine.ucp_last_load
        resumed = {
            "step": engine.global_steps,
            "saved": report.saved,
            "live": report.live,
            "mode": report.mode,
            "in_place": report.in_place,
        }
        if dist.get_rank() == 0:
            print(f"resumed from step {engine.global_steps} at topology {report.saved} -> {report.live}", flush=True)
        if args.snapshots:
            snap = snapshot(engine)
            if dist.get_rank() == 0:
                put(snap, st.join(args.ckpt_dir, f"resumed_step{engine.global_steps}.pt"))
    log, saves = [], []
    step_time = 0.0
    batches = iter(loader) if loader is not None else None
    while engine.global_steps < args.steps:
        seen: list[list[int]] = []
        if loader is not None:
            dense, ids, labels, index = next(batches)
            seen = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(seen, index.tolist())
        else:
            dense, ids, labels = batch(engine.global_steps, args)
        start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(engine(dense, ids), labels)
        engine.backward(loss)
        engine.step()
        step_time += time.perf_counter() - start
        total = loss.detach().clone()
        dist.all_reduce(total)
        mean = total.item() / dist.get_world_size()
        log.append({"step": engine.global_steps, "loss": mean, "ids": [i for part in seen for i in part]})
        if dist.get_rank() == 0:
            print(f"step {engine.global_steps} loss {mean:.6f} world {dist.get_world_size()}", flush=True)
        if not args.no_save and engine.global_steps % args.ckpt_every == 0:
            if args.snapshots:
                snap = snapshot(engine)
                if dist.get_rank() == 0:
                    st.makedirs(args.ckpt_dir)
                    put(snap, st.join(args.ckpt_dir, f"saved_step{engine.global_steps}.pt"))
            start = time.perf_counter()
            engine.save_checkpoint(args.ckpt_dir, data_loader=loader)
            seconds = time.perf_counter() - start
            tag_dir = st.join(args.ckpt_dir, f"global_step{engine.global_steps}")
            if dist.get_rank() == 0:
                manifest = json.loads(st.read(st.join(tag_dir, "manifest.json")))
                saves.append(
                    {
                        "step": engine.global_steps,
                        "seconds": seconds,
                        "bytes": sum(v["bytes"] for v in manifest["files"].values()),
                        "kind": manifest["differential"]["kind"],
                        "bits": (manifest["differential"]["quantize"] or {}).get("bits"),
                        "changed_fraction": manifest["differential"]["changed_fraction"],
                    }
                )
            dist.barrier()
        if engine.global_steps == args.stop_at:
            break
    tracker = engine.ucp.saver.tracker if engine.ucp.saver is not None else None
    eval_loss, eval_auc = evaluate(engine, args)
    if dist.get_rank() == 0:
        print(f"eval loss {eval_loss:.6f} auc {eval_auc:.6f}", flush=True)
        if args.results:
            with open(args.results, "w") as f:
                json.dump(
                    {
                        "resumed": resumed,
                        "log": log,
                        "saves": saves,
                        "final_step": engine.global_steps,
                        "eval_loss": eval_loss,
                        "eval_auc": eval_auc,
                        "step_seconds": step_time,
                        "tracking_seconds": tracker.seconds if tracker is not None else 0.0,
                    },
                    f,
                    indent=1,
                )
    dist.barrier()


if __name__ == "__main__":
    main()
