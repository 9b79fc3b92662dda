"""Time to resume: save, convert, load and the first training step, ours against DeepSpeed's universal checkpoint.

    python benchmarks/bench_resume.py                  # full run (ZeRO-1 and ZeRO-3, 3 sizes each); about an hour
    python benchmarks/bench_resume.py --smoke          # tiny sizes on 2 ranks: checks that everything still runs
    python benchmarks/bench_resume.py --update-docs    # also rewrite the tables and the plot in docs/

Each source is an fp32 AdamW checkpoint saved by `--ranks` ranks after one training step. It is resumed at its
own layout by DeepSpeed's load (through ours: the floor every resharded row is held to), and at half the DP size
and at the other ZeRO stage (1 <-> 3) three ways. The same model is also saved at half the DP size and loaded
there by DeepSpeed's load: the native load at the DP target's layout, beside the source's own.

- ours, direct: `"direct": true`, each rank reads its element ranges straight from the rank files;
- ours, converted: `ucp convert`, then the load reads the universal copy;
- DeepSpeed: `ds_to_universal`, then `load_universal`.

Every load is a launch of its own (a resumed job is a fresh process), except with `--smoke`, where one launch
loads every target of a world size. A load's time, first training step, extra resident memory and bytes written
are measured inside the ranks and summed over them; a conversion's by sampling its process tree
(`bench_convert.measure`). What a row reads (the source's files, then the copy it loads, if any) is read once
right before its launch, so every row starts from a warm page cache: at 600M parameters the engines and the
copies do not leave room for all of them at once, and a row after another one would read from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_convert import dd_write, mb, measure, tree_size, warm  # benchmarks/, next to this script
from docs_table import update_doc
from launching import ROOT, each, env, torchrun_command

WORKER = ROOT / "benchmarks" / "synthetic.py"
RESULTS = ROOT / "benchmarks" / "resume.json"
PLOT = ROOT / "docs" / "img" / "resume.png"
TAG = "global_step1"
ROWS = ("native", "direct", "converted", "deepspeed")
ROW_NAMES = {
    "native": "native load, same layout (the floor)",
    "direct": "ours, direct",
    "converted": "ours, `ucp convert` + load",
    "deepspeed": "DeepSpeed, `ds_to_universal` + `load_universal`",
}


def reason(output: str) -> str:
    """The last exception line of a failed run's output (torchrun ends with its own summary)."""
    if "SIGKILL" in output:
        return "a rank was killed (SIGKILL): out of memory"
    found = re.findall(r"^\s*(?:\[rank\d+\]:\s*)?(\w+(?:Error|Exception): .*)$", output, re.MULTILINE)
    return (found[-1] if found else output.strip().splitlines()[-1])[:300]


@dataclass(frozen=True)
class Load:
    """One timed load: of which source, at which target layout, by which row, in a launch of `world` ranks."""

    source: str
    target: str
    row: str
    world: int
    job: list[str]
    reads: list[Path]


def torchrun(nproc: int, args: list[str]) -> list[dict]:
    """One launch of the synthetic worker; its RESULT lines."""
    out = measure(torchrun_command(nproc, WORKER, *args))["output"]
    return [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]


def ucp(*args: str) -> list[str]:
    return [sys.executable, "-m", "ucp_deepspeed.tools.cli", *args]


def convert_ours(ckpt: Path, procs: int, workers: int) -> dict:
    """`ucp convert` into a fresh folder, then `ucp verify` of the result (untimed: a fast failure is no result)."""
    out = ckpt / f"{TAG}.universal"
    shutil.rmtree(out, ignore_errors=True)
    cmd = ucp("convert", str(ckpt), "--procs", str(procs), "--workers", str(workers), "--no-progress")
    result = measure(cmd, watch=out)
    check = subprocess.run(ucp("verify", str(out)), env=env(), capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"ucp verify failed after conversion:\n{check.stdout}{check.stderr}")
    result.pop("output")
    return {**result, "bytes_out": tree_size(out)}


def convert_deepspeed(ckpt: Path, extract: int, merge: int) -> dict:
    """`ds_to_universal` into `<tag>_universal`, left in place for `load_universal`."""
    out = ckpt / f"{TAG}_universal"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / TAG)]
    cmd += ["--output_folder", str(out), "--num_extract_workers", str(extract), "--num_merge_workers", str(merge)]
    try:
        result = measure([*cmd, "--inject_missing_state"], watch=out)
    except RuntimeError as exc:  # which sources DeepSpeed cannot convert is a result
        return {"error": reason(str(exc))}
    if not (out / "zero").is_dir():
        return {"error": "no zero/ folder in the output: " + result["output"][-300:]}
    result.pop("output")
    return {**result, "bytes_out": tree_size(out)}


