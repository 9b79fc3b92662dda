"""DeepSpeed's FastPersist writer (`"checkpoint": {"writer": {"type": "fast"}}`) on the CPU, for tests.

DeepSpeed 0.19.8's writer factory pins its IO buffer with `Tensor.pin_memory()`, which needs an accelerator ("Cannot
access accelerator device when none is available"), and each `FastFileWriter` loads the `UtilsBuilder` op for
`cast_to_byte_tensor`, which only the storage-splitting path uses (torch 2.13 never takes it). Both are lifted here
and nothing else: the async_io op writes every byte with O_DIRECT through the double buffer, as on a GPU host.
Apply before the engine is built; a process spawned by a decoupled writer needs them too (`UCP_TEST_FASTPERSIST=1`
makes tests/site/sitecustomize.py apply them at its start).
"""

from __future__ import annotations

from typing import Any

import torch

FAST = {"type": "fast", "io_buffer_size": 1 << 20, "data_parallel": "replica"}


class _Utils:
    """`UtilsBuilder().load()`'s one function FastFileWriter takes: tensors viewed as their bytes."""

    @staticmethod
    def cast_to_byte_tensor(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.contiguous().view(torch.uint8).flatten() for t in tensors]


class _UtilsBuilder:
    def load(self) -> _Utils:
        return _Utils()


def shims() -> list[tuple[Any, str, Any]]:
    """(object, attribute, value) for each patch FastPersist needs on the CPU."""
    import deepspeed.io.fast_file_writer as fast_file_writer

    return [
        (torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self),
        (fast_file_writer, "UtilsBuilder", _UtilsBuilder),
    ]


def enable() -> None:
    """Apply the shims for the rest of this process (a launched worker's)."""
    for target, name, value in shims():
        setattr(target, name, value)
