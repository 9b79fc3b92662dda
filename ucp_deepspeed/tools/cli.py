"""The `ucp` command: convert, inspect, verify and diff checkpoints without any model code."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ucp_deepspeed.checkn_run.chain import read_element
from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import kind_of
from ucp_deepspeed.format.manifest import IMPLEMENTATION_KEYS, Manifest
from ucp_deepspeed.format.model import ACTIVATIONS
from ucp_deepspeed.format.paths import locate, read_latest
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint
from ucp_deepspeed.hf.export import DTYPES, Overrides, export_hf
from ucp_deepspeed.hf.import_ import import_hf
from ucp_deepspeed.hf.models import ARCHS
from ucp_deepspeed.interop import export_dcp, export_deepspeed, export_megatron, import_dcp, import_megatron
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.data_loaders import read_loader_records
from ucp_deepspeed.sources.infer import Placement
from ucp_deepspeed.sources.native import tag_metas
from ucp_deepspeed.tools.compare import DiffReport, diff

RULES_HELP = (
    "how each parameter was split, for a tensor-parallel checkpoint saved without ucp metadata and without a record "
    "of its own (DeepSpeed's AutoTP and Megatron-DeepSpeed write one)"
)


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return ""


def _manifest_summary(kind: str, path: str, m: Manifest) -> dict[str, Any]:
    """What a manifest says a universal folder or Check-N-Run tag holds: each parameter's shape, dtype, keys and
    file size (and its Check-N-Run table entry), counters, groups, buffers and files."""
    params = {}
    for name, r in m.params.items():
        params[name] = {
            "shape": list(r.shape),
            "dtype": r.dtype,
            "keys": list(r.keys),
            "trainable": r.trainable,
            "bytes": m.files[r.file].nbytes,
        }
        if kind == "check-n-run":
            params[name]["table"] = r.extra.get("table")
    summary = {
        "kind": kind,
        "path": path,
        "source_topology": m.source.topology.encode(),
        "counters": m.counters.encode(),
        "param_groups": len(m.param_groups),
        "params": params,
        "buffers": list(m.buffers),
        "tied": m.tied,
        "total_bytes": sum(f.nbytes for f in m.files.values()),
        "files": len(m.files),
    }
    if kind == "check-n-run":
        summary["differential"] = m.section("differential")
    if m.model is not None:
        summary["model"] = m.model.encode()
    summary["optimizer"] = _optimizer_summary(m.optimizer, [g.hyperparams for g in m.param_groups])
    return summary


def _optimizer_summary(record: dict[str, Any] | None, hyperparams: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The saving optimizer's class and algorithm (when recorded) and each group's hyperparameters, as saved."""
    groups = [{k: v for k, v in (h or {}).items() if k not in ("params", *IMPLEMENTATION_KEYS)} for h in hyperparams]
    return {"class": (record or {}).get("class"), "algorithm": (record or {}).get("algorithm"), "groups": groups}


def _described(root: str, tag: str | None, layout_rules: Any) -> NativeCheckpoint:
    """A native tag opened to be described or checked: a plain ZeRO-0 save's numbered optimizer positions whose shapes
    repeat named in module order (which is which does not change a shape or a file; a conversion refuses them)."""
    tag_dir = st.join(root, tag if tag is not None else read_latest(root))
    return NativeCheckpoint(root, tag, layout_rules, metas=tag_metas(tag_dir, layout_rules, Placement.LOOSE))


