"""What one resuming rank spends at 8 to 1024 ranks, what rank 0 spends for all of them, and `ucp convert` at 64 to
1024 source ranks; then a projection to a 1T-parameter job on 4096 GPUs.

Synthetic checkpoints (`synth_source.py`: DeepSpeed's exact layout) of one tiny GPT-like model are saved at DP=S for
S = 8 ... 1024, and every rank of a resharding job is simulated in this process (`tests/simulate.py`: the planning
and reads of a direct resharding load, one rank after another). Per rank: files opened, read requests, metadata and
data bytes (`ucp_deepspeed.io.stats`), planning and reading time. Once per job: rank 0 reading the metadata, the
manifest and the index of every optimizer file, which it shares. "Unshared" repeats a run with every rank parsing
the files it reads itself instead, to measure what sharing saves. `ucp convert` runs in a child process on sources
whose model grows with S (S/8 layers), so its time and peak RSS should grow linearly with S.

    python benchmarks/bench_scale.py                  full run (about 3 minutes here), tables to stdout
    python benchmarks/bench_scale.py --update-docs    also the table and plot in docs/benchmarks.md
    python benchmarks/bench_scale.py --smoke          8 to 64 ranks, for CI
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from docs_table import update_doc  # noqa: E402
from simulate import Simulation, Target, simulate  # noqa: E402
from synth_source import SynthSpec, gpt_stack, synthesize  # noqa: E402

from ucp_deepspeed.geometry.layout import REPLICATED, Layout  # noqa: E402

RESULTS = Path(__file__).with_name("scale.json")
PLOT = ROOT / "docs" / "img" / "scale.png"
LAYERS, HIDDEN, VOCAB = 8, 16, 64
SCENARIOS = [
    # (name, source stage, target stage, target DP / source DP)
    ("shrink to 3/4, ZeRO-1", 1, 1, 0.75),
    ("ZeRO-1 to ZeRO-3", 1, 3, 1.0),
    ("grow to 3/2, ZeRO-3", 3, 3, 1.5),
]


def params_for(spec: SynthSpec, target: Target) -> list[tuple[str, tuple[int, ...], Layout, int, int]]:
    """The trainable parameters as `simulate` wants them, staged for the target's pipeline size."""
    stages = {t.name: t.stage for t in gpt_stack(spec.layers, spec.hidden, spec.vocab, target.pp)}
    return [
        (t.name, t.shape, Layout("split", t.split) if t.split is not None else REPLICATED, t.group, stages[t.name])
        for t in spec.model()
        if t.trainable
    ]


def summary(sim: Simulation, elapsed: float) -> dict[str, Any]:
    """Per-rank medians and maxima, and rank 0's shared reading."""
    costs = sim.costs
    plans = sorted(c.plan_s for c in costs)

    def worst(field: str) -> int:
        return max(getattr(c.stats, field) for c in costs)

    def median(field: str) -> float:
        return statistics.median(getattr(c.stats, field) for c in costs)

    return {
        "ranks": sim.target.world,
        "files": [median("files_opened"), worst("files_opened")],
        "requests": [median("requests"), worst("requests")],
        "metadata_bytes": [median("metadata_bytes"), worst("metadata_bytes")],
        "data_bytes": [median("data_bytes"), worst("data_bytes")],
        "plan_ms": [1000 * statistics.median(plans), 1000 * plans[int(0.99 * (len(plans) - 1))]],
        "read_ms": 1000 * statistics.median(c.read_s for c in costs),
        "shared": {
            "files": sim.shared.files_opened,
            "requests": sim.shared.requests,
            "metadata_bytes": sim.shared.metadata_bytes,
            "seconds": sim.shared_s,
        },
        "seconds": elapsed,
    }


def resume_runs(work: Path, sizes: list[int]) -> list[dict[str, Any]]:
    """Every scenario at every source size, with the shared index, and without it for the first two."""
    rows = []
    for stage in (1, 3):
        for size in sizes:
            spec = SynthSpec(size, stage, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB)
            synthetic = synthesize(work / f"dp{size}-z{stage}", spec)
            for name, source, to_stage, factor in SCENARIOS:
                if source != stage:
                    continue
                target = Target(max(1, int(size * factor)), to_stage)
                for shared in (True, False) if source == 1 else (True,):
                    start = time.perf_counter()
                    sim = simulate(
                        str(synthetic.ckpt_dir), synthetic.tag, params_for(spec, target), target, shared_index=shared
                    )
                    row = {
                        "scenario": name,
                        "source": size,
                        "index": shared,
                        **summary(sim, time.perf_counter() - start),
                    }
                    rows.append(row)
                    print(f"  resume {name} from {size}{'' if shared else ' (unshared)'}: {row['seconds']:.1f} s")
            shutil.rmtree(work / f"dp{size}-z{stage}")
    return rows


