"""A global that hostile test pickles name: calling or building it records that code from a file ran."""

from __future__ import annotations

import os
from typing import Any

ENV = "UCP_TEST_CANARY"


def fire(*_args: Any, **_kwargs: Any) -> int:
    """Record a call in the file `$UCP_TEST_CANARY` names."""
    with open(os.environ[ENV], "a") as f:
        f.write("fired\n")
    return 0


class Boom:
    """Fires when constructed or given state."""

    def __new__(cls, *args: Any) -> Boom:
        fire()
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        fire()
