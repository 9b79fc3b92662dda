"""Whether an engine's training state is whole: a load that failed while writing it closes the gate.

A restore writes into the engine only after every rank has read and checked its share, so a refused
load leaves the engine as it was. Two writes cannot be staged: DeepSpeed's own load (same layout),
which reads and writes as it goes, and ZeRO-3 with NVMe optimizer offload, whose state does not fit in
memory. If one of those fails part-way, the engine holds a state that is neither its own nor the
checkpoint's; the gate then refuses every step and save until a load succeeds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ucp_deepspeed.errors import CheckpointError


class Gate:
    """Open while the engine's state is whole; closed by a load that failed while writing it."""

    def __init__(self) -> None:
        self.broken: str | None = None  # the checkpoint whose load failed part-way

    @contextlib.contextmanager
    def writing(self, source: str) -> Iterator[None]:
        """Around writing a checkpoint's state into the engine: on success the gate opens, on failure it closes."""
        self.broken = source
        yield
        self.broken = None

    def check(self, action: str) -> None:
        """Refuse `action` (a step or a save) while the engine's state is partly overwritten."""
        if self.broken is not None:
            raise CheckpointError(
                self.broken,
                f"a load of this checkpoint failed after it had started writing into the engine, whose state is "
                f"now partly overwritten; refusing to {action} until a load_checkpoint succeeds",
            )
