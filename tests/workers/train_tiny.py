"""Train a tiny LM with ucp_deepspeed, save, and resume at another layout, checking every state.

Used by launch/demo.sh and by the end-to-end tests (one torchrun launch per layout):

    save  --out DIR --variant NAME ...: train STEPS steps, snapshot every state, save, continue
          CONT steps and record their losses; rank 0 writes DIR/NAME/reference.pt
    load  --source DIR/NAME ... --variant NAME: build the engine at this launch's layout, load,
          compare every state with the reference using torch.equal, continue CONT steps, compare
          losses; rank 0 writes one JSON result per source to --results
    load --expect-error --source DIR[#TAG] ...: load each (damaged or hostile) checkpoint and record
          the error every rank raised (they must agree), or null if it loaded

One launch handles several checkpoints, because each launch pays for importing DeepSpeed; `--each 'ARGS'` adds
more runs (another mode or flags) to the same launch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import io
import json
import math
import os
import shutil
import tempfile
import time

import common  # tests/workers/common.py, next to this script
import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from compare import compare  # tests/workers/compare.py, next to this script
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed import compat
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.capture import infos

GLOBAL_BATCH = 48  # divides evenly over 1, 2, 3, 4, 6, 8 and 16 ranks
SEQ = 6
VOCAB = 37
STEPS = 3
CONT = 3

VARIANTS = {
    "z0": {"stage": 0, "dtype": "fp32"},
    "z1": {"stage": 1, "dtype": "fp32"},
    "z1b": {"stage": 1, "dtype": "fp32", "seed": 99, "early": 2},  # another run of z1; also saved at step 2
    "z2": {"stage": 2, "dtype": "fp32"},
    "z2keys": {"stage": 2, "dtype": "fp32", "key_prefixes": 4},  # on a store: objects spread over 4 key prefixes
    "z3": {"stage": 3, "dtype": "fp32"},
    "bf16z1": {"stage": 1, "dtype": "bf16", "grad_accum_fp32": True},
    # a target: low-precision weights rebuilt by all-gathering the partitions, as on NCCL (`"refresh": "gather"`)
    "bf16z1gather": {"stage": 1, "dtype": "bf16", "grad_accum_fp32": True, "refresh": "gather"},
    "bf16z2": {"stage": 2, "dtype": "bf16"},
    "bf16z3": {"stage": 3, "dtype": "bf16"},
    # a block 41 wide: the no-decay group's 147 elements do not divide by 2 x dp at dp=2 or 3, so BF16_Optimizer
    # (bf16z1pad) saves its last partition with DeepSpeed's alignment padding
    "bf16z1pad": {"stage": 1, "dtype": "bf16", "grad_accum_fp32": True, "hidden": 41},
    "bf16z2pad": {"stage": 2, "dtype": "bf16", "hidden": 41},
    "bf16z3pad": {"stage": 3, "dtype": "bf16", "hidden": 41},
    "sgdz2": {"stage": 2, "dtype": "fp32", "optimizer": "sgd"},
    "sgdz1": {"stage": 1, "dtype": "fp32", "optimizer": "sgd"},
    "z2nofrozen": {"stage": 2, "dtype": "fp32", "exclude_frozen": True},
    # ZeRO-Offload: DeepSpeed steps its CPU Adam kernel (int steps) on fp32 partitions in host memory
    "offz1": {"stage": 1, "dtype": "fp32", "offload": True},
    "offz2": {"stage": 2, "dtype": "fp32", "offload": True},
    "offz3": {"stage": 3, "dtype": "fp32", "offload": True, "offload_param": True},
    # DeepSpeed's own optimizers, built from the config: FusedAdam without offload, CPU Adagrad and CPU Lion with
    "fusedz1": {"stage": 1, "dtype": "fp32", "ds_optimizer": "AdamW"},
    # torch's Adagrad makes its state when built, which DeepSpeed's ZeRO-1/2 partitioning trips over: ZeRO-0
    "adagradz0": {"stage": 0, "dtype": "fp32", "optimizer": "adagrad"},
    "offadagradz2": {"stage": 2, "dtype": "fp32", "offload": True, "ds_optimizer": "Adagrad"},
    "offlionz1": {"stage": 1, "dtype": "fp32", "offload": True, "ds_optimizer": "Lion"},
    "offlionz2": {"stage": 2, "dtype": "fp32", "offload": True, "ds_optimizer": "Lion"},
    # NVMe offload swaps a sub-group's fp32 partition and states to files only when the partition reaches 1 MiB
    # (DeepSpeed's MIN_AIO_BYTES): a block this wide has one swapped sub-group (the matrices) and one kept in
    # memory (biases and norms) at every DP size up to 3; its plain and CPU-offload twins load and save it
    "nvmez3": {"stage": 3, "dtype": "fp32", "offload": "nvme", "hidden": 17000},
    "widez1": {"stage": 1, "dtype": "fp32", "hidden": 17000},
    "wideoffz3": {"stage": 3, "dtype": "fp32", "offload": True, "offload_param": True, "hidden": 17000},
    # a third param group of 8 elements (the layer norm): smaller than twice the DP size from DP=8 on, so DeepSpeed's
    # padded partitions leave most ranks' files with nothing of it
    "z1narrow": {"stage": 1, "dtype": "fp32", "hidden": 4, "norm_group": True},
    "z2narrow": {"stage": 2, "dtype": "fp32", "hidden": 4, "norm_group": True},
    "z3narrow": {"stage": 3, "dtype": "fp32", "hidden": 4, "norm_group": True},
    "moez1": {"stage": 1, "dtype": "fp32", "moe": True},
    "moez2": {"stage": 2, "dtype": "fp32", "moe": True},
}
EXPERTS = 4
SWAP_DIRS: list[str] = []
DIRECT = [True]  # load --converted: every engine of the launch reshards through a universal copy instead
HYPERPARAMS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "initial_lr")


class TinyLM(torch.nn.Module):
    """Embedding tied to the output head, an MLP block, a frozen scale and an integer buffer."""

    def __init__(self, hidden: int = 40, **block_args: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 24)
        self.build_block(hidden, **block_args)
        self.scale = torch.nn.Parameter(torch.rand(24) + 0.5, requires_grad=False)
        self.head = torch.nn.Linear(24, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        torch.nn.init.normal_(self.embed.weight, std=0.05)

    def build_block(self, hidden: int) -> None:
        self.up = torch.nn.Linear(24, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.down = torch.nn.Linear(hidden, 24)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.embed(tokens[:, :-1]) * self.scale
        logits = self.head(x + self.block(x)).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class TinyMoE(TinyLM):
    """TinyLM with its MLP block replaced by a DeepSpeed MoE layer: 4 experts, top-2."""

    def __init__(self, ep: int, hidden: int = 40, experts: int = EXPERTS) -> None:
        super().__init__(hidden, ep=ep, experts=experts)

    def build_block(self, hidden: int, ep: int, experts: int) -> None:
        from deepspeed.moe import sharded_moe
        from deepspeed.moe.layer import MoE

        # top-2 gating adds Gumbel noise to pick the second expert; without it routing depends only on the
        # weights, so an uninterrupted run and a resharded one route the same tokens the same way
        sharded_moe.gumbel_rsample = lambda shape, device: torch.zeros(shape, device=device)
        self.norm = torch.nn.LayerNorm(24)
        expert = torch.nn.Sequential(torch.nn.Linear(24, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 24))
        self.moe = MoE(
            hidden_size=24,
            expert=expert,
            num_experts=experts,
            ep_size=ep,
            k=2,
            min_capacity=64,
            drop_tokens=False,
            use_rts=False,
        )

    def block(self, x: torch.Tensor) -> torch.Tensor:
        # the load-balancing loss is left out: it is computed per rank, so it changes with the DP size
        return self.moe(self.norm(x))[0]


def ds_config(variant: dict, dp: int, swap_dir: str = "") -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": variant["stage"]},
        "checkpoint": {"universal": {"enabled": True, "progress": False, "direct": DIRECT[0]}},
    }
    if variant.get("refresh"):
        cfg["checkpoint"]["universal"]["refresh"] = variant["refresh"]
    if variant.get("key_prefixes"):
        cfg["checkpoint"]["universal"]["key_prefixes"] = variant["key_prefixes"]
    if variant["stage"] == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if variant.get("optimizer") in ("sgd", "adagrad"):
        cfg["zero_allow_untested_optimizer"] = True
    if variant.get("offload") or variant.get("ds_optimizer"):  # DeepSpeed builds it: its CPU kernels with offload
        cfg["optimizer"] = {"type": variant.get("ds_optimizer", "AdamW"), "params": {"lr": 2e-3}}
    if variant.get("offload") == "nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    elif variant.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if variant.get("offload_param"):
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if variant["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
        if variant.get("grad_accum_fp32"):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def build(
    variant_name: str, hidden: int = 40, stock: bool = False, ep: int = 1, experts: int = EXPERTS, plain: bool = False
) -> deepspeed.DeepSpeedEngine:
    """The engine of a variant; `stock` builds it with plain DeepSpeed loading its universal format, `plain`
    with plain DeepSpeed and no ucp_deepspeed at all (its checkpoints carry no ucp metadata)."""
    variant = VARIANTS[variant_name]
    hidden = variant.get("hidden", hidden)
    torch.manual_seed(variant.get("seed", 1234))
    model = TinyMoE(ep, hidden, experts) if variant.get("moe") else TinyLM(hidden)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    if variant.get("optimizer") == "sgd":
        groups = [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 0.05, "momentum": 0.8},
        ]
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    elif variant.get("optimizer") == "adagrad" or variant.get("ds_optimizer") == "Adagrad":
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]
        optimizer = torch.optim.Adagrad(groups, lr=2e-2, eps=1e-10)
    else:
        groups = [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.95), "name": "no_decay"},
        ]
        if variant.get("norm_group"):
            norm = [model.norm.weight, model.norm.bias]
            groups[1]["params"] = [p for p in no_decay if all(p is not q for q in norm)]
            groups.append({"params": norm, "weight_decay": 0.0, "lr": 5e-3, "name": "norm"})
        if variant.get("moe"):  # DeepSpeed partitions experts over their own data-parallel groups
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = torch.optim.AdamW(groups, lr=2e-3)
    if variant.get("offload") or variant.get("ds_optimizer"):
        optimizer = None
    swap_dir = ""
    if variant.get("offload") == "nvme":  # each engine swaps into a folder of its own, removed at exit
        swap_dir = tempfile.mkdtemp(prefix="ucp-nvme-")
        SWAP_DIRS.append(swap_dir)
    config = ds_config(variant, dist.get_world_size(), swap_dir)
    init = ucp_deepspeed.initialize
    if stock:
        config["checkpoint"] = {"load_universal": True}
        init = deepspeed.initialize
    if plain:
        del config["checkpoint"]
        init = deepspeed.initialize
    engine, _, _, _ = init(
        model=model,
        optimizer=optimizer,
        model_parameters=groups if optimizer is None else None,
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s)),
    )
    return engine


def batch(step: int, engine: deepspeed.DeepSpeedEngine) -> torch.Tensor:
    """The same global batch for a step whatever the DP size; each rank takes its rows."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    dp, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // dp
    return tokens[rank * per : (rank + 1) * per]


