"""Should ranks of one node share a read? Every rank reading the same bytes, against one rank reading them and
broadcasting them to the others, timed on this machine.

    torchrun --standalone --nproc_per_node 4 benchmarks/bench_shared_reads.py [--mib 64,256,1024] [--dir /tmp]

A direct resharded load reads each rank's whole low-precision weights (as DeepSpeed's native load reads the full
model-states file), so N ranks of a node read the same bytes N times. Sharing the read trades N reads for one
read plus a broadcast. Rank 0 prints one line per size and a JSON line starting with `RESULT `.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def read_into(path: str, out: torch.Tensor) -> None:
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise EOFError(path)
            done += n


def one_size(mib: int, folder: str, repeat: int) -> dict:
    """Best of `repeat` for both ways of getting `mib` MiB of a page-cached file to every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(folder, f"shared_reads_{mib}.bin")
    if rank == 0:
        with open(path, "wb") as f:
            f.write(os.urandom(mib << 20))
    out = torch.empty(mib << 20, dtype=torch.uint8)
    timed(lambda: read_into(path, out))  # into the page cache, as a load after a save finds it

    def shared() -> None:
        if rank == 0:
            read_into(path, out)
        dist.broadcast(out, src=0)

    each = min(timed(lambda: read_into(path, out)) for _ in range(repeat))
    one = min(timed(shared) for _ in range(repeat))
    if rank == 0:
        print(f"{mib} MiB on {world} ranks: every rank reads {each:.3f} s; one reads + broadcast {one:.3f} s")
        os.unlink(path)
    return {"mib": mib, "ranks": world, "every_rank_reads_s": each, "one_reads_and_broadcasts_s": one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="64,256,1024", help="sizes to read, in MiB")
    parser.add_argument("--dir", default="/tmp", help="where the test file is written (then read from the cache)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = [one_size(int(mib), args.dir, args.repeat) for mib in args.mib.split(",")]
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
