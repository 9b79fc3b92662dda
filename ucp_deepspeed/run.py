"""`python -m ucp_deepspeed.run SCRIPT [ARGS...]`: an unmodified training script, with ucp_deepspeed installed.

For jobs whose code should not change (HF Trainer and Accelerate scripts, example scripts): every
launcher can run a module instead of a script, e.g. `torchrun --nproc_per_node 8 -m
ucp_deepspeed.run train.py ...`, `deepspeed --module ucp_deepspeed.run train.py ...` or
`accelerate launch -m ucp_deepspeed.run train.py ...`.
"""

from __future__ import annotations

import os
import runpy
import sys

from ucp_deepspeed.runtime.integrations import install


def main(argv: list[str] | None = None) -> None:
    """Install ucp_deepspeed, then run SCRIPT as `__main__` with the remaining arguments as its argv."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
