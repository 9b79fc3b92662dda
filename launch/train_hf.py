"""An unmodified Hugging Face Trainer (or Accelerate) job on DeepSpeed, with ucp_deepspeed installed.

    train --out DIR --zero Z --steps N --save-steps K [--resume CHECKPOINT] [--global-batch B]
          [--arch llama --sp P] [--no-install]
    accelerate --out DIR --zero Z --steps N --save-at K [--resume STATE_DIR]

The script is an ordinary Trainer script except for `ucp_deepspeed.install()` at the top (and the
probes the tests read). A tiny GPT-2 built from a config (no hub) trains on deterministic
Markov-chain tokens. The global batch is 6 sequences at every world size (--global-batch):
per-device batch 6 / (world x gradient accumulation steps).

Probes, written by rank 0 into DIR: `losses.json` (global-mean loss per step), and a snapshot of
the full fp32 weights, every Adam state and counters at each save (`saved_step<K>.pt`) and right
after a resume (`resumed_step<K>.pt`), gathered over ZeRO partitions with DeepSpeed's own helpers.
Each rank of a Trainer job writes `samples_rank<R>.json`: the dataset index of every sequence it
trained on, by step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

GLOBAL_BATCH = 6
SEQ = 16
VOCAB = 64
SAMPLES = 96


def dataset() -> list[dict[str, torch.Tensor]]:
    """Learnable tokens: each follows a fixed successor table 80% of the time."""
    g = torch.Generator().manual_seed(5)
    successor = torch.randperm(VOCAB, generator=g)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    follow = torch.rand(SAMPLES, SEQ, generator=g) < 0.8
    for t in range(1, SEQ):
        tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], tokens[:, t])
    # position ids: Ulysses keeps each token's global position through its sequence sharding
    return [{"input_ids": row, "labels": row.clone(), "position_ids": torch.arange(SEQ)} for row in tokens]


def model(arch: str = "gpt2") -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    if arch == "llama":  # Ulysses needs key-value head counts, which GPT-2's config does not name
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
                attn_implementation="sdpa",
            )
        )
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def ds_config(zero: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},  # the Trainer's `bf16` says
        "zero_optimization": {"stage": zero},
    }


def configure_cpu_state() -> bool:
    """Name gloo for accelerate on a CPU-only machine; returns whether a state was configured.

    accelerate's device detection finds no GPU, leaves the backend unset, and then counts DeepSpeed's
    processes as one. A `PartialState` made first, with a backend and DeepSpeed flagged, is the
    configuration accelerate's `use_configured_state` option exists for.
    """
    if torch.cuda.is_available():
        return False
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return True


def snapshot(engine: object) -> dict:
    """Full fp32 weights and Adam states of the trained parameters, the frozen ones' weights (a LoRA job's base), step
    and counters (collective: every rank must call it)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-1/2 link optimizer states to parameters lazily
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    snap: dict = {"fp32": {}, "state": {}, "frozen": {}}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                snap["frozen"][name] = p.detach().clone()
            continue
        snap["fp32"][name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            snap["state"][f"{name}/{key}"] = safe_get_full_optimizer_state(p, key).clone()
    base = engine.optimizer.optimizer
    snap["steps"] = sorted({int(s["step"]) for s in base.state.values() if "step" in s})
    snap["counters"] = [engine.global_steps, engine.global_samples]
    return snap


def save_probe(out: str, name: str, obj: object) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(obj, os.path.join(out, name))


def do_train(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    losses: dict[int, float] = {}
    data = dataset()
    index = {tuple(row["input_ids"].tolist()): i for i, row in enumerate(data)}
    samples: list[tuple[int, list[int]]] = []

    def record(module, positional, kwargs):  # which sequences each forward trains on (-1: none of the dataset's)
        ids = kwargs.get("input_ids") if module.training else None
        if ids is None:
            return
        if ids.shape[1] == SEQ:
            rows = [index.get(tuple(r.tolist()), -1) for r in ids]
        else:  # Ulysses: each rank holds a shard of every sequence; the rank of the first shard records them whole
            shards: list = [None] * dist.get_world_size()
            dist.all_gather_object(shards, ids.tolist())  # every rank runs each forward, so every rank is here
            sp, rank = SEQ // ids.shape[1], dist.get_rank()
            group = shards[rank - rank % sp : rank - rank % sp + sp]  # DeepSpeed's Ulysses groups: consecutive ranks
            whole = [tuple(t for shard in group for t in shard[i]) for i in range(len(ids))]
            rows = [] if rank % sp else [index.get(seq, -1) for seq in whole]
        samples.append((trainer.state.global_step + 1, rows))

    class Probe(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

        def on_save(self, targs, state, control, **kw):
            save_probe(args.out, f"saved_step{state.global_step}.pt", snapshot(trainer.model_wrapped))

        def on_train_begin(self, targs, state, control, **kw):
            if args.resume:
                save_probe(args.out, f"resumed_step{state.global_step}.pt", snapshot(trainer.model_wrapped))

        def on_step_end(self, targs, state, control, **kw):
            torch.rand(1)  # draw from the CPU generator each step, as dropout would, so a missing RNG restore shows

        def on_step_begin(self, targs, state, control, **kw):
            if args.resume and not os.path.exists(os.path.join(args.out, "rng_resumed.pt")):
                save_probe(args.out, "rng_resumed.pt", torch.random.get_rng_state())  # what the Trainer restored

    extra = {}
    if args.sp > 1:  # ALST: Accelerate registers Ulysses attention, shards each sequence and passes the mpu
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        sequences = DeepSpeedSequenceParallelConfig(
            sp_seq_length=SEQ, sp_seq_length_is_variable=False, sp_attn_implementation="sdpa"
        )
        extra["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp, sp_handler=sequences)
    targs = TrainingArguments(
        **extra,
        output_dir=args.out,
        # the sequence-parallel ranks of a group share one sample: the data-parallel size is world / sp
        per_device_train_batch_size=args.global_batch // (world // args.sp * args.grad_accum),
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=1,
        learning_rate=2e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.01,
        seed=1234,
        report_to="none",
        deepspeed=ds_config(args.zero),
        bf16=args.bf16,
        use_cpu=args.bf16 and not torch.cuda.is_available(),  # the Trainer refuses bf16 on a CPU it was not told of
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_only_model=False,
        accelerator_config={"use_configured_state": configure_cpu_state()},
    )
    net = model(args.arch)
    if args.lora:  # PEFT's LoRA adapters on the attention projections; the base is frozen
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    net.register_forward_pre_hook(record, with_kwargs=True)
    trainer = Trainer(model=net, args=targs, train_dataset=data, callbacks=[Probe()])
    trainer.train(resume_from_checkpoint=args.resume)

    with open(os.path.join(args.out, f"samples_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(samples, f)
    if dist.get_rank() == 0:
        engine = trainer.model_wrapped
        report = getattr(engine, "ucp_last_load", None)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "global_step": trainer.state.global_step,
                    "world": world,
                    "load": None
                    if report is None
                    else {"mode": report.mode, "saved": report.saved, "live": report.live},
                },
                f,
                indent=1,
            )


def do_accelerate(args: argparse.Namespace) -> None:
    """A plain Accelerate loop with a DeepSpeed plugin: save_state at --save-at, load_state on --resume."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, set_seed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    configure_cpu_state()
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    set_seed(1234)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, shuffle=False)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    step, losses = 0, {}
    if args.resume:
        accelerator.load_state(args.resume)
        step = net.global_steps
        save_probe(args.out, f"resumed_step{step}.pt", snapshot(net))
        # what each process restored from random_states_<i>.pkl, before this loop draws anything
        torch.save(
            {"rng": torch.random.get_rng_state(), "step": accelerator.step},
            os.path.join(args.out, f"restored_rank{accelerator.process_index}.pt"),
        )
    batches = iter(loader)
    for _ in range(step):
        next(batches)  # the same samples in the same order: the global batch is fixed
    while step < args.steps:
        torch.rand(1)  # a draw per step, as dropout would, so a process that restores no RNG state shows
        with accelerator.accumulate(net):  # counts accelerator.step, which save_state keeps
            loss = net(**next(batches)).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        step += 1
        losses[step] = accelerator.reduce(loss.detach(), reduction="mean").item()
        if step == args.save_at:
            save_probe(args.out, f"saved_step{step}.pt", snapshot(net))
            accelerator.save_state(os.path.join(args.out, f"state-{step}"))
    if accelerator.is_main_process:
        report = getattr(net, "ucp_last_load", None)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "global_step": step,
                    "world": world,
                    "load": None
                    if report is None
                    else {"mode": report.mode, "saved": report.saved, "live": report.live},
                },
                f,
                indent=1,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "accelerate"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--resume", help="checkpoint folder to resume from")
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="train: gradient accumulation steps; the per-device batch shrinks to keep the global batch",
    )
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="train: sequences per step")
    parser.add_argument("--sp", type=int, default=1, help="train: Ulysses sequence-parallel size (ALST)")
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="train: the tiny model's kind")
    parser.add_argument("--no-install", action="store_true", help="leave ucp_deepspeed out (plain DeepSpeed)")
    parser.add_argument("--bf16", action="store_true", help="train: in bf16, as most jobs do")
    parser.add_argument("--lora", action="store_true", help="train: PEFT LoRA adapters on a frozen base")
    args = parser.parse_args()
    if not args.no_install:
        import ucp_deepspeed

        ucp_deepspeed.install()
    os.makedirs(args.out, exist_ok=True)
    {"train": do_train, "accelerate": do_accelerate}[args.mode](args)
    import torch.distributed as dist

    if dist.is_initialized():  # join gloo's threads before the interpreter tears down the objects they use
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
