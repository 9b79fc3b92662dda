"""Universal checkpointing for engines that other code creates: HF Trainer, Accelerate, TRL, Lightning, any library.

Those frameworks call `deepspeed.initialize` themselves, so `install()` replaces that function
with ours. Every engine created afterwards saves ucp metadata and reshards on load, with no change
to the training script. A config may still say `"checkpoint": {"universal": false}`, or give
options. Accelerate looks `deepspeed.initialize` up at call time; code that imported the function
by name before `install()` keeps DeepSpeed's own.

HF Trainer and Accelerate also keep one RNG file per process (`rng_state_<i>.pth`, or
`rng_state.pth` for one process; `random_states_<i>.pkl`, which also holds Accelerate's step
count). At a larger world size the new processes would find none and keep their seeded state, and
an Accelerate process would also keep step 0 while the others continue. `install()` lets such a
process restore the files of saved process `i mod n` instead (the step count with it), and then
re-seeds its generators from that state and its own index (`rng.reseed_process`): two processes
never continue on one stream. A process whose own file exists restores it as saved.

PyTorch Lightning's `DeepSpeedStrategy` never waits for a checkpoint: `install()` has its teardown commit an
asynchronous save still being written, which the process would otherwise leave uncommitted.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import tempfile
from typing import Any

import deepspeed

from ucp_deepspeed import compat
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime import engine, rng
from ucp_deepspeed.runtime.checkpointer import checkpointer_of
from ucp_deepspeed.runtime.config import UniversalConfig

log = logging.getLogger("ucp_deepspeed")

_saved: dict[str, tuple[Any, str, Any]] = {}  # what install() replaced: key -> (owner, attribute, original)


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

    _replace("initialize", deepspeed, "initialize", initialize)
    for key, hook, widen in (
        ("trainer_rng", compat.trainer_rng_restore(), _load_rng_state_any_world),
        ("accelerate_state", compat.accelerate_state_restore(), _load_accelerator_state_any_world),
    ):
        if hook is not None:
            _replace(key, hook.owner, hook.name, widen(getattr(hook.owner, hook.name)))
    strategy = compat.lightning_deepspeed_strategy()
    if strategy is not None:  # Lightning never waits for an asynchronous save
        _replace("lightning_teardown", strategy, "teardown", _commit_at_teardown(strategy.teardown))


def uninstall() -> None:
    """Give `deepspeed.initialize` and the frameworks' RNG restores back their original behaviour."""
    for key in list(_saved):
        owner, attribute, original = _saved.pop(key)
        setattr(owner, attribute, original)


def _replace(key: str, owner: Any, attribute: str, new: Any) -> None:
    _saved[key] = (owner, attribute, getattr(owner, attribute))
    setattr(owner, attribute, new)


def installed() -> bool:
    """Whether `install()` is in effect."""
    return "initialize" in _saved


def saved_process_index(directory: str, stem: str, suffix: str, process_index: int) -> int | None:
    """Whose per-process file `<stem>_<i><suffix>` a process restores: its own, else saved process i mod n's."""
    pattern = re.compile(rf"{re.escape(stem)}_(\d+){re.escape(suffix)}")
    saved = sorted(int(m.group(1)) for f in st.listdir(directory) if (m := pattern.fullmatch(f)))
    if not saved:
        return None
    return process_index if process_index in saved else saved[process_index % len(saved)]


def saved_rng_file(checkpoint: str, process_index: int, world_size: int) -> str | None:
    """The Trainer RNG file a process should restore at this world size: its own, else saved process i mod n."""
    single = st.join(checkpoint, "rng_state.pth")
    if world_size == 1 and st.isfile(single):
        return single
    index = saved_process_index(checkpoint, "rng_state", ".pth", process_index)
    if index is not None:
        return st.join(checkpoint, f"rng_state_{index}.pth")
    return single if st.isfile(single) else None


def _load_rng_state_any_world(original: Any) -> Any:
    @functools.wraps(original)
    def _load_rng_state(self: Any, checkpoint: str | None) -> None:
        if checkpoint is None:
            return original(self, checkpoint)
        index, world = self.args.process_index, self.args.world_size
        found = saved_rng_file(checkpoint, index, world)
        wanted = f"rng_state_{index}.pth" if world > 1 else "rng_state.pth"
        if found is None or st.basename(found) == wanted:
            return original(self, checkpoint)
        saved_index = int(st.basename(found).removeprefix("rng_state").removesuffix(".pth").lstrip("_") or 0)
        log.info(
            "ucp: process %d restores the RNG state saved as %s (saved at another world size)%s",
            index,
            st.basename(found),
            "" if saved_index == index else ", then re-seeds from it: no two processes share a stream",
        )
        with tempfile.TemporaryDirectory() as tmp:  # the Trainer's own restore, which knows every device type
            os.symlink(found, os.path.join(tmp, wanted))
            original(self, tmp)
        if saved_index != index:
            rng.reseed_process(index)

    return _load_rng_state


def _load_accelerator_state_any_world(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_accelerator_state(*args: Any, **kwargs: Any) -> dict:
        bound = signature.bind(*args, **kwargs)
        directory, index = os.fspath(bound.arguments["input_dir"]), bound.arguments["process_index"]
        found = saved_process_index(directory, "random_states", ".pkl", index) if st.isdir(directory) else None
        if found is not None and found != index:
            log.info(
                "ucp: process %d restores the random states saved as random_states_%d.pkl (saved at "
                "another world size)",
                index,
                found,
            )
            bound.arguments["process_index"] = found  # accelerate uses it only to name that file
            loaded = original(*bound.args, **bound.kwargs)
            rng.reseed_process(index)
            return loaded
        return original(*bound.args, **bound.kwargs)

    return load_accelerator_state


def _commit_at_teardown(original: Any) -> Any:
    """Lightning's `DeepSpeedStrategy.teardown`, after committing an asynchronous save still being written (Lightning
    never calls `wait_for_checkpoint`; the process would exit with it uncommitted). Only at the end of a run that
    ended normally: after an error another rank may be gone, and nothing waits on it."""

    @functools.wraps(original)
    def teardown(self: Any) -> Any:
        checkpointer = checkpointer_of(compat.strategy_engine(self))
        if checkpointer is not None and compat.run_ended_normally(self):
            checkpointer.wait()
        return original(self)

    return teardown
