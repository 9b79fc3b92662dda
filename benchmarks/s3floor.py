"""What an S3 server itself takes, measured with the fastest client at hand (obstore: Rust, many requests in flight,
no Python per byte): the floor a checkpoint load or save is compared with.

- `get_floor`: ranged GETs of every byte of some objects, `request` bytes each, `in_flight` at once;
- `put_floor`: PUTs of objects of the sizes a save writes, `in_flight` at once.

Each gives the seconds, bytes and requests, hence MB/s and requests/s; a load's floor for its bytes is those bytes at
the floor's MB/s.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

REQUEST = 8 << 20
IN_FLIGHT = 16
SERVER_PID = "UCP_BENCH_SERVER_PID"
"""The environment variable naming the local server's process, whose CPU time a measurement adds to its own."""


def cpu_seconds() -> float:
    """CPU seconds so far of this process (every thread) and of the server `SERVER_PID` names."""
    import psutil

    pids = [os.getpid(), *([int(os.environ[SERVER_PID])] if os.environ.get(SERVER_PID) else [])]
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


@dataclass(frozen=True)
class Floor:
    """One timed batch of requests."""

    seconds: float
    nbytes: int
    requests: int
    cpu_s: float = 0.0
    """CPU seconds the client and the server spent (the server's where `SERVER_PID` names it): on one machine they
    share its cores, so a load cannot take less than its own CPU and the server's over the core count."""

    @property
    def mb_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds

    @property
    def requests_s(self) -> float:
        return self.requests / self.seconds

    def seconds_for(self, nbytes: float) -> float:
        """How long the server takes to serve `nbytes` at this floor's rate."""
        return nbytes / self.nbytes * self.seconds

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "mb_s": self.mb_s, "requests_s": self.requests_s}


def store(bucket: str) -> Any:
    """An obstore client for `bucket` at the server `AWS_ENDPOINT_URL` names, with the AWS variables' keys."""
    from obstore.store import S3Store

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    return S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        virtual_hosted_style_request=False,
        client_options={"allow_http": endpoint.startswith("http://")},
    )


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key.rstrip("/")


def get_floor(url: str, request: int = REQUEST, in_flight: int = IN_FLIGHT, best_of: int = 2) -> Floor:
    """Every byte of every object under the prefix `url`, as ranged GETs of `request` bytes, `in_flight` at once
    (the best of `best_of` passes)."""
    import obstore

    bucket, prefix = _split(url)
    client = store(bucket)
    objects = [(o["path"], o["size"]) for batch in obstore.list(client, prefix=prefix + "/") for o in batch]
    ranges = [(path, at, min(request, size - at)) for path, size in objects for at in range(0, size, request)]

    def get(item: tuple[str, int, int]) -> int:
        path, at, length = item
        return len(obstore.get_range(client, path, start=at, length=length))

    best = None
    for _ in range(best_of):
        start, cpu = time.perf_counter(), cpu_seconds()
        with ThreadPoolExecutor(in_flight) as pool:
            nbytes = sum(pool.map(get, ranges))
        found = Floor(time.perf_counter() - start, nbytes, len(ranges), cpu_seconds() - cpu)
        best = found if best is None or found.seconds < best.seconds else best
    assert best is not None
    return best


def put_floor(url: str, sizes: list[int], in_flight: int = IN_FLIGHT) -> Floor:
    """PUTs of one object per size in `sizes` (fresh random bytes, under a new prefix of `url`, deleted after),
    `in_flight` at once; obstore sends each whole, as we do."""
    import obstore

    bucket, prefix = _split(url)
    client = store(bucket)
    under = f"{prefix}/floor-{uuid.uuid4().hex[:8]}"
    payloads = [
        os.urandom(min(size, 64 << 20)) * (size // (64 << 20)) + os.urandom(size % (64 << 20)) for size in sizes
    ]
    start = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(lambda i: obstore.put(client, f"{under}/{i}", payloads[i]), range(len(sizes))))
    found = Floor(seconds=time.perf_counter() - start, nbytes=sum(sizes), requests=len(sizes))
    obstore.delete(client, [f"{under}/{i}" for i in range(len(sizes))])
    return found
