"""Universal checkpointing for engines that other code creates: HF Trainer, Accelerate, any library.

Those frameworks call `deepspeed.initialize` themselves, so `install()` replaces that function
with ours. Every engine created afterwards saves ucp metadata and reshards on load, with no change
to the training script. A config may still say `"checkpoint": {"universal": false}`, or give
options. Accelerate looks `deepspeed.initialize` up at call time; code that imported the function
by name before `install()` keeps DeepSpeed's own.

HF Trainer also keeps one RNG file per process (`rng_state_<i>.pth`, or `rng_state.pth` for one
process). At a new world size some processes would find none, so `install()` also lets such a
process restore the state of saved process `i mod n` instead of none.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import sys
import tempfile
from typing import Any

import deepspeed

from ucp_deepspeed import engine
from ucp_deepspeed.config import UniversalConfig

log = logging.getLogger("ucp_deepspeed")

_saved: dict[str, Any] = {}  # what install() replaced, for uninstall()


def install(**options: Any) -> None:
    """Make every later `deepspeed.initialize` (HF Trainer, Accelerate, ...) use universal checkpointing.

    `options` are the `"checkpoint": {"universal": {...}}` keys used when a config has none. A
    second call changes nothing.
    """
    if "initialize" in _saved:
        return
    original = deepspeed.initialize
    signature = inspect.signature(original)
    default = {"enabled": True, **options}
    UniversalConfig(**default)  # a bad option fails here, not when the framework builds its engine

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> tuple:
        bound = signature.bind_partial(*args, **kwargs).arguments
        return engine.initialize(default_universal=default, **bound)

    _saved["initialize"] = original
    deepspeed.initialize = initialize
    trainer = sys.modules.get("transformers.trainer")
    if trainer is None:
        try:
            import transformers.trainer as trainer
        except ImportError:
            return
    _saved["_load_rng_state"] = trainer.Trainer._load_rng_state
    trainer.Trainer._load_rng_state = _load_rng_state_any_world(trainer.Trainer._load_rng_state)


def uninstall() -> None:
    """Give `deepspeed.initialize` (and the Trainer's RNG restore) back their original behaviour."""
    if "initialize" in _saved:
        deepspeed.initialize = _saved.pop("initialize")
    if "_load_rng_state" in _saved:
        import transformers.trainer as trainer

        trainer.Trainer._load_rng_state = _saved.pop("_load_rng_state")


def installed() -> bool:
    """Whether `install()` is in effect."""
    return "initialize" in _saved


def saved_rng_file(checkpoint: str, process_index: int, world_size: int) -> str | None:
    """The Trainer RNG file a process should restore at this world size: its own, else saved process i mod n."""
    own = os.path.join(checkpoint, f"rng_state_{process_index}.pth" if world_size > 1 else "rng_state.pth")
    if os.path.isfile(own):
        return own
    saved = sorted(int(m.group(1)) for f in os.listdir(checkpoint) if (m := re.fullmatch(r"rng_state_(\d+)\.pth", f)))
    if saved:
        return os.path.join(checkpoint, f"rng_state_{saved[process_index % len(saved)]}.pth")
    single = os.path.join(checkpoint, "rng_state.pth")
    return single if os.path.isfile(single) else None


def _load_rng_state_any_world(original: Any) -> Any:
    @functools.wraps(original)
    def _load_rng_state(self: Any, checkpoint: str | None) -> None:
        if checkpoint is None:
            return original(self, checkpoint)
        index, world = self.args.process_index, self.args.world_size
        found = saved_rng_file(checkpoint, index, world)
        wanted = f"rng_state_{index}.pth" if world > 1 else "rng_state.pth"
        if found is None or os.path.basename(found) == wanted:
            return original(self, checkpoint)
        log.info("ucp: process %d restores the RNG state saved as %s (saved at another world size)",
                 index, os.path.basename(found))
        with tempfile.TemporaryDirectory() as tmp:  # the Trainer's own restore, which knows every device type
            os.symlink(found, os.path.join(tmp, wanted))
            return original(self, tmp)

    return _load_rng_state