def train(engine: deepspeed.DeepSpeedEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(batch(engine.global_steps, engine))
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict:
    """Every state that must survive a reshard, gathered in full on every rank."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # without ZeRO or bf16, DeepSpeed steps the torch optimizer itself
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    if engine.zero_optimization_stage() == 3:  # ZeRO-3 keeps its fp32 flats out of param_groups between steps
        flats = [(opt.sub_group_to_group_id[i], f) for i, f in enumerate(opt.fp32_partitioned_groups_flat)]
    else:
        flats = [(g, f) for g, group in enumerate(base.param_groups) for f in group["params"]]
    first_state = base.state[flats[0][1]]
    keys = sorted(k for k, v in first_state.items() if torch.is_tensor(v) and v.dim() >= 1)
    # each kernel names its states its own way (DeepSpeed's CPU Adagrad keeps torch's `sum` as `exp_avg_sq`)
    algorithm_name = compat.optimizer_kernel(base).states
    # keyed by global name: each expert-parallel rank holds other experts, merged over all ranks below
    name_of = {local: info.name for local, info in infos(engine).items()}
    snap: dict = {
        "fp32": {},
        "state": {},
        "lp": {},
        "buffers": {},
        "state_keys": [algorithm_name.get(k, k) for k in keys],
    }
    for local, p in engine.module.named_parameters():
        if p.requires_grad and base is opt:  # the parameter is its own fp32 master
            name = name_of[local]
            snap["fp32"][name] = p.detach().cpu().clone()
            for key in keys:
                snap["state"][f"{name}/{algorithm_name.get(key, key)}"] = opt.state[p][key].detach().cpu().clone()
        elif p.requires_grad:
            name = name_of[local]
            snap["fp32"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in keys:
                value = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
                snap["state"][f"{name}/{algorithm_name.get(key, key)}"] = value
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for local, p in engine.module.named_parameters():
            snap["lp"][name_of[local]] = p.detach().cpu().clone()
        snap["tied"] = engine.module.head.weight is engine.module.embed.weight
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: snap[k] for k in ("fp32", "state", "lp")})
    for part in parts:
        for k in ("fp32", "state", "lp"):
            snap[k].update(part[k])
    for name, b in engine.module.named_buffers():
        snap["buffers"][name] = b.detach().cpu().clone()
    # DeepSpeed names MoE param groups after the expert-parallel size ("ep_size_2"): structure, not a hyperparameter
    # what the algorithm computes with; each kernel adds its own switches (torch's foreach, DeepSpeed's
    # bias_correction), which a checkpoint of another kernel leaves as the live one has them
    snap["hyperparams"] = [{k: g[k] for k in HYPERPARAMS if k in g} for g in base.param_groups]
    snap["steps"] = {}
    for g, f in flats:  # one flat buffer per group with ZeRO, every parameter without: all must agree
        step = base.state[f].get("step")  # a tensor for torch's kernels, an int for DeepSpeed's: the same count
        if step is not None:
            count = float(step)
            snap["steps"][g] = count if snap["steps"].get(g, count) == count else float("nan")
    snap["scheduler"] = engine.lr_scheduler.state_dict()
    snap["counters"] = [engine.global_steps, engine.global_samples, engine.skipped_steps]
    return snap


def count_tensors(snap: dict) -> int:
    return sum(len(snap[k]) for k in ("fp32", "state", "lp", "buffers")) + len(snap["steps"])


def client_state(engine: deepspeed.DeepSpeedEngine) -> dict:
    return {"epoch": 7, "sampler_position": engine.global_samples, "rng": torch.arange(5)}


def do_save(args: argparse.Namespace) -> None:
    reloaded: list[dict] = []
    for name in args.variant:
        engine = build(name, ep=args.ep, plain=args.plain)
        ckpt = st.join(args.out, name)  # a folder or an object-store URL
        early = VARIANTS[name].get("early", 0)
        if early:
            train(engine, early)
            engine.save_checkpoint(ckpt, client_state=client_state(engine))
        losses = train(engine, STEPS - early)
        snap = snapshot(engine)
        engine.save_checkpoint(
            ckpt,
            client_state=client_state(engine),
            exclude_frozen_parameters=VARIANTS[name].get("exclude_frozen", False),
        )
        if dist.get_rank() == 0:
            print(
                f"[{name} dp={dist.get_world_size()}] step {engine.global_steps} loss {losses[-1]:.6f}; "
                f"saved {count_tensors(snap)} tensors to {ckpt}",
                flush=True,
            )
        cont = train(engine, CONT)
        if dist.get_rank() == 0:
            reference = io.BytesIO()
            torch.save(
                {
                    "snapshot": snap,
                    "continuation": cont,
                    "client_state": client_state(engine) | {"sampler_position": snap["counters"][1]},
                    "dp": dist.get_world_size(),
                },
                reference,
            )
            st.write(st.join(ckpt, "reference.pt"), reference.getvalue())
        dist.barrier()
        # load what was just saved as the targets `--reload-as` names for it (another ZeRO stage at the same size), or
        # at the same layout (ucp's own reader on a store, DeepSpeed's on disk)
        targets = [t for pair in args.reload_as for s, t in [pair.split("=")] if s == name] or [name]
        for target in targets if args.reload else []:
            again = build(target, ep=args.ep)
            _, client = again.load_checkpoint(ckpt)
            diffs = compare(snap, snapshot(again))
            diffs += compare(client_state(engine) | {"sampler_position": snap["counters"][1]}, client, "client_state")
            losses = train(again, CONT)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, cont))
            mode = again.ucp_last_load.mode
            reloaded.append({"source": ckpt, "target": target, "mode": mode, "diffs": diffs, "max_rel_loss": rel})
            again.destroy()
    if args.reload and dist.get_rank() == 0:
        with open(args.reload, "w") as f:
            json.dump(reloaded, f, indent=1)


def do_mismatch(args: argparse.Namespace) -> None:
    """Load into a wider model (or one with twice the experts): a clear error before any state is touched."""
    moe = VARIANTS[args.variant[0]].get("moe")
    engine = build(args.variant[0], hidden=40 if moe else 48, ep=args.ep, experts=2 * EXPERTS if moe else EXPERTS)
    before = snapshot(engine)
    try:
        engine.load_checkpoint(args.source[0])
        outcome = {"error": None}
    except ucp_deepspeed.CheckpointError as exc:
        outcome = {"error": str(exc), "untouched": compare(before, snapshot(engine)) == []}
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(outcome, f)


def do_stock(args: argparse.Namespace) -> None:
    """Plain DeepSpeed loads each `--source` (a folder with `latest_universal`); report what it restored."""
    snaps = []
    for source in args.source:
        engine = build(args.variant[0], stock=True)
        engine.load_checkpoint(source)
        snap = snapshot(engine)
        snaps.append({k: snap[k] for k in ("fp32", "state", "steps", "hyperparams")})
    if dist.get_rank() == 0:
        ref = torch.load(os.path.join(args.source[0], "reference.pt"), weights_only=False)["snapshot"]
        ref = {k: ref[k] for k in ("fp32", "state", "steps", "hyperparams")}
        with open(args.results, "w") as f:
            json.dump(
                {
                    "vs_reference": [compare(ref, s) for s in snaps],
                    "vs_first": [compare(snaps[0], s) for s in snaps[1:]],
                    "tensors": count_tensors({**snaps[0], "lp": {}, "buffers": {}}),
                },
                f,
                indent=1,
            )


def attempt(work) -> str | None:
    """The CheckpointError `work` raised, as text, or None."""
    try:
        work()
    except ucp_deepspeed.CheckpointError as exc:
        return str(exc)
    return None


def gathered(value: object) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


@contextlib.contextmanager
def fault(name: str):
    """What a source's `!NAME` suffix injects into its load:

    - `RuntimeError`, `MemoryError`: rank 1 raises it at its third read while it stages its share (mid-restore);
    - `slow`: the default process group's timeout drops to 1 s and rank 0 takes 4 s over the tag's metadata, while
      the other ranks wait for it (the collective timeout NCCL would enforce)."""
    if not name:
        yield
        return
    from ucp_deepspeed.runtime import planning, restore

    if name == "slow":
        real = planning.tag_metas

        def slow_metas(*a, **k):
            time.sleep(4)
            return real(*a, **k)

        planning.tag_metas = slow_metas if dist.get_rank() == 0 else real
        c10d._set_pg_timeout(datetime.timedelta(seconds=1), None)
        try:
            yield
        finally:
            planning.tag_metas = real
            c10d._set_pg_timeout(datetime.timedelta(minutes=10), None)
        return
    real_reader = restore._reader

    def failing_reader(*a, **k):
        read, calls = real_reader(*a, **k), [0]

        def read_or_fail(*ra, **rk):
            calls[0] += 1
            if calls[0] == 3:
                raise {"RuntimeError": RuntimeError, "MemoryError": MemoryError}[name]("injected on rank 1")
            return read(*ra, **rk)

        return read_or_fail

    restore._reader = failing_reader if dist.get_rank() == 1 else real_reader
    try:
        yield
    finally:
        restore._reader = real_reader


def do_expect_error(args: argparse.Namespace) -> None:
    """Load each source (`DIR`, `DIR#TAG`, either with `!FAULT`: `fault`) that should fail; every rank must raise
    the same error. Each engine trains a step first; what the failed load changed in it, and whether it then
    refuses a step, are recorded."""
    outcomes = []
    for source in args.source:
        spec, _, injected = source.partition("!")
        load_dir, _, tag = spec.partition("#")
        engine = build(args.variant[0])
        train(engine, 1)
        before = snapshot(engine)
        with fault(injected):
            error = attempt(functools.partial(engine.load_checkpoint, load_dir, tag=tag or None))
        changed = compare(before, snapshot(engine)) if error is not None else []
        refused = attempt(functools.partial(train, engine, 1)) if error is not None else None
        outcomes.append(
            {"source": source, "errors": gathered(error), "changed": gathered(changed), "step": gathered(refused)}
        )
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(outcomes, f, indent=1)


def do_load(args: argparse.Namespace) -> None:
    if args.expect_error:
        return do_expect_error(args)
    if args.mismatch:
        return do_mismatch(args)
    if args.stock:
        return do_stock(args)
    cases = args.case or [[args.variant[0], *args.source]]
    results = []
    for name, source in ((case[0], src) for case in cases for src in case[1:]):
        ref = torch.load(io.BytesIO(st.read(st.join(source, "reference.pt"))), weights_only=False)
        engine = build(name, ep=args.ep)
        path, client = engine.load_checkpoint(source)
        snap = snapshot(engine)
        saved_dtype = VARIANTS.get(st.basename(source), {}).get("dtype", VARIANTS[name]["dtype"])
        if saved_dtype != VARIANTS[name]["dtype"]:
            # the fp32 masters are the truth: weights of another precision are made from them (frozen ones from
            # their saved value), as DeepSpeed makes them after each step
            expected = ref["snapshot"]
            expected["lp"] = {n: expected["fp32"].get(n, v).to(snap["lp"][n].dtype) for n, v in expected["lp"].items()}
        diffs = compare(ref["snapshot"], snap)
        diffs += compare(ref["client_state"], client, "client_state")
        losses = train(engine, CONT)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["continuation"]))
        report = engine.ucp_last_load
        results.append(
            {
                "source": source,
                "target": name,
                "dp": dist.get_world_size(),
                "path": path,
                "mode": report.mode,
                "saved": report.saved,
                "live": report.live,
                "diffs": diffs,
                "tensors": count_tensors(snap),
                "losses": losses,
                "reference_losses": ref["continuation"],
                "max_rel_loss": rel if math.isfinite(rel) else 1e9,
            }
        )
        if dist.get_rank() == 0:
            print(
                f"[{name} dp={dist.get_world_size()}] from {st.basename(source)}: step {engine.global_steps} "
                f"loss {losses[-1]:.6f}; restored {count_tensors(snap)} tensors "
                f"{'bit-exactly' if not diffs else f'with {len(diffs)} differences'} ({report.how()})",
                flush=True,
            )
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--variant", nargs="+", default=[], choices=sorted(VARIANTS))
    parser.add_argument("--out")
    parser.add_argument("--source", nargs="*", default=[])
    parser.add_argument("--results")
    parser.add_argument(
        "--case",
        nargs="+",
        action="append",
        metavar="VARIANT SOURCE",
        help="load: a target variant and the sources it loads; repeat to load several targets in one launch",
    )
    parser.add_argument(
        "--mismatch", action="store_true", help="load into a wider model (MoE: twice the experts); expect a clear error"
    )
    parser.add_argument("--stock", action="store_true", help="load DeepSpeed universal folders with plain DeepSpeed")
    parser.add_argument("--expect-error", action="store_true", help="load damaged checkpoints; record each error")
    parser.add_argument("--plain", action="store_true", help="save with plain DeepSpeed: no ucp metadata")
    parser.add_argument("--reload", metavar="RESULTS", help="save: then load each save at the same layout, compare")
    parser.add_argument(
        "--reload-as", nargs="*", default=[], metavar="SAVED=TARGET", help="with --reload: load SAVED as TARGET instead"
    )
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of the MoE variants")
    parser.add_argument(
        "--converted", action="store_true", help='load: reshard through a universal copy ("direct": false)'
    )
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for args in runs:  # a plain DeepSpeed save runs first in its launch: nothing of ucp has touched DeepSpeed yet
        DIRECT[0] = not args.converted
        do_save(args) if args.mode == "save" else do_load(args)
        dist.barrier()
    dist.destroy_process_group()
    for swap_dir in SWAP_DIRS:
        shutil.rmtree(swap_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