def summarize(path: str, tag: str | None = None, layout_rules: Any = None) -> dict[str, Any]:
    """Summary of a universal folder, a Check-N-Run tag or a native checkpoint, from metadata only (`layout_rules`:
    how a tensor-parallel checkpoint saved without ucp metadata or a record of its own was split)."""
    found = locate(path, tag)
    if found.kind == "checkn_run" and found.tag is not None:
        return _manifest_summary("check-n-run", found.path, read_element(found.root, found.tag))
    if found.kind == "universal":
        with UniversalCheckpoint(found.path) as ckpt:
            return _manifest_summary("universal", ckpt.root, ckpt.manifest)
    if found.kind == "ds_universal":
        raise CheckpointError(
            found.path,
            "is in DeepSpeed's universal layout; import it first with "
            "load_checkpoint, or inspect the checkpoint it was made from",
        )
    with _described(found.root, found.tag, layout_rules) as src:
        meta = src.meta
        keys = ["fp32"] + src.state_keys()
        params = {
            t.name: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "keys": keys if t.kind == "param" else ["value"],
                "trainable": t.kind == "param",
                "bytes": t.nbytes * (len(keys) if t.kind == "param" else 1),
            }
            for t in src.tensors
            if t.kind != "buffer"
        }
        files = src.source_files()
        return {
            "kind": "deepspeed",
            "path": src.tag_dir,
            "tag": src.tag,
            "source_topology": meta.topology.encode(),
            "counters": src.model_states(0).counters().encode(),
            "param_groups": meta.num_groups,
            "params": params,
            "buffers": [t.name for t in src.tensors if t.kind == "buffer"],
            "tied": {k: v for m in src.metas for k, v in m.tied.items()},
            "total_bytes": sum(st.stat(f)[0] for f in files),
            "files": len(files),
            "metadata": "rebuilt from DeepSpeed's files" if src.inferred else "ucp_deepspeed",
            **({"model": meta.model.encode()} if meta.model is not None else {}),
            "optimizer": _optimizer_summary(meta.optimizer, src.optimizer_groups()[0] or []),
            "data_loaders": _loaders_summary(src.tag_dir, meta),
        }


def _loaders_summary(tag_dir: str, meta: Any) -> list[dict[str, Any]] | dict[str, str] | None:
    """Where each rank's data loader stood at the save (its loader and global order; its state is the loader's), or
    why its file cannot tell: the rest of the summary stands without it, and `ucp verify` names the file."""
    try:
        records = read_loader_records(tag_dir, meta.data_loaders, meta.save_id)
    except CheckpointError as exc:
        return {"error": str(exc)}
    if records is None:
        return None
    return [{k: r[k] for k in ("rank", "dp_rank", "dp_size", "loader", "order")} for r in records]


