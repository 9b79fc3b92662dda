"""megatron-core's own checkpoints (`dist_checkpointing`, torch_dist) into DeepSpeed: launch/train_gpt.py's GPT.

save --out DIR --tp T [--arch gpt|llama] [--distributed-optimizer [--bf16]]
    megatron-core alone trains the GPT STEPS steps (torch AdamW with train_gpt's groups, its LR schedule and
    gradient clipping, DP gradients averaged as DeepSpeed does) and saves it with `dist_checkpointing.save`,
    model and optimizer `sharded_state_dict`s and Megatron-LM's common entries, into DIR/ckpt. Rank 0 writes
    DIR/reference.pt: the full state in universal names, gathered over TP, and the losses of CONT more steps.
    With --distributed-optimizer the model is wrapped in megatron-core's DDP and trained by its
    `DistributedOptimizer` (the same AdamW, groups and clipping, each DP rank holding a shard), saved
    `fully_reshardable`, and again `dp_reshardable` (Megatron-LM's default) into DIR/dp_reshardable. With --bf16 the
    weights are bf16 (megatron-core's Float16Module) and the optimizer keeps their fp32 copies, the reference's weights.
load --source DIR [--folder ckpt|dp_reshardable] --tp T --zero Z --results FILE ...
    a ucp_deepspeed engine at this layout loads DIR/ckpt (or DIR/dp_reshardable) directly (imported on the way),
    takes megatron's LR-scheduler state from the client state, and compares every fp32 weight, Adam moment, step and
    hyperparameter with the reference (`torch.equal`) and its next CONT losses with megatron-core's.

native-load --source DIR --reference REF --tp T [--distributed-optimizer] --results FILE
    megatron-core alone loads a torch_dist folder `ucp export-megatron` wrote (into torch AdamW sharded as its
    `FP32Optimizer`, or into its DDP and `DistributedOptimizer`), compares every state with REF (the DeepSpeed
    job's, from tests/workers/gpt.py save) and trains CONT steps.

`--each 'ARGS'` adds runs to the same launch (a save, then loads at other layouts of the same world size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator

import common  # tests/workers/common.py, next to this script; puts launch/ on sys.path
import deepspeed
import megatron_cpu  # launch/megatron_cpu.py
import torch
import torch.distributed as dist
import train_gpt  # launch/train_gpt.py, the reference script
from compare import compare
from gpt import snapshot
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import Float16Module
from train_gpt import SEQ, VOCAB, lm_loss

STEPS = 3
CONT = 3


def cpu_saving() -> None:
    """`dist_checkpointing.save` on the CPU: its preload calls `torch.cuda.synchronize()` when non-blocking."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    original = fa.FileSystemWriterAsync.preload_tensors
    fa.FileSystemWriterAsync.preload_tensors = staticmethod(lambda buckets, non_blocking=True: original(buckets, False))


def tied_copy(model):
    """A last pipeline stage's copy of the tied embedding (megatron-core all-reduces its gradient with the first
    stage's and counts it once), or None."""
    if model.share_embeddings_and_output_weights and model.post_process and not model.pre_process:
        return model.shared_embedding_or_output_weight()
    return None


def attention_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The causal mask and position ids train_gpt's model takes."""
    return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ), torch.arange(SEQ).unsqueeze(0)


def mean_loss(total: torch.Tensor) -> float:
    """A step's loss over the job: the last stage's DP (and CP) and TP ranks each hold the mean of their rows."""
    dist.all_reduce(total)
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    return total.item() / (dp * ps.get_tensor_model_parallel_world_size())


def setup(args: argparse.Namespace) -> None:
    """train_gpt's setup, with a context-parallel size. The local spec's attention has no context parallelism, so a
    CP rank trains on whole sequences; what a CP save looks like is what matters here: the model replicated over the
    CP ranks, the DistributedOptimizer's shards over DP x CP."""
    if args.cp == 1:
        train_gpt.setup(args)
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        context_parallel_size=args.cp,
    )
    megatron_cpu.install()


