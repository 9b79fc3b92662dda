"""Checkpoints on a real S3 server against its own floor and against local disk: saves, loads, reshards, and the
readers users would pick instead.

    python benchmarks/bench_object_store.py                     # 75M (4 ranks) and 300M (2 ranks), ZeRO-1 and 3
    python benchmarks/bench_object_store.py --params-m 75       # one size
    python benchmarks/bench_object_store.py --smoke             # tiny sizes on 2 ranks: checks that everything runs
    python benchmarks/bench_object_store.py --update-docs       # also rewrite the tables in docs/benchmarks.md
    python benchmarks/bench_object_store.py --table             # the tables of the last full run (object_store.json)

The server is s3rver on 127.0.0.1 (`s3server.py`; `benchmarks/setup.sh` installs it), whose ranged GETs cost what
the range costs; moto, the tests' server, costs the whole object for any range, so its timings describe moto. Per size:

1. Per ZeRO stage and storage (s3rver, a local folder), one launch of `--ranks` ranks trains a step and saves
   synchronously, then asynchronously (`synthetic.py stall`).
2. The server's floor, with obstore (Rust, many requests in flight, no Python per byte; `s3floor.py`): ranged GETs of
   every byte of the saved tag, 8 MiB each, 16 in flight; and PUTs of objects of the sizes the save wrote, all at
   once. A row's "x floor" is its time over the floor's time for the same bytes.
3. One launch loads every checkpoint at its own layout, one reshards each to half the ranks at the other stage.
4. At the first size, the side-by-side: the ZeRO-1 checkpoint exported to DCP on the same server (`ucp export-dcp`),
   loaded into half the ranks by torch's FsspecReader and by s3torchconnector's S3StorageReader
   (`dcp_reader.py`), beside our direct reshard of the same checkpoint to half the ranks.

Requests, round trips and bytes: what every rank asked of storage (`io.stats`): ranged GETs, and the HEADs and
listings before and between them; the side-by-side counts what the server logged, for every reader alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import s3floor
from docs_table import update_doc
from launching import ROOT, each, env, torchrun_command
from s3server import S3Server, s3rver_server

from ucp_deepspeed.io.remote import MAX_REQUEST, PART

WORKER = ROOT / "benchmarks" / "synthetic.py"
SPREAD_OVER = 16  # `key_prefixes`: a save's objects, and so a load's GETs, over this many prefixes
DCP_WORKER = ROOT / "benchmarks" / "dcp_reader.py"
RESULTS = ROOT / "benchmarks" / "object_store.json"
STORES = ("local disk", "S3 (s3rver)", f"S3, {SPREAD_OVER} key prefixes")


def launch(nproc: int, argv: list[str], script: Path = WORKER) -> list[dict]:
    """One launch of a worker; its RESULT lines."""
    cmd = torchrun_command(nproc, script, *argv)
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        sys.exit(f"launch failed: {' '.join(map(str, cmd))}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _served(s3: S3Server) -> int:
    time.sleep(0.3)  # s3rver logs a request once its response is sent
    return s3.requests()


def one_size(s3: S3Server, params_m: float, ranks: int, work: Path, side_by_side: bool) -> dict:
    """Every row of one model size; its local folder and its bucket are emptied afterwards (at 300M they hold 17 GB
    each, and a save to the store spools its largest file to local disk)."""
    bucket = s3.bucket()
    local = work / f"local{params_m:g}"
    shutil.rmtree(local, ignore_errors=True)
    try:
        bases = {STORES[0]: str(local), STORES[1]: f"s3://{bucket}/bench", STORES[2]: f"s3://{bucket}/spread"}
        return _one_size(s3, params_m, ranks, bases, side_by_side)
    finally:
        shutil.rmtree(local, ignore_errors=True)
        _empty(f"s3://{bucket}")


def _empty(bucket: str) -> None:
    from ucp_deepspeed.io import storage as st

    for name in st.listdir(bucket):
        st.delete(st.join(bucket, name))


def _one_size(s3: S3Server, params_m: float, ranks: int, bases: dict[str, str], side_by_side: bool) -> dict:
    bucket = bases[STORES[1]].removeprefix("s3://").split("/")[0]
    saves, loads, floors = [], [], {}
    for zero in (1, 3):
        for store, base in bases.items():
            spread = ["--key-prefixes", str(SPREAD_OVER)] if store == STORES[2] else []
            (result,) = launch(
                ranks, ["stall", "--params-m", str(params_m), "--zero", str(zero), "--out", f"{base}/z{zero}", *spread]
            )
            saves.append({"zero": zero, "store": store, **result})
        tag = f"{bases[STORES[1]]}/z{zero}/sync/" + read_latest(f"{bases[STORES[1]]}/z{zero}/sync")
        sizes = object_sizes(tag)
        floors[zero] = {
            "get": s3floor.get_floor(tag).record(),
            "put": s3floor.put_floor(f"s3://{bucket}/floor", sizes, in_flight=len(sizes)).record(),
        }
    for world, other in ((ranks, False), (max(1, ranks // 2), True)):
        jobs = []
        for zero in (1, 3):
            target = 4 - zero if other else zero
            for base in bases.values():
                jobs.append(["load", "--params-m", str(params_m), "--zero", str(target), "--direct"])
                jobs[-1] += ["--source", f"{base}/z{zero}/sync"]
        results = iter(launch(world, each(jobs)))
        for zero in (1, 3):
            for store in bases:
                target = f"DP {world}, ZeRO-{4 - zero if other else zero}"
                loads.append({"zero": zero, "store": store, "target": target, "reshard": other, **next(results)})
    found = {"params_m": params_m, "ranks": ranks, "saves": saves, "loads": loads, "floors": floors}
    found["cpus"] = os.cpu_count()  # the ranks and the server share them
    if side_by_side:
        found["side_by_side"] = compare_readers(s3, bases[STORES[1]], params_m, ranks)
    return found


def read_latest(ckpt: str) -> str:
    from ucp_deepspeed.io import storage as st

    return st.read_text(st.join(ckpt, "latest")).strip()


def object_sizes(tag: str) -> list[int]:
    from ucp_deepspeed.io import storage as st

    return [st.stat(st.join(tag, rel))[0] for rel in st.find(tag)]


def compare_readers(s3: S3Server, base: str, params_m: float, ranks: int) -> list[dict]:
    """The ZeRO-1 checkpoint resharded to half the ranks: ours straight from the rank files, and DCP's readers on its
    export; requests as the server logged them."""
    world = max(1, ranks // 2)
    source, folder = f"{base}/z1/sync", f"{base}/dcp"
    exported = subprocess.run(
        [sys.executable, "-m", "ucp_deepspeed.tools.cli", "export-dcp", source, folder, "--no-progress"],
        env=env(),
        capture_output=True,
        text=True,
    )
    if exported.returncode:
        raise RuntimeError(f"ucp export-dcp {source} failed: {exported.stderr.strip()[-2000:]}")
    before = _served(s3)
    (ours,) = launch(world, ["load", "--params-m", str(params_m), "--zero", "1", "--direct", "--source", source])
    ours.update(reader="ours, direct reshard", requests_served=_served(s3) - before)
    loads = [["--source", folder, "--reader", r, "--requests-log", str(s3.log)] for r in ("fsspec", "s3torchconnector")]
    theirs = launch(world, each(loads), DCP_WORKER)
    for one in theirs:
        one["reader"] = {"fsspec": "DCP FsspecReader (s3fs)", "s3torchconnector": "s3torchconnector S3StorageReader"}[
            one["reader"]
        ]
    return [ours, *theirs]


BIG_M = 150.0
"""Above this many million parameters a size runs on 2 ranks: 4 ranks of 300M, each holding an engine and the whole
files it uploads in host memory, pass this machine's 24 GiB."""