def _print_summary(s: dict[str, Any]) -> None:
    topo = s["source_topology"]
    print(f"{s['kind']} checkpoint: {s['path']}")
    print(
        f"  saved at: zero{topo['zero_stage']} dp={topo['dp']} tp={topo['tp']} pp={topo['pp']} ep={topo['ep']} "
        f"{topo['dtype']} ({topo['optimizer']})"
    )
    if "metadata" in s:
        print(f"  metadata: {s['metadata']}")
    optimizer = s.get("optimizer") or {}
    if optimizer.get("class") or optimizer.get("groups"):
        print(f"  optimizer: {optimizer.get('class') or 'not recorded'} ({optimizer.get('algorithm') or '?'})")
        for i, group in enumerate(optimizer.get("groups", [])):
            print(f"    group {i}: " + ", ".join(f"{k}={v}" for k, v in group.items()))
    if "model" in s:
        m = s["model"]
        moe = f", {m['num_moe_experts']} experts top-{m['moe_router_topk']}" if m["num_moe_experts"] else ""
        print(
            f"  model: megatron-core GPT, {m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']} heads in {m['num_query_groups']} groups, {m['normalization']}, "
            f"{m['activation']}{' GLU' if m['gated_linear_unit'] else ''}, {m['position_embedding_type']}, "
            f"vocab {m['vocab_size']}{'' if m['tied'] else ', untied output'}{moe}"
        )
    print("  counters: " + ", ".join(f"{k}={v}" for k, v in s["counters"].items()))
    loaders = s.get("data_loaders")
    if isinstance(loaders, dict):
        print(f"  data loaders: unreadable ({loaders['error']})")
    elif loaders:
        order = loaders[0]["order"]
        drawn = {r["dp_rank"]: r["order"]["samples"] for r in loaders if r["order"]}  # TP/PP peers share a stream
        where = (
            f"epoch {order['epoch']} of {order['dataset_len']:,} samples (seed {order['seed']}), "
            f"{sum(drawn.values()):,} drawn" + (", epoch finished" if order["finished"] else "")
            if order
            else "its own state, no global order"
        )
        print(f"  data loaders: {len(loaders)} ranks of {loaders[0]['loader']}, {where}")
    trainable = [p for p in s["params"].values() if p["trainable"]]
    numel = sum(math.prod(p["shape"]) for p in trainable)
    print(
        f"  params: {len(s['params'])} ({len(trainable)} trainable, {numel:,} elements), "
        f"{s['param_groups']} param groups, buffers: {len(s['buffers'])}, tied: {len(s['tied'])}"
    )
    print(f"  files: {s['files']}, {_size(s['total_bytes'])}")
    diff = s.get("differential")
    if diff:
        quant = diff["quantize"]
        print(
            f"  check-n-run: {diff['kind']} ({diff['policy'] or 'quantized only'}), chain: "
            + " -> ".join(diff["chain"])
            + (f"; fp32 rows quantized {quant['method']} {quant['bits']} bits" if quant else "")
            + f"; restores so far: {diff['restores']}"
        )
        for name, p in s["params"].items():
            if p["table"]:
                print(f"    table {name}: {p['table']['saved_rows']:,} of {p['table']['rows']:,} rows")
    width = max((len(n) for n in s["params"]), default=4)
    for name, p in s["params"].items():
        size = _size(p["bytes"]) if p["bytes"] is not None else "-"
        print(f"    {name:<{width}}  {tuple(p['shape'])!s:<16} {p['dtype']:<9} {size:>9}  {','.join(p['keys'])}")


def _verify(path: str, tag: str | None, layout_rules: Any = None) -> tuple[list[str], str]:
    """Problems with every file of any kind of checkpoint, and what was checked."""
    found = locate(path, tag)
    if found.kind == "universal":
        with UniversalCheckpoint(found.path) as ckpt:
            return ckpt.verify(), "every file matches the manifest's block CRCs"
    if found.kind == "ds_universal":
        raise CheckpointError(found.path, "is in DeepSpeed's universal layout, which records no checksums")
    if found.kind == "native":
        with _described(found.root, found.tag, layout_rules) as src:
            return src.verify(), (
                "every rank file matches the CRCs in its zip directory (NVMe swap files: the CRCs their save "
                "recorded), carries this save's id and agrees with the metadata"
            )
    kind = kind_of(found.path) if found.tag is not None else None
    if kind is None or found.tag is None:
        raise CheckpointError(found.path, f"is a {found.kind} checkpoint, which `ucp verify` cannot check")
    problems = kind.verify(found.root, found.tag)
    copy = st.join(found.root, f"{found.tag}.universal")
    what = f"every file of the {kind.name} tag and the tags it needs matches its manifest"
    if st.isfile(st.join(copy, MANIFEST)):  # loads with "direct": false reuse this full copy
        with UniversalCheckpoint(copy) as full:
            problems += full.verify()
        what += ", and so does its full copy " + copy
    return problems, what


