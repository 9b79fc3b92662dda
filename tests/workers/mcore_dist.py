"""megatron-core's own checkpoints (`dist_checkpointing`, torch_dist) into DeepSpeed: launch/train_gpt.py's GPT.

save --out DIR --tp T [--arch gpt|llama]
    megatron-core alone trains the GPT STEPS steps (torch AdamW with train_gpt's groups, its LR schedule and
    gradient clipping, DP gradients averaged as DeepSpeed does) and saves it with `dist_checkpointing.save`,
    model and optimizer `sharded_state_dict`s and Megatron-LM's common entries, into DIR/ckpt. Rank 0 writes
    DIR/reference.pt: the full state in universal names, gathered over TP, and the losses of CONT more steps.
load --source DIR --tp T --zero Z --results FILE ...
    a ucp_deepspeed engine at this layout loads DIR/ckpt directly (imported on the way), takes megatron's
    LR-scheduler state from the client state, and compares every fp32 weight, Adam moment, step and
    hyperparameter with the reference (`torch.equal`) and its next CONT losses with megatron-core's.

native-load --source DIR --reference REF --tp T --results FILE
    megatron-core alone loads a torch_dist folder `ucp export-megatron` wrote, compares every state with REF (the
    DeepSpeed job's, from tests/workers/gpt.py save) and trains CONT steps.

`--each 'ARGS'` adds runs to the same launch (a save, then loads at other layouts of the same world size).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os

import common  # tests/workers/common.py, next to this script; puts launch/ on sys.path
import deepspeed
import torch
import torch.distributed as dist
import train_gpt  # launch/train_gpt.py, the reference script
from compare import compare
from gpt import snapshot
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from train_gpt import SEQ, VOCAB, lm_loss

STEPS = 3
CONT = 3


def cpu_saving() -> None:
    """`dist_checkpointing.save` on the CPU: its preload calls `torch.cuda.synchronize()` when non-blocking."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    original = fa.FileSystemWriterAsync.preload_tensors
    fa.FileSystemWriterAsync.preload_tensors = staticmethod(lambda buckets, non_blocking=True: original(buckets, False))


def steps(model, opt, sched, first: int, count: int) -> list[float]:
    """Training steps as DeepSpeed's ZeRO-1 takes them: micro-batch losses averaged, DP gradients averaged, the
    global gradient norm clipped to 1.0, then the optimizer and the schedule."""
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    position_ids = torch.arange(SEQ).unsqueeze(0)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for step in range(first, first + count):
        micro = train_gpt.batch(step)
        total = torch.zeros(())
        for tokens in micro:
            loss = lm_loss(model(tokens[:, :-1], position_ids, mask), tokens[:, 1:]) / len(micro)
            loss.backward()
            total += loss.detach()
        for p in params:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
            p.grad /= ps.get_data_parallel_world_size()
        # megatron-core's clip_grads allocates on CUDA; the same sum, over TP without duplicates, by hand
        square = sum(p.grad.float().square().sum() for p in params if param_is_not_tensor_parallel_duplicate(p))
        dist.all_reduce(square, group=ps.get_tensor_model_parallel_group())
        clip = 1.0 / (square.sqrt().item() + 1e-6)
        if clip < 1.0:
            for p in params:
                p.grad.mul_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / (ps.get_data_parallel_world_size() * ps.get_tensor_model_parallel_world_size()))
    return losses


def full_state(model, opt) -> dict:
    """The full state in universal names (gpt.py's snapshot form): TP shards gathered, vocabulary padding dropped."""
    group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    snap: dict = {"fp32": {}, "state": {}, "steps": {}}
    for name, p in model.named_parameters():
        values = {"fp32": p.detach(), "exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
        for key, local in values.items():
            full = local
            if getattr(p, "tensor_model_parallel", False):
                shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                full = torch.cat(shards, dim=p.partition_dim)
            if name.endswith("word_embeddings.weight") or name.startswith("output_layer."):
                full = full[:VOCAB]
            if key == "fp32":
                snap["fp32"][name] = full.clone()
            else:
                snap["state"][f"{name}/{key}"] = full.clone()
        snap["steps"][group_of[id(p)]] = opt.state[p]["step"].clone()
    snap["hyperparams"] = [{k: v for k, v in g.items() if k not in ("params", "name")} for g in opt.param_groups]
    return snap


def do_save(args: argparse.Namespace) -> None:
    cpu_saving()
    model, groups = train_gpt.model_and_groups(args)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))  # train_gpt's schedule
    steps(model, opt, sched, 0, STEPS)
    ref = full_state(model, opt)
    model_sd = model.sharded_state_dict()
    optim_sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    step = next(iter(optim_sd["state"].values()))["step"]
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys="step")
    optim_sd["state"]["common_step"] = step  # as megatron's FP32Optimizer keeps it
    megatron_args = argparse.Namespace(  # the fields of Megatron-LM's saved args that describe the model
        num_layers=model.config.num_layers,
        hidden_size=model.config.hidden_size,
        ffn_hidden_size=model.config.ffn_hidden_size,
        num_attention_heads=model.config.num_attention_heads,
        group_query_attention=True,
        num_query_groups=model.config.num_query_groups,
        max_position_embeddings=SEQ,
        normalization=model.config.normalization,
        swiglu=model.config.gated_linear_unit,
        add_bias_linear=model.config.add_bias_linear,
        position_embedding_type=model.position_embedding_type,
        untie_embeddings_and_output_weights=False,
        padded_vocab_size=train_gpt.padded_vocab(args.tp),
        tensor_model_parallel_size=args.tp,
    )
    state = {
        "model": model_sd,
        "optimizer": optim_sd,
        "iteration": STEPS,
        "checkpoint_version": 3.0,
        "args": megatron_args,
        "opt_param_scheduler": sched.state_dict(),
    }
    os.makedirs(f"{args.out}/ckpt", exist_ok=True)  # megatron-core saves into an existing, empty folder
    dist_checkpointing.save(state, f"{args.out}/ckpt")
    cont = steps(model, opt, sched, STEPS, CONT)
    if dist.get_rank() == 0:
        torch.save({"snapshot": ref, "continuation": cont}, f"{args.out}/reference.pt")