def forward_backward(call: Callable, model, micro: list[torch.Tensor]) -> torch.Tensor:
    """One step's micro-batches through this rank's pipeline stage, one at a time (activations received from the
    previous stage and sent to the next, their gradients back); `call` runs the stage (the model, or megatron-core's
    DDP around it). Returns the last stage's loss, the micro-batches' mean."""
    mask, position_ids = attention_inputs()
    prev, nxt = train_gpt.stage_ranks()
    total = torch.zeros(())
    for tokens in micro:
        x = None
        if prev is not None:
            x = torch.empty(SEQ, tokens.shape[0], model.config.hidden_size)
            dist.recv(x, prev)
            x.requires_grad_()
            model.set_input_tensor(x)
        out = call(tokens[:, :-1], position_ids, mask)
        if nxt is None:
            loss = lm_loss(out, tokens[:, 1:]) / len(micro)
            loss.backward()
            total += loss.detach()
        else:
            dist.send(out.detach().contiguous(), nxt)
            grad = torch.empty_like(out)
            dist.recv(grad, nxt)
            out.backward(grad)
        if x is not None:
            dist.send(x.grad.contiguous(), prev)
    return total


def steps(model, opt, sched, first: int, count: int) -> list[float]:
    """Training steps as DeepSpeed's ZeRO-1 takes them: micro-batches through the pipeline stages one at a time,
    their losses averaged, DP gradients averaged, the global gradient norm clipped to 1.0, then the optimizer and
    the schedule."""
    experts = {id(p) for g in opt.param_groups if g["is_expert_parallel"] for p in g["params"]}
    params = [p for g in opt.param_groups for p in g["params"]]
    tied = model.shared_embedding_or_output_weight() if model.pre_process or model.post_process else None
    copy = tied_copy(model)
    losses = []
    for step in range(first, first + count):
        total = forward_backward(model, model, train_gpt.batch(step))
        if ps.get_pipeline_model_parallel_world_size() > 1 and tied is not None:
            dist.all_reduce(tied.grad, group=ps.get_embedding_group())  # megatron-core's finalize_model_grads
        # megatron-core's DDP: every gradient scaled by 1/DP, summed over DP (experts over expert-DP: the
        # all-gather dispatcher already summed their tokens over the expert-parallel ranks)
        for p in params:
            p.grad /= ps.get_data_parallel_world_size()
            group = ps.get_expert_data_parallel_group() if id(p) in experts else ps.get_data_parallel_group()
            dist.all_reduce(p.grad, group=group)
        # megatron-core's clip_grads allocates on CUDA; the same sums by hand: dense over TP x PP without duplicates,
        # experts over the expert tensor, model and pipeline ranks, which hold different experts
        dense = sum(
            (
                p.grad.square().sum()
                for p in params
                if id(p) not in experts and p is not copy and param_is_not_tensor_parallel_duplicate(p)
            ),
            torch.zeros(()),
        )
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        expert = sum((p.grad.square().sum() for p in params if id(p) in experts), torch.zeros(()))
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        clip = 1.0 / ((dense + expert).sqrt().item() + 1e-6)
        if clip < 1.0:
            for p in params:
                p.grad.mul_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(mean_loss(total))
    return losses


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """megatron-core's `DistributedOptimizer` on the CPU. It names the CUDA device and CUDA tensor types literally
    (`torch.tensor(..., device='cuda')` for its scale and clipping buffers, `param.type() == 'torch.cuda.FloatTensor'`,
    `.cuda()` before its gathers); here they mean the CPU. gloo has the reduce-scatter and all-gather it uses."""
    factories = {name: getattr(torch, name) for name in ("tensor", "zeros", "empty", "ones")}
    tensor_type, tensor_cuda = torch.Tensor.type, torch.Tensor.cuda

    def on_cpu(factory: Callable) -> Callable:
        def made(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return made

    def type_name(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    for name, factory in factories.items():
        setattr(torch, name, on_cpu(factory))
    torch.Tensor.type, torch.Tensor.cuda = type_name, lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        for name, factory in factories.items():
            setattr(torch, name, factory)
        torch.Tensor.type, torch.Tensor.cuda = tensor_type, tensor_cuda


def megatron_groups(model, groups: list[dict]) -> list[dict]:
    """train_gpt's groups as megatron-core's `_get_param_groups` orders them: each weight-decay class, dense
    parameters before experts, every group marked `is_expert_parallel`. Experts are what megatron-core marks
    `allreduce=False`: only under expert parallelism (EP > 1); at EP=1 they train in the dense groups."""
    experts = {id(p) for p in model.parameters() if not getattr(p, "allreduce", True)}
    out = []
    for group in groups:
        for expert in (False, True):
            params = [p for p in group["params"] if (id(p) in experts) == expert]
            if params or not expert:
                out.append({**group, "params": params, "is_expert_parallel": expert})
    return out


def megatron_param_groups(model, groups: list[dict], weight_decay: float, decoupled_lr: float | None) -> list[dict]:
    """megatron-core's own groups (`_get_param_groups`: `wd_mult`, `lr_mult`, a decoupled learning rate for the
    embedding and output layer, experts apart), each with train_gpt's hyperparameters for its class and the weight
    decay Megatron-LM's scheduler gives it (`weight_decay * wd_mult`)."""
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=weight_decay, decoupled_lr=decoupled_lr)
    out = []
    for group in _get_param_groups([model], config, None):
        like = {k: v for k, v in groups[0 if group["wd_mult"] else 1].items() if k not in ("params", "name")}
        lr = decoupled_lr if group["default_config"] is False else like.get("lr", 1e-3)
        out.append({**group, **like, "lr": lr, "weight_decay": weight_decay * group["wd_mult"]})
    return out


def deepspeed_groups(model, groups: list[dict]) -> list[tuple[int, list[int]]]:
    """The groups as a DeepSpeed MoE job of the same model keeps them (`split_params_into_different_moe_groups_for_
    optimizer`): the dense groups, then the experts in groups of their own (megatron-core's expert groups, or at EP=1
    the experts of each dense group); each as (the megatron group it comes from, its parameters' ids)."""
    experts = {id(p) for name, p in model.named_parameters() if ".mlp.experts." in name}
    dense, moe = [], []
    for g, group in enumerate(groups):
        ids = [id(p) for p in group["params"]]
        if group["is_expert_parallel"]:
            moe.append((g, ids))
            continue
        dense.append((g, [i for i in ids if i not in experts]))
        if split := [i for i in ids if i in experts]:
            moe.append((g, split))
    return dense + moe


def universal_name(model, name: str) -> str:
    """A parameter's name with its layer and expert indices made global (a pipeline stage numbers its layers from 0,
    an expert-parallel rank its experts)."""
    found = re.fullmatch(r"decoder\.layers\.([0-9]+)\.(.+)", name)
    if found:
        name = f"decoder.layers.{model.decoder.layers[int(found.group(1))].layer_number - 1}.{found.group(2)}"
    head, sep, rest = name.partition(".mlp.experts.local_experts.")
    if not sep:
        return name
    local, _, leaf = rest.partition(".")
    per_rank = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return f"{head}{sep}{ps.get_expert_model_parallel_rank() * per_rank + int(local)}.{leaf}"


def full_state(model, groups: list[dict], state_of: Callable[[torch.Tensor], dict]) -> dict:
    """The full state in universal names (gpt.py's snapshot form): TP shards gathered, experts by global index,
    vocabulary padding dropped, the groups in DeepSpeed's order; on rank 0. `groups` are the optimizer's groups
    over the model's parameters, `state_of(p)` p's whole AdamW state."""
    slots = deepspeed_groups(model, groups)
    group_of = {pid: i for i, (_, ids) in enumerate(slots) for pid in ids}
    part: dict = {"fp32": {}, "state": {}, "steps": {}}
    copy = tied_copy(model)
    for name, p in model.named_parameters():
        if p is copy:  # the tied embedding, saved and compared once
            continue
        name = universal_name(model, name)
        state = state_of(p)
        weight = state.get("param", p.detach())  # an optimizer's fp32 copy, where it keeps one
        values = {"fp32": weight, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for key, local in values.items():
            full = local
            if getattr(p, "tensor_model_parallel", False):
                shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                if model.config.gated_linear_unit and ".linear_fc1." in name:  # [gate; up] on each rank
                    shards = [h for half in zip(*(s.chunk(2) for s in shards)) for h in half]
                full = torch.cat(shards, dim=p.partition_dim)
            if name.endswith("word_embeddings.weight") or name.startswith("output_layer."):
                full = full[:VOCAB]
            if key == "fp32":
                part["fp32"][name] = full.clone()
            else:
                part["state"][f"{name}/{key}"] = full.clone()
        part["steps"][group_of[id(p)]] = state["step"].clone()
    parts: list = [None] * dist.get_world_size()  # pipeline stages and expert-parallel ranks hold different parts
    dist.all_gather_object(parts, part)
    snap: dict = {"fp32": {}, "state": {}, "steps": {}}
    for piece in parts:
        for key in snap:
            snap[key].update(piece[key])
    snap["steps"] = dict(sorted(snap["steps"].items()))
    # a DeepSpeed job's groups hold torch's hyperparameters; megatron-core's scheduler keys stay in the checkpoint
    scheduler_keys = ("wd_mult", "lr_mult", "max_lr", "min_lr", "default_config", "is_decoupled_lr")
    snap["hyperparams"] = [
        {k: v for k, v in groups[g].items() if k not in ("params", "name", "is_expert_parallel", *scheduler_keys)}
        for g, _ in slots
    ]
    return snap


def chain_members(opt: torch.optim.Optimizer) -> list[list[int]]:
    """The groups of each optimizer megatron-core would build: the dense ones, then (MoE) the expert ones."""
    flags = [group["is_expert_parallel"] for group in opt.param_groups]
    return [members for e in (False, True) if (members := [g for g, f in enumerate(flags) if f == e])]


def merged_optimizer(opt: torch.optim.Optimizer, loaded: dict) -> dict:
    """`opt`'s `state_dict` from what `dist_checkpointing.load` returned for `sharded_optimizer`'s layout, each
    parameter's step put back from its optimizer's `common_step`."""
    chains = chain_members(opt)
    parts = [loaded] if len(chains) == 1 else [loaded[c] for c in range(len(chains))]
    full = opt.state_dict()
    state: dict = {}
    groups: list = [None] * len(opt.param_groups)
    for members, part in zip(chains, parts):
        step = part["state"].pop("common_step")
        ids = [pid for g in members for pid in full["param_groups"][g]["params"]]
        for n, pid in enumerate(ids):
            state[pid] = {**part["state"][n], "step": step.clone()}
        for g, group in zip(members, part["param_groups"]):
            groups[g] = {**group, "params": full["param_groups"][g]["params"]}
    return {"state": state, "param_groups": groups}


def sharded_optimizer(model_sd: dict, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's `sharded_state_dict` as megatron-core's optimizers give it: an `FP32Optimizer`'s for a dense
    model (the step kept once, as `common_step`); for an MoE model a `ChainedOptimizer`'s of a dense and an expert
    `FP32Optimizer` (`{0: ..., 1: ...}`, their tensors' keys prefixed `chained_<i>.`), as Megatron-LM builds it."""
    full = opt.state_dict()
    chains = chain_members(opt)
    out = {}
    for i, members in enumerate(chains):
        ids = [pid for g in members for pid in full["param_groups"][g]["params"]]
        renumber = {pid: n for n, pid in enumerate(ids)}
        optim_sd = {
            "state": {renumber[pid]: dict(full["state"][pid]) for pid in ids},
            "param_groups": [
                {**full["param_groups"][g], "params": [renumber[pid] for pid in full["param_groups"][g]["params"]]}
                for g in members
            ],
        }
        params = [p for g in members for p in opt.param_groups[g]["params"]]
        step = optim_sd["state"][0]["step"]
        optim_state_to_sharding_state(
            optim_sd, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys="step"
        )
        optim_sd["state"]["common_step"] = step
        if len(chains) > 1:
            add_prefix_for_sharding(optim_sd, f"chained_{i}.")
        out[i] = optim_sd
    return out if len(chains) > 1 else out[0]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """train_gpt's learning-rate schedule."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


class Trainer:
    """megatron-core's model trained with torch AdamW and saved as its `FP32Optimizer` (a `ChainedOptimizer` of a
    dense and an expert one for MoE) shards it, through pipeline stages this worker runs by hand (`steps`); one
    save. The other sources use megatron-core's own DDP and optimizers (`MegatronTrainer`)."""

    saves = (("ckpt", None),)

    def __init__(self, model, groups: list[dict]) -> None:
        self.model = model
        self.torch = torch.optim.AdamW(megatron_groups(model, groups), lr=1e-3)
        self.schedules = [schedule(self.torch)]

    def steps(self, first: int, count: int) -> list[float]:
        return steps(self.model, self.torch, self.schedules[0], first, count)

    def full_state(self) -> dict:
        return full_state(self.model, self.torch.param_groups, lambda p: self.torch.state[p])

    def sharded(self, model_sd: dict, sharding: str | None) -> dict:
        return sharded_optimizer(model_sd, self.torch)


class MegatronTrainer:
    """megatron-core's DDP and optimizers (the same AdamW, groups and clipping), built as Megatron-LM's
    `get_megatron_optimizer` builds them: one for the dense groups over the DP group, and for MoE one for the expert
    groups over the expert-DP group, chained. `distributed`: `DistributedOptimizer`s, each DP rank updating its
    shard, saved `fully_reshardable` (`--dist-ckpt-optim-fully-reshardable`) and `dp_reshardable` (Megatron-LM's
    default); else `Float16OptimizerWithFloat16Params` (bf16) or `FP32Optimizer`, saved once. Saved with the metadata
    Megatron-LM passes (a `ChainedOptimizer` then prefixes only the keys of a format that is not fully
    reshardable)."""

    def __init__(self, model, groups: list[dict], distributed: bool, bf16: bool, args: argparse.Namespace) -> None:
        self.distributed = distributed
        self.saves = (
            (("ckpt", "fully_reshardable"), ("dp_reshardable", "dp_reshardable"))
            if distributed
            else (("ckpt", "dp_reshardable"),)  # Megatron-LM names its default format whatever the optimizer
        )
        self.groups = (
            megatron_groups(model, groups)
            if args.megatron_groups is None
            else megatron_param_groups(model, groups, args.megatron_groups, args.decoupled_lr)
        )
        self.members = [list(g["params"]) for g in self.groups]  # each optimizer puts its shards in their place
        self.model = model
        if bf16:  # as Megatron-LM's --bf16: the weights in bf16 (the same parameters), fp32 copies in the optimizer
            model.config.bf16, model.config.params_dtype = True, torch.bfloat16
            model = Float16Module(model.config, model)
        self.ddp = DistributedDataParallel(
            self.model.config,
            DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=bf16),
            model,
        )
        self.experts = {id(p) for g in self.groups if g["is_expert_parallel"] for p in g["params"]}
        # (the optimizer's groups, its buffers, its DP group and gloo twin, its model-parallel group)
        parts = [
            (
                [g for g in self.groups if not g["is_expert_parallel"]],
                self.ddp.buffers,
                ps.get_data_parallel_group(with_context_parallel=True),
                ps.get_data_parallel_group_gloo(with_context_parallel=True),
                ps.get_model_parallel_group(),
            )
        ]
        if self.experts:
            parts.append(
                (
                    [g for g in self.groups if g["is_expert_parallel"]],
                    self.ddp.expert_parallel_buffers,
                    ps.get_expert_data_parallel_group(),
                    ps.get_expert_data_parallel_group_gloo(),
                    ps.get_expert_tensor_model_pipeline_parallel_group(),
                )
            )
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            use_distributed_optimizer=distributed,
            clip_grad=1.0,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        self.parts = [
            _get_megatron_optimizer_based_on_param_groups(
                config,
                [self.ddp],
                mine,
                per_model_buffers={0: buffers},
                model_parallel_group=model_parallel,
                data_parallel_group=dp,
                data_parallel_group_gloo=dp_gloo,
                data_parallel_group_idx=model_parallel.rank(),
                intra_dist_opt_group=ps.get_intra_distributed_optimizer_instance_group(),
            )
            for mine, buffers, dp, dp_gloo, model_parallel in parts
        ]
        self.opt = ChainedOptimizer(self.parts)
        # a Float16OptimizerWithFloat16Params' fp32 copy of each bf16 parameter
        self.copies = {}
        for part in self.parts:
            for params, copies in zip(
                getattr(part, "float16_groups", []), getattr(part, "fp32_from_float16_groups", [])
            ):
                self.copies.update({id(p): copy for p, copy in zip(params, copies)})
        self.schedules = [schedule(part.optimizer) for part in self.parts]

    def steps(self, first: int, count: int) -> list[float]:
        """DDP scales each gradient by 1/DP and all-reduces it (for a DistributedOptimizer: reduce-scatters it into
        the owning rank's shard); the optimizer's step takes the norm, clips, updates the parameters (its shard, then
        all-gathers them)."""
        model = self.model
        tied = model.shared_embedding_or_output_weight() if model.pre_process or model.post_process else None
        losses = []
        for step in range(first, first + count):
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()
            total = forward_backward(self.ddp, model, train_gpt.batch(step))
            self.ddp.finish_grad_sync()
            if ps.get_pipeline_model_parallel_world_size() > 1 and tied is not None:  # finalize_model_grads
                dist.all_reduce(tied.main_grad, group=ps.get_embedding_group())
            self.opt.step()
            for each in self.schedules:
                each.step()
            losses.append(mean_loss(total))
        return losses

    def state_of(self, p: torch.Tensor) -> dict:
        """p's whole fp32 copy and AdamW state: each rank of its optimizer's DP group fills the range its shard
        holds, a sum over that group joins the ranges (the other ranks add zeros), the step is the owners'."""
        expert = id(p) in self.experts
        part = self.parts[1 if expert else 0]
        if not self.distributed:  # every rank holds the whole state
            main = self.copies.get(id(p), p)
            return {"param": main.detach(), **part.optimizer.state[main]}
        whole = {k: torch.zeros(p.numel()) for k in ("param", "exp_avg", "exp_avg_sq")}
        step = torch.zeros(())
        if p in part.model_param_group_index_map:
            where = part._get_model_param_range_map(p)["param"]
            shard = part._get_main_param_and_optimizer_states(p)
            for key, value in whole.items():
                value[where.start : where.end] = shard[key]
            step = shard["step"].clone()
        group = (
            ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(with_context_parallel=True)
        )
        for value in whole.values():
            dist.all_reduce(value, group=group)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
        return {**{k: v.view_as(p) for k, v in whole.items()}, "step": step}

    def full_state(self) -> dict:
        """The full state, each group's hyperparameters as its optimizer holds them now (dense, then expert)."""
        flags = [g["is_expert_parallel"] for g in self.groups]
        order = [i for i, f in enumerate(flags) if not f] + [i for i, f in enumerate(flags) if f]
        live = [g for part in self.parts for g in part.optimizer.param_groups]
        groups: list = [None] * len(order)
        for i, group in zip(order, live):
            groups[i] = {**group, "params": self.members[i]}
        return full_state(self.model, groups, self.state_of)

    def sharded(self, model_sd: dict, sharding: str | None) -> dict:
        metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False}
        return self.opt.sharded_state_dict(model_sd, metadata={**metadata, "chained_optim_avoid_prefix": True})


def do_save(args: argparse.Namespace) -> None:
    cpu_saving()
    model, groups = train_gpt.model_and_groups(args)
    megatron = args.distributed_optimizer or args.megatron_optimizer
    with cuda_as_cpu() if megatron else contextlib.nullcontext():
        trainer = (
            MegatronTrainer(model, groups, args.distributed_optimizer, args.bf16, args)
            if megatron
            else Trainer(model, groups)
        )
        trainer.steps(0, STEPS)
        ref = trainer.full_state()
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
            pipeline_model_parallel_size=args.pp,
            expert_model_parallel_size=args.ep,
            num_experts=model.config.num_moe_experts,
            moe_router_topk=model.config.moe_router_topk,
            use_distributed_optimizer=args.distributed_optimizer,
            bf16=args.bf16,
            transformer_impl="local",
            context_parallel_size=args.cp,
            consumed_train_samples=STEPS * train_gpt.GLOBAL_BATCH,  # Megatron-LM's sampler resumes from it
            data_parallel_size=ps.get_data_parallel_world_size(),
        )
        for folder, sharding in trainer.saves:
            model_sd = model.sharded_state_dict()
            state = {
                "model": model_sd,
                "optimizer": trainer.sharded(model_sd, sharding),
                "iteration": STEPS,
                "checkpoint_version": 3.0,
                "args": megatron_args,
                "opt_param_scheduler": trainer.schedules[0].state_dict(),
            }
            os.makedirs(f"{args.out}/{folder}", exist_ok=True)  # megatron-core saves into an existing, empty folder
            dist_checkpointing.save(state, f"{args.out}/{folder}")
        cont = trainer.steps(STEPS, CONT)
    if dist.get_rank() == 0:
        torch.save({"snapshot": ref, "continuation": cont}, f"{args.out}/reference.pt")


