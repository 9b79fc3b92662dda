"""Check-N-Run measured as in the paper, on a DLRM-like model trained with DeepSpeed (tests/workers/train_dlrm.py).

    python benchmarks/bench_checkn_run.py [--update-docs] [--smoke]

1. Bytes written per checkpoint and storage held after 11 checkpoints, for every policy x bit width,
   against full fp32 checkpoints written the same way.
2. The cost of change tracking per training step (the same run with and without the lookup hooks).
3. Accuracy after restoring from a quantized checkpoint: train to step N, stop, resume from the
   quantized checkpoint, train to 2N, and compare held-out loss and AUC with an uninterrupted run.

Tables of about 1M rows x 32 (4 tables, Zipf-distributed lookups), plain SGD as in DLRM's reference
implementation, one rank. Results go to benchmarks/checkn_run.json and, with --update-docs, into
docs/benchmarks.md between the `cnr:start` / `cnr:end` markers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from docs_table import update_doc
from launching import ROOT, each, env, torchrun_command

WORKER = ROOT / "tests" / "workers" / "train_dlrm.py"
POLICIES = ("full", "one_shot", "incremental", "intermittent")
BITS = (None, 8, 4, 3, 2)
PAPER = "the paper reports 6-17x less write bandwidth and 2.5-8x less capacity"


def launch(args: argparse.Namespace, jobs: list[tuple[Path, list[str]]]) -> list[dict]:
    """Run the worker's jobs (checkpoint dir, extra arguments) in order in one torchrun launch, so start-up is
    paid once; return each job's JSON report. Every timing a job reports is taken inside the job."""
    common = ["--rows", *map(str, args.rows), "--dim", str(args.dim), "--batch", str(args.batch)]
    common += ["--optimizer", "sgd", "--lr", "0.5", "--keep", "1000"]
    runs = [
        ["train", "--ckpt-dir", str(ckpt), *common, "--results", str(_results(ckpt, i)), *extra]
        for i, (ckpt, extra) in enumerate(jobs)
    ]
    cmd = torchrun_command(1, WORKER, *each(runs))
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=1800 * len(jobs))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(_results(ckpt, i).read_text()) for i, (ckpt, _) in enumerate(jobs)]


def _results(ckpt: Path, job: int) -> Path:
    return ckpt.parent / f"{ckpt.name}.{job}.json"


def chain_bytes(ckpt: Path, tag: str) -> int:
    """Bytes a restore of `tag` needs: every file of every element of its chain."""
    manifest = json.loads((ckpt / tag / "manifest.json").read_text())
    total = 0
    for element in manifest["differential"]["chain"]:
        files = json.loads((ckpt / element / "manifest.json").read_text())["files"]
        total += sum(f["bytes"] for f in files.values())
    return total


def storage(args: argparse.Namespace, work: Path, report: dict) -> None:
    """One launch per policy: its checkpoints (every bit width) are measured and removed before the next."""
    steps = args.interval * args.checkpoints
    for policy in POLICIES:
        jobs, names = [], []
        for bits in BITS:
            name = f"{policy}-{bits or 32}"
            shutil.rmtree(work / name, ignore_errors=True)
            extra = ["--steps", str(steps), "--ckpt-every", str(args.interval)]
            extra += ["--policy", policy]
            extra += ["--bits", str(bits), "--method", "adaptive"] if bits else []
            print(f"== {name}", flush=True)
            jobs.append((work / name, extra))
            names.append((name, bits))
        for (name, bits), run in zip(names, launch(args, jobs)):
            report["storage"][name] = {
                "policy": policy,
                "bits": bits,
                "saves": run["saves"],
                "written": sum(s["bytes"] for s in run["saves"]),
                "held": chain_bytes(work / name, f"global_step{steps}"),
            }
            shutil.rmtree(work / name)


def tracking(args: argparse.Namespace, work: Path, report: dict) -> None:
    steps = str(args.interval * args.checkpoints)
    jobs, modes = [], []
    for i in range(args.repeats):  # alternate, keep the best of each
        for mode in ("off", "on"):
            extra = ["--steps", steps, "--no-save", "--policy", "incremental" if mode == "on" else "full"]
            print(f"== tracking {mode}", flush=True)
            jobs.append((work / f"tracking-{mode}-{i}", extra))
            modes.append(mode)
    times: dict[str, list[float]] = {"off": [], "on": [], "hooks": []}
    for mode, run in zip(modes, launch(args, jobs)):
        times[mode].append(run["step_seconds"] / int(steps))
        if mode == "on":
            times["hooks"].append(run["tracking_seconds"] / int(steps))
    report["tracking"] = {mode: min(t) for mode, t in times.items()}
    report["tracking_repeats"] = args.repeats


