"""A job whose data comes from DeepSpeed's own pipeline (`deepspeed_io` with data efficiency's curriculum learning,
`DeepSpeedDataSampler`), saved mid-epoch and resumed at another data-parallel size; the sample ids every step trains
on are recorded.

    save --out DIR: train STEPS steps, save, train CONT more (the uninterrupted run); then, in the same launch, a
        fresh engine resumes the checkpoint at this size and trains CONT steps. Rank 0 writes DIR/saved.json.
    load --out DIR [--source PATH --name NAME]: resume the checkpoint (or PATH: a universal folder made from it) at
        this launch's size, train CONT steps; rank 0 writes DIR/NAME<N>.json (NAME: resumed). `--each 'ARGS'` adds
        another load to the launch.
    load --out DIR --clusters EMPTY --name NAME: the same resume with a cluster folder that lacks the saved clusters:
        rank 0 writes the error and whether the engine kept its state.

The same for torchdata's `StatefulDataLoader`, passed to `save_checkpoint` / `load_checkpoint` as `data_loader`:

    loader-save --out DIR: as save, for a map-style loader over a `DistributedSampler` in its second epoch, and for
        an iterable dataset; rank 0 writes DIR/loader-saved.json.
    loader-load --out DIR [--source PATH]: resume both at this size: the map-style one with the same global batch
        and with half of it (and from PATH: a universal folder of its tag); rank 0 writes DIR/loader<N>.json (an
        iterable one resumed at another size is refused: the error, and whether the engine kept its state).

A step's ids are the global batch as the ranks' micro-batches in rank order: DeepSpeed's sampler shuffles each global
batch and hands each rank a contiguous piece, so at any size the concatenation is the batch it drew (a
`DistributedSampler` interleaves its ranks instead: the same samples, in another order within the step). Its loss is
the mean of the ranks' (equal batches): the loss of the whole global batch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import common  # tests/workers/common.py, next to this script
import deepspeed
import torch
import torch.distributed as dist

import ucp_deepspeed

SAMPLES = 48  # an epoch is 6 steps of 8: a save after 3 resumes mid-epoch
GLOBAL_BATCH = 8  # divides evenly over 1, 2 and 4 ranks
STEPS = CONT = 3


class Samples(torch.utils.data.Dataset):
    """Sample i: a fixed random input, and its id."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, generator=torch.Generator().manual_seed(i)), torch.tensor(i)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) ** 2).mean()


def config(world: int, clusters: Path) -> dict:
    """ZeRO-1, the same global batch at every size, and a curriculum over one cluster of every sample: the sampler
    draws each global batch from it and shuffles it with its own generator."""
    metric = {
        "difficulty_type": "value",
        "clustering_type": "single_cluster",
        "min_difficulty": 2,
        "max_difficulty": 8,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1},
    }
    curriculum = {"enabled": True, "data_cluster_path": str(clusters), "curriculum_metrics": {"seqlen": metric}}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
        "checkpoint": {"universal": True},
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {"enabled": True, "num_epochs": 2, "num_workers": 0, "curriculum_learning": curriculum},
        },
    }


def engine_and_loader(out: Path, clusters: Path | None = None) -> tuple[deepspeed.DeepSpeedEngine, object]:
    torch.manual_seed(0)
    net = Net()
    engine, _, loader, _ = ucp_deepspeed.initialize(
        model=net,
        model_parameters=net.parameters(),
        config=config(dist.get_world_size(), clusters or out / "clusters"),
        training_data=Samples(),
    )
    return engine, loader


def refused(out: Path, clusters: Path) -> dict:
    """A resume whose config names a cluster folder without the saved clusters: the error, and whether the engine
    kept its weights and step count."""
    engine, _ = engine_and_loader(out, clusters)
    return refusal(engine, lambda: engine.load_checkpoint(str(out / "ckpt")))


def refusal(engine: deepspeed.DeepSpeedEngine, load: Callable[[], object]) -> dict:
    """`load` into a fresh `engine`, which is then destroyed: the error it raised, and whether the engine kept its
    weights and step count."""
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        load()
        error = None
    except ucp_deepspeed.CheckpointError as exc:
        error = str(exc)
    kept = engine.global_steps == 0 and all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.destroy()
    return {"error": error, "kept": kept}


def train(engine: deepspeed.DeepSpeedEngine, batches, steps: int) -> list[dict]:
    """`steps` steps; each one's global batch ids (in rank order) and loss."""
    out = []
    for _ in range(steps):
        x, ids = next(batches)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, ids.tolist())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append({"ids": [i for ids in every for i in ids], "loss": mean.item() / dist.get_world_size()})
    return out


