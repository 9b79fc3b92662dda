"""What a save costs training, side by side on one engine and state: ours synchronous and asynchronous, DeepSpeed's
own save (torch's writer, its python writer and FastPersist), DCP's `async_save` (thread, process, process with its
cached shared-memory staging), and the disk's floor for the same bytes.

    python benchmarks/bench_async.py                               # 20M parameters, 1 rank; fails if async stops
                                                                   # gaining over sync
    python benchmarks/bench_async.py --sizes 75,300 --zero 1,3 --ranks 1,4 --update-docs

Each launch (`synthetic.py async`) trains a synthetic LM with fp32 AdamW at one ZeRO stage. Each kind of save saves
once (the first save, which pays for staging and for starting a writer process), then `--repeat` times in turns with
every other kind (each save after an `os.sync()`, each followed by `--steps` training steps): the stall is the time of
the save call and those steps, less as many plain steps timed right before it (the median of the turns; the host drifts
by seconds within a launch, and kinds measured one block after another read that drift as their own).
Time to durable is the median of 3 more saves, each with its wait alone, and the disk's floor the median of 3 writes of
the same bytes from memory with fsync. Held memory is the resident memory the kind left behind after its first save
(staging included), summed over the ranks, and the bytes what it wrote.
On 1 rank a core is free for a writer, as the CPU of a GPU job mostly is; on 4 ranks every core of this 2-core
machine trains.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_resume import torchrun
from docs_table import update_doc
from launching import ROOT

RESULTS = ROOT / "benchmarks" / "async.json"
SYNC, ASYNC = "ours, sync", "ours, async: writer process, staging made once"


def table(report: dict) -> str:
    """The side-by-side table of every launch in `report`."""
    dates = sorted({run.get("date", report["date"]) for run in report["runs"].values()})
    lines = [
        f"Measured {' and '.join(dates)}, fp32 AdamW, {report['steps']} steps after each save. The disk's floor: "
        "the same bytes written from memory in 64 MiB writes and fsynced, shared over the ranks, in the same launch. "
        "DeepSpeed's own save with torch's writer or its python writer fsyncs nothing, so its time to durable is only "
        "the time it took; FastPersist fsyncs each file, not its folder.",
        "",
        "| size, stage, ranks | save | stall s | x ours sync | first save's stall s | time to durable s | x disk floor "
        "| held GB | GB written |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, run in report["runs"].items():
        sync = next(r["stall_s"] for r in run["rows"] if r["kind"] == SYNC)
        floor = run["floor_s"]
        lines.append(f"| {key} | the disk's floor | | | | {floor:.2f} | 1.00 | | {run['rows'][0]['bytes'] / 1e9:.2f} |")
        for r in run["rows"]:
            lines.append(
                f"| {key} | {r['kind']} | {r['stall_s']:.2f} | {r['stall_s'] / sync:.2f} | {r['first_stall_s']:.2f} "
                f"| {r['durable_s']:.2f} | {r['durable_s'] / floor:.2f} | {r['held_gb']:.2f} | {r['bytes'] / 1e9:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="20", help="million parameters, comma-separated")
    parser.add_argument("--ranks", default="1", help="ranks of each launch, comma-separated")
    parser.add_argument("--zero", default="1", help="ZeRO stages, comma-separated")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=4, help="turns of warm saves, one of each kind per turn")
    parser.add_argument("--smoke", action="store_true", help="10M parameters on 1 rank: the check alone")
    parser.add_argument(
        "--kinds", help="only these kinds of save, by short name (synthetic.py's KINDS; sync and async among them)"
    )
    parser.add_argument("--work", default="/tmp/ucp_bench_async")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help=f"keep the results in {RESULTS.name}, and the table (launches not run now keep their rows)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.ranks = "10", "1"
    report: dict = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "runs": {}}
    for size in args.sizes.split(","):
        for zero in args.zero.split(","):
            for ranks in args.ranks.split(","):
                print(f"== {size}M, ZeRO-{zero}, at {ranks} rank(s): every kind of save", flush=True)
                job = ["async", "--params-m", size, "--zero", zero, "--steps", str(args.steps)]
                job += ["--repeat", str(args.repeat), "--out", f"{args.work}/{size}M-{zero}-{ranks}"]
                job += ["--kinds", args.kinds] if args.kinds else []
                run = torchrun(int(ranks), job)[0]
                report["runs"][f"{size}M, ZeRO-{zero}, {ranks}"] = {**run, "date": report["date"]}
    if args.update_docs and RESULTS.exists():  # the launches run now replace theirs; the others' rows stay
        kept = json.loads(RESULTS.read_text())
        report["runs"] = {
            **{key: {"date": kept["date"], **run} for key, run in kept["runs"].items()},
            **report["runs"],
        }
    text = table(report)
    print(text)
    if args.update_docs:
        RESULTS.write_text(json.dumps(report, indent=1) + "\n")
        update_doc("benchmarks.md", "async", text)
    slower = []
    for key, run in report["runs"].items():
        stall = {r["kind"]: r["stall_s"] for r in run["rows"]}
        if stall[ASYNC] >= stall[SYNC]:
            slower.append(f"{key}: async {stall[ASYNC]:.2f} s, sync {stall[SYNC]:.2f} s")
    for line in slower:
        print(f"FAIL {line}: the async save no longer stalls training less than a synchronous one")
    if slower:
        sys.exit(1)
    print("PASS the async save stalls training less than a synchronous one in every launch")


if __name__ == "__main__":
    main()
