"""How tests and benchmarks start torchrun launches: one environment and one command line for all of them.

Standard library only. The benchmarks import it as their sibling, the tests through pytest's `pythonpath`.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env(*paths: Path) -> dict[str, str]:
    """This process's environment for a launch: the CPU accelerator, one op cache for every launch (so each op
    builds once), one thread per rank, and the repository (after `paths`) on PYTHONPATH."""
    out = dict(os.environ)
    out.setdefault("DS_ACCELERATOR", "cpu")
    out.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "ucp_torch_extensions"))
    out.setdefault("OMP_NUM_THREADS", "1")
    out["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT), out.get("PYTHONPATH", "")])
    return out


def torchrun_command(nproc: int, *argv: str | Path) -> list[str]:
    """`torchrun --standalone` on `nproc` local ranks of `argv`: a script and its arguments, or `-m module ...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, argv)]


def each(jobs: Sequence[Sequence[str]]) -> list[str]:
    """The arguments of one launch that runs `jobs` in turn: the first job's, then `--each 'ARGS'` for every other
    (the workers that take `--each` pay start-up once for all of them)."""
    first, *rest = jobs
    return [*first, *(arg for job in rest for arg in ("--each", shlex.join(job)))]