def disk_bandwidth(work: Path, files: list[Path]) -> dict:
    """Read bandwidth of the source (warm, as every row reads it) and write bandwidth with fsync."""
    warm(files)
    read_s, nbytes = warm(files)
    return {"read_bps": nbytes / read_s, "write_bps": nbytes / dd_write(work / "dd.bin", nbytes), "bytes": nbytes}


def load_job(size: float, zero: int, ckpt: Path, row: str) -> list[str]:
    job = ["load", "--params-m", str(size), "--zero", str(zero), "--source", str(ckpt), "--step"]
    if row == "direct":
        job.append("--direct")
    elif row == "deepspeed":
        job += ["--deepspeed-universal", f"{TAG}_universal"]
    return job


def run(args: argparse.Namespace, report: dict) -> None:
    """Save every source, convert each both ways, then time every load of every target."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report["machine"] = {"cpus": os.cpu_count(), "mem_gb": round(psutil.virtual_memory().total / 2**30)}
    report["ranks"], report["date"] = args.ranks, time.strftime("%Y-%m-%d")
    sources = report.setdefault("sources", {})
    loads: list[Load] = []
    for spec in args.sources.split(","):
        stage, size = spec.split(":")
        zero, size_m = int(stage.removeprefix("z")), float(size)
        name = f"z{zero}-dp{args.ranks}-{size_m:g}M"
        ckpt = work / name
        shutil.rmtree(ckpt, ignore_errors=True)
        print(f"== saving {name}", flush=True)
        save = ["save", "--params-m", str(size_m), "--zero", str(zero), "--out", str(ckpt), "--repeat", "1"]
        try:
            (saved,) = torchrun(args.ranks, save)
        except RuntimeError as exc:  # a size the machine cannot train is recorded, and the rest still run
            report.setdefault("failed", {})[name] = reason(str(exc))
            continue
        files = sorted((ckpt / TAG).iterdir())
        entry = sources[name] = {
            "zero": zero,
            "params": saved["params"],
            "save_s": saved["ucp_save_s"],
            "plain_save_s": saved["plain_save_s"],
            "disk": disk_bandwidth(work, [f for f in files if f.is_file()]),
            "convert": {},
            "loads": {},
        }
        print(f"== converting {name}", flush=True)
        settings = [(1, 2)] if args.smoke else [(1, 2), (1, 1), (2, 1)]
        for procs, workers in settings:  # the last kept: the copy the converted loads read is one like any other
            entry["convert"][f"ours {procs}/{workers}"] = convert_ours(ckpt, procs, workers)
        for extract, merge in [(2, 1)] if args.smoke else [(2, 1), (4, 2)]:  # the last one's output is loaded
            entry["convert"][f"deepspeed {extract}/{merge}"] = convert_deepspeed(ckpt, extract, merge)
        deepspeed_ok = "error" not in entry["convert"][f"deepspeed {extract}/{merge}"]
        # ds_to_universal leaves its output unsynced: without this the kernel writes it back (16 GB at 600M) while
        # the loads below run, and they read at a fraction of the page cache's speed
        os.sync()
        other = 3 if zero == 1 else 1
        targets = {
            "same": (args.ranks, zero, ["native"]),
            f"dp{args.ranks // 2}": (args.ranks // 2, zero, ["direct", "converted", "deepspeed"]),
            f"zero{other}": (args.ranks, other, ["direct", "converted", "deepspeed"]),
        }
        for target, (world, stage_to, rows) in targets.items():
            for row in rows:
                if row == "deepspeed" and not deepspeed_ok:
                    entry["loads"].setdefault(target, {})[row] = {"error": "ds_to_universal failed"}
                    continue
                copy = {"converted": f"{TAG}.universal", "deepspeed": f"{TAG}_universal"}.get(row)
                reads = [f for f in files if f.is_file()]
                reads += sorted(p for p in (ckpt / copy).rglob("*") if p.is_file()) if copy else []
                loads.append(Load(name, target, row, world, load_job(size_m, stage_to, ckpt, row), reads))
        report["convert_settings"] = [f"{p}/{w}" for p, w in settings]
        reference = save_reference(args, zero, size_m, work, report) if args.ranks > 1 else None
        if reference is not None:
            loads.append(reference)
        if not args.smoke:
            run_loads(report, loads)
            loads.clear()
            save_report(report)
            if not args.keep:  # the next, larger source needs the disk
                shutil.rmtree(ckpt)
                if reference is not None:
                    shutil.rmtree(work / reference.source)
    run_loads(report, loads, shared=args.smoke)


def save_reference(args: argparse.Namespace, zero: int, size_m: float, work: Path, report: dict) -> Load | None:
    """The same model saved at the DP target's layout (half the ranks), and its native load: what a direct reshard to
    that layout is held to. None when the machine cannot save it (recorded)."""
    ranks = args.ranks // 2
    name = f"z{zero}-dp{ranks}-{size_m:g}M"
    ckpt = work / name
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"== saving {name} (the DP target's own layout)", flush=True)
    save = ["save", "--params-m", str(size_m), "--zero", str(zero), "--out", str(ckpt), "--repeat", "0"]
    try:
        (saved,) = torchrun(ranks, save)
    except RuntimeError as exc:
        report.setdefault("failed", {})[name] = reason(str(exc))
        return None
    files = sorted(f for f in (ckpt / TAG).iterdir() if f.is_file())
    report["sources"][name] = {
        "zero": zero,
        "params": saved["params"],
        "save_s": saved["ucp_save_s"],
        "plain_save_s": saved["plain_save_s"],
        "disk": disk_bandwidth(work, files),
        "convert": {},
        "loads": {},
        "reference": True,
    }
    return Load(name, "same", "native", ranks, load_job(size_m, zero, ckpt, "native"), files)


def run_loads(report: dict, loads: list[Load], shared: bool = False) -> None:
    """Time the loads: each in a launch of its own, or (`shared`) one launch per world size."""
    worlds = sorted({load.world for load in loads})
    batches = [[ld for ld in loads if ld.world == w] for w in worlds] if shared else [[ld] for ld in loads]
    for batch in batches:
        warm([path for ld in batch for path in ld.reads])
        world = batch[0].world
        print(
            f"== {world} ranks load " + "; ".join(f"{ld.source} at {ld.target} ({ld.row})" for ld in batch), flush=True
        )
        try:
            results = torchrun(world, each([ld.job for ld in batch]))
        except RuntimeError as exc:  # recorded, not fatal: which loads DeepSpeed cannot do is a result
            print(str(exc)[-4000:], flush=True)
            results = [{"error": reason(str(exc))}] * len(batch)
        if len(results) != len(batch):
            raise RuntimeError(f"{len(batch)} loads in one launch printed {len(results)} results")
        for ld, result in zip(batch, results):
            report["sources"][ld.source]["loads"].setdefault(ld.target, {})[ld.row] = result


def save_report(report: dict) -> None:
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")


def size(n: float) -> str:
    """Bytes in the unit that shows them (a direct load writes only log lines)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def best_convert(entry: dict, tool: str) -> tuple[str, dict] | None:
    ran = [(k, v) for k, v in entry["convert"].items() if k.startswith(tool) and "seconds" in v]
    return min(ran, key=lambda kv: kv[1]["seconds"]) if ran else None


