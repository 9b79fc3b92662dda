"""Train a tiny megatron-core GPT under DeepSpeed with universal checkpoints: the reference script to copy.

    torchrun --nproc_per_node N launch/train_gpt.py --ckpt-dir DIR --steps S [--tp T --pp P --zero Z]

On start it resumes from the newest complete checkpoint in DIR, whatever layout saved it (or from
`--init-from`), then trains to step S, saving every `--ckpt-every` steps and keeping the `--keep` newest.
The data-parallel size is whatever world size is left over: world / (T * P). `--model DIR` builds the
megatron-core model a universal checkpoint recorded (`ucp import-hf`) instead of `--arch`'s. It uses only
ucp_deepspeed's public API; launch/README.md is its guide.

Pipeline stages are megatron-core `GPTModel`s (pre_process/post_process), one DeepSpeed engine per
stage. The schedule is a plain fill-drain over micro-batches, in the order DeepSpeed's own
PipelineEngine uses with ZeRO-1: backward without gradient reduction, all-reduce of the tied
embedding's gradient between the first and last stage, then reduction and step. On a machine
without a GPU, megatron_cpu.py (next to this script) stands in for megatron-core's CUDA-only helpers.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import deepspeed
import megatron_cpu  # launch/megatron_cpu.py, next to this script
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import ucp_deepspeed

VOCAB = 70  # padded to a multiple of 8 * tp: 72 at tp=1, 80 at tp=2
PAD_MULTIPLE = 8
SEQ = 8
GLOBAL_BATCH = 12  # divisible by every data-parallel size from 1 to 4
STEPS = 3
CONT = 3
EXPERTS = 4

ARCHS = {
    "gpt": {
        "normalization": "LayerNorm",
        "gated_linear_unit": False,
        "activation_func": torch.nn.functional.gelu,
        "add_bias_linear": True,
        "position_embedding_type": "learned_absolute",
    },
    "llama": {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "position_embedding_type": "rope",
    },
}


def padded_vocab(tp: int) -> int:
    multiple = PAD_MULTIPLE * tp
    return -(-VOCAB // multiple) * multiple


def model_args(args: argparse.Namespace) -> tuple[dict, dict]:
    """(TransformerConfig, GPTModel) arguments: the model a universal checkpoint recorded (`--model`, e.g. a
    Hugging Face import), or this script's tiny `--arch` model."""
    if args.model:
        spec = ucp_deepspeed.UniversalCheckpoint(args.model).manifest.model
        if spec is None:
            raise SystemExit(f"{args.model} records no model")
        if spec.vocab_size != VOCAB:
            raise SystemExit(f"{args.model}: this script's data has {VOCAB} tokens, the model {spec.vocab_size}")
        return ucp_deepspeed.megatron_kwargs(spec)
    arch = dict(ARCHS[args.arch])
    position = arch.pop("position_embedding_type")
    if args.moe:  # 4 experts, top-2; SequentialMLP
        arch.update(num_moe_experts=EXPERTS, moe_router_topk=2, add_bias_linear=False)
    transformer = {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 96,
        **arch,
    }
    gpt = {
        "vocab_size": VOCAB,
        "max_sequence_length": SEQ,
        "share_embeddings_and_output_weights": True,
        "position_embedding_type": position,
    }
    return transformer, gpt


def model_and_groups(args: argparse.Namespace) -> tuple[GPTModel, list[dict]]:
    """This rank's pipeline stage of the model and its optimizer's param groups (decay, no decay), as megatron-core
    alone would train it."""
    transformer, gpt = model_args(args)
    num_layers = transformer["num_layers"]
    experts = transformer.get("num_moe_experts") or 0
    if experts:  # the load-balancing loss is per rank, so it is left out
        transformer.update(
            expert_model_parallel_size=args.ep,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
        )
    megatron_cpu.seed(1234)
    config = TransformerConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        num_layers_in_first_pipeline_stage=args.first_stage_layers or None,
        num_layers_in_last_pipeline_stage=(num_layers - args.first_stage_layers) if args.first_stage_layers else None,
        **transformer,
    )
    with megatron_cpu.cpu_model_construction():
        spec = get_gpt_layer_local_spec(
            num_experts=experts or None, moe_grouped_gemm=False, normalization=config.normalization
        )
        model = GPTModel(
            config,
            spec,
            vocab_size=padded_vocab(args.tp),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **{k: v for k, v in gpt.items() if k != "vocab_size"},
        )
    padded = [model.embedding.word_embeddings.weight] if model.pre_process else []
    padded += (
        [model.output_layer.weight] if model.post_process and not model.share_embeddings_and_output_weights else []
    )
    with torch.no_grad():  # padding rows start at zero and, with padded logits masked, stay there
        for weight in padded:
            first = ps.get_tensor_model_parallel_rank() * weight.shape[0]
            weight[max(0, VOCAB - first) :].zero_()
    tied = model.shared_embedding_or_output_weight() if (model.pre_process or model.post_process) else None
    if tied is not None and model.share_embeddings_and_output_weights and not model.pre_process:
        tied.ds_pipe_replicated = True  # DeepSpeed counts it once in the gradient norm
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    groups = [
        {"params": decay, "weight_decay": 0.1, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4, "betas": (0.8, 0.95), "name": "no_decay"},
    ]
    return model, groups


