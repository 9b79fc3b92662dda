"""Save one engine many times through DeepSpeed's python writer (`"checkpoint": {"writer": {"type": "python",
"data_parallel": "replica"}}`), under which every data-parallel rank writes the replicated model-states file, then
check every tag and resume the last one at this launch's size from another's. The same launch then does it again
through FastPersist (`"type": "fast"`, with tests/fastpersist_cpu.py's shims), whose data-parallel writers each write
their own `<file>-<rank>.<writers>`, and once more through FastPersist by plain DeepSpeed (without `universal`), whose
tag keeps those names.

    save --out DIR --saves N --fast K   train a step, save N tags (s0 ... s<N-1>) in a row, each followed by a step;
                                        then a fresh engine saves K tags into DIR/fast through FastPersist, and one
                                        without `universal` one into DIR/fast-plain; rank 0 verifies every tag (`ucp
                                        verify`: each file's save id and CRCs)
                                        (first: an async engine whose writer CPUs rank 1 lacks, refused on both
                                        ranks: DIR/writer-cpus.json)
    load --out DIR                      load the newest tag of DIR, DIR/fast and DIR/fast-plain (saved at another
                                        size) and compare fp32 weights and Adam states with the saving launch's
                                        snapshots
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed.tools.cli import main as ucp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fastpersist_cpu

WIDTH = 512  # 0.5M parameters: a 2 MB model-states file, written by both ranks at once


def engine(writer: str, universal: bool = True) -> deepspeed.DeepSpeedEngine:
    # DeepSpeed's writer config reads the launcher's machine layout, which torchrun does not export (one node)
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": os.environ["LOCAL_WORLD_SIZE"]}.items():
        os.environ.setdefault(key, value)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 8))
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "checkpoint": {
            "universal": {"enabled": universal, "progress": False},
            "writer": {"type": writer, "io_buffer_size": 1048576, "data_parallel": "replica"},
        },
    }
    built, *_ = ucp_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return built


def writer_cpus_one_rank_lacks(out: str) -> None:
    """`"async_writer_cpus"` that rank 1's machine lacks (CPU 4096) and rank 0's has: the engine must fail on both
    ranks, with rank 1's reason, rather than rank 1 alone while rank 0 waits on it; rank 0 writes what each raised to
    OUT/writer-cpus.json."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    cpus = [min(os.sched_getaffinity(0))] if dist.get_rank() == 0 else [4096]
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"universal": {"async_save": True, "async_writer_cpus": cpus, "progress": False}},
    }
    try:
        ucp_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, raised)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "writer-cpus.json"), "w") as f:
            json.dump(everyone, f)


def step(model: deepspeed.DeepSpeedEngine) -> None:
    per = 8 // dist.get_world_size()
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(int(model.global_steps)))
    loss = model(x[dist.get_rank() * per : (dist.get_rank() + 1) * per]).pow(2).mean()
    model.backward(loss)
    model.step()


def snapshot(model: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    opt = model.optimizer
    opt._hp_optimizer_states_linked = False  # ZeRO-1 links optimizer states to parameters lazily
    opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in model.module.named_parameters():
        out[name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def save(writer: str, out: str, saves: int, universal: bool = True) -> None:
    """Train a step, then `saves` saves each followed by a step (by plain DeepSpeed without `universal`); rank 0 keeps
    the last one's snapshot and verifies every tag."""
    model = engine(writer, universal)
    step(model)
    for i in range(saves):
        if i == saves - 1:
            reference = snapshot(model)
        model.save_checkpoint(out, tag=f"s{i}")
        step(model)
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
        failed = [i for i in range(saves) if ucp(["verify", os.path.join(out, f"s{i}")]) != 0]
        if failed:
            sys.exit(f"{writer} writer: tags {failed} of {saves} do not verify")


def load(out: str) -> None:
    """Resume `out`'s newest tag at this size and compare every state with the saving launch's snapshot."""
    model = engine("python")
    model.load_checkpoint(out)
    assert model.ucp_last_load.mode == "resharded", model.ucp_last_load
    got, saved = snapshot(model), torch.load(os.path.join(out, "reference.pt"))
    differ = sorted(k for k in saved if not torch.equal(saved[k], got[k]))
    if differ:
        sys.exit(f"{out}: restored state differs: {differ}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--saves", type=int, default=1)
    parser.add_argument("--fast", type=int, default=0)
    args = parser.parse_args()
    fastpersist_cpu.enable()
    deepspeed.init_distributed(dist_backend="gloo")
    fast, plain = os.path.join(args.out, "fast"), os.path.join(args.out, "fast-plain")
    if args.mode == "save":
        writer_cpus_one_rank_lacks(args.out)
        save("python", args.out, args.saves)
        if args.fast:
            save("fast", fast, args.fast)
            save("fast", plain, 1, universal=False)
    else:
        load(args.out)
        for folder in (fast, plain):
            if os.path.isdir(folder):
                load(folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
