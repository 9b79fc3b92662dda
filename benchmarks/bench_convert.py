"""Conversion and load benchmarks: ucp_deepspeed against DeepSpeed's ds_to_universal, same checkpoints, one run.

    python benchmarks/bench_convert.py                    # full run (~300M-parameter sources, 3 sizes)
    python benchmarks/bench_convert.py --smoke            # tiny sizes: checks that everything still runs
    python benchmarks/bench_convert.py --update-docs      # also rewrite the tables in docs/

Every tool runs as a subprocess. A sampler thread polls the process tree every 0.1 s for the sum of
resident memory, the bytes passed to write(), and the size of the output folder (which holds
ds_to_universal's temporary folder too). Sources are read once beforehand, so every tool and the
`cat` reference start from the same warm page cache. Conversions are checked for completeness
(`ucp verify` for ours, the expected files for DeepSpeed's) so a fast failure cannot pass as a
fast run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from docs_table import update_doc  # benchmarks/docs_table.py, next to this script
from launching import ROOT, each, env, torchrun_command

WORKER = ROOT / "benchmarks" / "synthetic.py"
RANKS = 4  # ranks that save each source (--ranks)


def tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def measure(cmd: list[str], watch: Path | None = None) -> dict:
    """Run `cmd`; return wall time, peak tree RSS, bytes written and read, peak size of `watch`, and the output."""
    # a reaped child's IO is added to its parent's counters, up to this process once it reaps `cmd`: the
    # difference of this process's counters is the tree's IO, each byte once
    before = psutil.Process().io_counters()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = {"rss": 0, "disk": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak["rss"] = max(peak["rss"], rss)
            if watch is not None and watch.exists():
                peak["disk"] = max(peak["disk"], tree_size(watch))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    elapsed = time.perf_counter() - start
    after = psutil.Process().io_counters()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return {
        "seconds": elapsed,
        "peak_rss": peak["rss"],
        "written": after.write_chars - before.write_chars,
        "read": after.read_chars - before.read_chars - len(output),
        "peak_disk": peak["disk"],
        "output": output,
    }


def torchrun(nproc: int, *args: str) -> list[dict]:
    """Run the synthetic worker; return its RESULT lines (one per run of the launch)."""
    out = measure(torchrun_command(nproc, WORKER, *args))["output"]
    return [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]


def warm(paths: list[Path]) -> tuple[float, int]:
    """Read every file once (the `cat > /dev/null` reference); return seconds and bytes."""
    start, total = time.perf_counter(), 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return time.perf_counter() - start, total


def dd_write(target: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` of zeros and fsync them (the raw write reference)."""
    count = max(1, nbytes >> 24)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    target.unlink()
    return elapsed


def ours(ckpt: Path, workers: int, verify: bool = True) -> dict:
    """`ucp convert`; with `verify=False` the same conversion through the Python API without the source CRC checks."""
    out = ckpt / "global_step1.universal"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "ucp_deepspeed.tools.cli",
        "convert",
        str(ckpt),
        "--workers",
        str(workers),
        "--no-progress",
    ]
    if not verify:
        cmd = [
            sys.executable,
            "-c",
            "import sys; from ucp_deepspeed import convert; "
            f"convert(sys.argv[1], workers={workers}, progress=False, verify=False)",
            str(ckpt),
        ]
    result = measure(cmd, watch=out)
    verify = subprocess.run(
        [sys.executable, "-m", "ucp_deepspeed.tools.cli", "verify", str(out)], env=env(), capture_output=True, text=True
    )
    if verify.returncode != 0:
        raise RuntimeError(f"ucp verify failed after conversion:\n{verify.stdout}{verify.stderr}")
    result.pop("output")
    return {**result, "files": count_files(out), "bytes_out": tree_size(out)}


def deepspeeds(ckpt: Path, extract: int, merge: int) -> dict:
    out = ckpt / "global_step1_universal"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt / "global_step1"),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        str(extract),
        "--num_merge_workers",
        str(merge),
        "--inject_missing_state",
    ]
    result = measure(cmd, watch=out)
    if not (out / "zero" / "optimizer_state.pt").is_file():
        raise RuntimeError(f"ds_to_universal produced no optimizer_state.pt:\n{result['output'][-2000:]}")
    files, nbytes = count_files(out), tree_size(out)
    shutil.rmtree(out)
    result.pop("output")
    return {**result, "files": files, "bytes_out": nbytes}