def build(args: argparse.Namespace, keep_last: int | None = None, direct: bool = True) -> deepspeed.DeepSpeedEngine:
    """This rank's pipeline stage of the model, wrapped in a ucp_deepspeed engine that keeps the `keep_last` newest
    checkpoints (all when None) and reshards by reading the saved files in place (`direct`)."""
    model, groups = model_and_groups(args)
    if ucp_deepspeed.register_megatron_experts(model):  # experts get their own expert-data-parallel groups
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (ps.get_data_parallel_world_size() * micro_batches()),
        "gradient_accumulation_steps": micro_batches(),
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "checkpoint": {
            "universal": {
                "enabled": True,
                "progress": False,
                "vocab_size": VOCAB,
                "async_save": args.async_save,
                "direct": direct,
                "keep_last": keep_last,
            }
        },
    }
    engine, _, _, _ = ucp_deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s)),
    )
    if args.pp > 1:
        engine.enable_backward_allreduce = False  # reduce once per step, after the tied-gradient sync
    return engine


def stage_ranks() -> tuple[int | None, int | None]:
    """Global ranks of the previous and next pipeline stage (None at the ends)."""
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    stage = ps.get_pipeline_model_parallel_rank()
    return (ranks[stage - 1] if stage > 0 else None), (ranks[stage + 1] if stage + 1 < len(ranks) else None)


def micro_batches() -> int:
    """Two micro-batches per step when the rank's rows split evenly, so a pipeline has something to fill."""
    return 2 if (GLOBAL_BATCH // ps.get_data_parallel_world_size()) % 2 == 0 else 1


def global_tokens(step: int, data: str) -> torch.Tensor:
    """The whole global batch of a step, a function of the step alone.

    `random` tokens are uniform, so the loss stays near ln(VOCAB); `markov` tokens follow a fixed
    successor table 80% of the time, a pattern the model learns, so the loss curve falls.
    """
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    if data == "markov":
        successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
        follow = torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) < 0.8
        for t in range(1, SEQ + 1):
            tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], tokens[:, t])
    return tokens