def do_load(args: argparse.Namespace) -> None:
    ref = torch.load(f"{args.source}/reference.pt", weights_only=False)
    engine = train_gpt.build(args)
    _, client = engine.load_checkpoint(f"{args.source}/{args.folder}")
    # Megatron-LM sets its schedule from the iteration (its scheduler is another class); the restored groups hold
    # the learning rates, the schedule needs only its count
    engine.lr_scheduler.last_epoch = client["iteration"]
    snap = snapshot(engine)
    counted, samples = engine.global_steps, engine.global_samples
    losses = train_gpt.train(engine, CONT)
    if dist.get_rank() == 0:
        want = {k: ref["snapshot"][k] for k in ("fp32", "state", "steps", "hyperparams")}
        snap["hyperparams"] = [{k: v for k, v in h.items() if k != "moe"} for h in snap["hyperparams"]]
        diffs = compare(want, {k: snap[k] for k in want})
        if client.get("iteration") != STEPS or counted != STEPS:
            diffs.append(f"iteration {client.get('iteration')}, global_steps {counted}")
        if samples != STEPS * train_gpt.GLOBAL_BATCH:  # the next unseen sample, from consumed_train_samples
            diffs.append(f"global_samples {samples}, not {STEPS * train_gpt.GLOBAL_BATCH}")
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
    if args.distributed_optimizer:
        with cuda_as_cpu():
            snap, loaded, losses = distributed_native_load(args, model, groups)
        report_native(args, ref, snap, loaded, losses)
        return
    opt = torch.optim.AdamW(megatron_groups(model, groups), lr=1e-3)
    base_lrs = [g["lr"] for g in opt.param_groups]  # the schedule's peaks, as Megatron-LM's args give them
    for group in opt.param_groups:  # megatron-core's init_state_fn: the states must exist to be loaded into
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
    model_sd = model.sharded_state_dict()
    sharded = {"model": model_sd, "optimizer": sharded_optimizer(model_sd, opt)}
    loaded = dist_checkpointing.load(sharded, args.source)
    model.load_state_dict(loaded["model"], strict=False)  # the linears' `_extra_state` hold nothing here
    opt.load_state_dict(merged_optimizer(opt, loaded["optimizer"]))
    sched = schedule(opt)
    # Megatron-LM's scheduler is set from the iteration; building one above reset the learning rates to their peaks
    sched.last_epoch, sched.base_lrs = loaded["iteration"] - 1, base_lrs
    sched.step()
    snap = full_state(model, opt.param_groups, lambda p: opt.state[p])
    losses = steps(model, opt, sched, loaded["iteration"], CONT)
    report_native(args, ref, snap, loaded, losses)


