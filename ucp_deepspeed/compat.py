"""Every reach into DeepSpeed's internals that reading and writing its files needs, each named once.

`tests/test_compat.py` has a canary per function: a DeepSpeed upgrade that moves one of these
fails there by name, not somewhere inside a multi-rank reshard test.
"""
from __future__ import annotations

import importlib
from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.safe_pickle import DEEPSPEED_CLASSES, PickledObject, user_allowed

ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def _class(qualname: str) -> Any:
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed pickles into its checkpoint files, for `torch.load(weights_only=True)`."""
    return [_class(q) for q in (*DEEPSPEED_CLASSES, ZERO_STAGE_ENUM)]


def user_safe_globals() -> list[Any]:
    """The globals a user trusts (`UCP_ALLOW_PICKLE`), imported by exact name."""
    out = []
    for qualname in sorted(user_allowed()):
        module, _, name = qualname.rpartition(".")
        if not module or not name.isidentifier():
            raise CheckpointError("UCP_ALLOW_PICKLE", f"{qualname!r} is not module.Name")
        out.append(getattr(importlib.import_module(module), name))
    return out


def rebuild(value: Any) -> Any:
    """A real DeepSpeed object from a stand-in (`PickledObject`) or its plain-data form; anything else as is.

    Only the classes in `DEEPSPEED_CLASSES` are built, the way pickle would build them: `__new__`,
    then the saved attributes.
    """
    if isinstance(value, PickledObject):
        qualname, args, state = value.qualname, value.args, value.state
    elif isinstance(value, dict) and set(value) == {"__class__", "args", "state"}:
        qualname, args, state = value["__class__"], tuple(value["args"]), value["state"]
    else:
        return value
    if qualname not in DEEPSPEED_CLASSES:
        raise CheckpointError(qualname, "is not a class ucp_deepspeed rebuilds")
    cls = _class(qualname)
    obj = cls.__new__(cls, *args)
    if isinstance(state, dict):
        obj.__dict__.update(state)
    return obj