def do_load(args: argparse.Namespace) -> None:
    ref = torch.load(f"{args.source}/reference.pt", weights_only=False)
    engine = train_gpt.build(args)
    _, client = engine.load_checkpoint(f"{args.source}/ckpt")
    engine.lr_scheduler.load_state_dict({**client["opt_param_scheduler"], "lr_lambdas": [None, None]})
    snap = snapshot(engine)
    counted = engine.global_steps
    losses = train_gpt.train(engine, CONT)
    if dist.get_rank() == 0:
        want = {k: ref["snapshot"][k] for k in ("fp32", "state", "steps", "hyperparams")}
        diffs = compare(want, {k: snap[k] for k in want})
        if client.get("iteration") != STEPS or counted != STEPS:
            diffs.append(f"iteration {client.get('iteration')}, global_steps {counted}")
        result = {
            "mode": engine.ucp_last_load.mode,
            "diffs": diffs,
            "tensors": len(snap["fp32"]) + len(snap["state"]),
            "losses": losses,
            "reference_losses": ref["continuation"],
        }
        with open(args.results, "w") as f:
            json.dump(result, f, indent=1)


def do_native_load(args: argparse.Namespace) -> None:
    """megatron-core alone loads an exported torch_dist folder with `dist_checkpointing.load` at this layout, as
    Megatron-LM resumes (torch Adam's states made first, `common_step` put back), and trains on."""
    cpu_saving()
    ref = torch.load(f"{args.reference}", weights_only=False)
    model, groups = train_gpt.model_and_groups(args)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    base_lrs = [g["lr"] for g in opt.param_groups]  # the schedule's peaks, as Megatron-LM's args give them
    for group in opt.param_groups:  # megatron-core's init_state_fn: the states must exist to be loaded into
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
    model_sd, optim_sd = model.sharded_state_dict(), opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys="step")
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, args.source)
    model.load_state_dict(loaded["model"], strict=False)  # the linears' `_extra_state` hold nothing here
    optim = loaded["optimizer"]
    step = optim["state"].pop("common_step")
    for state in optim["state"].values():
        state["step"] = step.clone()
    opt.load_state_dict(optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    # Megatron-LM's scheduler is set from the iteration; building one above reset the learning rates to their peaks
    sched.last_epoch, sched.base_lrs = loaded["iteration"] - 1, base_lrs
    sched.step()
    snap = full_state(model, opt)
    losses = steps(model, opt, sched, loaded["iteration"], CONT)
    if dist.get_rank() == 0:
        want = {k: ref["snapshot"][k] for k in ("fp32", "state", "steps")}
        result = {
            "diffs": compare(want, {k: snap[k] for k in want}),
            "tensors": len(snap["fp32"]) + len(snap["state"]),
            "losses": losses,
            "reference_losses": ref["continuation"],
        }
        with open(args.results, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "native-load"])
    train_gpt.add_arguments(parser)
    parser.add_argument("--out")
    parser.add_argument("--source")
    parser.add_argument("--results")
    parser.add_argument("--reference", help="native-load: the saving DeepSpeed job's reference.pt")
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:  # megatron-core's groups are rebuilt for each run: one launch saves and loads
        train_gpt.setup(run)
        {"save": do_save, "load": do_load, "native-load": do_native_load}[run.mode](run)
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()
    # dist_checkpointing's writers report through a spawned multiprocessing Manager, which would outlive the
    # os._exit below and keep the launch's output pipes open
    for child in multiprocessing.active_children():
        child.terminate()


if __name__ == "__main__":
    common.main_then_exit(main)