def row_cost(entry: dict, row: str, load: dict) -> dict:
    """A row's parts and totals: its conversion (the fastest setting), its load and first step, what it wrote and
    read, and its floor (bytes read at the source's read bandwidth, bytes written at the disk's write bandwidth)."""
    convert = (
        best_convert(entry, "ours" if row == "converted" else "deepspeed")
        if row in ("converted", "deepspeed")
        else None
    )
    c = convert[1] if convert else {"seconds": 0.0, "written": 0, "read": 0, "peak_rss": 0, "peak_disk": 0}
    save = entry["plain_save_s"] if row == "deepspeed" else entry["save_s"]
    disk = entry["disk"]
    read, written = c["read"] + load["read"], c["written"] + load["written"]
    return {
        "setting": convert[0].split()[-1] if convert else "",
        "save": save,
        "convert": c["seconds"],
        "load": load["load_s"],
        "step": load["step_s"],
        "end_to_end": save + c["seconds"] + load["load_s"] + load["step_s"],
        "convert_rss": c["peak_rss"],
        "load_rss": load["extra_rss"],
        "load_own_rss": load["extra_rss"] - load.get("held_rss", 0.0),
        "written": written,
        "read": read,
        "disk": c["peak_disk"],
        "floor": read / disk["read_bps"],
        "write_floor": written / disk["write_bps"],
    }