def run(sizes: list[float], ranks: int, work: Path, keep: Path | None) -> dict:
    """Every row, measured; each size's rows are kept in `keep` as soon as they are, beside the rows kept there of
    the sizes not measured now (a later size that fails, or a run of one size, loses no other size's)."""
    kept = json.loads(keep.read_text())["runs"] if keep is not None and keep.exists() else []
    found: dict = {"runs": [one for one in kept if one["params_m"] not in sizes]}
    with s3rver_server(data_dir=work, log=True) as s3:
        os.environ[s3floor.SERVER_PID] = str(s3.server.process.pid)  # the launches inherit it (`launching.env`)
        for i, params_m in enumerate(sizes):
            world = min(ranks, 2) if params_m > BIG_M else ranks
            measured = one_size(s3, params_m, world, work, side_by_side=i == 0)
            found["runs"] = sorted(
                [*found["runs"], {**measured, "measured": time.strftime("%Y-%m-%d")}], key=lambda one: one["params_m"]
            )
            if keep is not None:
                keep.write_text(json.dumps(found, indent=1) + "\n")
    return found


def _cpu(load: dict, cpus: int | None) -> str:
    """A load's CPU seconds, its ranks' and the server's, and the least time they allow on `cpus` cores."""
    if "cpu_s" not in load or not cpus:  # measured before CPU time was
        return ""
    ranks, server = load["cpu_s"], load.get("server_cpu_s", 0.0)
    return (
        f"{ranks:.2f} + {server:.2f} ({(ranks + server) / cpus:.2f})" if server else f"{ranks:.2f} ({ranks / cpus:.2f})"
    )


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def table(found: dict) -> str:
    """The results as Markdown tables."""
    lines: list[str] = []
    for one in found["runs"]:
        ranks = one["ranks"]
        lines += [
            f"**{one['params_m']:g}M parameters** (measured {one.get('measured', '?')}), fp32 AdamW, saved by {ranks} "
            "ranks. Server floor (obstore): "
            + "; ".join(
                f"ZeRO-{z}: GET {f['get']['mb_s']:,.0f} MB/s ({f['get']['requests_s']:,.0f} requests/s"
                + (f", {f['get']['cpu_s']:.2f} CPU s" if f["get"].get("cpu_s") else "")
                + "), "
                f"PUT {f['put']['mb_s']:,.0f} MB/s"
                for z, f in sorted(one["floors"].items())
            )
            + ".",
            "",
            "| ZeRO | storage | what | time s | x floor | GETs (all ranks / worst rank) | HEADs + listings (all ranks)"
            " | round trips, worst rank | MB fetched or written | async stall s (rest in background s) "
            "| CPU s, ranks + server ("
            + (f"their bound on {one['cpus']} cores, s) |" if one.get("cpus") else "not measured in this run) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for zero in (1, 3):
            floor = one["floors"][str(zero)] if str(zero) in one["floors"] else one["floors"][zero]
            for store in STORES:
                on_store = store != STORES[0]
                save = next((s for s in one["saves"] if s["zero"] == zero and s["store"] == store), None)
                if save is None:  # measured before that store was
                    continue
                put_s = save["bytes"] / 1e6 / floor["put"]["mb_s"]
                lines.append(
                    f"| {zero} | {store} | save, DP {ranks} | {save['sync_save_s']:.2f} "
                    f"| {save['sync_save_s'] / put_s:.2f} |"
                    if on_store
                    else f"| {zero} | {store} | save, DP {ranks} | {save['sync_save_s']:.2f} | |"
                )
                lines[-1] += (
                    f" {save['objects']} PUTs | | | {_mb(save['bytes'])} written "
                    f"| {save['async_stall_s']:.2f} ({save['async_rest_s']:.2f}) | |"
                )
                for load in (x for x in one["loads"] if x["zero"] == zero and x["store"] == store):
                    what = f"{'reshard' if load['reshard'] else 'load'} to {load['target']} ({load['mode']})"
                    ratio = load["load_s"] / (load["fetched"] / 1e6 / floor["get"]["mb_s"]) if on_store else None
                    lines.append(
                        f"| {zero} | {store} | {what} | {load['load_s']:.2f} | {f'{ratio:.2f}' if ratio else ''} "
                        f"| {load['requests']:g} / {load['max_rank_requests']} "
                        f"| {load.get('lookups', 0):g} | {load.get('max_rank_round_trips', '')} "
                        f"| {_mb(load['fetched'])} fetched | | {_cpu(load, one.get('cpus'))} |"
                    )
        lines.append("")
        for zero in (1, 3):
            local, store = (
                next(x for x in one["loads"] if x["zero"] == zero and x["reshard"] and x["store"] == s)
                for s in STORES[:2]
            )
            lines.append(
                f"ZeRO-{zero} reshard, {one['params_m']:g}M: the store fetched "
                f"{store['fetched'] / local['fetched']:.3f}x the bytes the same reshard read from disk, and took "
                f"{store['load_s'] / local['load_s']:.2f}x the time."
            )
            lines.append("")
        if "side_by_side" in one:
            lines += [
                f"Side by side, {one['params_m']:g}M: the ZeRO-1 checkpoint of {ranks} ranks into {max(1, ranks // 2)}"
                " ranks, from the same server (DCP's readers load its `ucp export-dcp` folder).",
                "",
                "| reader | time s | MB received | requests (server's count) | peak extra memory, all ranks MB |",
                "|---|---|---|---|---|",
            ]
            for row in one["side_by_side"]:
                received = row.get("fetched", row.get("served", 0))
                requests = row.get("requests_served", row.get("requests", 0))
                lines.append(
                    f"| {row['reader']} | {row['load_s']:.2f} | {_mb(received)} | {requests:g} "
                    f"| {_mb(row['extra_rss'])} |"
                )
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# AWS's documented rates: per connection about 85-90 MB/s, per partitioned prefix about 3,500 PUT and 5,500 GET
# requests a second, and 100-200 ms to the first byte of a small object
CONNECTION_MB_S = 85.0
GETS_PER_S, PUTS_PER_S = 5500, 3500
FIRST_BYTE_S = 0.1
IN_FLIGHT = 16
REQUEST = MAX_REQUEST  # our ranged GETs
PARTS_IN_FLIGHT = 10  # s3fs sends an object of 2 parts or more in parts, 10 at a time
PROJECTED = (("7B", 7e9), ("70B", 70e9))


def projection(scale: dict) -> str:
    """Per-rank bytes, requests and round trips of a 1,024-rank resume, from the scale simulation's counts (ZeRO-1
    saved by 1,024 ranks, resumed at ZeRO-3 on 1,024), turned into seconds at AWS's documented rates."""
    row = next(r for r in scale["resume"] if r["source"] == 1024 and r["index"] and r["scenario"] == "ZeRO-1 to ZeRO-3")
    ranks, (runs, worst_runs), shared = row["ranks"], row["requests"], row["shared"]
    lines = [
        f"Simulated: each of {ranks} ranks reads from {row['files'][0]:.0f} files (at worst {row['files'][1]}) in "
        f"{runs:.0f} runs of ranges (at worst {worst_runs}); rank 0 reads, once, {shared['files']:,} files' metadata "
        f"in {shared['requests']:,} requests. The model sizes below set the bytes: fp32 masters and two Adam moments "
        f"(12 bytes a parameter), each rank's 1/{ranks}.",
        "",
        "| model | MB a rank reads | GETs a rank (mean / worst) | a rank's transfer s (16 x 85 MB/s) "
        "| a rank's round trips s (16 in flight, 100 ms) | GETs, all ranks | s at 5,500 GETs/s on one prefix "
        f"| s over {SPREAD_OVER} prefixes (`key_prefixes: {SPREAD_OVER}`) "
        "| rank 0 once: s of round trips (16 files in flight, 100 ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    per_file = shared["requests"] / shared["files"]  # rank 0's round trips per file, one after another
    rank0_s = -(-shared["files"] // IN_FLIGHT) * per_file * FIRST_BYTE_S
    for name, params in PROJECTED:
        nbytes = 12 * params / ranks
        gets = runs + -(-nbytes // REQUEST)
        worst = worst_runs + -(-nbytes // REQUEST)
        every = ranks * gets + shared["requests"]
        lines.append(
            f"| {name} | {nbytes / 1e6:,.0f} | {gets:,.0f} / {worst:,.0f} "
            f"| {nbytes / 1e6 / (IN_FLIGHT * CONNECTION_MB_S):.2f} | {-(-worst // IN_FLIGHT) * FIRST_BYTE_S:.1f} "
            f"| {every:,.0f} | {every / GETS_PER_S:.1f} | {every / GETS_PER_S / SPREAD_OVER:.1f} | {rank0_s:.0f} |"
        )
    lines += [
        "",
        "A ZeRO-1 save of the same job: each rank PUTs its optimizer file; s3fs sends one of 100 MiB or more in 50 MiB "
        "parts, 10 at a time, plus a request to start and one to finish.",
        "",
        "| model | MB a rank writes | PUTs a rank | a rank's upload s (85 MB/s a connection) | PUTs, all ranks "
        f"| s at 3,500 PUTs/s on one prefix | s over {SPREAD_OVER} prefixes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, params in PROJECTED:
        nbytes = 12 * params / ranks
        parts = 1 if nbytes < 2 * PART else -(-nbytes // PART)
        puts = parts if parts == 1 else parts + 2
        upload = nbytes / 1e6 / (CONNECTION_MB_S * min(parts, PARTS_IN_FLIGHT))
        lines.append(
            f"| {name} | {nbytes / 1e6:,.0f} | {puts:.0f} | {upload:.1f} | {ranks * puts:,.0f} "
            f"| {ranks * puts / PUTS_PER_S:.1f} | {ranks * puts / PUTS_PER_S / SPREAD_OVER:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="0.5M parameters on 2 ranks")
    parser.add_argument("--params-m", type=float, action="append", help="a model size (repeatable; 75 and 300)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucp_bench_object_store"))
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--table", action="store_true", help="print (and with --update-docs write) the last run's")
    args = parser.parse_args()
    sizes, ranks = ([0.5], 2) if args.smoke else (args.params_m or [75.0, 300.0], args.ranks)
    args.work.mkdir(parents=True, exist_ok=True)
    keep = None if args.smoke or args.table else RESULTS
    found = json.loads(RESULTS.read_text()) if args.table else run(sizes, ranks, args.work, keep)
    text = table(found)
    print(text)
    projected = projection(json.loads((ROOT / "benchmarks" / "scale.json").read_text()))
    print(projected)
    if args.update_docs:
        update_doc("benchmarks.md", "object-store", text)
        update_doc("guides/object-storage.md", "object-store-projection", projected)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