def accuracy(args: argparse.Namespace, work: Path, report: dict) -> None:
    """Each quantized run stops at a checkpoint, then a fresh engine (the next job of the launch) resumes from
    its files on disk."""
    half = args.interval * (args.checkpoints // 2)  # a checkpoint step
    total = 2 * half
    print("== uninterrupted", flush=True)
    jobs = [(work / "uninterrupted", ["--steps", str(total), "--no-save"])]
    for method, bits in args.accuracy:
        ckpt = work / f"acc-{method}-{bits}"
        shutil.rmtree(ckpt, ignore_errors=True)
        common = ["--policy", "intermittent", "--ckpt-every", str(args.interval), "--bits", str(bits)]
        common += ["--method", method, "--steps", str(total)]
        print(f"== restore from {method} {bits} bits", flush=True)
        jobs += [(ckpt, [*common, "--stop-at", str(half)]), (ckpt, common)]
    base, *runs = launch(args, jobs)
    report["accuracy"] = {"uninterrupted": {"loss": base["eval_loss"], "auc": base["eval_auc"]}}
    for (method, bits), run in zip(args.accuracy, runs[1::2]):
        assert run["resumed"]["step"] == half, run["resumed"]
        report["accuracy"][f"{method}-{bits}"] = {"loss": run["eval_loss"], "auc": run["eval_auc"]}
        shutil.rmtree(work / f"acc-{method}-{bits}")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def table(report: dict) -> str:
    full = report["storage"]["full-32"]
    full_one = full["saves"][0]["bytes"]
    cfg = report["config"]
    lines = [
        f"DLRM-like model: {len(cfg['rows'])} tables, {sum(cfg['rows']):,} rows x {cfg['dim']} (fp32), "
        f"Zipf({cfg['alpha']}) lookups, batch {cfg['batch']}, SGD, 1 rank, a checkpoint every "
        f"{cfg['interval']} steps, {cfg['checkpoints']} checkpoints. `written` is the sum over all "
        f"checkpoints; `held` is what a restore of the last one needs (its chain). Factors are against "
        f"full fp32 checkpoints ({_mb(full_one)} each); {PAPER}.",
        "",
        "| policy | bits | first / later checkpoints | written | held | write-bandwidth reduction | "
        "capacity reduction |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in report["storage"].values():
        sizes = [s["bytes"] for s in e["saves"]]
        later = f"{_mb(min(sizes[1:]))}-{_mb(max(sizes[1:]))}" if len(sizes) > 1 else "-"
        lines.append(
            f"| {e['policy']} | {e['bits'] or 32} | {_mb(sizes[0])} / {later} | "
            f"{_mb(e['written'])} | {_mb(e['held'])} | {full['written'] / e['written']:.1f}x | "
            f"{full_one / e['held']:.1f}x |"
        )
    t = report["tracking"]
    lines += [
        "",
        f"Change tracking: the lookup hooks take {t['hooks'] * 1e6:.0f} us per training step, "
        f"{t['hooks'] / t['off'] * 100:.2f}% of a {t['off'] * 1e3:.1f} ms step. Whole runs with and without "
        f"them take {t['on'] * 1e3:.1f} and {t['off'] * 1e3:.1f} ms per step (best of {report['tracking_repeats']}"
        f" each), a difference within this machine's run-to-run noise.",
    ]
    acc = report["accuracy"]
    ref = acc["uninterrupted"]
    lines += [
        "",
        "Restoring once, half-way, from a quantized intermittent checkpoint (adaptive unless named), "
        "then training on; held-out loss and AUC at the end:",
        "",
        "| run | loss | AUC | AUC change |",
        "|---|---|---|---|",
        f"| uninterrupted | {ref['loss']:.5f} | {ref['auc']:.5f} | - |",
    ]
    for name, r in acc.items():
        if name != "uninterrupted":
            lines.append(
                f"| restored from {name} bits | {r['loss']:.5f} | {r['auc']:.5f} | "
                f"{(r['auc'] - ref['auc']) / ref['auc'] * 100:+.3f}% |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/ucp_cnr_bench")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one configuration of each, for CI")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument(
        "--parts",
        default="storage,tracking,accuracy",
        help="which measurements to run; the others are kept from benchmarks/checkn_run.json",
    )
    args = parser.parse_args()
    args.rows, args.dim, args.batch, args.alpha = [400_003, 300_007, 200_003, 100_003], 32, 2048, 1.1
    args.interval, args.checkpoints, args.repeats = 10, 11, 3
    args.accuracy = [
        ("adaptive", 8),
        ("adaptive", 4),
        ("adaptive", 3),
        ("adaptive", 2),
        ("symmetric", 4),
        ("kmeans", 4),
    ]
    if args.smoke:
        global POLICIES, BITS
        POLICIES, BITS = ("full", "intermittent"), (None, 4)
        args.rows, args.dim, args.batch, args.interval, args.checkpoints = [1001, 501], 8, 48, 2, 3
        args.accuracy, args.repeats = [("adaptive", 4)], 1
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    saved = ROOT / "benchmarks" / "checkn_run.json"
    report = json.loads(saved.read_text()) if saved.exists() and not args.smoke else {}
    report.update(config={k: getattr(args, k) for k in ("rows", "dim", "batch", "alpha", "interval", "checkpoints")})
    parts = args.parts.split(",")
    if "storage" in parts:
        report["storage"] = {}
        storage(args, work, report)
    if "tracking" in parts:
        tracking(args, work, report)
    if "accuracy" in parts:
        accuracy(args, work, report)
    text = table(report)
    print(text)
    if not args.smoke:
        saved.write_text(json.dumps(report, indent=1))
        if args.update_docs:
            update_doc("benchmarks.md", "cnr", text)


if __name__ == "__main__":
    main()