@contextlib.contextmanager
def torch_adam_step_kept() -> Iterator[None]:
    """megatron-core 0.16.1's `DistributedOptimizer` loading `fully_reshardable` into torch's Adam (no Transformer
    Engine or Apex, as on this CPU). Its `load_state_dict` puts one step tensor into every parameter's state, shared,
    so that torch's Adam, which increments it in place, would count one step per parameter; then
    `_set_main_param_and_optimizer_states` copies every state key from the loaded tensors, which hold no step
    (`KeyError: 'step'`). With TE's FusedAdam the state has no per-parameter step. Here each state gets its own
    copy of the step, copied onto itself."""
    cls = DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def keeping(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            state["step"] = state["step"].detach().clone()
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = keeping
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original


def distributed_native_load(args: argparse.Namespace, model, groups: list[dict]) -> tuple[dict, dict, list[float]]:
    """As Megatron-LM resumes with `--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable`: megatron-core's
    DDP and DistributedOptimizer built, `dist_checkpointing.load` of the model's and the optimizer's sharded state
    dicts, each loaded into its owner; then the full state joined from the shards, and CONT steps."""
    trainer = MegatronTrainer(model, groups, True, False, args)
    base_lrs = [[g["lr"] for g in part.optimizer.param_groups] for part in trainer.parts]
    for part in trainer.parts:  # init_state_fn, with torch Adam's step (Transformer Engine's keeps it per group)
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                part.optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False}
    optimizer_sd = trainer.opt.sharded_state_dict(
        model_sd, is_loading=True, metadata={**metadata, "chained_optim_avoid_prefix": True}
    )
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer_sd}, args.source)
    model.load_state_dict(loaded["model"], strict=False)
    with torch_adam_step_kept():
        trainer.opt.load_state_dict(loaded["optimizer"])
    for sched, lrs in zip(trainer.schedules, base_lrs):  # Megatron-LM's scheduler is set from the iteration
        sched.last_epoch, sched.base_lrs = loaded["iteration"] - 1, lrs
        sched.step()
    return trainer.full_state(), loaded, trainer.steps(loaded["iteration"], CONT)