def batch(step: int, data: str = "random") -> list[torch.Tensor]:
    """This data-parallel rank's micro-batches of a step; the global batch never depends on the layout."""
    tokens = global_tokens(step, data)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = GLOBAL_BATCH // dp
    return list(tokens[rank * per : (rank + 1) * per].chunk(micro_batches()))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy over the vocab-parallel logits, with the padded vocabulary masked out."""
    local = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * local
    pad = torch.arange(first, first + local) >= VOCAB
    logits = logits.float().masked_fill(pad, -1e4).transpose(0, 1).contiguous()
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).mean()


def train(engine: deepspeed.DeepSpeedEngine, steps: int, data: str = "random") -> list[float]:
    """Run `steps` optimizer steps; return the global mean loss of each, on every rank."""
    prev, nxt = stage_ranks()
    first, last = prev is None, nxt is None
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    position_ids = torch.arange(SEQ).unsqueeze(0)
    out_losses = []
    for _ in range(steps):
        micro = batch(engine.global_steps, data)
        total = torch.zeros(())
        for m, tokens in enumerate(micro):
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            x = None
            if not first:
                x = torch.empty(SEQ, inputs.shape[0], engine.module.config.hidden_size)
                dist.recv(x, prev)
                x.requires_grad_()
                engine.module.set_input_tensor(x)
            out = engine(inputs, position_ids, mask)
            if last:
                loss = lm_loss(out, labels)
                engine.backward(loss)
                total += loss.detach() / len(micro)
            else:
                dist.send(out.detach().contiguous(), nxt)
                grad = torch.empty_like(out)
                dist.recv(grad, nxt)
                engine.backward((out * grad).sum(), scale_wrt_gas=False)
            if not first:
                dist.send(x.grad.contiguous(), prev)
            if m + 1 < len(micro):
                engine.step()
        if ps.get_pipeline_model_parallel_world_size() > 1:
            module = engine.module
            tied = (
                module.shared_embedding_or_output_weight()
                if module.share_embeddings_and_output_weights and (module.pre_process or module.post_process)
                else None
            )
            if tied is not None:
                dist.all_reduce(tied.grad, group=ps.get_embedding_group())
            engine.allreduce_gradients()
        engine.step()
        dist.all_reduce(total)
        out_losses.append(
            total.item() / (ps.get_data_parallel_world_size() * ps.get_tensor_model_parallel_world_size())
        )
    return out_losses


Hook = Callable[[deepspeed.DeepSpeedEngine], None]


def do_train(
    args: argparse.Namespace,
    on_resume: Hook | None = None,
    before_save: Hook | None = None,
    after_step: Hook | None = None,
) -> tuple[dict | None, list[dict]]:
    """Train to --steps, checkpointing every --ckpt-every steps and keeping --keep; resume whatever the layout.

    The hooks run on every rank: after a resume, before each save, after each step. Returns what was resumed
    from (None on a fresh start) and each step's loss.
    """
    engine = build(args, keep_last=args.keep if args.ckpt_every else None)
    resumed = None
    if args.init_from or (os.path.isdir(args.ckpt_dir) and ucp_deepspeed.resume_tag(args.ckpt_dir)):
        engine.load_checkpoint(args.init_from or args.ckpt_dir, tag=args.init_tag)
        report = engine.ucp_last_load
        resumed = {"step": engine.global_steps, "saved": report.saved, "live": report.live, "mode": report.mode}
        if dist.get_rank() == 0:
            print(f"resumed from step {engine.global_steps}: {report.how()}", flush=True)
        if on_resume is not None:
            on_resume(engine)
        if args.save_resumed:  # the resumed state at this layout, before any step (compare with `ucp diff`)
            engine.save_checkpoint(args.ckpt_dir)
    log = []
    while engine.global_steps < args.steps:
        [loss] = train(engine, 1, args.data)
        log.append({"step": engine.global_steps, "loss": loss, "world": dist.get_world_size()})
        if dist.get_rank() == 0:
            print(f"step {engine.global_steps} loss {loss:.6f} world {dist.get_world_size()}", flush=True)
        if after_step is not None:
            after_step(engine)
        if args.ckpt_every and engine.global_steps % args.ckpt_every == 0:
            if before_save is not None:
                before_save(engine)
            engine.save_checkpoint(args.ckpt_dir)  # keeps the --keep newest complete tags ("keep_last")
    engine.wait_for_checkpoint()  # an async save finishes, and is counted for retention, here at the latest
    return resumed, log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, layout and training options."""
    parser.add_argument("--arch", choices=sorted(ARCHS), default="gpt")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--first-stage-layers", type=int, default=0, help="uneven pipeline split: layers on stage 0")
    parser.add_argument("--moe", action="store_true", help="MoE MLPs: 4 experts, top-2")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    parser.add_argument(
        "--model", help="build the megatron-core model a universal checkpoint recorded (e.g. from ucp import-hf)"
    )
    parser.add_argument("--ckpt-dir", help="checkpoint directory, resumed from when it holds a tag")
    parser.add_argument("--steps", type=int, default=8, help="last step")
    parser.add_argument("--ckpt-every", type=int, default=2, help="0 saves nothing")
    parser.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    parser.add_argument(
        "--data",
        choices=["random", "markov"],
        default="random",
        help="token distribution (markov is learnable, so the loss falls)",
    )
    parser.add_argument(
        "--init-from",
        help="start from this checkpoint (e.g. a universal folder from ucp import-hf) instead of resuming from "
        "--ckpt-dir",
    )
    parser.add_argument("--init-tag", help="the tag of --init-from to start from (default: the latest)")
    parser.add_argument("--save-resumed", action="store_true", help="save once right after resuming, before training")
    parser.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; unused")


def setup(args: argparse.Namespace) -> None:
    """megatron-core's groups for this layout (and, without a GPU, its CPU stand-ins)."""
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
    )
    if not torch.cuda.is_available():
        megatron_cpu.install()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["train"], default="train", help="(the only mode)")
    add_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    setup(args)
    do_train(args)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
