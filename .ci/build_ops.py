"""Build DeepSpeed's JIT ops once into the extensions cache, saying what is built and how long each took.

DeepSpeed compiles its optimizer kernels at first use (ZeRO-Offload's CPU Adam, Adagrad and Lion; FusedAdam;
async_io for NVMe offload where libaio is present) and, on the CPU, its shared-memory collectives at the first launch.
A test launch that paid for them would run past its time limit, so `.ci/install` builds them here. The compiler's
output goes to the log named on the command line; the terminal gets one line per op.

Usage: python .ci/build_ops.py LOG [OP ...]   (every op, or only the builders named, e.g. ShareMemCommBuilder)
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import time
from collections.abc import Iterator

HOLDER = "ucp-builder-"  # + pid, beside torch's `lock`: a process building the op
# the first build of each on a 2-core machine, measured (docs/testing.md); from the cache, a few seconds
OPS = {
    "CPUAdamBuilder": "1-2 min",
    "CPUAdagradBuilder": "about 1 min",
    "CPULionBuilder": "about 1 min",
    "FusedAdamBuilder": "about 1 min",
    "AsyncIOBuilder": "2-7 min",
    "ShareMemCommBuilder": "1-4 min",
}


@contextlib.contextmanager
def _holding_build_lock(op_dir: str) -> Iterator[None]:
    """Record this process beside torch's build lock of the op in `op_dir` while it builds: torch's lock is a bare
    file naming no holder, so a build killed part-way (a stopped run) leaves it and every later build waits on it
    forever. A lock whose recorded builders have all stopped is such a leftover, and is cleared; each builder has a
    record of its own (`ucp-builder-<pid>`), so builds of one op side by side keep each other's."""
    records = glob.glob(os.path.join(op_dir, HOLDER + "*"))
    gone = [r for r in records if not _running(r)]
    lock = os.path.join(op_dir, "lock")
    if records and len(gone) == len(records) and os.path.exists(lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)
    for record in gone:
        with contextlib.suppress(FileNotFoundError):
            os.remove(record)
    os.makedirs(op_dir, exist_ok=True)
    mine = os.path.join(op_dir, f"{HOLDER}{os.getpid()}")
    open(mine, "w").close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(mine)


def _running(record: str) -> bool:
    """Whether the builder a record names is still running."""
    try:
        os.kill(int(record.rsplit("-", 1)[1]), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def main(log_path: str, only: list[str]) -> int:
    """Build every op (or those in `only`), one line each on the terminal; on failure, the op, the reason and where
    the log is."""
    terminal = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
    log = open(log_path, "w")  # it replaces fds 1 and 2 until the process ends: no `with`
    # ninja and the compiler write to the process's file descriptors, not to sys.stdout
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import op_builder

    cache = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not cache:
        terminal.write(".ci/build_ops.py: TORCH_EXTENSIONS_DIR is not set (.ci/install sets it)\n")
        return 1
    terminal.write(f".ci/install: building DeepSpeed's ops into {cache} (first time only; log: {log_path})\n")
    unknown = set(only) - set(OPS)
    if unknown:
        terminal.write(f".ci/build_ops.py: no such op: {', '.join(sorted(unknown))} (known: {', '.join(OPS)})\n")
        return 1
    for name, expected in OPS.items():
        if only and name not in only:
            continue
        if name == "ShareMemCommBuilder":
            builder = get_accelerator().create_op_builder(name)
        else:
            builder = getattr(op_builder, name)()
        if builder is None or (name == "AsyncIOBuilder" and not builder.is_compatible(verbose=False)):
            terminal.write(f"  {builder.NAME if builder else name}: skipped (not buildable here)\n")
            continue
        terminal.write(f"  {builder.NAME} (a first build takes {expected}) ... ")
        start = time.monotonic()
        try:
            with _holding_build_lock(os.path.join(cache, builder.NAME)):
                builder.load()
        except Exception as exc:  # the build's own output is in the log
            terminal.write(f"failed after {time.monotonic() - start:.0f} s: {exc}\n")
            terminal.write(f".ci/install: the compiler's output is in {log_path}\n")
            return 1
        terminal.write(f"{time.monotonic() - start:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
