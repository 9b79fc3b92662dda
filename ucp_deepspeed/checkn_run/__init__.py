"""Check-N-Run (NSDI'22) differential and quantized checkpoints, plugged into the core as an extension.

Importing this package registers, with nothing in the core importing it back: its tag kind
(`format.kinds`), so locating, resuming, pruning, converting and verifying know its chains; its
config sections `differential` and `quantize`; and its saver, which replaces DeepSpeed's save when
either section is given.
"""

from __future__ import annotations

from typing import Any

from ucp_deepspeed.checkn_run.chain import MARKER, ChainCheckpoint, chain, crc_problems, materialize
from ucp_deepspeed.checkn_run.config import DifferentialConfig, QuantizeConfig
from ucp_deepspeed.format.kinds import TagKind, register_tag_kind
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.plugins import register_saver, register_section

KIND = "checkn_run"


def _needs(ckpt_dir: str, tag: str) -> list[str]:
    return [t for t, _ in chain(ckpt_dir, tag)]


def _verify(ckpt_dir: str, tag: str) -> list[str]:
    return crc_problems(ckpt_dir, chain(ckpt_dir, tag))


def _saver(engine: Engine, options: Any) -> Any:
    """A Check-N-Run saver when the config has a `differential` or `quantize` section."""
    diff: DifferentialConfig | None = options.extensions.get("differential")
    quant: QuantizeConfig | None = options.extensions.get("quantize")
    if diff is None and quant is None:
        return None
    from ucp_deepspeed.checkn_run.differential import DifferentialSaver  # imports DeepSpeed: only for engines

    return DifferentialSaver(
        engine,
        diff.policy if diff else None,
        (diff.tables if diff else None) or (quant.tables if quant else None),
        quant.method if quant else None,
        quant.bits if quant else None,
        quant.expected_restores if quant else None,
    )


register_tag_kind(TagKind(KIND, MARKER, _needs, materialize, _verify, ChainCheckpoint))
register_section("differential", DifferentialConfig)
register_section("quantize", QuantizeConfig)
register_saver(_saver)