def ordered(report: dict) -> list[tuple[str, dict]]:
    """Sources by ZeRO stage, then size (a --merge run appends)."""
    return sorted(report["sources"].items(), key=lambda kv: (kv[1]["zero"], kv[1]["params"]))


def native_at(report: dict, name: str, target: str) -> float | None:
    """DeepSpeed's load at a target's layout, when a source was saved in it: at the other ZeRO stage and the same
    size, that source's own same-layout load; at half the DP size, the reference saved there (`save_reference`)."""
    zero, dp, size = name.split("-")
    if target.startswith("zero"):
        other = report["sources"].get(f"z{target.removeprefix('zero')}-{dp}-{size}")
    else:
        other = report["sources"].get(f"{zero}-{target}-{size}")
    return other["loads"].get("same", {}).get("native", {}).get("load_s") if other else None


def table(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']['cpus']} cores, {report['machine']['mem_gb']} GiB RAM; "
        f"measured {report['date']}. "
        f"Sources saved by {report['ranks']} ranks (fp32 AdamW, one step); every load is a fresh launch followed by "
        "one training step. A load's peak memory is measured above the fresh engine's and summed over the ranks; "
        "the load's own is that peak less what the engine still holds after it (the optimizer states a load "
        "creates, which a training step would create too). The native load is the source's, at its own layout; "
        "in parentheses, DeepSpeed's load at the target layout, where a source of this size was saved in it. "
        "End-to-end is "
        "save + convert + load + first step (the launch's start-up, the same for every row, is left out). The "
        "read floor is the row's bytes read at the source's measured read bandwidth (page cache, one reader); "
        "the write floor, its bytes written at the disk's bandwidth with fsync (`dd`), is what a durable copy "
        "costs: `ucp convert` fsyncs every file, `ds_to_universal` none.",
        "",
        "| source | resumed at | row | convert | load | first step | end-to-end | load / native load (at the target "
        "layout) | "
        "peak RSS: convert / load (the load's own) | written | read | peak extra disk | read floor | write floor |",
        "|" + "---|" * 14,
    ]
    for name, entry in ordered(report):
        native = entry["loads"].get("same", {}).get("native", {}).get("load_s")
        for target, rows in entry["loads"].items():
            for row in ROWS:
                if row not in rows:
                    continue
                load = rows[row]
                where = "same layout" if target == "same" else target.replace("zero", "ZeRO-").replace("dp", "DP ")
                if "error" in load:
                    lines.append(
                        f"| {name} | {where} | {ROW_NAMES[row]} | failed: {load['error'][:120]} |" + " - |" * 10
                    )
                    continue
                c = row_cost(entry, row, load)
                convert = f"{c['convert']:.1f} s ({c['setting']})" if c["setting"] else "-"
                ratio = f"{c['load'] / native:.2f}x" if native else "-"
                at_target = native_at(report, name, target)
                if at_target and row != "native":
                    ratio += f" ({c['load'] / at_target:.2f}x)"
                lines.append(
                    f"| {name} | {where} | {ROW_NAMES[row]} | {convert} | {c['load']:.1f} s | {c['step']:.1f} s | "
                    f"{c['end_to_end']:.1f} s | {ratio} | {mb(c['convert_rss']) if c['setting'] else '-'} / "
                    f"{mb(c['load_rss'])} ({mb(c['load_own_rss'])}) | {size(c['written'])} | {size(c['read'])} | "
                    f"{size(c['disk'])} | {c['floor']:.1f} s | {c['write_floor']:.1f} s |"
                )
    for name, why in report.get("failed", {}).items():
        lines.append(f"| {name} | - | save failed: {why} |" + " - |" * 11)
    return "\n".join(lines) + "\n"


