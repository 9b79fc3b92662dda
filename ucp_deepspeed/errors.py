"""The one exception type the library raises for bad checkpoints: it always names the file."""

from __future__ import annotations

import os


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, damaged, or does not match what it should hold."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.path, self.reason)  # rebuilt whole in the process that receives it
