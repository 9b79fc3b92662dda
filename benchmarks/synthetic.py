"""torchrun worker for the benchmarks: save a synthetic LM with Adam state, or time a load.

    save --params-m 300 --zero 1 --out DIR   one training step, then save with ucp_deepspeed; also
                                             time a plain DeepSpeed save of the same engine
    load --params-m 300 --zero 2 --source DIR  time engine.load_checkpoint (native or resharded)

Rank 0 prints one JSON line starting with `RESULT `.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import deepspeed
import torch
import torch.distributed as dist

import ucp_deepspeed

HIDDEN = 1024
VOCAB = 32768


class SyntheticLM(torch.nn.Module):
    """An embedding and residual MLP blocks: parameter sizes like a small GPT's, no attention needed."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                                              torch.nn.Linear(4 * hidden, hidden))
                                          for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x).pow(2).mean()


def shape_for(params_m: float) -> tuple[int, int, int]:
    """(layers, hidden, vocab) giving about `params_m` million parameters (tiny sizes shrink everything)."""
    hidden, vocab = (HIDDEN, VOCAB) if params_m >= 20 else (64, 512)
    per_block = 8 * hidden * hidden + 5 * hidden
    return max(1, round((params_m * 1e6 - vocab * hidden) / per_block)), hidden, vocab


def build(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    layers, hidden, vocab = shape_for(args.params_m)
    config = {"train_batch_size": dist.get_world_size(), "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": args.zero, "reduce_bucket_size": 10**7,
                                    # ZeRO-3 on 4 CPU ranks of one machine: keep few gathered parameters alive
                                    "stage3_max_live_parameters": 10**7, "stage3_prefetch_bucket_size": 10**7},
              "checkpoint": {"universal": {"enabled": True, "progress": False, "verify": bool(args.verify)}}}
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=args.zero == 3):  # 4 full copies do not fit
        model = SyntheticLM(layers, hidden, vocab)
    engine, _, _, _ = ucp_deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    return engine


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--params-m", type=float, required=True)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--source")
    parser.add_argument("--verify", type=int, default=1, help="crc32-check a reused conversion before loading")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    result: dict = {}
    if args.mode == "save":
        engine = build(args)
        loss = engine(torch.randint(0, engine.module.embed.num_embeddings, (1, 16)))
        engine.backward(loss)
        engine.step()
        plain = os.path.join(args.out, "plain")
        result["plain_save_s"] = timed(lambda: deepspeed.DeepSpeedEngine.save_checkpoint(engine, plain))
        if dist.get_rank() == 0:
            shutil.rmtree(plain)
        result["ucp_save_s"] = timed(lambda: engine.save_checkpoint(args.out))
        result["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    else:
        engine = build(args)
        result["load_s"] = timed(lambda: engine.load_checkpoint(args.source))
        result["mode"] = engine.ucp_last_load.mode
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see launch/train_tiny.py: skip an occasional abort in C++ teardown
