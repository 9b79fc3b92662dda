"""Run the `ucp` CLI with a fault injected into the library's writes (test-only; never imported by the library).

python shim.py slow SECONDS ARGS...     every parameter file takes SECONDS longer to write
python shim.py enospc BYTES ARGS...     writes fail with ENOSPC once BYTES have been written
python shim.py hold PATH ARGS...        the first parameter file waits until PATH exists (a test's go signal)
"""

from __future__ import annotations

import errno
import os
import sys
import time
from importlib import import_module
from typing import Any

from ucp_deepspeed.tools.cli import main

writer_module = import_module("ucp_deepspeed.format.writer")  # a conversion writes each parameter file through it
atomic_module = import_module("ucp_deepspeed.io.atomic")  # every output file is written through it


def slow_writes(seconds: float) -> None:
    original = writer_module.stream_tensors

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    writer_module.stream_tensors = slow


def held_until(path: str) -> None:
    original = writer_module.stream_tensors
    deadline = time.monotonic() + 300

    def held(*args: Any, **kwargs: Any) -> Any:
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return original(*args, **kwargs)

    writer_module.stream_tensors = held


def disk_full_after(limit: float) -> None:
    written = [0]

    class FullDisk:
        def __init__(self, path: str, mode: str) -> None:
            self._f = open(path, mode)
            self._path = path

        def write(self, data: Any) -> int:
            written[0] += len(memoryview(data).cast("B"))
            if written[0] > limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
            return self._f.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.close()

    atomic_module.open = FullDisk


if __name__ == "__main__":
    fault, value = sys.argv[1], sys.argv[2]
    if fault == "hold":
        held_until(value)
    else:
        {"slow": slow_writes, "enospc": disk_full_after}[fault](float(value))
    sys.exit(main(sys.argv[3:]))
