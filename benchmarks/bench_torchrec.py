"""Universal checkpoints of a TorchRec DLRM against TorchRec's own DCP saves, on the same state.

    python benchmarks/bench_torchrec.py [--update-docs] [--smoke]

A DLRM under `DistributedModelParallel` at 2 ranks (benchmarks/torchrec_worker.py): 4 tables of 250k x 64 (three
table-wise, one column-wise in two shards), fused row-wise Adagrad, Zipf-distributed lookups. One launch saves the
same state with `dcp.save` and ours (whole, 8-bit, 4-bit adaptive, a one-shot chain whose delta follows 5 more
steps); four launches load: 2 ranks at the saved plan, 2 ranks with every table on the other rank, 1 rank with the
column split kept, 1 rank with the column-wise table table-wise. Results
go to benchmarks/torchrec.json and, with --update-docs, into docs/benchmarks.md between the `torchrec:start` /
`torchrec:end` markers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from docs_table import update_doc
from launching import ROOT, env, torchrun_command

WORKER = ROOT / "benchmarks" / "torchrec_worker.py"
LOADS = {
    "2 ranks, saved plan": (2, []),
    "2 ranks, tables moved": (2, ["--moved"]),
    "1 rank, the column split kept": (1, []),
    "1 rank, the column-wise table table-wise (ours: `approximate_row_state`)": (1, ["--merged"]),
}


def launch(world: int, mode: str, work: Path, size: list[str], extra: list[str], report: Path) -> dict:
    cmd = torchrun_command(world, WORKER, mode, "--out", work, "--report", report, *size, *extra)
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(report.read_text())


def table(results: dict) -> str:
    """The docs' table: each save's time and bytes, then each load's time (or DCP's refusal)."""
    whole = results["saves"]["ours, whole"]["bytes"]
    lines = ["| save (2 ranks) | seconds | MB | bytes vs ours whole |", "|---|---|---|---|"]
    for name, row in results["saves"].items():
        extra = f" ({row['rows']:.0%} of the rows)" if "rows" in row else ""
        mb, ratio = row["bytes"] / 1e6, row["bytes"] / whole
        lines.append(f"| {name}{extra} | {row['seconds']:.2f} | {mb:.1f} | {ratio:.2f} |")
    lines += ["", "| load | ours, whole | ours, one-shot chain | DCP `dcp.load` |", "|---|---|---|---|"]
    for name, row in results["loads"].items():
        theirs = row["DCP dcp.load"]
        dcp = f"{theirs['seconds']:.2f} s" if "seconds" in theirs else f"refused: `{theirs['refused']}`"
        whole_s, chain_s = row["ours, whole"]["seconds"], row["ours, one-shot chain"]["seconds"]
        lines.append(f"| {name} | {whole_s:.2f} s | {chain_s:.2f} s | {dcp} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucp_bench_torchrec"))
    parser.add_argument("--smoke", action="store_true", help="tiny tables: that it runs, not what it measures")
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    size = ["--rows", "2000", "--dim", "16", "--batch", "64", "--steps", "3"] if args.smoke else []
    results = {"saves": launch(2, "save", args.work, size, [], args.work / "save.json"), "loads": {}}
    for name, (world, extra) in LOADS.items():
        report = args.work / f"load{world}{''.join(extra)}.json"
        results["loads"][name] = launch(world, "load", args.work, size, extra, report)
    text = table(results)
    print(text)
    if not args.smoke:
        (ROOT / "benchmarks" / "torchrec.json").write_text(json.dumps(results, indent=1) + "\n")
        if args.update_docs:
            update_doc("benchmarks.md", "torchrec", text)


if __name__ == "__main__":
    main()
