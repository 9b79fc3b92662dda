"""torchrun worker: load a PyTorch DCP folder on an object store with the readers a user would pick instead of us.

    --source s3://BUCKET/DCP --reader fsspec            torch's FsspecReader (s3fs; reads each item whole, narrows)
    --source s3://BUCKET/DCP --reader s3torchconnector  s3torchconnector's S3StorageReader with the reader it makes
                                                        the default for DCP, `S3ReaderConstructor.dcp_optimized()`:
                                                        only the byte ranges of the plan's items, ranges less than
                                                        32 MiB apart coalesced into one stream (its default gap)
    --each 'ARGS'                                       another load in the same launch
    --requests-log PATH                                 s3rver's log (`s3rver_server(log=True)`): also count the
                                                        requests each load sent

Both find the store through `AWS_ENDPOINT_URL` (path-style, as s3rver, MinIO and moto need). The state dict is
every tensor entry of the folder's metadata at its dtype, a DTensor on a 1-D CPU mesh of all ranks: `Shard(0)` when
its first dimension has at least one row per rank, else replicated; objects (bytes entries) are left out, as DCP
loads a subset of keys. It is allocated before the timing: a load into a live model and optimizer.

A DCP item is one tensor's whole torch.save, so either reader fetches whole every item a rank's shards touch
(s3torchconnector's ranges are the items'), and each of 2 ranks fetches the whole folder; the fsspec reader takes
a file's items in plan order, not by offset, and s3fs refetches its read-ahead block at each seek back (at 0.5M
parameters, 3 GETs of the file's tail per rank: 3 times the folder).

Rank 0 prints one JSON line starting with `RESULT ` per load: `load_s`, `extra_rss` (peak above the allocated state,
summed over the ranks), `received` (read_chars, summed: what the ranks read from files and sockets with read(), the
little gloo traffic of DCP's planning included; s3torchconnector's native client reads its sockets so, but asyncio,
under s3fs, with recv_into(), which read_chars does not count: the fsspec reader's bytes are in `served`), `numel`
(elements loaded, summed; replicas count on every rank) and `check` (the float64 sum of the loaded values, each
element once: replicas count on rank 0 only, so it equals the sum of the whole tensors, whichever reader and however
many ranks). With `--requests-log`, also `requests` (what the server answered during the load) and `served` (the
bytes of its ranged GETs' bodies, as it logs them to 3 digits: both readers fetch data only by ranged GETs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from s3server import logged_requests
from synthetic import Usage, summed, timed
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

READERS = ("fsspec", "s3torchconnector")


def storage_reader(kind: str, url: str) -> dcp.StorageReader:
    """A fresh reader of `url` of the given kind, pointed at the store that `AWS_ENDPOINT_URL` names."""
    if kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url)  # s3fs finds the endpoint in AWS_ENDPOINT_URL itself
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader

    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    config = S3ClientConfig(force_path_style=True)
    reader = S3StorageReader(region, url, s3client_config=config)
    # S3StorageReader takes no endpoint, and its native client does not read AWS_ENDPOINT_URL: give its file
    # system a client that has one, keeping the reader's own (DCP-optimized, range-coalescing) constructor
    client = S3Client(region, endpoint=os.environ.get("AWS_ENDPOINT_URL"), s3client_config=config)
    reader.fs = S3FileSystem(region, s3_client=client, reader_constructor=reader._reader_constructor)
    return reader


def empty_state(metadata: dcp.Metadata, mesh: DeviceMesh) -> dict[str, DTensor]:
    """Zeroed DTensors for every tensor entry of `metadata`, placed as a sharded job would hold them."""
    world = mesh.size()
    state = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        size = tuple(entry.size)
        placement = Shard(0) if size and size[0] >= world else Replicate()
        state[key] = torch.distributed.tensor.zeros(
            size, dtype=entry.properties.dtype, device_mesh=mesh, placements=[placement]
        )
    return state


def checksum(state: dict[str, DTensor]) -> tuple[float, int]:
    """This rank's share of the float64 sum of the loaded values (each element on one rank), and its elements."""
    total, numel = 0.0, 0
    for value in state.values():
        local = value.to_local()
        numel += local.numel()
        if value.placements[0].is_shard() or dist.get_rank() == 0:
            total += local.double().sum().item()
    return total, numel


def load(args: argparse.Namespace, mesh: DeviceMesh) -> dict:
    """Time one `dcp.load` of the whole folder's tensors with a fresh reader, and what it cost."""
    state = empty_state(storage_reader(args.reader, args.source).read_metadata(), mesh)
    before = logged_requests(args.requests_log) if args.requests_log and dist.get_rank() == 0 else (0, 0)
    with Usage() as usage:
        seconds = timed(lambda: dcp.load(state, storage_reader=storage_reader(args.reader, args.source)))
    check, numel = checksum(state)
    extra_rss, received, numel, check = summed(usage.extra_rss, usage.read, numel, check)
    result = {
        "reader": args.reader,
        "load_s": seconds,
        "extra_rss": extra_rss,
        "received": received,
        "numel": int(numel),
        "check": check,
        "tensors": len(state),
    }
    if args.requests_log:
        time.sleep(0.2)  # s3rver logs a request once its response is done, which the client may see first
        if dist.get_rank() == 0:
            after = logged_requests(args.requests_log)
            result["requests"], result["served"] = after[0] - before[0], after[1] - before[1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, help="the DCP folder's URL, s3://BUCKET/PREFIX")
    parser.add_argument("--reader", required=True, choices=READERS)
    parser.add_argument("--requests-log", type=Path, help="s3rver's log, to count each load's requests")
    parser.add_argument(
        "--each", action="append", default=[], metavar="'ARGS'", help="one more load in the same launch"
    )
    args = parser.parse_args()
    runs = [args] + [parser.parse_args(shlex.split(more)) for more in args.each]
    if any(run.each for run in runs[1:]):
        parser.error("--each cannot nest")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for run in runs:
        results.append(load(run, mesh))
        gc.collect()  # one state at a time
    if dist.get_rank() == 0:
        for one in results:
            print("RESULT " + json.dumps(one), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