def targets_table(report: dict) -> str:
    """The issue's targets, each as a ratio from the same run."""
    lines = [
        "| source | direct load / native load | `ucp convert` / `ds_to_universal` | "
        "`ucp convert` peak RSS | 2 processes vs 1 (1 worker each) | conversion floor (read + fsync write) |",
        "|" + "---|" * 6,
    ]
    for name, entry in ordered(report):
        if entry.get("reference"):
            continue  # saved only to be loaded at its own layout: no conversions, no reshards
        native = entry["loads"].get("same", {}).get("native", {}).get("load_s")
        direct = []
        for target, rows in entry["loads"].items():
            load = rows.get("direct")
            if load and "load_s" in load and native:
                at_target = native_at(report, name, target)
                there = f", {load['load_s'] / at_target:.2f}x at the target layout" if at_target else ""
                direct.append(f"{target}: {load['load_s'] / native:.2f}x{there} ({size(load['written'])} written)")
        ours, theirs = best_convert(entry, "ours"), best_convert(entry, "deepspeed")
        ratio = f"{ours[1]['seconds'] / theirs[1]['seconds']:.2f}x" if ours and theirs else "-"
        one, two = entry["convert"].get("ours 1/1"), entry["convert"].get("ours 2/1")
        procs = (
            f"{one['seconds'] / two['seconds']:.2f}x ({one['seconds']:.1f} s / {two['seconds']:.1f} s)"
            if one and two
            else "-"
        )
        disk = entry["disk"]  # a durable copy: read it, and write it with fsync
        floor = ours[1]["read"] / disk["read_bps"] + ours[1]["written"] / disk["write_bps"] if ours else 0
        lines.append(
            f"| {name} | {', '.join(direct) or '-'} | {ratio} | {mb(ours[1]['peak_rss']) if ours else '-'} | "
            f"{procs} | {floor:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Time and peak memory against model size, log-log, for the conversions and the loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    nan = float("nan")
    dp_half = f"dp{report['ranks'] // 2}"
    for zero, style in ((1, "-"), (3, "--")):
        entries = [e for _, e in ordered(report) if e["zero"] == zero and not e.get("reference")]
        if not entries:
            continue
        sizes = [e["params"] for e in entries]
        series: dict[str, tuple[str, list[float], list[float]]] = {}
        for e in entries:
            picks = {
                "ucp convert": (best_convert(e, "ours") or ("", {}))[1],
                "ds_to_universal": (best_convert(e, "deepspeed") or ("", {}))[1],
            }
            for label, c in picks.items():
                _, t, m = series.setdefault(label, ("o", [], []))
                t.append(c.get("seconds", nan))
                m.append(c.get("peak_rss", nan) / 1e6)
            for label, load in (
                ("native load", e["loads"].get("same", {}).get("native", {})),
                ("direct load at DP/2", e["loads"].get(dp_half, {}).get("direct", {})),
            ):
                _, t, m = series.setdefault(label, ("s", [], []))
                t.append(load.get("load_s", nan))
                m.append(max(10.0, (load.get("extra_rss", nan) - load.get("held_rss", 0.0)) / 1e6))
        for label, (marker, t, m) in series.items():
            ax_t.plot(sizes, t, style, marker=marker, label=f"{label}, ZeRO-{zero}")
            ax_m.plot(sizes, m, style, marker=marker, label=f"{label}, ZeRO-{zero}")
    for ax, title in ((ax_t, "seconds"), (ax_m, "peak RSS, MB (loads: their own, all ranks; under 10 at 10)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sources",
        # the largest 4 ranks can train and save in 24 GiB: 300M at ZeRO-1, 600M at ZeRO-3 (docs/benchmarks.md)
        default="z1:75,z1:150,z1:300,z3:75,z3:150,z3:300,z3:600",
        help="ZeRO stage and million parameters of each source (z<stage>:<size>)",
    )
    parser.add_argument("--work", default="/tmp/ucp_bench_resume")
    parser.add_argument("--ranks", type=int, default=4, help="ranks that save each source")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on 2 ranks, loads sharing launches, for CI")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --work")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--from-results", action="store_true", help=f"no runs: tables and plot from {RESULTS.name}")
    parser.add_argument("--merge", action="store_true", help=f"add the sources to {RESULTS.name} instead of replacing")
    args = parser.parse_args()
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed heap memory: the full tensors that
    # zero.Init builds and partitions stayed resident (a ZeRO-3 save peaked at 16.9 GB at 300M, against 10.7 GB with
    # a fixed threshold). Every process of every row inherits the same setting.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    if args.smoke:
        args.sources, args.ranks = "z1:0.5,z3:0.5", 2
    report: dict = json.loads(RESULTS.read_text()) if args.from_results or args.merge else {}
    if not args.from_results:
        try:
            run(args, report)
        finally:
            if not args.keep:
                shutil.rmtree(args.work, ignore_errors=True)
    text = table(report) + "\n" + targets_table(report)
    print(text)
    if not args.smoke:
        save_report(report)
        plot(report, PLOT)
    if args.update_docs and not args.smoke:
        update_doc("benchmarks.md", "resume", text)


if __name__ == "__main__":
    main()