def source_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in (ckpt / "global_step1").iterdir() if p.suffix == ".pt")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def run(args: argparse.Namespace, report: dict, save: Callable[[dict], None]) -> None:
    """Benchmark each `--sources` entry (`z<stage>:<million params>`), saving the report after each."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report["machine"] = {"cpus": os.cpu_count(), "mem_gb": round(psutil.virtual_memory().total / 2**30)}
    ranks = report["ranks"] = args.ranks
    specs = []
    for spec in args.sources.split(","):
        layout, size = spec.split(":")
        found = re.fullmatch(r"z(\d)(?:tp(\d))?(?:pp(\d))?(?:ep(\d))?", layout)
        if found is None:
            raise SystemExit(f"bad source {spec!r}: expected z<stage>[tp<size>][pp<size>][ep<size>]:<million params>")
        tp, pp, ep = (int(found.group(i) or d) for i, d in ((2, 1), (3, 1), (4, 0)))
        specs.append((int(found.group(1)), tp, pp, ep, float(size)))
    largest = {key[:4]: max(s[4] for s in specs if s[:4] == key[:4]) for key in specs}
    for zero, tp, pp, ep, size in specs:
        parallel = f"{f'tp{tp}-' if tp > 1 else ''}{f'pp{pp}-' if pp > 1 else ''}{f'moe-ep{ep}-' if ep else ''}"
        name = f"z{zero}-{parallel}dp{ranks // (tp * pp)}-{size:g}M"
        plain_dense = (zero, tp, pp, ep) == (1, 1, 1, 0)
        ckpt = work / name
        shutil.rmtree(ckpt, ignore_errors=True)
        print(f"== saving {name}", flush=True)
        (saved,) = torchrun(
            ranks,
            "save",
            "--params-m",
            str(size),
            "--zero",
            str(zero),
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--ep",
            str(ep),
            "--out",
            str(ckpt),
        )
        files = source_files(ckpt)
        warm(files)
        read_s, nbytes = warm(files)
        entry: dict = {
            "params": saved["params"],
            "source_bytes": nbytes,
            "source_files": len(files),
            "plain_save_s": saved["plain_save_s"],
            "ucp_save_s": saved["ucp_save_s"],
            "cat_s": read_s,
            "dd_s": dd_write(work / "dd.bin", nbytes),
            "ours": {},
            "deepspeed": {},
        }
        for workers in (2,) if args.smoke else (1, 2):
            print(f"== ucp convert {name} --workers {workers}", flush=True)
            entry["ours"][str(workers)] = ours(ckpt, workers)
        if plain_dense and size == largest[zero, tp, pp, ep] and not args.smoke:
            print(f"== ucp convert {name} --workers 2, source CRC checks off", flush=True)
            entry["ours_unverified"] = ours(ckpt, 2, verify=False)
        settings = [(1, 1), (2, 1), (4, 2)] if size == largest[zero, tp, pp, ep] and not args.smoke else [(2, 1)]
        for extract, merge in settings:
            print(f"== ds_to_universal {name} extract={extract} merge={merge}", flush=True)
            try:
                entry["deepspeed"][f"{extract}/{merge}"] = deepspeeds(ckpt, extract, merge)
            except RuntimeError as exc:  # recorded, not fatal: which layouts DeepSpeed cannot convert is a result
                entry["deepspeed"][f"{extract}/{merge}"] = {"error": str(exc).splitlines()[-1][:300]}
        if plain_dense and size == largest[zero, tp, pp, ep]:
            print(f"== loads of {name}", flush=True)
            load = ("load", "--params-m", str(size), "--source", str(ckpt))
            variants = {"native": ("--zero", "1"), "resharded": ("--zero", "2")}
            if not args.smoke:  # the cost of the integrity checks: the same loads without them
                variants.update(
                    native_plain=("--zero", "1", "--plain"), resharded_no_verify=("--zero", "2", "--verify", "0")
                )
            # one launch: an untimed warm-up load (it reuses the conversion `ours` left), then the timed loads,
            # each into a fresh engine, alternating so that a slow moment of the machine hits all alike
            order = [key for _ in range(1 if args.smoke else 3) for key in variants]
            jobs = [[*load, *variants[key]] for key in order]
            if not args.smoke:
                jobs.insert(0, [*load, "--zero", "2"])
            results = torchrun(ranks, *each(jobs))
            if len(results) != len(jobs):
                raise RuntimeError(f"{len(jobs)} loads in one launch printed {len(results)} results")
            runs: dict[str, list[float]] = {k: [] for k in variants}
            for key, result in zip(order, results[len(jobs) - len(order) :]):
                runs[key].append(result["load_s"])
            report["loads"] = {k: {"load_s": statistics.median(v), "runs": v} for k, v in runs.items()}
        report.setdefault("sources", {})[name] = entry
        save(report)
        if not args.keep:
            shutil.rmtree(ckpt)


def best(entries: dict) -> tuple[str, dict] | None:
    ran = [kv for kv in entries.items() if "seconds" in kv[1]]
    return min(ran, key=lambda kv: kv[1]["seconds"]) if ran else None


def table(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']['cpus']} cores, {report['machine']['mem_gb']} GiB RAM; sources saved by "
        f"{report['ranks']} ranks with fp32 AdamW; warm page cache. `ours` is `ucp convert` (threads), `DeepSpeed` is "
        "`python -m deepspeed.checkpoint.ds_to_universal` at its fastest worker setting (extract/merge).",
        "",
        "| source | state | ours: time (workers) | DeepSpeed: time (workers) | ratio | ours: peak RSS | "
        "DeepSpeed: peak RSS | written: ours / DeepSpeed | peak extra disk: ours / DeepSpeed | "
        "files: ours / DeepSpeed | % of cat+dd |",
        "|" + "---|" * 11,
    ]
    for name, e in report["sources"].items():
        ow, o = best(e["ours"])
        raw = e["cat_s"] + e["dd_s"] * o["bytes_out"] / e["source_bytes"]
        found = best(e["deepspeed"])
        if found is None:
            error = next(iter(e["deepspeed"].values()))["error"]
            ds = {"time": f"failed: {error}", "ratio": "-", "rss": "-", "written": "-", "disk": "-", "files": "-"}
        else:
            dw, d = found
            ds = {
                "time": f"{d['seconds']:.1f} s ({dw})",
                "ratio": f"{o['seconds'] / d['seconds']:.2f}x",
                "rss": mb(d["peak_rss"]),
                "written": gb(d["written"]),
                "disk": gb(d["peak_disk"]),
                "files": d["files"],
            }
        lines.append(
            f"| {name} ({e['params'] / 1e6:.0f}M params) | {gb(e['source_bytes'])} | {o['seconds']:.1f} s ({ow}) | "
            f"{ds['time']} | {ds['ratio']} | {mb(o['peak_rss'])} | {ds['rss']} | "
            f"{gb(o['written'])} / {ds['written']} | {gb(o['peak_disk'])} / {ds['disk']} | "
            f"{o['files']} / {ds['files']} | {100 * raw / o['seconds']:.0f}% |"
        )
    if any("-tp" in name for name in report["sources"]):
        lines += [
            "",
            "The tensor-parallel source is the same model built from megatron-core's vocab-parallel "
            f"embedding and column/row-parallel linears, saved at TP=2 x DP={report['ranks'] // 2}. It carries no "
            "`universal_checkpoint_info`, so `ds_to_universal` (with `--inject_missing_state`) has no TP "
            "layout to go by; its result is shown as it came. Ours merges each parameter by the layout read "
            "from megatron-core's parameter attributes.",
        ]
    if any("-pp" in name for name in report["sources"]):
        lines += [
            "",
            "The pipeline source is the same model as a DeepSpeed `PipelineModule` (`PipelineEngine`), its "
            "embedding tied to an output head on the last stage as in Megatron-DeepSpeed's `GPTModelPipe`, saved "
            "at PP=2. `ds_to_universal` needs `--inject_missing_state` for it.",
        ]
    if any("-moe-" in name for name in report["sources"]):
        lines += [
            "",
            "The MoE source replaces each MLP block by a DeepSpeed MoE layer of 4 such blocks (top-1), "
            "saved with 2 expert-parallel ranks (expert-data-parallel 2). DeepSpeed's converter does not "
            "handle expert files (DeepSpeed issue #5716); its result is shown as it came.",
        ]
    lines += [
        "",
        "| source | ours, 1 worker | ours, 2 workers | every DeepSpeed setting tried | cat (read) | "
        "dd (write, fsync) | plain save | save with ucp metadata |",
        "|" + "---|" * 8,
    ]
    for name, e in report["sources"].items():
        ds = ", ".join(
            f"{k}: {v['seconds']:.1f} s" if "seconds" in v else f"{k}: failed" for k, v in e["deepspeed"].items()
        )
        one, two = (f"{e['ours'][w]['seconds']:.1f} s" if w in e["ours"] else "-" for w in ("1", "2"))
        lines.append(
            f"| {name} | {one} | {two} | {ds} | "
            f"{e['cat_s']:.1f} s | {e['dd_s']:.1f} s | {e['plain_save_s']:.2f} s | {e['ucp_save_s']:.2f} s |"
        )
    loads = report.get("loads")
    if loads:
        native = loads["native"]["load_s"]
        lines += [
            "",
            f"Load of the largest ZeRO-1 source by {report['ranks']} ranks: native same-topology load {native:.1f} s; "
            f"resharded load at ZeRO-2 from the converted copy {loads['resharded']['load_s']:.1f} s "
            f"({loads['resharded']['load_s'] / native:.2f}x), every block it reads checked.",
        ]
    return "\n".join(lines) + "\n"


def integrity_table(report: dict) -> str:
    """What the integrity checks cost, each against the same operation without them, from the same run."""
    name, e = next((n, e) for n, e in report["sources"].items() if "ours_unverified" in e)
    loads = report["loads"]
    checked, unchecked = best(e["ours"])[1]["seconds"], e["ours_unverified"]["seconds"]
    rows = [
        (
            "save (metadata and a save-id record in every file)",
            e["ucp_save_s"],
            e["plain_save_s"],
            "DeepSpeed's own save",
        ),
        (
            "same-topology load (every file's pickle checked on rank 0, weights-only unpickling, every record's "
            "CRC-32)",
            loads["native"]["load_s"],
            loads["native_plain"]["load_s"],
            "DeepSpeed's own load",
        ),
        (
            "`ucp convert` (metadata checked against DeepSpeed's files, every byte read CRC-checked)",
            checked,
            unchecked,
            "the same conversion, CRCs off",
        ),
        (
            "resharded load from the converted copy (every block read CRC-checked)",
            loads["resharded"]["load_s"],
            loads["resharded_no_verify"]["load_s"],
            "the same load, `verify: false`",
        ),
    ]
    lines = [
        f"Measured ({time.strftime('%Y-%m-%d')}) on the {name} source ({e['params'] / 1e6:.0f}M parameters, "
        f"{gb(e['source_bytes'])}, {report['ranks']} ranks), each with and without the checks in the same run; "
        "loads are medians of 3 alternating runs:",
        "",
        "| operation | with the checks | without | ratio | baseline |",
        "|---|---|---|---|---|",
    ]
    for label, with_, without, base in rows:
        lines.append(f"| {label} | {with_:.2f} s | {without:.2f} s | {with_ / without:.2f}x | {base} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # ZeRO-3 at 300M does not fit: four CPU ranks gathering parameters for the training step exceed 24 GiB
    parser.add_argument(
        "--sources",
        default="z1:75,z1:150,z1:300,z3:150,z1tp2:300,z1pp2:300,z1ep2:300",
        help="ZeRO stage and million parameters of each source; the largest per stage gets every "
        "ds_to_universal setting",
    )
    parser.add_argument("--work", default="/tmp/ucp_bench")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on 2 ranks, for CI")
    parser.add_argument("--ranks", type=int, default=RANKS, help="ranks that save each source (data-parallel x TP)")
    parser.add_argument("--keep", action="store_true", help="keep the source checkpoints")
    parser.add_argument("--merge", action="store_true", help="add to benchmarks/results.json instead of replacing it")
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results.json"
    if args.smoke:  # every kind of source and every tool, at the smallest size and world that show they work
        # (ZeRO-3 is in bench_resume.py's smoke run)
        args.sources, args.ranks = "z1:0.5,z1tp2:0.5,z1pp2:0.5,z1ep2:0.5", 2
    report = json.loads(results.read_text()) if args.merge and results.exists() else {}

    def save(partial: dict) -> None:
        if not args.smoke:
            results.write_text(json.dumps(partial, indent=1))

    run(args, report, save)
    text = table(report)
    integrity = integrity_table(report) if "native_plain" in report.get("loads", {}) else ""
    print(text + "\n" + integrity)
    if args.update_docs and not args.smoke:
        update_doc("benchmarks.md", "bench", text)
        if integrity:
            update_doc("reference/security.md", "integrity", integrity)


if __name__ == "__main__":
    main()