def _print_diff(report: DiffReport, everything: bool, as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "identical": report.identical,
                    "states": [dataclasses.asdict(s) for s in report.states],
                    "only_a": report.only_a,
                    "only_b": report.only_b,
                    "values": report.values,
                },
                indent=1,
            )
        )
        return
    shown = [s for s in report.states if everything or not s.equal]
    width = max((len(f"{s.name}:{s.key}") for s in shown), default=0)
    for s in shown:
        status = "equal" if s.equal else f"max abs {s.max_abs:.3g}  max rel {s.max_rel:.3g}"
        print(f"  {s.name + ':' + s.key:<{width}}  {status}{'  ' + s.note if s.note else ''}")
    for label, names in (("only in A", report.only_a), ("only in B", report.only_b)):
        if names:
            print(f"  {label}: {', '.join(names)}")
    for line in report.values:
        print(f"  {line}")
    same = sum(s.equal for s in report.states)
    print(
        f"{len(report.states)} tensor states compared, {same} bit-identical; "
        + ("checkpoints are identical" if report.identical else "checkpoints differ")
    )


def _under_torchrun() -> bool:
    """Launched by torchrun with other ranks, not merely started from inside a training job's process."""
    import torch.distributed as dist

    launched = "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched and not (dist.is_available() and dist.is_initialized())


