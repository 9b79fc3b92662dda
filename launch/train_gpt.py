"""Train a tiny megatron-core GPT at any TP x PP x DP with ucp_deepspeed, save, and resume elsewhere.

    save --out DIR --tp T --pp P --zero Z --arch gpt|llama
        train STEPS steps, gather the full model state, save, continue CONT steps and record their
        losses; rank 0 writes DIR/reference.pt
    load --source DIR [DIR ...] --tp T --pp P --zero Z --arch ... [--resave OUT]
        build the engines at this launch's layout, load each source, compare every full fp32 weight
        and optimizer state with the reference using torch.equal, continue CONT steps and compare
        losses; --resave saves the loaded state again, untrained, at this layout

The data-parallel size is whatever world size is left over: world / (T * P). `--model DIR` builds
the megatron-core model a universal checkpoint recorded (`ucp import-hf`) instead of `--arch`'s.

Pipeline stages are megatron-core `GPTModel`s (pre_process/post_process), one DeepSpeed engine per
stage. The schedule is a plain fill-drain over micro-batches, in the order DeepSpeed's own
PipelineEngine uses with ZeRO-1: backward without gradient reduction, all-reduce of the tied
embedding's gradient between the first and last stage, then reduction and step.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shlex
import signal
import sys
import time

import deepspeed
import megatron_cpu
import torch
import torch.distributed as dist
from compare import compare
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import ucp_deepspeed
import ucp_deepspeed.runtime.mpu
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.geometry.layout import merge
from ucp_deepspeed.hf.models import megatron_kwargs
from ucp_deepspeed.runtime.capture import infos
from ucp_deepspeed.sources import list_tags

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
        spec = UniversalCheckpoint(args.model).manifest.model
        if spec is None:
            raise SystemExit(f"{args.model} records no model")
        if spec.vocab_size != VOCAB:
            raise SystemExit(f"{args.model}: this script's data has {VOCAB} tokens, the model {spec.vocab_size}")
        return megatron_kwargs(spec)
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


def build(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    """This rank's pipeline stage of the model, wrapped in a ucp_deepspeed engine."""
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
    if ucp_deepspeed.runtime.mpu.register_megatron_experts(model):  # experts get their own expert-data-parallel groups
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
                "async_save": getattr(args, "async_save", False),
                "direct": not getattr(args, "converted", False),
                "keep_last": args.keep if args.mode == "train" and args.ckpt_every else None,
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


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict | None:
    """Full fp32 weights and optimizer states of the whole model, on rank 0 (None elsewhere)."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    if engine.zero_optimization_stage() == 3:
        flats = [(opt.sub_group_to_group_id[i], f) for i, f in enumerate(opt.fp32_partitioned_groups_flat)]
    else:
        flats = [(g, f) for g, group in enumerate(opt.optimizer.param_groups) for f in group["params"]]
    keys = sorted(k for k, v in opt.optimizer.state[flats[0][1]].items() if torch.is_tensor(v) and v.dim() == 1)
    placed = infos(engine)
    tp_group = ps.get_tensor_model_parallel_group()
    part: dict = {"fp32": {}, "state": {}, "alias": {}}
    for name, p in sorted(engine.module.named_parameters()):
        info = placed[name]
        values = {"fp32": safe_get_full_fp32_param(p)} | {k: safe_get_full_optimizer_state(p, k) for k in keys}
        for key, local in values.items():
            shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(shards, local.detach().contiguous(), group=tp_group)
            full = merge(info.layout, shards, name)
            if info.alias:
                part["alias"][f"{info.name}/{key}"] = full
            elif key == "fp32":
                part["fp32"][info.name] = full
            else:
                part["state"][f"{info.name}/{key}"] = full
    part["steps"] = {g: opt.optimizer.state[f]["step"].clone() for g, f in flats if "step" in opt.optimizer.state[f]}
    parts: list = [None] * dist.get_world_size()  # every rank: expert-parallel ranks hold different experts
    dist.all_gather_object(parts, part)
    if dist.get_rank() != 0:
        return None
    snap: dict = {"fp32": {}, "state": {}, "alias": {}, "state_keys": keys}
    for piece in filter(None, parts):
        for k in ("fp32", "state", "alias"):
            snap[k].update(piece[k])
    snap["steps"] = parts[0]["steps"]
    # DeepSpeed names MoE param groups after the expert-parallel size: structure, not a hyperparameter
    snap["hyperparams"] = [
        {k: v for k, v in g.items() if k not in ("params", "name")} for g in opt.optimizer.param_groups
    ]
    snap["scheduler"] = engine.lr_scheduler.state_dict()
    snap["counters"] = [engine.global_steps, engine.global_samples, engine.skipped_steps]
    return snap


def tied_copies_agree(snap: dict) -> list[str]:
    """A last stage's copy of the tied embedding must equal the first stage's, state by state."""
    diffs = []
    for key, value in snap["alias"].items():
        name, state = key.rsplit("/", 1)
        owner = snap["fp32"][name] if state == "fp32" else snap["state"][key]
        if not torch.equal(owner, value):
            diffs.append(f"tied copy {key} differs from its owner")
    return diffs


def save_logits(engine: deepspeed.DeepSpeedEngine, path: str) -> None:
    """Logits of the current weights on fixed tokens (through every pipeline stage), for comparison with
    `transformers`; the last stage's first tensor-parallel rank writes them."""
    prev, nxt = stage_ranks()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    with torch.no_grad():
        if prev is not None:
            x = torch.empty(SEQ, tokens.shape[0], engine.module.config.hidden_size)
            dist.recv(x, prev)
            engine.module.set_input_tensor(x)
        out = engine.module(tokens, torch.arange(SEQ).unsqueeze(0), mask)
        if nxt is not None:
            dist.send(out.contiguous(), nxt)
            return
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits[..., :VOCAB].clone()}, path)


