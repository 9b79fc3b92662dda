"""A direct reshard against DeepSpeed's own load at the target layout, measured side by side: the check that catches a
time-to-resume regression, and the table that holds the 1.0x goal.

    python benchmarks/bench_ratio.py                        # 80M parameters, 2 ranks -> 1; fails above --bound (1.5x)
    python benchmarks/bench_ratio.py --sizes 75,150,300 --ranks 4 --update-docs
    python benchmarks/bench_ratio.py --sizes 600 --ranks 4 --stages 3 --update-docs --merge

For each size, launches save the sources, fp32 AdamW after one step, at each ZeRO stage of `--stages`: on `--ranks`
ranks (what is resharded) and on half as many (the native loads' sources, saved at the target layout). Then, in
rounds, each native source is loaded by DeepSpeed's load and each full-size source by a direct reshard to half the
ranks, at its own stage and at the other one. Every load is a fresh launch, as a resumed job is a fresh process: a
process that loaded before reuses the memory it freed, and on this virtual machine memory a process touches for the
first time costs up to 2.6 s per GB to fault in, so loads sharing a launch measure their order more than themselves.
Loads alternate within a round, so slow minutes of this shared host fall on both sides alike; the medians are
compared. Each load's source is read right before its launch, so the page cache is warm for all of them.

Each load also reports what it cost per parameter: bytes read from storage, bytes copied in memory after they were
read (`io.stats`: into the engine at the commit, into the low-precision weights), and its peak resident memory above
the fresh engine's, all summed over the ranks. The 1.0x goal is held in docs/benchmarks.md on the medians; the check
compares the best load of each side against `--bound`, which leaves room for this machine's noise, and a regression
like the 3-5x one of 2026-11 fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil
from bench_convert import warm  # benchmarks/, next to this script
from bench_resume import torchrun
from docs_table import update_doc
from launching import ROOT, each

RESULTS = ROOT / "benchmarks" / "ratio.json"


def cases(stages: list[int]) -> list[tuple[int, int]]:
    """(source stage, target stage) of each direct reshard: each stage to itself, and to the other one."""
    return [(src, dst) for src in stages for dst in stages]


def case_name(src: int, dst: int, ranks: int) -> str:
    if src == dst:
        return f"ZeRO-{src}, DP {ranks} -> {ranks // 2}"
    return f"ZeRO-{src} DP {ranks} -> ZeRO-{dst} DP {ranks // 2}"


def load_job(params: str, zero: int, source: Path, direct: bool) -> list[str]:
    direct_flag = ["--direct"] if direct else []
    return ["load", "--params-m", params, "--zero", str(zero), "--source", str(source), *direct_flag]


def run_size(args: argparse.Namespace, size: str, stages: list[int]) -> dict:
    """Save one size's sources, then time every load of every round, each in a launch of its own."""
    work = Path(args.work) / f"{size}M"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    full, half = args.ranks, args.ranks // 2
    source = {(zero, dp): work / f"z{zero}-dp{dp}" for zero in stages for dp in (full, half)}
    params = 0
    for dp in (full, half):
        print(f"== {size}M: saving at ZeRO {stages} on {dp} rank(s)", flush=True)
        saves = [
            ["save", "--params-m", size, "--zero", str(zero), "--out", str(source[zero, dp]), "--repeat", "0"]
            for zero in stages
        ]
        params = torchrun(dp, each(saves))[0]["params"]
    loads: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        print(f"== {size}M: round {round_ + 1} of {args.rounds}: native loads, then direct reshards", flush=True)
        jobs = {f"native zero{zero}": (zero, source[zero, half], False) for zero in stages}
        jobs.update({f"direct zero{src}->zero{dst}": (dst, source[src, full], True) for src, dst in cases(stages)})
        for key, (zero, folder, direct) in jobs.items():
            warm([p for p in folder.rglob("*") if p.is_file()])
            loads.setdefault(key, []).extend(torchrun(half, load_job(size, zero, folder, direct)))
    shutil.rmtree(work)  # the next, larger size needs the disk
    return {"params": params, "ranks": full, "stages": stages, "loads": loads}


def median(loads: list[dict], key: str) -> float:
    return statistics.median(one[key] for one in loads)


