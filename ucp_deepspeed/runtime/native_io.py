"""DeepSpeed's own checkpoint file IO, made safe: every file a save writes is bound to the save, and
every file a load reads is unpickled without running code and checked byte for byte.

DeepSpeed writes and reads each checkpoint file through its engine's `checkpoint_engine`
(`save(state_dict, path)`, `load(path, map_location)`), for model states, optimizer partitions,
expert and pipeline-layer files alike. `guard` wraps both on the engine instance:

- save: after DeepSpeed's `torch.save`, the file gets the current save id (`torch_file.stamp`),
  which our metadata for the tag also records;
- load: `torch.load(weights_only=True)` with only DeepSpeed's own checkpoint classes allowed
  (and those the user names in `UCP_ALLOW_PICKLE`), reading through `VerifyingReader` so every
  record torch reads is checked against its CRC-32, and refusing a file whose save id differs from
  the one the tag's metadata records.

A record that fails its CRC is noted, not raised, while DeepSpeed's load runs: each rank reads
its own files, and one rank raising in the middle of a load that the others finish would leave
them waiting in a collective. The caller raises the noted problem on every rank afterwards
(`Guard.take_problem`).
"""

from __future__ import annotations

import os
import pickle
import re
from typing import IO, Any, cast

import torch

from ucp_deepspeed.compat import deepspeed_safe_globals, user_safe_globals
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.safe_pickle import hint
from ucp_deepspeed.io.torch_file import VerifyingReader, stamp

_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def safe_load(
    path: str, map_location: Any = None, save_id: str = "", verify: bool = True, on_damage: Any = None
) -> Any:
    """`torch.load` that runs no code from the file, checks every record it reads, and (given one) the save id.

    A damaged record raises, or is passed to `on_damage(error)` if given (the load then completes).
    """
    reader = VerifyingReader(path, verify)
    try:
        if save_id and reader.save_id != save_id:
            found = f"save id {reader.save_id}" if reader.save_id else "no save id"
            raise CheckpointError(
                path,
                f"belongs to another save: it carries {found}, and the metadata of this "
                f"tag records save id {save_id} (a file copied from another run or step?)",
            )
        try:
            with torch.serialization.safe_globals(deepspeed_safe_globals() + user_safe_globals()):
                obj = torch.load(cast(IO[bytes], reader), map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            match = _UNSUPPORTED.search(str(exc))
            reason = hint(*match.group(1).rsplit(".", 1)) if match else f"cannot unpickle ({str(exc)[:300]})"
            raise CheckpointError(path, reason) from None
        except (RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(path, f"truncated or corrupt torch file ({str(exc)[:300]})") from None
        if verify:
            try:
                reader.check()
            except CheckpointError as exc:
                if on_damage is None:
                    raise
                on_damage(exc)
        return obj
    finally:
        reader.close()


class Guard:
    """What the wrapped checkpoint engine needs to know: the save in progress, and each tag's save id."""

    def __init__(self, verify: bool):
        self.verify = verify
        self.save_id = ""
        self.expected: dict[str, str] = {}  # tag folder -> save id its metadata records
        self.problem: CheckpointError | None = None  # the first damaged record a load read

    def damaged(self, exc: CheckpointError) -> None:
        """Note a damaged record read during a load; the first one is kept."""
        self.problem = self.problem or exc

    def take_problem(self) -> CheckpointError | None:
        """The damage noted since the last call, if any."""
        problem, self.problem = self.problem, None
        return problem

    def expect(self, tag_dir: str, save_id: str) -> None:
        """Files read from `tag_dir` must carry `save_id` (empty: the save recorded none)."""
        self.expected[os.path.realpath(tag_dir)] = save_id


def guard(engine: Any, verify: bool = True) -> Guard:
    """Wrap the engine's checkpoint engine (on the instance) so saves bind and loads check; returns the guard."""
    ce = engine.checkpoint_engine
    if getattr(ce, "ucp_guard", None) is not None:
        return ce.ucp_guard
    if getattr(ce, "zipfile_serialization", True) is False:
        raise NotImplementedError(
            "universal checkpointing reads torch's zip archives; remove "
            '"checkpoint_serialization": false from the DeepSpeed config'
        )
    state = Guard(verify)
    own_save = ce.__dict__.get("save")  # an instance-level save someone installed before us, else the class's

    def save(state_dict: Any, path: str) -> None:
        (own_save or type(ce).save.__get__(ce))(state_dict, path)
        if state.save_id and not getattr(ce, "stamps_itself", False):
            stamp(path, state.save_id)

    def load(path: str, map_location: Any = None) -> Any:
        expected = state.expected.get(os.path.realpath(os.path.dirname(path)), "")
        return safe_load(path, map_location, expected, state.verify, state.damaged)

    ce.save, ce.load, ce.ucp_guard = save, load, state
    return state