def layout_name(args: argparse.Namespace) -> str:
    moe = f" moe ep{args.ep}" if args.moe else ""
    name = os.path.basename(args.model) if args.model else args.arch
    return f"{name}{moe} z{args.zero} tp{args.tp} pp{args.pp} dp{ps.get_data_parallel_world_size()}"


def rank_client_state(tp_rank: int, pp_rank: int) -> dict:
    """Per-rank client state as Megatron-DeepSpeed keeps it: each model-parallel rank's own random stream."""
    stream = torch.Generator().manual_seed(1000 + 100 * pp_rank + tp_rank)
    return {"rng_state": stream.get_state(), "role": [tp_rank, pp_rank]}


def own_role() -> tuple[int, int]:
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def client_state_ok(client: dict, report: ucp_deepspeed.LoadReport) -> bool:
    """A rank that keeps its role (same TP and PP sizes) gets its own saved client state, any other rank model-parallel
    rank 0's (collective: true on every rank)."""

    def sizes(desc: str) -> tuple[str, str]:
        found = dict(part.split("=") for part in desc.split() if "=" in part)
        return found.get("tp", "1"), found.get("pp", "1")

    expected = rank_client_state(*own_role()) if sizes(report.saved) == sizes(report.live) else rank_client_state(0, 0)
    ok = client.get("role") == expected["role"] and torch.equal(client.get("rng_state"), expected["rng_state"])
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def do_save(args: argparse.Namespace) -> None:
    engine = build(args)
    if args.init_from:
        engine.load_checkpoint(args.init_from)
        if args.logits_init:
            save_logits(engine, args.logits_init)
    losses = train(engine, args.save_steps)
    snap = snapshot(engine)
    engine.save_checkpoint(args.out, client_state=rank_client_state(*own_role()))
    if args.logits:
        save_logits(engine, args.logits)
    cont = train(engine, args.cont)
    if dist.get_rank() == 0:
        print(f"[{layout_name(args)}] losses {losses} then {cont}; saved {len(snap['fp32'])} params", flush=True)
        torch.save(
            {"snapshot": snap, "continuation": cont, "layout": layout_name(args)},
            os.path.join(args.out, "reference.pt"),
        )


