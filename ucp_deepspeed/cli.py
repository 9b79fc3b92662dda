"""The `ucp` command: convert, inspect and verify checkpoints without any model code."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from ucp_deepspeed.chain import is_element, read_element
from ucp_deepspeed.convert import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.interop import export_deepspeed
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.universal import MANIFEST, UniversalCheckpoint


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return ""


def summarize(path: str, tag: str | None = None) -> dict[str, Any]:
    """Summary of a universal folder, a Check-N-Run tag or a native checkpoint, from metadata only."""
    if tag is not None and is_element(os.path.join(path, tag)):
        path = os.path.join(path, tag)
    if is_element(path):
        ckpt_dir, tag = os.path.split(os.path.abspath(path))
        m = read_element(ckpt_dir, tag)
        params = {n: {"shape": r["shape"], "dtype": r["dtype"], "keys": r["keys"], "trainable": r["trainable"],
                      "bytes": m["files"][r["file"]]["bytes"], "table": r.get("table")} for n, r in m["params"].items()}
        return {"kind": "check-n-run", "path": os.path.join(ckpt_dir, tag), "source_topology": m["source"]["topology"],
                "counters": m["counters"], "param_groups": len(m["param_groups"]), "params": params,
                "buffers": list(m["buffers"]), "tied": m["tied"], "differential": m["differential"],
                "total_bytes": sum(f["bytes"] for f in m["files"].values()), "files": len(m["files"])}
    if os.path.isfile(os.path.join(path, MANIFEST)):
        ckpt = UniversalCheckpoint(path)
        m = ckpt.manifest
        params = {n: {"shape": r["shape"], "dtype": r["dtype"], "keys": r["keys"], "trainable": r["trainable"],
                      "bytes": m["files"][r["file"]]["bytes"]} for n, r in ckpt.params.items()}
        return {"kind": "universal", "path": ckpt.root, "source_topology": m["source"]["topology"],
                "counters": m["counters"], "param_groups": len(m["param_groups"]), "params": params,
                "buffers": list(ckpt.buffers), "tied": m["tied"],
                "total_bytes": sum(f["bytes"] for f in m["files"].values()), "files": len(m["files"])}
    src = NativeCheckpoint(path, tag)
    try:
        meta = src.meta
        keys = ["fp32"] + src.state_keys()
        params = {t.name: {"shape": list(t.shape), "dtype": t.dtype, "keys": keys if t.kind == "param" else ["value"],
                           "trainable": t.kind == "param",
                           "bytes": t.nbytes * (len(keys) if t.kind == "param" else 1)}
                  for t in src.tensors if t.kind != "buffer"}
        files = src.source_files()
        return {"kind": "deepspeed", "path": src.tag_dir, "tag": src.tag, "source_topology": meta.topology.__dict__,
                "counters": src.model_states(0).counters(), "param_groups": meta.num_groups, "params": params,
                "buffers": [t.name for t in src.tensors if t.kind == "buffer"],
                "tied": {k: v for m in src.metas for k, v in m.tied.items()},
                "total_bytes": sum(os.path.getsize(f) for f in files), "files": len(files)}
    finally:
        src.close()


def _print_summary(s: dict[str, Any]) -> None:
    topo = s["source_topology"]
    print(f"{s['kind']} checkpoint: {s['path']}")
    print(f"  saved at: zero{topo['zero_stage']} dp={topo['dp']} tp={topo['tp']} pp={topo['pp']} ep={topo['ep']} "
          f"{topo['dtype']} ({topo['optimizer']})")
    print("  counters: " + ", ".join(f"{k}={v}" for k, v in s["counters"].items()))
    trainable = [p for p in s["params"].values() if p["trainable"]]
    numel = sum(math.prod(p["shape"]) for p in trainable)
    print(f"  params: {len(s['params'])} ({len(trainable)} trainable, {numel:,} elements), "
          f"{s['param_groups']} param groups, buffers: {len(s['buffers'])}, tied: {len(s['tied'])}")
    print(f"  files: {s['files']}, {_size(s['total_bytes'])}")
    diff = s.get("differential")
    if diff:
        quant = diff["quantize"]
        print(f"  check-n-run: {diff['kind']} ({diff['policy'] or 'quantized only'}), chain: "
              + " -> ".join(diff["chain"]) + (f"; fp32 rows quantized {quant['method']} {quant['bits']} bits"
                                              if quant else "") + f"; restores so far: {diff['restores']}")
        for name, p in s["params"].items():
            if p["table"]:
                print(f"    table {name}: {p['table']['saved_rows']:,} of {p['table']['rows']:,} rows")
    width = max((len(n) for n in s["params"]), default=4)
    for name, p in s["params"].items():
        size = _size(p["bytes"]) if p["bytes"] is not None else "-"
        print(f"    {name:<{width}}  {str(tuple(p['shape'])):<16} {p['dtype']:<9} {size:>9}  {','.join(p['keys'])}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ucp` console script."""
    parser = argparse.ArgumentParser(prog="ucp", description="Universal checkpoints for DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="convert a DeepSpeed checkpoint (or materialize a Check-N-Run chain) to the "
                       "universal format")
    p.add_argument("ckpt_dir")
    p.add_argument("--tag", help="checkpoint tag (default: the one in 'latest')")
    p.add_argument("--output", help="output folder (default: CKPT_DIR/TAG.universal, or CKPT_DIR/TAG_universal "
                   "for --format deepspeed)")
    p.add_argument("--format", choices=["ucp", "deepspeed"], default="ucp",
                   help="ucp: our format; deepspeed: DeepSpeed's universal layout, loadable with load_universal")
    p.add_argument("--workers", type=int, default=2, help="writer threads (default 2)")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("inspect", help="summarise a native or universal checkpoint without loading tensors")
    p.add_argument("path")
    p.add_argument("--tag")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("verify", help="check every file of a universal checkpoint against its manifest")
    p.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            write = export_deepspeed if args.format == "deepspeed" else convert
            out = write(args.ckpt_dir, args.tag, args.output, args.workers, progress=not args.no_progress)
            print(out)
        elif args.command == "inspect":
            summary = summarize(args.path, args.tag)
            print(json.dumps(summary, indent=1)) if args.json else _print_summary(summary)
        else:
            problems = UniversalCheckpoint(args.path).verify()
            for line in problems:
                print(line)
            print(f"{len(problems)} bad files" if problems else "ok: every file matches the manifest")
            return 1 if problems else 0
    except CheckpointError as exc:
        print(f"ucp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
