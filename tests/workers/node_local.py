"""A job that keeps its checkpoints on each node's own disk (`"use_node_local_storage": true`), one rank per node.

    save CKPT OUT: train 3 steps, snapshot every full fp32 weight and Adam state, save (each node writes its own
        ranks' files into CKPT, its disk), train 2 more steps; rank 0 writes OUT/reference.pt
    load CKPT OUT: first an engine at ZeRO-3, whose load (a resume at another layout) must be refused by name and
        leave it as it was; then one at the saved layout: load the tag `latest` names (on rank 0's node only),
        compare every state with the reference (`torch.equal`) and the next 2 losses; each rank writes
        OUT/result-<rank>.json

    reshard CKPT OUT: a ZeRO-3 engine loads a tag whose ranks all saved on one disk (one node): every state
        compared; each rank writes OUT/reshard-<rank>.json
    missing CKPT OUT: a load that must be refused, on every rank; each writes the error to OUT/missing-<rank>.json

tests/test_node_local.py gives each node a disk of its own, mounted at the same path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed import compat


def build(stage: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"universal": True, "use_node_local_storage": True},
    }
    engine, *_ = ucp_deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def step(engine: deepspeed.DeepSpeedEngine, i: int) -> float:
    data = torch.Generator().manual_seed(100 + 10 * i + dist.get_rank())
    loss = engine(torch.randn(2, 8, generator=data)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def states(engine: deepspeed.DeepSpeedEngine, optimizer: bool = True) -> dict[str, torch.Tensor]:
    """Every full fp32 weight and Adam state (a fresh engine has none), cloned (collective)."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}.fp32"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq") if optimizer else ():
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def main() -> None:
    mode, ckpt, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    deepspeed.init_distributed(dist_backend="gloo")
    if mode == "save":
        engine = build(1)
        for i in range(3):
            step(engine, i)
        reference = states(engine)
        engine.save_checkpoint(ckpt)
        losses = [step(engine, i) for i in (3, 4)]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, losses)
        if dist.get_rank() == 0:
            torch.save({"states": reference, "losses": everyone}, out / "reference.pt")
        return
    if mode == "missing":  # a file node 1's rank reads is gone: refused on every rank, naming it
        try:
            build(1).load_checkpoint(ckpt)
            refused = None
        except ucp_deepspeed.CheckpointError as exc:
            refused = str(exc)
        (out / f"missing-{dist.get_rank()}.json").write_text(json.dumps(refused))
        return
    reference = torch.load(out / "reference.pt")
    if mode == "reshard":  # every rank's files on one disk, the flag on: resharded as any other tag
        engine = build(3)
        engine.load_checkpoint(ckpt)
        loaded = states(engine)
        differ = sorted(k for k, v in reference["states"].items() if not torch.equal(v, loaded[k]))
        result = {"differ": differ, "how": str(engine.ucp_last_load)}
        (out / f"reshard-{dist.get_rank()}.json").write_text(json.dumps(result))
        return
    other = build(3)
    before = states(other, optimizer=False)
    try:
        other.load_checkpoint(ckpt)
        refused = None
    except ucp_deepspeed.CheckpointError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in states(other, optimizer=False).items())
    other.destroy()
    engine = build(1)
    path, _ = engine.load_checkpoint(ckpt)
    compat.relink_optimizer_states(engine.optimizer)  # DeepSpeed's own load leaves safe_get_*'s links stale
    loaded = states(engine)
    result = {
        "refused": refused,
        "unchanged": unchanged,
        "path": path,
        "differ": sorted(k for k, v in reference["states"].items() if not torch.equal(v, loaded[k])),
        "losses": [step(engine, i) for i in (3, 4)],
        "expected": reference["losses"][dist.get_rank()],
    }
    (out / f"result-{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