def do_load(args: argparse.Namespace) -> None:
    results = []
    for source in args.source:
        ref = torch.load(os.path.join(source, "reference.pt"), weights_only=False) if dist.get_rank() == 0 else None
        engine = build(args)
        _, client = engine.load_checkpoint(source)
        client_ok = client_state_ok(client, engine.ucp_last_load)
        snap = snapshot(engine)
        if args.resave:
            engine.save_checkpoint(args.resave)
        losses = train(engine, args.cont)
        if dist.get_rank() == 0:
            diffs = compare(
                {k: v for k, v in ref["snapshot"].items() if k != "alias"},
                {k: v for k, v in snap.items() if k != "alias"},
            ) + tied_copies_agree(snap)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["continuation"]))
            report = engine.ucp_last_load
            results.append(
                {
                    "source": source,
                    "saved": report.saved,
                    "live": report.live,
                    "mode": report.mode,
                    "diffs": diffs,
                    "tensors": len(snap["fp32"]) + len(snap["state"]),
                    "aliases": len(snap["alias"]),
                    "losses": losses,
                    "reference_losses": ref["continuation"],
                    "max_rel_loss": rel if math.isfinite(rel) else 1e9,
                    "client_state_ok": client_ok,
                }
            )
            print(
                f"[{layout_name(args)}] from {ref['layout']}: {report.mode}, "
                f"{len(diffs)} differences, losses {losses} vs {ref['continuation']}",
                flush=True,
            )
        del engine
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)


