"""Train a tiny Hugging Face Llama that DeepSpeed parallelizes itself (AutoTP), save, and resume at another layout.

    save --out DIR --variant NAME ...: train STEPS steps, snapshot every state, save, continue CONT steps;
         rank 0 writes DIR/NAME/reference.pt (the snapshot, the continuation losses). `--plain`: plain DeepSpeed
         saves it, with no ucp_deepspeed at all; `--drift PARAM`: tensor-parallel rank 1 changes its copy of a
         replicated parameter just before saving.
    load --case TARGET SOURCE ...: build TARGET at this launch's size, load each SOURCE, compare every state with
         its reference using torch.equal, continue CONT steps; rank 0 writes one JSON result per case to --results.
         `--refuse`: every load must fail on every rank and leave the engine as it was
    refused --variant NAME ... --results FILE: building NAME through ucp_deepspeed must fail; built by plain
         DeepSpeed and stepped once, do its ranks' copies of the model drift apart?

A variant is `[tp<T>][[m]sp<P>][ep<E>]z<S>`: AutoTP size T, Ulysses size P (`m`: built from the config's mesh),
AutoEP size E, ZeRO stage S; the rest of the launch's ranks are data-parallel. `--arch mixtral` or `qwen3moe` trains
a tiny MoE model instead of the Llama (AutoEP needs one); its experts are snapshot by global id, under AutoEP's
names whether or not AutoEP built the model. The Llama is sized so that AutoTP splits unevenly at T=2: 6 heads in
3 key-value groups give q/o (32, 16) and k/v (16, 8), an intermediate size of 99 gives (50, 49). Full tensors in
the snapshot are merged from the tensor-parallel ranks with DeepSpeed's own affine maps
(`deepspeed.checkpoint.affine`), not ours, so the comparison does not share the code under test; replicated tensors
are compared across the ranks as well.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re

import common  # tests/workers/common.py, next to this script
import deepspeed
import torch
import torch.distributed as dist
import transformers
from compare import compare  # tests/workers/compare.py, next to this script
from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap
from deepspeed.checkpoint.constants import DS_AUTOEP_UC_META, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

import ucp_deepspeed
from ucp_deepspeed.io import storage as st

CONFIG: dict = {
    "vocab_size": 128,
    "hidden_size": 48,
    "intermediate_size": 99,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# AutoEP's models: 4 experts, 2 per token, so that AutoEP can place them 4, 2 or 1 to a rank; sized like the Llama
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 40, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
}
ARCH = ["llama"]  # set by --arch
GLOBAL_BATCH, SEQ, STEPS, CONT = 12, 12, 3, 3
STATES = ("exp_avg", "exp_avg_sq")
BUILT = [(1, 1, False)]  # the AutoTP and Ulysses sizes (and Ulysses' route) of the engines this process has built


def parse(variant: str) -> tuple[int, int, int, bool, int]:
    """(AutoTP size, Ulysses sequence-parallel size, ZeRO stage, whether DeepSpeed builds the Ulysses groups from the
    config's device mesh: `msp<P>`, AutoEP size, 0 for none) of a variant name."""
    m = re.fullmatch(r"(?:tp(\d+))?(?:(m?)sp(\d+))?(?:ep(\d+))?z(\d)", variant)
    if m is None:
        raise SystemExit(f"unknown variant {variant!r}: expected [tp<T>][[m]sp<P>][ep<E>]z<S>")
    return int(m.group(1) or 1), int(m.group(3) or 1), int(m.group(5)), m.group(2) == "m", int(m.group(4) or 0)


def model() -> torch.nn.Module:
    """The same model on every rank and in every run: built from a config with a fixed seed, nothing downloaded.
    Ulysses wraps a core attention that takes no mask (sdpa), so every variant uses that one."""
    torch.manual_seed(1234)
    if ARCH[0] == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    config, cls, extra = MOE[ARCH[0]]
    fields = {**CONFIG, "intermediate_size": 40, "num_experts_per_tok": 2, **extra}
    return getattr(transformers, cls)(getattr(transformers, config)(**fields, attn_implementation="sdpa"))


def build(variant: str, plain: bool = False) -> deepspeed.DeepSpeedEngine:
    """The engine of a variant: through ucp_deepspeed with universal checkpointing, or `plain` DeepSpeed."""
    tp, sp, stage, mesh, ep = parse(variant)
    if (tp, sp, mesh) != BUILT[0] and BUILT[0] != (1, 1, False):
        # DeepSpeed keeps the first AutoTP or Ulysses engine's groups for the whole process (`groups.mpu`), and
        # Ulysses replaces transformers' sdpa attention process-wide
        raise SystemExit(f"{variant}: build engines without AutoTP or Ulysses first in a launch, then one layout")
    BUILT[0] = (tp, sp, mesh)
    net = model()
    mpu = None
    if sp > 1:  # what Accelerate's ParallelismConfig(sp_backend="deepspeed") and ALST's recipe call
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
            mpu = parallel_state_sp  # the groups and the attention of this launch's first Ulysses engine
        else:
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                net, "sdpa", sp, GLOBAL_BATCH * tp * sp // dist.get_world_size(), SEQ, seq_length_is_variable=False
            )
    mesh_keys = {"sequence_parallel_size": sp, "data_parallel_size": dist.get_world_size() // sp} if mesh else {}
    if mesh:  # DeepSpeed builds the same groups as a device mesh; the attention keeps Ulysses' own
        mpu = None
    config = {
        **mesh_keys,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH * tp * sp // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "checkpoint": {"universal": {"enabled": True, "progress": False}},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    init = ucp_deepspeed.initialize
    if plain:
        del config["checkpoint"]
        init = deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=net.parameters(), config=config, mpu=mpu)
    return engine


def ranks(engine: deepspeed.DeepSpeedEngine) -> tuple[int, int, int, int, int]:
    """(tensor-parallel rank, sequence-parallel rank and size, data-parallel rank and size) of this process."""
    mpu = engine.mpu
    if engine.sequence_parallel_size > 1:  # an mpu or the config's mesh: the groups Ulysses' attention uses
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as ulysses

        sp, sp_rank = ulysses.get_sequence_parallel_world_size(), ulysses.get_sequence_parallel_rank()
        return 0, sp_rank, sp, dist.get_rank() // sp, dist.get_world_size() // sp
    if mpu is None:
        return 0, 0, 1, dist.get_rank(), dist.get_world_size()
    return (
        mpu.get_tensor_model_parallel_rank(),
        0,
        1,
        mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_world_size(),
    )


def step_loss(engine: deepspeed.DeepSpeedEngine, rows: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss over `rows`. Under Ulysses each rank runs its slice of every sequence, with the labels
    shifted before slicing; DeepSpeed's ALST recipe all-gathers the slices' losses and averages them by token count.
    Here each rank scales its own by sp x its share of the tokens instead: the gradient that recipe's backward
    gives each rank, and the same mean once averaged over the ranks, without a differentiable all-gather (whose
    backward on gloo names a sequence-parallel group's source ranks by global rank, and fails outside the first
    group)."""
    _, sp_rank, sp, _, _ = ranks(engine)
    shift = torch.cat([rows[:, 1:], torch.full_like(rows[:, :1], -100)], dim=1)
    width = SEQ // sp
    cut = slice(sp_rank * width, (sp_rank + 1) * width)
    positions = torch.arange(SEQ).expand_as(rows)
    logits = engine(input_ids=rows[:, cut], position_ids=positions[:, cut]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift[:, cut].reshape(-1))
    if sp == 1:
        return loss
    counts = [int((shift[:, r * width : (r + 1) * width] != -100).sum()) for r in range(sp)]
    return loss * (sp * counts[sp_rank] / sum(counts))


def train(engine: deepspeed.DeepSpeedEngine, steps: int) -> list[float]:
    """`steps` steps on the same global batches whatever the layout; the mean loss of each."""
    _, _, _, dp_rank, dp = ranks(engine)
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 + engine.global_steps)
        tokens = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
        rows = tokens[dp_rank * GLOBAL_BATCH // dp : (dp_rank + 1) * GLOBAL_BATCH // dp]
        loss = step_loss(engine, rows)
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict:
    """Every state, each tensor whole: this rank's shares gathered over data parallelism by DeepSpeed, then merged
    over tensor parallelism with the affine maps DeepSpeed recorded for the model."""
    tp_rank = ranks(engine)[0]
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-1/2 link the states to the parameters lazily
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    local: dict = {"fp32": {}, "lp": {}, **{key: {} for key in STATES}}
    for name, p in engine.module.named_parameters():
        local["fp32"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in STATES:
            local[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for name, p in engine.module.named_parameters():
            local["lp"][name] = p.detach().cpu().clone()
    held = {n: list(getattr(p, DS_AUTOEP_UC_META)["local_experts"]) for n, p in engine.module.named_parameters()
            if hasattr(p, DS_AUTOEP_UC_META)}  # fmt: skip
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (tp_rank, local, held))
    by_tp = {r: s for r, s, _ in reversed(shares)}  # one data-parallel rank's copy per tensor-parallel rank
    maps = (getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {}).get("affine_map", {}).get("params", {})
    snap: dict = {kind: {} for kind in local}
    replicas = []
    for kind in local:
        power = SCALE_POWER_BY_STATE.get(kind, 1)
        for name in held:  # AutoEP's experts, by global id: each rank's stack placed where DeepSpeed put it
            snap[kind][name], differ = by_expert_id([(s[kind][name], h[name]) for _, s, h in shares])
            replicas += [f"{kind}/{name}@expert{e}" for e in differ]
        for name in (n for n in local[kind] if n not in held):
            shards = {r: by_tp[r][kind][name] for r in sorted(by_tp)}
            entry = maps.get(f"^{re.escape(name)}$")
            affine = ParamAffineMap.from_dict(entry) if entry is not None and len(shards) > 1 else None
            whole = affine is None or all(
                len(p.locations) == len(shards) for pieces in affine.pieces_by_rank.values() for p in pieces
            )
            differ = [f"{kind}/{name}@tp{r}" for r in shards if whole and not torch.equal(shards[r], shards[0])]
            replicas += differ
            snap[kind][name] = shards[0] if whole else affine.rebuild(shards, power)
    for kind in local:
        snap[kind] = canonical_experts(snap[kind])
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    snap["steps"] = sorted(steps)
    settings = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in base.param_groups]
    # AutoEP's expert group repeats the dense group's settings: the distinct ones compare with and without AutoEP
    snap["hyperparams"] = [one for i, one in enumerate(settings) if one not in settings[:i]]
    # the samples the data-parallel ranks consumed: DeepSpeed counts each AutoTP rank's copy of a batch
    snap["counters"] = [engine.global_steps, engine.global_samples // max(1, engine.autotp_size())]
    snap["replicas_differ"] = replicas
    return snap


def by_expert_id(stacks: list[tuple[torch.Tensor, list[int]]]) -> tuple[torch.Tensor, list[int]]:
    """Every rank's stack of experts placed at their global ids; the ids whose copies differ across ranks."""
    count = 1 + max(e for _, ids in stacks for e in ids)
    whole: list = [None] * count
    differ = set()
    for stack, ids in stacks:
        for row, e in zip(stack, ids):
            if whole[e] is not None and not torch.equal(whole[e], row):
                differ.add(e)
            whole[e] = row if whole[e] is None else whole[e]
    return torch.stack(whole), sorted(differ)


def canonical_experts(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE model's tensors under AutoEP's names, whether or not AutoEP built it: Hugging Face's fused
    `experts.gate_up_proj` [E, 2F, H] is AutoEP's `w1` (gate) over `w3` (up), `down_proj` its `w2`, and the
    router `gate` AutoEP's `router.gate`. The test's own mapping, from transformers' and DeepSpeed's modules."""
    out = {}
    for name, t in states.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            out[stem + "w1"], out[stem + "w3"] = (half.clone() for half in t.chunk(2, dim=1))
        elif name.endswith(".mlp.experts.down_proj"):
            out[name.removesuffix("down_proj") + "w2"] = t
        elif re.search(r"\.mlp\.gate\.weight$", name):
            out[name.replace(".mlp.gate.", ".mlp.router.gate.")] = t
        else:
            out[name] = t
    return out


def do_save(args: argparse.Namespace) -> None:
    for name in args.variant:
        engine = build(name, plain=args.plain)
        ckpt = st.join(args.out, name)
        train(engine, STEPS)
        snap = snapshot(engine)
        for drifted in args.drift:  # tensor-parallel rank 1's copy of a replicated parameter drifts from rank 0's
            p = dict(engine.module.named_parameters())[drifted]
            if ranks(engine)[0] == 1:
                safe_set_full_fp32_param(p, safe_get_full_fp32_param(p) + 1e-3)
        engine.save_checkpoint(ckpt)
        cont = train(engine, CONT)
        if dist.get_rank() == 0:
            buffer = io.BytesIO()
            torch.save({"snapshot": snap, "continuation": cont, "config": CONFIG}, buffer)
            st.write(st.join(ckpt, "reference.pt"), buffer.getvalue())
            print(f"[{name} world={dist.get_world_size()}] saved to {ckpt}; continuation {cont}", flush=True)
        dist.barrier()


def do_refused(args: argparse.Namespace) -> None:
    """Each variant must be refused when built through ucp_deepspeed; built by plain DeepSpeed, is it sound? One
    JSON entry per variant: the error, and whether the ranks' copies of the (replicated) model differ after a step."""
    out = []
    for name in args.variant:
        try:
            build(name)
            error = None
        except NotImplementedError as exc:
            error = str(exc)
        engine = build(name, plain=True)
        train(engine, 1)
        weight = safe_get_full_fp32_param(engine.module.model.norm.weight).detach().cpu()
        copies: list = [None] * dist.get_world_size()
        dist.all_gather_object(copies, weight)
        out.append({"variant": name, "error": error, "drifted": any(not torch.equal(c, copies[0]) for c in copies)})
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(out, f, indent=1)


def do_load(args: argparse.Namespace) -> None:
    results = []
    for target, source in ((case[0], src) for case in args.case for src in case[1:]):
        ref = torch.load(io.BytesIO(st.read(st.join(source, "reference.pt"))), weights_only=False)
        engine = build(target)
        if args.refuse:  # a load that must be refused, on every rank, leaving the engine (one step in) as it was
            train(engine, 1)
            before = snapshot(engine)
            try:
                engine.load_checkpoint(source)
                error = None
            except Exception as exc:
                error = str(exc)
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            untouched = compare(before, snapshot(engine)) == []
            results.append({"source": source, "target": target, "errors": errors, "untouched": untouched})
            continue
        engine.load_checkpoint(source)
        snap = snapshot(engine)
        diffs = compare(ref["snapshot"], snap)
        losses = train(engine, CONT)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["continuation"]))
        results.append(
            {
                "source": source,
                "target": target,
                "world": dist.get_world_size(),
                "how": engine.ucp_last_load.how(),
                "diffs": diffs,
                "tensors": sum(len(snap[k]) for k in ("fp32", "lp", *STATES)),
                "losses": losses,
                "reference_losses": ref["continuation"],
                "max_rel_loss": rel if math.isfinite(rel) else 1e9,
            }
        )
        if dist.get_rank() == 0:
            print(f"[{target} world={dist.get_world_size()}] from {source}: {len(diffs)} differences", flush=True)
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "refused"])
    parser.add_argument("--variant", nargs="+", default=[])
    parser.add_argument("--out")
    parser.add_argument("--plain", action="store_true", help="save with plain DeepSpeed: no ucp metadata")
    parser.add_argument("--case", nargs="+", action="append", default=[], metavar="TARGET SOURCE")
    parser.add_argument("--drift", nargs="*", default=[], metavar="PARAM", help="save: rank 1's replica drifts")
    parser.add_argument("--refuse", action="store_true", help="load: each case must be refused")
    parser.add_argument("--results")
    parser.add_argument("--arch", choices=["llama", *MOE], default="llama")
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for args in runs:
        ARCH[0] = args.arch
        {"save": do_save, "load": do_load, "refused": do_refused}[args.mode](args)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
