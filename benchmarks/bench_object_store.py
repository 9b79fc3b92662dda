"""Checkpoints on an S3-compatible store against local disk: the save's stall, the load and the reshard.

    python benchmarks/bench_object_store.py                # 75M parameters, ZeRO-1 and ZeRO-3, 4 ranks
    python benchmarks/bench_object_store.py --smoke        # tiny sizes on 2 ranks: checks that everything still runs
    python benchmarks/bench_object_store.py --update-docs  # also rewrite the table in docs/benchmarks.md
    python benchmarks/bench_object_store.py --table        # the table of the last full run (object_store.json)

The store is moto's S3 server on 127.0.0.1 (`s3server.py`), started here; the same jobs run against a local folder
beside it. Per ZeRO stage and storage, one launch of `--ranks` ranks trains a step and saves twice
(`synthetic.py stall`): synchronously, which keeps training waiting until every object is written and, on the
store, committed; then asynchronously, which keeps it waiting only for the copy to host memory. One launch then
loads every saved checkpoint at its own layout, and one reshards each to half the ranks at the other ZeRO stage
(1 <-> 3), straight from the rank files. A load's requests and bytes fetched are what every rank asked of storage
(`io.stats`): ranged GETs on the store, preads on disk.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from docs_table import update_doc
from launching import ROOT, each, env, torchrun_command
from s3server import s3_server

WORKER = ROOT / "benchmarks" / "synthetic.py"
RESULTS = ROOT / "benchmarks" / "object_store.json"
STORES = ("local disk", "S3 (moto)")


def launch(nproc: int, jobs: list[list[str]]) -> list[dict]:
    """One launch of the synthetic worker running `jobs` in turn; its RESULT lines."""
    cmd = torchrun_command(nproc, WORKER, *each(jobs))
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        sys.exit(f"launch failed: {' '.join(map(str, cmd))}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def run(params_m: float, ranks: int, work: Path) -> dict:
    """Every row, measured: {"saves": [...], "loads": [...]}."""
    with s3_server() as s3:
        bases = {STORES[0]: str(work / "local"), STORES[1]: f"s3://{s3.bucket()}/bench"}
        saves, loads = [], []
        for zero in (1, 3):
            for store, base in bases.items():
                (result,) = launch(
                    ranks, [["stall", "--params-m", str(params_m), "--zero", str(zero), "--out", f"{base}/z{zero}"]]
                )
                saves.append({"zero": zero, "store": store, **result})
        for world, other in ((ranks, False), (max(1, ranks // 2), True)):
            jobs = []
            for zero in (1, 3):
                target = 4 - zero if other else zero
                for base in bases.values():
                    source = f"{base}/z{zero}/sync"
                    jobs.append(["load", "--params-m", str(params_m), "--zero", str(target), "--direct"])
                    jobs[-1] += ["--source", source]
            results = launch(world, jobs)
            i = 0
            for zero in (1, 3):
                for store in bases:
                    target = f"DP {world}, ZeRO-{4 - zero if other else zero}"
                    loads.append({"zero": zero, "store": store, "target": target, "reshard": other, **results[i]})
                    i += 1
    return {"params_m": params_m, "ranks": ranks, "saves": saves, "loads": loads}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def table(found: dict) -> str:
    """The results as a Markdown table, store rows beside disk rows."""
    lines = [
        f"{found['params_m']:g}M parameters, fp32 AdamW, saved by {found['ranks']} ranks.",
        "",
        "| ZeRO | storage | what | time s | requests (all ranks / worst rank) | MB fetched or written "
        "| sync save stall s | async save stall s (rest in background s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for zero in (1, 3):
        for store in STORES:
            save = next(s for s in found["saves"] if s["zero"] == zero and s["store"] == store)
            lines.append(
                f"| {zero} | {store} | save, DP {found['ranks']} | {save['sync_save_s']:.2f} "
                f"| {save['objects']} objects | {_mb(save['bytes'])} written | {save['sync_save_s']:.2f} "
                f"| {save['async_stall_s']:.2f} ({save['async_rest_s']:.2f}) |"
            )
            for load in (x for x in found["loads"] if x["zero"] == zero and x["store"] == store):
                what = f"{'reshard' if load['reshard'] else 'load'} to {load['target']} ({load['mode']})"
                lines.append(
                    f"| {zero} | {store} | {what} | {load['load_s']:.2f} "
                    f"| {load['requests']:g} / {load['max_rank_requests']} | {_mb(load['fetched'])} fetched | | |"
                )
    for zero in (1, 3):
        local, store = (
            next(x for x in found["loads"] if x["zero"] == zero and x["reshard"] and x["store"] == s) for s in STORES
        )
        lines.append("")
        lines.append(
            f"ZeRO-{zero} reshard: the store fetched {store['fetched'] / local['fetched']:.3f}x the bytes the same "
            f"reshard read from disk, and took {store['load_s'] / local['load_s']:.2f}x the time."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="0.5M parameters on 2 ranks")
    parser.add_argument("--params-m", type=float, default=75.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucp_bench_object_store"))
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--table", action="store_true", help="print (and with --update-docs write) the last run's")
    args = parser.parse_args()
    params_m, ranks = (0.5, 2) if args.smoke else (args.params_m, args.ranks)
    found = json.loads(RESULTS.read_text()) if args.table else run(params_m, ranks, args.work)
    text = table(found)
    print(text)
    if not args.smoke and not args.table:
        RESULTS.write_text(json.dumps(found, indent=1) + "\n")
    if args.update_docs:
        update_doc("benchmarks.md", "object-store", text + "\n")


if __name__ == "__main__":
    main()
