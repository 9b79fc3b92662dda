"""Test worker around launch/train_gpt.py: save and load cases that compare every state, and training runs with
the hooks the resume and elastic tests need.

    save --out DIR --tp T --pp P --zero Z --arch gpt|llama
        train STEPS steps, gather the full model state, save, continue CONT steps and record their
        losses; rank 0 writes DIR/reference.pt
    load --source DIR [DIR ...] --tp T --pp P --zero Z --arch ... [--resave OUT]
        build the engines at this launch's layout, load each source, compare every full fp32 weight
        and optimizer state with the reference using torch.equal, continue CONT steps and compare
        losses; --resave saves the loaded state again, untrained, at this layout
    train ... [--snapshots] [--die-in-save STEP] [--step-delay S] [--results FILE]
        launch/train_gpt.py's training job, storing the full state at saves and resumes, killing the last
        rank mid-save, slowing steps down (so a test can kill a node mid-run), and writing what it did

`--each 'ARGS'` adds runs to the same launch; megatron-core's groups are rebuilt for each run, so one launch
serves every layout of a world size.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import signal
import threading
import time
from concurrent.futures import Future

import common  # tests/workers/common.py, next to this script; puts launch/ on sys.path
import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import train_gpt  # launch/train_gpt.py, the reference script
from compare import compare
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from te_names import te_named_spec
from train_gpt import SEQ, VOCAB, build, stage_ranks, train

import ucp_deepspeed
from ucp_deepspeed.geometry.layout import merge
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.capture import infos

STEPS = 3
CONT = 3


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
    moe += " te-names" if args.te_names else ""
    name = os.path.basename(args.model) if args.model else args.arch
    return f"{name}{moe} z{args.zero} tp{args.tp} pp{args.pp} dp{ps.get_data_parallel_world_size()}"


def rank_client_state(tp_rank: int, pp_rank: int) -> dict:
    """Per-rank client state as Megatron-DeepSpeed keeps it: `get_rng_state()`'s list of each model-parallel rank's
    python, numpy, torch and tracker streams (seeded as megatron-core seeds them), and a plain per-rank entry."""
    seed = 1000 + 100 * pp_rank

    def gen(s: int) -> torch.Tensor:
        return torch.Generator().manual_seed(s).get_state()

    streams = {
        "random_rng_state": random.Random(seed).getstate(),
        "np_rng_state": np.random.RandomState(seed).get_state(),
        "torch_rng_state": gen(seed),
        "rng_tracker_states": {"data-parallel-rng": gen(seed), "model-parallel-rng": gen(seed + 2718 + tp_rank)},
    }
    return {"rng_state": [streams], "role": [tp_rank, pp_rank]}


def own_role() -> tuple[int, int]:
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def _same(a: object, b: object) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def client_state_ok(client: dict, report: ucp_deepspeed.LoadReport) -> bool:
    """A rank that keeps its role (same TP and PP sizes) gets its own saved client state. At other sizes each gets
    model-parallel rank 0's plain entries and random streams of its own: none a saved rank's, the default ones
    shared by the tensor-parallel ranks of a stage and the model-parallel one by no two of them (collective: true
    on every rank)."""

    def sizes(desc: str) -> tuple[str, str]:
        found = dict(part.split("=") for part in desc.split() if "=" in part)
        return found.get("tp", "1"), found.get("pp", "1")

    tp_rank, pp_rank = own_role()
    if sizes(report.saved) == sizes(report.live):
        ok = _same(client, rank_client_state(tp_rank, pp_rank))
    else:
        saved_tp, saved_pp = (int(n) for n in sizes(report.saved))
        saved = [rank_client_state(t, p)["rng_state"][0] for t in range(saved_tp) for p in range(saved_pp)]
        mine = client["rng_state"][0]
        ok = client["role"] == [0, 0] and not any(
            _same(mine[k], s[k]) for s in saved for k in s if k != "rng_tracker_states"
        )
        ok = ok and not any(
            _same(v, s["rng_tracker_states"][n]) for s in saved for n, v in mine["rng_tracker_states"].items()
        )
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (tp_rank, pp_rank, mine))
        for tp, pp, theirs in everyone:
            for key in ("random_rng_state", "np_rng_state", "torch_rng_state"):
                ok = ok and _same(mine[key], theirs[key]) == (pp == pp_rank)
            trackers = mine["rng_tracker_states"], theirs["rng_tracker_states"]
            ok = ok and _same(*(t["data-parallel-rng"] for t in trackers)) == (pp == pp_rank)
            ok = ok and _same(*(t["model-parallel-rng"] for t in trackers)) == ((tp, pp) == (tp_rank, pp_rank))
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
        reference = io.BytesIO()
        torch.save({"snapshot": snap, "continuation": cont, "layout": layout_name(args)}, reference)
        st.write(st.join(args.out, "reference.pt"), reference.getvalue())  # a folder or an object-store URL


def do_load(args: argparse.Namespace) -> None:
    results = []
    for source in args.source:
        ref = (
            torch.load(io.BytesIO(st.read(st.join(source, "reference.pt"))), weights_only=False)
            if dist.get_rank() == 0
            else None
        )
        engine = build(args, direct=not args.converted)
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


def die_while_saving(step: int, background: bool) -> None:
    """Test hook: at `step`, the last rank writes half of its optimizer file, then is SIGKILLed mid-save.

    With `background` (async saves) this happens in a thread of its own in place of the writer process, after
    `save_checkpoint` returned, and it lingers half-way for a while so that training runs on with the write
    unfinished.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from ucp_deepspeed.runtime.write_worker import WriterProcess

    def doomed(path: str) -> bool:
        return (
            f"global_step{step}" in path
            and dist.get_rank() == dist.get_world_size() - 1
            and ".pt" in path  # a synchronous save's file is written under a temporary name, renamed when whole
            and "optim_states" in path
        )

    def die(data: memoryview, path: str, linger: float = 0.0) -> None:
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(linger)
        os.kill(os.getpid(), signal.SIGKILL)

    if background:
        original_submit = WriterProcess.submit

        def submit(self: WriterProcess, path: str, state: dict, zipfile_serialization: bool, save_id: str) -> Future:
            if not doomed(path):
                return original_submit(self, path, state, zipfile_serialization, save_id)
            buf = io.BytesIO()
            torch.save(state, buf)
            # the writer is half-way through this file, and training goes on, when the rank dies
            args = (buf.getbuffer()[: buf.tell()], f"{path}.tmp.partial", 2.0)
            threading.Thread(target=die, args=args, daemon=True).start()
            return Future()

        WriterProcess.submit = submit
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
    """launch/train_gpt.py's job, with the test hooks."""
    if args.die_in_save:
        die_while_saving(args.die_in_save, args.async_save)

    def store(engine: deepspeed.DeepSpeedEngine, kind: str) -> None:
        snap = snapshot(engine)  # collective
        if dist.get_rank() == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save(snap, os.path.join(args.ckpt_dir, f"{kind}_step{engine.global_steps}.pt"))

    resumed, log = train_gpt.do_train(
        args,
        on_resume=(lambda engine: store(engine, "resumed")) if args.snapshots else None,
        before_save=(lambda engine: store(engine, "saved")) if args.snapshots else None,
        after_step=(lambda engine: time.sleep(args.step_delay)) if args.step_delay else None,
    )
    if dist.get_rank() == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    "resumed": resumed,
                    "log": log,
                    "final_step": log[-1]["step"] if log else (resumed or {}).get("step", 0),
                },
                f,
                indent=1,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "train"])
    train_gpt.add_arguments(parser)
    parser.add_argument("--snapshots", action="store_true", help="train: store the full state at saves and resumes")
    parser.add_argument("--die-in-save", type=int, default=0, help="train: SIGKILL the last rank mid-save")
    parser.add_argument(
        "--converted", action="store_true", help='load: reshard through a universal copy ("direct": false)'
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="train: seconds to wait after each step, so a test can kill a node mid-run",
    )
    parser.add_argument("--out")
    parser.add_argument("--source", nargs="*", default=[])
    parser.add_argument("--resave")
    parser.add_argument("--results")
    parser.add_argument("--logits", help="save: also store logits of the saved weights on fixed tokens")
    parser.add_argument("--save-steps", type=int, default=STEPS, help="save: steps to train before saving")
    parser.add_argument("--cont", type=int, default=CONT, help="save, load: steps to train after, losses compared")
    parser.add_argument("--logits-init", help="save: logits right after loading --init-from, before training")
    parser.add_argument(
        "--te-names", action="store_true", help="build the layers as megatron-core's TE spec names them (te_names.py)"
    )
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    local_spec = train_gpt.get_gpt_layer_local_spec
    for run in runs:
        train_gpt.get_gpt_layer_local_spec = te_named_spec if run.te_names else local_spec
        train_gpt.setup(run)
        {"save": do_save, "load": do_load, "train": do_train}[run.mode](run)
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
