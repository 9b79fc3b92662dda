"""The GPU smoke run's training jobs (launch/gpu_smoke.sh): NCCL, bf16, a few steps, a save; or a resume at
another layout that saves at once, so that `ucp diff` can compare every state of the two checkpoints.

    tiny --zero Z --out DIR [--init SRC]   a small torch LM under DeepSpeed
    gpt --tp T --zero Z --out DIR [--init SRC]   a megatron-core GPT (local spec) at tensor-parallel size T

With `--init`, the job loads SRC (any layout), checks that the load resharded, and saves at once into DIR,
before any step. Prints one line per check. Needs CUDA; it stands on its own (no test code).
"""

from __future__ import annotations

import argparse
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

import ucp_deepspeed

VOCAB, SEQ, BATCH = 128, 16, 8


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU())
        self.head = torch.nn.Linear(256, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def tokens(step: int, rows: int, rank: int) -> torch.Tensor:
    """Rows of a step's global batch for this data-parallel rank, the same whatever the layout."""
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return batch[rank * rows : (rank + 1) * rows].to(get_accelerator().current_device_name())


def config(zero: int, dp: int) -> dict:
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // dp,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": zero},
        "gradient_clipping": 1.0,
        "checkpoint": {"universal": {"enabled": True, "progress": False}},
    }


def resume_or_train(engine: deepspeed.DeepSpeedEngine, args: argparse.Namespace, step) -> None:
    if args.init:
        engine.load_checkpoint(args.init)
        report = engine.ucp_last_load
        ok = report.mode == "resharded"
        print(f"{'PASS' if ok else 'FAIL'} load {args.init}: {report.how()}", flush=True)
        if not ok:
            sys.exit(1)
    else:
        for _ in range(3):
            step(engine)
        print(f"PASS trained 3 steps on {dist.get_world_size()} GPUs", flush=True)
    engine.save_checkpoint(args.out)
    print(f"PASS saved {args.out} at step {engine.global_steps}", flush=True)


def run_tiny(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    dp = dist.get_world_size()
    engine, *_ = ucp_deepspeed.initialize(model=model, optimizer=opt, config=config(args.zero, dp))

    def step(engine: deepspeed.DeepSpeedEngine) -> None:
        batch = tokens(engine.global_steps, BATCH // dp, dist.get_rank())
        logits = engine(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()

    resume_or_train(engine, args, step)


def run_gpt(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=args.tp,
        use_cpu_initialization=True,  # the same weights at every tensor-parallel size
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    dp = ps.get_data_parallel_world_size()
    universal = config(args.zero, dp)
    universal["checkpoint"]["universal"]["vocab_size"] = VOCAB
    engine, *_ = ucp_deepspeed.initialize(model=model, optimizer=opt, config=universal)
    device = get_accelerator().current_device_name()
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), 1).view(1, 1, SEQ, SEQ)

    def step(engine: deepspeed.DeepSpeedEngine) -> None:
        batch = tokens(engine.global_steps, BATCH // dp, ps.get_data_parallel_rank())
        logits = engine(batch[:, :-1], position_ids, mask)
        labels = batch[:, 1:].t().contiguous()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(), labels)
        engine.backward(loss.mean())
        engine.step()

    resume_or_train(engine, args, step)
    ps.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["tiny", "gpt"])
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--init")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke: CUDA is not available; this run checks GPU jobs (NCCL, bf16) and needs GPUs")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl")
    run_tiny(args) if args.model == "tiny" else run_gpt(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