CONVERT = """
import json, resource, sys, time
from ucp_deepspeed import convert
from ucp_deepspeed.io.stats import counting
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
with counting() as stats:
    convert(sys.argv[1], output=sys.argv[2], progress=False)
elapsed = time.perf_counter() - start
peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
read = stats.metadata_bytes + stats.data_bytes
print(json.dumps([elapsed, peak, baseline, stats.files_opened, stats.requests, read]))
"""
"""A child process: `ucp_deepspeed.convert` timed after its imports, with its peak RSS and the RSS before it, and
what it opened and read."""


def convert_runs(work: Path, sizes: list[int]) -> list[dict[str, Any]]:
    """`ucp convert` in a child process on a ZeRO-1 source whose model grows with its rank count."""
    rows = []
    for size in sizes:
        layers = max(2, size // 8)
        spec = SynthSpec(size, 1, layers=layers, hidden=HIDDEN, vocab=VOCAB)
        synthetic = synthesize(work / f"convert{size}", spec)
        source_bytes = sum(f.stat().st_size for f in Path(synthetic.ckpt_dir, synthetic.tag).iterdir())
        out = work / f"convert{size}.ucp"
        found = subprocess.run(
            [sys.executable, "-c", CONVERT, str(synthetic.ckpt_dir), str(out)], capture_output=True, text=True
        )
        if found.returncode:
            raise SystemExit(f"ucp convert failed at {size} ranks: {found.stderr[-2000:]}")
        elapsed, rss, baseline, files, requests, read = json.loads(found.stdout.strip().splitlines()[-1])
        rows.append(
            {"source": size, "layers": layers, "source_bytes": source_bytes, "seconds": elapsed, "rss_kb": rss}
            | {"baseline_rss_kb": baseline, "files": files, "requests": requests, "read_bytes": read}
        )
        print(f"  convert {size} ranks ({source_bytes / 1e6:.1f} MB): {elapsed:.1f} s, {rss / 1024:.0f} MB")
        shutil.rmtree(work / f"convert{size}")
        shutil.rmtree(out)
    return rows


# --- the 1T projection ---------------------------------------------------------------------------------------------

PROJECTION = {
    "params": 1e12,
    "tp": 8,
    "pp": 16,
    "dp": 32,
    "resume_dp": 24,
    "groups": 2,
    "bandwidth_gb_s": 2.0,
}
"""A 1T-parameter GPT trained at TP8 x PP16 x DP32 (4096 GPUs), ZeRO-1, fp32 master and two Adam moments, resumed
at DP24 (3072 GPUs) after losing 128 nodes; each GPU reads at 2 GB/s (a node's 16 GB/s from a parallel file system)."""


def projection(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per resuming rank and for rank 0, from the measured per-file costs and the geometry of the 1T job."""
    p = PROJECTION
    shard = p["params"] / (p["tp"] * p["pp"])  # parameters of one TP x PP share
    ranks = p["resume_dp"] * p["tp"] * p["pp"]
    optimizer_bytes = 12 * shard / p["resume_dp"]  # fp32 master + 2 moments of its ZeRO-1 partition
    # ZeRO-1/2 on gloo or with "refresh": "read" rebuild the rank's low-precision weights from the fp32 masters of the
    # part of its share other ranks own (its own partition is in memory)
    refresh_bytes = 4 * shard * (1 - 1 / p["resume_dp"])
    files = -(-p["dp"] // p["resume_dp"]) + 1  # source partitions a target partition overlaps, per group
    requests = 3 * p["groups"] * files + p["groups"] * p["dp"]  # merged runs, plus the refresh's one per file
    shared = next(r for r in reversed(rows) if r["scenario"].startswith("shrink") and r["index"])
    per_file_s = shared["shared"]["seconds"] / shared["shared"]["files"]
    per_file_meta = shared["shared"]["metadata_bytes"] / shared["shared"]["files"]
    source_files = p["dp"] * p["tp"] * p["pp"]
    bw = p["bandwidth_gb_s"] * 1e9
    return {
        "ranks": ranks,
        "optimizer_gb": optimizer_bytes / 1e9,
        "refresh_gb": refresh_bytes / 1e9,
        "files": files * p["groups"] + p["dp"],
        "requests": requests,
        "optimizer_s": optimizer_bytes / bw,
        "refresh_s": refresh_bytes / bw,
        "rank0_files": source_files,
        "rank0_metadata_mb": source_files * per_file_meta / 1e6,
        "rank0_s": source_files * per_file_s,
    }


# --- reporting -----------------------------------------------------------------------------------------------------


def _kb(value: float) -> str:
    return f"{value / 1024:.1f}"


def resume_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | source ranks | target ranks | files per rank (median / max) | requests per rank | metadata KiB "
        "per rank | data KiB per rank | planning ms (median / p99) | reading ms | rank 0 once: files, requests, "
        "metadata KiB, s | unshared: metadata KiB, requests per rank (max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unshared = {(r["scenario"], r["source"]): r for r in rows if not r["index"]}
    for r in rows:
        if not r["index"]:
            continue
        alone = unshared.get((r["scenario"], r["source"]))
        s = r["shared"]
        out.append(
            f"| {r['scenario']} | {r['source']} | {r['ranks']} | {r['files'][0]:g} / {r['files'][1]} "
            f"| {r['requests'][0]:g} / {r['requests'][1]} | {_kb(r['metadata_bytes'][1])} | {_kb(r['data_bytes'][1])} "
            f"| {r['plan_ms'][0]:.2f} / {r['plan_ms'][1]:.2f} | {r['read_ms']:.2f} "
            f"| {s['files']}, {s['requests']}, {_kb(s['metadata_bytes'])}, {s['seconds']:.2f} "
            f"| {_kb(alone['metadata_bytes'][1]) + ', ' + str(alone['requests'][1]) if alone else '-'} |"
        )
    return "\n".join(out) + "\n"


def convert_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| source ranks | layers | source MB | `ucp convert` s | s per source MB | files opened | requests | MB read "
        "| peak RSS MB (before it) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = r["source_bytes"] / 1e6
        out.append(
            f"| {r['source']} | {r['layers']} | {mb:.1f} | {r['seconds']:.1f} | {r['seconds'] / mb:.2f} "
            f"| {r['files']} | {r['requests']} | {r['read_bytes'] / 1e6:.1f} "
            f"| {r['rss_kb'] / 1024:.0f} ({r['baseline_rss_kb'] / 1024:.0f}) |"
        )
    return "\n".join(out) + "\n"


def projection_table(proj: dict[str, float]) -> str:
    p = PROJECTION
    return (
        f"1T parameters at TP{p['tp']} x PP{p['pp']} x DP{p['dp']} (4096 GPUs), ZeRO-1, resumed at DP{p['resume_dp']} "
        f"({int(proj['ranks'])} GPUs), {p['bandwidth_gb_s']:g} GB/s per GPU:\n\n"
        "| per resuming rank | value |\n|---|---|\n"
        f"| optimizer share read (fp32 + 2 moments) | {proj['optimizer_gb']:.1f} GB, {proj['optimizer_s']:.1f} s |\n"
        f"| low-precision refresh read (fp32 of its TP x PP share that other ranks own) | {proj['refresh_gb']:.1f} GB, "
        f"{proj['refresh_s']:.1f} s |\n"
        f"| files opened | {proj['files']:g} |\n"
        f"| read requests (merged) | {proj['requests']:g} |\n"
        f"| metadata read | 0 (shared by rank 0) |\n"
        f"| rank 0, once: files indexed, metadata, time | {proj['rank0_files']:g}, {proj['rank0_metadata_mb']:.0f} MB, "
        f"{proj['rank0_s']:.1f} s |\n"
    )


def plot(rows: list[dict[str, Any]]) -> None:
    """Per-rank maxima and rank 0's once-per-job costs against the source's rank count, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, *_ in SCENARIOS:
        mine = [r for r in rows if r["scenario"] == name and r["index"]]
        xs = [r["source"] for r in mine]
        axes[0].loglog(xs, [r["requests"][1] for r in mine], "o-", label=f"{name}: requests")
        axes[0].loglog(xs, [r["files"][1] for r in mine], "s--", label=f"{name}: files")
    alone = [r for r in rows if r["scenario"] == SCENARIOS[1][0] and not r["index"]]
    axes[0].loglog(
        [r["source"] for r in alone], [r["requests"][1] for r in alone], "x:", label="ZeRO-1 to ZeRO-3, unshared"
    )
    axes[0].set(xlabel="source ranks", ylabel="per resuming rank (max)", title="What one rank opens and requests")
    axes[0].legend(fontsize=7)
    first = [r for r in rows if r["scenario"] == SCENARIOS[0][0] and r["index"]]
    xs = [r["source"] for r in first]
    axes[1].loglog(xs, [r["plan_ms"][1] for r in first], "o-", label="planning ms per rank (p99)")
    axes[1].loglog(xs, [r["shared"]["files"] for r in first], "s-", label="rank 0 files, once")
    axes[1].loglog(xs, [1000 * r["shared"]["seconds"] for r in first], "^-", label="rank 0 ms, once")
    axes[1].set(xlabel="source ranks", title="Per rank flat; rank 0's share linear")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="8 to 64 ranks, conversions at 16 and 64")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--from-results", action="store_true", help=f"no runs: tables and plot from {RESULTS.name}")
    args = parser.parse_args()
    if args.from_results:
        results = json.loads(RESULTS.read_text())
    else:
        sizes = [8, 16, 32, 64] if args.smoke else [8, 16, 32, 64, 128, 256, 512, 1024]
        with tempfile.TemporaryDirectory(prefix="ucp_bench_scale") as tmp:
            print("== resuming ranks", flush=True)
            resume = resume_runs(Path(tmp), sizes)
            print("== ucp convert", flush=True)
            convert = convert_runs(Path(tmp), [16, 64] if args.smoke else [64, 256, 1024])
        results = {"resume": resume, "convert": convert}
        if not args.smoke:
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    text = (
        resume_table(results["resume"])
        + "\n"
        + convert_table(results["convert"])
        + "\n"
        + projection_table(projection(results["resume"]))
    )
    print(text)
    if args.update_docs:
        plot(results["resume"])
        update_doc("benchmarks.md", "scale", text)


if __name__ == "__main__":
    main()