def die_while_saving(engine: deepspeed.DeepSpeedEngine, step: int, background: bool) -> None:
    """Test hook: at `step`, the last rank writes half of its optimizer file, then is SIGKILLed mid-save.

    With `background` (async saves) this happens in the writer thread, after `save_checkpoint` returned,
    and the thread lingers half-way for a while so that training runs on with the write unfinished.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    import ucp_deepspeed.runtime.async_save

    def doomed(path: str) -> bool:
        return (
            f"global_step{step}" in path
            and dist.get_rank() == dist.get_world_size() - 1
            and path.endswith("optim_states.pt")
        )

    def die(data: memoryview, path: str, linger: float = 0.0) -> None:
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(linger)
        os.kill(os.getpid(), signal.SIGKILL)

    if background:
        original_write = ucp_deepspeed.runtime.async_save.write_file

        def write_file(path: str, state: dict, zipfile_serialization: bool, save_id: str = "") -> None:
            if doomed(path):
                buf = io.BytesIO()
                torch.save(state, buf)
                die(buf.getbuffer()[: buf.tell()], f"{path}.tmp.partial", linger=2.0)
            original_write(path, state, zipfile_serialization, save_id)

        ucp_deepspeed.runtime.async_save.write_file = write_file
        return
    original = TorchCheckpointEngine.save

    def save(self: TorchCheckpointEngine, state_dict: dict, path: str) -> None:
        if doomed(path):
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            die(buf.getbuffer()[: buf.tell()], path)
        original(self, state_dict, path)

    TorchCheckpointEngine.save = save


def do_train(args: argparse.Namespace) -> None:
    """Train to --steps, checkpointing every --ckpt-every steps and keeping --keep; resume whatever the layout."""
    engine = build(args)
    resumed = None
    if args.init_from or (os.path.isdir(args.ckpt_dir) and list_tags(args.ckpt_dir)):
        engine.load_checkpoint(args.init_from or args.ckpt_dir, tag=args.init_tag)
        report = engine.ucp_last_load
        resumed = {"step": engine.global_steps, "saved": report.saved, "live": report.live, "mode": report.mode}
        if dist.get_rank() == 0:
            print(f"resumed from step {engine.global_steps} at topology {report.saved} -> {report.live}", flush=True)
    if args.snapshots and resumed is not None:  # the test compares it with the one taken before that save
        snap = snapshot(engine)
        if dist.get_rank() == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save(snap, os.path.join(args.ckpt_dir, f"resumed_step{engine.global_steps}.pt"))
    if args.die_in_save:
        die_while_saving(engine, args.die_in_save, args.async_save)
    log = []
    while engine.global_steps < args.steps:
        [loss] = train(engine, 1, args.data)
        log.append({"step": engine.global_steps, "loss": loss, "world": dist.get_world_size()})
        if dist.get_rank() == 0:
            print(f"step {engine.global_steps} loss {loss:.6f} world {dist.get_world_size()}", flush=True)
        time.sleep(args.step_delay)
        if args.ckpt_every and engine.global_steps % args.ckpt_every == 0:
            if args.snapshots:
                snap = snapshot(engine)
                if dist.get_rank() == 0:
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    torch.save(snap, os.path.join(args.ckpt_dir, f"saved_step{engine.global_steps}.pt"))
            engine.save_checkpoint(args.ckpt_dir)  # keeps the --keep newest complete tags ("keep_last")
    engine.wait_for_checkpoint()  # an async save finishes, and is counted for retention, here at the latest
    if dist.get_rank() == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({"resumed": resumed, "log": log, "final_step": engine.global_steps}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "train"])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="gpt")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--first-stage-layers", type=int, default=0, help="uneven pipeline split: layers on stage 0")
    parser.add_argument("--moe", action="store_true", help="MoE MLPs: 4 experts, top-2")
    parser.add_argument("--ckpt-dir", help="train: checkpoint directory, resumed from when it holds a tag")
    parser.add_argument("--steps", type=int, default=8, help="train: last step")
    parser.add_argument("--ckpt-every", type=int, default=2, help="train: 0 saves nothing")
    parser.add_argument(
        "--data",
        choices=["random", "markov"],
        default="random",
        help="train: token distribution (markov is learnable, so the loss falls)",
    )
    parser.add_argument("--keep", type=int, default=2, help="train: complete checkpoints to keep")
    parser.add_argument("--snapshots", action="store_true", help="train: store the full state at saves and resumes")
    parser.add_argument("--die-in-save", type=int, default=0, help="train (tests): SIGKILL the last rank mid-save")
    parser.add_argument("--async-save", action="store_true", help="train: write checkpoints in the background")
    parser.add_argument(
        "--converted", action="store_true", help='load: reshard through a universal copy ("direct": false)'
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="train: seconds to wait after each step, so a test can kill a node mid-run",
    )
    parser.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; unused")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    parser.add_argument("--out")
    parser.add_argument("--source", nargs="*", default=[])
    parser.add_argument("--resave")
    parser.add_argument("--results")
    parser.add_argument(
        "--init-from",
        help="train, save: start from this checkpoint (e.g. a universal folder from "
        "ucp import-hf) instead of resuming from --ckpt-dir",
    )
    parser.add_argument("--init-tag", help="train: the tag of --init-from to start from (default: the latest)")
    parser.add_argument("--logits", help="save: also store logits of the saved weights on fixed tokens")
    parser.add_argument("--save-steps", type=int, default=STEPS, help="save: steps to train before saving")
    parser.add_argument("--cont", type=int, default=CONT, help="save, load: steps to train after, losses compared")
    parser.add_argument("--logits-init", help="save: logits right after loading --init-from, before training")
    parser.add_argument(
        "--model", help="build the megatron-core model a universal checkpoint recorded (e.g. from ucp import-hf)"
    )
    parser.add_argument(
        "--each",
        action="append",
        default=[],
        metavar="'ARGS'",
        help="one more run in the same launch, given as its own quoted arguments (e.g. 'load --tp 2 --source A "
        "--results R'); megatron-core's groups are rebuilt for each run, so one launch serves every layout of a "
        "world size",
    )
    args = parser.parse_args()
    runs = [args] + [parser.parse_args(shlex.split(more)) for more in args.each]
    if any(run.each for run in runs[1:]):
        parser.error("--each runs cannot nest")
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp, expert_model_parallel_size=run.ep
        )
        megatron_cpu.install()
        {"save": do_save, "load": do_load, "train": do_train}[run.mode](run)
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # A C++ thread (gloo or DeepSpeed's shm op) occasionally aborts interpreter teardown with
    # "terminate called without an active exception" after all work is done and written; skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