def resume(out: Path, source: Path | None = None) -> list[dict]:
    engine, loader = engine_and_loader(out)
    engine.load_checkpoint(str(source or out / "ckpt"))
    try:
        return train(engine, iter(loader), CONT)
    finally:
        engine.destroy()


LOADER_SEED, LOADER_EPOCH = 7, 1  # the second epoch: a resumed sampler left at epoch 0 draws another permutation


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset that says where it stands: rank r of N yields samples r, r+N, ... in order."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self):
        while self.next * dist.get_world_size() + dist.get_rank() < SAMPLES:
            i = self.next * dist.get_world_size() + dist.get_rank()
            self.next += 1
            yield Samples()[i]

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


def plain_engine() -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    net = Net()
    cfg = {k: v for k, v in config(dist.get_world_size(), Path(".")).items() if k != "data_efficiency"}
    engine, *_ = ucp_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine


def stateful_loader(kind: str, micro_batch: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "iterable":
        return StatefulDataLoader(Stream(), batch_size=micro_batch)
    sampler = torch.utils.data.DistributedSampler(Samples(), shuffle=True, seed=LOADER_SEED)
    return StatefulDataLoader(Samples(), batch_size=micro_batch, sampler=sampler)


def loader_resume(ckpt: Path, tag: str | None, kind: str, micro_batch: int, steps: int) -> list[dict]:
    engine = plain_engine()
    loader = stateful_loader(kind, micro_batch)
    engine.load_checkpoint(str(ckpt), tag=tag, data_loader=loader)
    try:
        return train(engine, iter(loader), steps)
    finally:
        engine.destroy()


def loader_refused(out: Path) -> dict:
    """An iterable loader saved at another size: refused, naming the loader, with the engine as it was."""
    engine = plain_engine()
    loader = stateful_loader("iterable", 4)
    return refusal(engine, lambda: engine.load_checkpoint(str(out / "loader-ckpt"), tag="iterable", data_loader=loader))


def loader_save(out: Path) -> dict:
    """Both loaders: STEPS steps, a save, CONT more (the uninterrupted run); then the resume at this size."""
    found = {}
    micro = GLOBAL_BATCH // dist.get_world_size()
    for kind in ("map", "iterable"):
        engine, loader = plain_engine(), stateful_loader(kind, micro)
        if kind == "map":
            loader.sampler.set_epoch(LOADER_EPOCH)
        batches = iter(loader)
        before = train(engine, batches, STEPS)
        engine.save_checkpoint(str(out / "loader-ckpt"), tag=kind, data_loader=loader)
        after = train(engine, batches, CONT)
        engine.destroy()
        found[kind] = {
            "before": before,
            "after": after,
            "resumed": loader_resume(out / "loader-ckpt", kind, kind, micro, CONT),
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "loader-save", "loader-load"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", type=Path, help="load: this checkpoint instead of OUT/ckpt")
    parser.add_argument("--name", default="resumed", help="load: the result's name")
    parser.add_argument("--clusters", type=Path, help="load: a cluster folder without the saved clusters (refused)")
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    for args in runs:
        if args.mode == "loader-save":
            result, name = loader_save(args.out), "loader-saved.json"
        elif args.mode == "loader-load":
            micro = GLOBAL_BATCH // world
            ckpt = args.out / "loader-ckpt"
            result = {
                "map": loader_resume(ckpt, "map", "map", micro, CONT),
                "half": loader_resume(ckpt, "map", "map", max(micro // 2, 1), 2 * CONT),
                "refused": loader_refused(args.out),
                "converted": loader_resume(args.source, None, "map", micro, CONT) if args.source else None,
            }
            name = f"loader{world}.json"
        elif args.mode == "save":
            engine, loader = engine_and_loader(args.out)
            batches = iter(loader)
            before = train(engine, batches, STEPS)
            engine.save_checkpoint(str(args.out / "ckpt"))
            after = train(engine, batches, CONT)
            engine.destroy()
            result = {"world": world, "before": before, "after": after, "resumed": resume(args.out)}
            name = "saved.json"
        elif args.clusters:
            result, name = refused(args.out, args.clusters), f"{args.name}{world}.json"
        else:
            result, name = {"world": world, "resumed": resume(args.out, args.source)}, f"{args.name}{world}.json"
        if dist.get_rank() == 0:
            (args.out / name).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