def rows(report: dict) -> list[dict]:
    """Each size's and case's medians and ratio, and what its direct load cost per parameter."""
    out = []
    for size, entry in report["sizes"].items():
        params = entry["params"]
        for src, dst in cases(entry["stages"]):
            direct, native = entry["loads"][f"direct zero{src}->zero{dst}"], entry["loads"][f"native zero{dst}"]
            failed = next((one["error"] for one in direct + native if "error" in one), None)
            if failed:
                raise SystemExit(f"{size}M {case_name(src, dst, entry['ranks'])}: a load failed: {failed}")
            d, n = median(direct, "load_s"), median(native, "load_s")
            best = min(one["load_s"] for one in direct) / min(one["load_s"] for one in native)
            out.append(
                {
                    "size": size,
                    "params": params,
                    "case": case_name(src, dst, entry["ranks"]),
                    "direct": d,
                    "native": n,
                    "ratio": d / n,
                    "best": best,
                    "all": [round(one["load_s"], 2) for one in direct],
                    "native_all": [round(one["load_s"], 2) for one in native],
                    "read": median(direct, "fetched") / params,
                    "native_read": median(native, "fetched") / params,
                    "copied": median(direct, "copied") / params,
                    "rss": (median(direct, "extra_rss") - median(direct, "held_rss")) / params,
                    "native_rss": (median(native, "extra_rss") - median(native, "held_rss")) / params,
                }
            )
    return out


def table(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']['cpus']} cores, {report['machine']['mem_gb']} GiB RAM; measured "
        f"{report['date']}. fp32 AdamW; medians of {report['rounds']} fresh launches per row, alternating, page "
        "cache warm. Bytes are per parameter of the model, summed over the loading ranks. A load's own memory is "
        "its peak above the fresh engine less what the engine keeps after it (the Adam moments, which a training "
        "step would create too).",
        "",
        "| size | reshard | direct load | DeepSpeed's load at the target layout | direct / native: medians (best of "
        "each) | read: direct / "
        "native | copied after reading (direct) | the load's own memory: direct / native |",
        "|" + "---|" * 8,
    ]
    for r in rows(report):
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['case']} | {r['direct']:.2f} s ({', '.join(map(str, r['all']))}) | "
            f"{r['native']:.2f} s ({', '.join(map(str, r['native_all']))}) | "
            f"**{r['ratio']:.2f}x** ({r['best']:.2f}x) | "
            f"{r['read']:.1f} B / {r['native_read']:.1f} B | {r['copied']:.1f} B | {r['rss']:.1f} B / "
            f"{r['native_rss']:.1f} B |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="80", help="million parameters of each synthetic LM, comma-separated")
    parser.add_argument("--ranks", type=int, default=2, help="ranks that save each source; loads run on half")
    parser.add_argument("--stages", default="1,3", help="ZeRO stages of the sources and targets")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bound", type=float, default=1.5, help="fail when a direct load takes more than this")
    parser.add_argument("--work", default="/tmp/ucp_bench_ratio")
    parser.add_argument("--update-docs", action="store_true", help=f"keep the results in {RESULTS.name}, and the table")
    parser.add_argument("--merge", action="store_true", help=f"add the sizes to {RESULTS.name} instead of replacing")
    parser.add_argument("--from-results", action="store_true", help=f"no runs: the table from {RESULTS.name}")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # as bench_resume.py, for the same reason
    report = json.loads(RESULTS.read_text()) if args.from_results or args.merge else {"sizes": {}}
    if not args.from_results:
        report.update(
            date=time.strftime("%Y-%m-%d"),
            machine={"cpus": os.cpu_count(), "mem_gb": round(psutil.virtual_memory().total / 2**30)},
            rounds=args.rounds,
        )
        stages = [int(s) for s in args.stages.split(",")]
        for size in args.sizes.split(","):
            report["sizes"][f"{size}@{args.ranks}"] = run_size(args, size, stages)
            if args.update_docs:
                RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    text = table(report)
    print(text)
    if args.update_docs:
        update_doc("benchmarks.md", "ratio", text)
    # the best of each side: noise on this shared host only ever adds time, and a slow minute can fall on one side's
    # loads of a round more than on the other's; a regression that makes every read slower shows in the best too
    over = [r for r in rows(report) if r["best"] > args.bound]
    for r in over:
        print(f"FAIL {r['case']} at {r['size']}: a direct reshard took {r['best']:.2f}x the native load (best of each)")
    if over:
        sys.exit(1)
    print(f"PASS every direct reshard within {args.bound}x of the native load at its target layout")


if __name__ == "__main__":
    main()