def _convert_under_torchrun(args: argparse.Namespace) -> str | None:
    """`ucp convert` launched by torchrun: its processes share the work (gloo); rank 0 returns the output folder."""
    import torch.distributed as dist

    from ucp_deepspeed.runtime.collective import on_rank0
    from ucp_deepspeed.runtime.shared_convert import convert_across_ranks
    from ucp_deepspeed.sources import resolve_tag

    # rank 0 alone prepares the output and checks the source while the others wait: allow it hours, not gloo's 30 min
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=12))
    try:
        box: list[Any] = [None]
        on_rank0(lambda: box.__setitem__(0, resolve_tag(args.ckpt_dir, args.tag)))  # one tag for all ranks
        dist.broadcast_object_list(box, src=0)
        tag = box[0]
        if kind_of(st.join(args.ckpt_dir, tag)) is not None:  # a Check-N-Run chain: replayed by one process
            done: list[str] = []
            on_rank0(lambda: done.append(convert(args.ckpt_dir, tag, args.output, args.workers, False)))
            return done[0] if done else None
        out = convert_across_ranks(
            args.ckpt_dir, tag, args.output, args.layout_rules, True, args.workers, not args.no_progress
        )
        return out if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ucp` console script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # e.g. that a finished conversion is reused
    try:
        return int(args.run(args))
    except CheckpointError as exc:
        print(f"ucp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a read-only folder: say which file, without a traceback
        print(f"ucp {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    """Every subcommand, each with its handler as `run`."""
    parser = argparse.ArgumentParser(prog="ucp", description="Universal checkpoints for DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    _checkpoint_commands(sub)
    _interop_commands(sub)
    return parser


def _checkpoint_commands(sub: Any) -> None:
    """convert, inspect, verify and diff: a checkpoint of ours or DeepSpeed's, read without model code."""
    p = sub.add_parser(
        "convert", help="convert a DeepSpeed checkpoint (or materialize a Check-N-Run chain) to the universal format"
    )
    p.set_defaults(run=_convert)
    p.add_argument("ckpt_dir")
    p.add_argument("--tag", help="checkpoint tag (default: the one in 'latest')")
    p.add_argument(
        "--output",
        help="output folder (default: CKPT_DIR/TAG.universal, or CKPT_DIR/TAG_universal for --format deepspeed)",
    )
    p.add_argument(
        "--format",
        choices=["ucp", "deepspeed"],
        default="ucp",
        help="ucp: our format; deepspeed: DeepSpeed's universal layout, loadable with load_universal",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="writer threads (default 2: one process converting alone; the config key `workers` "
        "defaults to 1 because every rank of a loading job already converts its share)",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="split the output files over this many processes, each with --workers threads (default 1); under "
        "torchrun the launched processes split them instead, on one node or several",
    )
    p.add_argument("--layout-rules", metavar="RULES.json", help=RULES_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("inspect", help="summarise a native or universal checkpoint without loading tensors")
    p.set_defaults(run=_inspect)
    p.add_argument("path")
    p.add_argument("--tag")
    p.add_argument("--layout-rules", metavar="RULES.json", help=RULES_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser(
        "verify",
        help="check every file of a checkpoint: a universal folder against its manifest, "
        "a Check-N-Run tag's whole chain, or a native tag's rank files and their zip crc32s",
    )
    p.set_defaults(run=_verify_command)
    p.add_argument("path")
    p.add_argument("--tag", help="tag of a native or Check-N-Run checkpoint (default: the one in 'latest')")
    p.add_argument("--layout-rules", metavar="RULES.json", help=RULES_HELP)
    p = sub.add_parser("diff", help="compare two checkpoints of any topology, state by state")
    p.set_defaults(run=_diff)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tag-a")
    p.add_argument("--tag-b")
    p.add_argument("--atol", type=float, default=0.0, help="exit 0 if every tensor is within this (default: exact)")
    p.add_argument("--all", action="store_true", help="list every state, not only those that differ")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _interop_commands(sub: Any) -> None:
    """The other formats, in and out: Hugging Face, PyTorch DCP, megatron-core's torch_dist."""
    p = sub.add_parser(
        "export-hf", help="write a megatron-core GPT's or a transformers model's checkpoint as a transformers folder"
    )
    p.set_defaults(run=_export_hf)
    p.add_argument("ckpt", help="universal folder, or native checkpoint directory (converted on the way)")
    p.add_argument("out")
    over = p.add_argument_group(
        "model overrides", "needed only for checkpoints that recorded no model; checked against the tensors' shapes"
    )
    over.add_argument("--arch", choices=ARCHS, help="default: the imported model's, else the one the model fits")
    over.add_argument("--num-heads", type=int, help="attention heads")
    over.add_argument("--num-kv-heads", type=int, help="key/value heads, i.e. query groups (default: --num-heads)")
    over.add_argument("--norm-eps", type=float, help="default 1e-5")
    over.add_argument("--rope-theta", type=float, help="default 10000")
    over.add_argument("--max-positions", type=int, help="RoPE models: context length (default 4096)")
    over.add_argument("--experts-per-token", type=int, help="mixtral: router top-k (default 2)")
    over.add_argument("--activation", choices=ACTIVATIONS, help="default: the architecture's own")
    p.add_argument(
        "--hf-config",
        metavar="CONFIG_JSON",
        help="a transformers model trained under its own names (AutoTP, Ulysses, HF Trainer) and saved without "
        "ucp_deepspeed: the config.json of the model it started from",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights' dtype (default fp32, exact)")
    p.add_argument("--shard-size", type=float, default=5120, help="MB per safetensors shard (default 5120, the Hub's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("import-hf", help="make a weights-only universal checkpoint of a transformers folder")
    p.set_defaults(run=_import_hf)
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--num-kv-heads", type=int, help="gpt2: fold repeated key/value heads back into this many groups")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser(
        "import-dcp", help="make a universal checkpoint of a PyTorch DCP folder (dcp.save of a model and optimizer)"
    )
    p.set_defaults(run=_import_dcp)
    p.add_argument("dcp_dir")
    p.add_argument("out")
    p = sub.add_parser(
        "import-megatron", help="make a universal checkpoint of a megatron-core dist_checkpointing (torch_dist) folder"
    )
    p.set_defaults(run=_import_megatron)
    p.add_argument("megatron_dir", help="the checkpoint folder, e.g. CKPT/iter_0000100")
    p.add_argument("out")
    p.add_argument("--vocab-size", type=int, help="unpadded vocabulary: drop the embedding's padding rows")
    p = sub.add_parser(
        "export-megatron", help="write a checkpoint as megatron-core torch_dist, read by dist_checkpointing.load"
    )
    p.set_defaults(run=_export_megatron)
    p.add_argument("ckpt", help="universal folder, or native checkpoint directory (converted on the way)")
    p.add_argument("out", help="the folder to write, e.g. CKPT/iter_0000100")
    p.add_argument("--padded-vocab-size", type=int, help="rows of the loading model's embedding (zeros past the vocab)")
    p.add_argument(
        "--expert-model-parallel-size",
        type=int,
        help="the loading job's (MoE): at 1 the experts are written into the dense param groups, as megatron-core "
        "trains them without expert parallelism",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="for a job with --use-distributed-optimizer: its fully_reshardable layout (load it with "
        "--dist-ckpt-optim-fully-reshardable)",
    )
    p = sub.add_parser("export-dcp", help="write a checkpoint as a PyTorch DCP folder that dcp.load reads at any size")
    p.set_defaults(run=_export_dcp)
    p.add_argument("ckpt", help="universal folder, or native checkpoint directory (converted on the way)")
    p.add_argument("out")
    p.add_argument("--model-key", default="model", help="top-level key of the model's state dict (default model)")
    p.add_argument("--optim-key", default="optim", help="top-level key of the optimizer's state dict (default optim)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _convert(args: argparse.Namespace) -> int:
    out: str | None
    if args.format == "deepspeed" and _under_torchrun():
        raise CheckpointError(args.ckpt_dir, "--format deepspeed runs in one process; start it without torchrun")
    if args.format == "deepspeed":
        out = export_deepspeed(
            args.ckpt_dir,
            args.tag,
            args.output,
            args.workers,
            progress=not args.no_progress,
            layout_rules=args.layout_rules,
        )
    elif _under_torchrun():
        out = _convert_under_torchrun(args)
    else:
        out = convert(
            args.ckpt_dir,
            args.tag,
            args.output,
            args.workers,
            progress=not args.no_progress,
            layout_rules=args.layout_rules,
            procs=args.procs,
        )
    if out:
        print(out)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    summary = summarize(args.path, args.tag, args.layout_rules)
    print(json.dumps(summary, indent=1)) if args.json else _print_summary(summary)
    return 0


def _verify_command(args: argparse.Namespace) -> int:
    problems, what = _verify(args.path, args.tag, args.layout_rules)
    for line in problems:
        print(line)
    print(f"{len(problems)} bad files" if problems else f"ok: {what}")
    return 1 if problems else 0


def _diff(args: argparse.Namespace) -> int:
    report = diff(args.a, args.b, args.tag_a, args.tag_b)
    _print_diff(report, args.all, args.json)
    return 0 if (report.identical or report.within(args.atol)) else 1


def _export_hf(args: argparse.Namespace) -> int:
    overrides = Overrides(
        args.arch,
        args.num_heads,
        args.num_kv_heads,
        args.norm_eps,
        args.rope_theta,
        args.max_positions,
        args.experts_per_token,
        args.activation,
    )
    shard = int(args.shard_size * 2**20)
    hf_config = json.loads(st.read(args.hf_config)) if args.hf_config else None
    print(export_hf(args.ckpt, args.out, overrides, args.dtype, shard, not args.no_progress, hf_config=hf_config))
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    print(import_hf(args.hf_dir, args.out, args.num_kv_heads, progress=not args.no_progress))
    return 0


def _import_dcp(args: argparse.Namespace) -> int:
    print(import_dcp(args.dcp_dir, args.out))
    return 0


def _import_megatron(args: argparse.Namespace) -> int:
    print(import_megatron(args.megatron_dir, args.out, args.vocab_size))
    return 0


def _export_megatron(args: argparse.Namespace) -> int:
    print(
        export_megatron(
            args.ckpt,
            args.out,
            args.padded_vocab_size,
            args.expert_model_parallel_size,
            distributed_optimizer=args.distributed_optimizer,
        )
    )
    return 0


def _export_dcp(args: argparse.Namespace) -> int:
    print(export_dcp(args.ckpt, args.out, args.model_key, args.optim_key, progress=not args.no_progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
