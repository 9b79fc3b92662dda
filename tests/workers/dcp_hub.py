"""PyTorch DCP both ways on the CPU: FSDP2 jobs and DeepSpeed engines of train_tiny's `TinyLM`.

save (one world size): an FSDP2 job trains STEPS steps and saves with `dcp.save`; a DeepSpeed ZeRO-1 job trains the
    same steps and saves with `save_checkpoint`. Each records its full state at the save and the losses of CONT more
    steps (the uninterrupted run).
load (another world size): DeepSpeed engines at each `--stage` load the FSDP2 job's DCP folder directly; an FSDP2
    job loads the DCP export of the DeepSpeed checkpoint with `dcp.load`. Each compares every fp32 weight, Adam
    moment, step count, frozen weight and buffer with the saver's (`torch.equal`) and its next losses with the saver's.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from compare import compare  # tests/workers/compare.py, next to this script
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from train_tiny import CONT, STEPS, TinyLM, batch, snapshot

import ucp_deepspeed

LR = 2e-3


def groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.95)},
    ]


def fsdp_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = TinyLM()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.AdamW(groups(model), lr=LR)


def ds_job(stage: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(1234)
    model = TinyLM()
    config = {
        "train_batch_size": 48,
        "train_micro_batch_size_per_gpu": 48 // dist.get_world_size(),
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
        "checkpoint": {"universal": {"enabled": True, "progress": False}},
    }
    engine, _, _, _ = ucp_deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(groups(model), lr=LR),
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),  # constant, as in FSDP's job
    )
    return engine


def fsdp_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        loss = model(batch(step, None))
        loss.backward()
        opt.step()
        opt.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def ds_steps(engine: deepspeed.DeepSpeedEngine, count: int) -> list[float]:
    losses = []
    for _ in range(count):
        loss = engine(batch(engine.global_steps, engine))
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def fsdp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The FSDP2 job's full state, in the form `snapshot` gives a DeepSpeed engine's."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    out: dict = {"fp32": {}, "state": {}, "frozen": {}, "buffers": {}, "steps": {}}
    for name in trainable:
        out["fp32"][name] = msd[name].detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out["state"][f"{name}/{key}"] = osd["state"][name][key].detach().clone()
    for g, group in enumerate(osd["param_groups"]):
        out["steps"][g] = float(osd["state"][group["params"][0]]["step"])
    out["frozen"] = {n: msd[n].detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
    return out


def ds_state(engine: deepspeed.DeepSpeedEngine) -> dict:
    snap = snapshot(engine)
    frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
    return {
        "fp32": snap["fp32"],
        "state": snap["state"],
        "frozen": {n: snap["lp"][n] for n in frozen},
        "buffers": snap["buffers"],
        "steps": snap["steps"],
    }


def do_save(args: argparse.Namespace) -> None:
    model, opt = fsdp_job()
    fsdp_steps(model, opt, 0, STEPS)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "epoch": 7}, checkpoint_id=f"{args.out}/fsdp")
    ref = {"state": fsdp_state(model, opt), "next": fsdp_steps(model, opt, STEPS, CONT)}
    engine = ds_job(1)
    ds_steps(engine, STEPS)
    engine.save_checkpoint(f"{args.out}/ds", client_state={"epoch": 7})
    ds_ref = {"state": ds_state(engine), "next": ds_steps(engine, CONT)}
    if dist.get_rank() == 0:
        torch.save({"fsdp": ref, "ds": ds_ref}, f"{args.out}/reference.pt")


def do_load(args: argparse.Namespace) -> None:
    refs = torch.load(f"{args.out}/reference.pt", weights_only=True)
    results = []
    for stage in args.stage:
        engine = ds_job(stage)
        _, client = engine.load_checkpoint(f"{args.out}/fsdp")
        diffs = compare(refs["fsdp"]["state"], ds_state(engine))
        if client.get("epoch") != 7:
            diffs.append(f"client_state {client!r}")
        next_losses = ds_steps(engine, CONT)
        engine.destroy()  # ZeRO-3's hooks would keep it alive in a test process that runs this load
        results.append({"case": f"fsdp->zero{stage}", "diffs": diffs, "next": next_losses, "ref": refs["fsdp"]["next"]})
    model, opt = fsdp_job()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{args.out}/exported")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    diffs = compare(refs["ds"]["state"], fsdp_state(model, opt))
    next_losses = fsdp_steps(model, opt, STEPS, CONT)
    results.append({"case": "zero1->fsdp", "diffs": diffs, "next": next_losses, "ref": refs["ds"]["next"]})
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(results, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, nargs="*", default=[1, 3])
    parser.add_argument("--results")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    do_save(args) if args.mode == "save" else do_load(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