def report_native(args: argparse.Namespace, ref: dict, snap: dict, loaded: dict, losses: list[float]) -> None:
    """native-load's results: every state against the DeepSpeed job's, the next losses."""
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
    parser.add_argument("--folder", default="ckpt", help="load: the save to load (dp_reshardable: the other format)")
    parser.add_argument("--reference", help="native-load: the saving DeepSpeed job's reference.pt")
    parser.add_argument(
        "--distributed-optimizer", action="store_true", help="save: train with megatron-core's DistributedOptimizer"
    )
    parser.add_argument(
        "--megatron-optimizer",
        action="store_true",
        help="save: train with megatron-core's FP32Optimizer or (bf16) Float16OptimizerWithFloat16Params",
    )
    parser.add_argument("--bf16", action="store_true", help="save, with megatron-core's optimizers: bf16 weights")
    parser.add_argument(
        "--megatron-groups",
        type=float,
        metavar="WEIGHT_DECAY",
        help="save, with megatron-core's optimizers: megatron-core's own param groups at this weight decay",
    )
    parser.add_argument("--decoupled-lr", type=float, help="save, with --megatron-groups: the embedding's own lr")
    parser.add_argument("--cp", type=int, default=1, help="save: context-parallel size (megatron-core's groups)")
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:  # megatron-core's groups are rebuilt for each run: one launch saves and loads
        setup(run)
        {"save": do_save, "load": do_load, "native-load": do_native_load}[run.mode](run)
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
