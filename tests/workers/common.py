"""What every test worker shares: `--each` (several runs in one launch) and the path to the reference scripts in
`launch/` (megatron-core's CPU shims, the GPT the GPT worker trains)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
sys.path.insert(0, str(LAUNCH))


def add_each(parser: argparse.ArgumentParser) -> None:
    """`--each 'ARGS'`: one more run in the same launch, so start-up (torch, DeepSpeed, megatron-core imports and
    process groups) is paid once for all of them."""
    parser.add_argument(
        "--each",
        action="append",
        default=[],
        metavar="'ARGS'",
        help="one more run in the same launch, given as its own quoted arguments",
    )


def runs(parser: argparse.ArgumentParser) -> list[argparse.Namespace]:
    """The command line's run, then each `--each` run, parsed by the same parser; `--each` cannot nest."""
    first = parser.parse_args()
    out = [first] + [parser.parse_args(shlex.split(more)) for more in first.each]
    if any(run.each for run in out[1:]):
        parser.error("--each runs cannot nest")
    return out
