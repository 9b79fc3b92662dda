"""Save one engine many times through DeepSpeed's python writer (`"checkpoint": {"writer": {"type": "python",
"data_parallel": "replica"}}`), under which every data-parallel rank writes the replicated model-states file, then
check every tag and resume the last one at this launch's size from another's.

    save --out DIR --saves N   train a step, save N tags (s0 ... s<N-1>) in a row, each followed by a step; rank 0
                               then verifies every tag (`ucp verify`: each file's save id and CRCs)
    load --out DIR             load DIR's newest tag (saved at another size) and compare its fp32 weights and Adam
                               states with the saving launch's snapshot
"""

from __future__ import annotations

import argparse
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed.tools.cli import main as ucp

WIDTH = 512  # 0.5M parameters: a 2 MB model-states file, written by both ranks at once


def engine() -> deepspeed.DeepSpeedEngine:
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
            "universal": {"enabled": True, "progress": False},
            "writer": {"type": "python", "io_buffer_size": 1048576, "data_parallel": "replica"},
        },
    }
    built, *_ = ucp_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return built


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--saves", type=int, default=1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = engine()
    if args.mode == "save":
        step(model)
        for i in range(args.saves):
            if i == args.saves - 1:
                reference = snapshot(model)
            model.save_checkpoint(args.out, tag=f"s{i}")
            step(model)
        if dist.get_rank() == 0:
            torch.save(reference, os.path.join(args.out, "reference.pt"))
            failed = [i for i in range(args.saves) if ucp(["verify", os.path.join(args.out, f"s{i}")]) != 0]
            if failed:
                sys.exit(f"tags {failed} of {args.saves} do not verify")
    else:
        model.load_checkpoint(args.out)
        assert model.ucp_last_load.mode == "resharded", model.ucp_last_load
        got, saved = snapshot(model), torch.load(os.path.join(args.out, "reference.pt"))
        differ = sorted(k for k in saved if not torch.equal(saved[k], got[k]))
        if differ:
            sys.exit(f"restored state differs: {differ}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
