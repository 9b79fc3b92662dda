"""Read a tensor from one of DeepSpeed's NVMe swap files, checked against the size and CRCs recorded at save.

ZeRO-3 with `offload_optimizer: nvme` keeps a sub-group's fp32 partition and each of its optimizer states
in a file of its own, `<ds_id>.tensor.swp`: the raw elements, then padding up to the I/O alignment; no
header. The optimizer file holds an empty tensor in its place. A save copies these files next to the
optimizer files (`offloaded_tensors/rank<NN>/`), and ucp_deepspeed records each one's element count,
byte size and one CRC-32 per MiB beside them (`format.swap`), since the files themselves carry nothing
to check. A read checks only the blocks it covers, each once.
"""

from __future__ import annotations

import math
import os
import stat
import threading

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.checksum import BLOCK, block_crcs

_SPAN = 16 * BLOCK  # read and check up to 16 blocks at a time


def file_block_crcs(path: str) -> list[int]:
    """CRC-32 of each 1 MiB block of a file, read in 16 MiB pieces."""
    out: list[int] = []
    with open(path, "rb") as f:
        while chunk := f.read(_SPAN):
            out += block_crcs(chunk)
    return out


class SwapTensor:
    """A 1-D tensor in a swap file, read by element range like `torch_file.LazyTensor`.

    The file must be a regular file (not a link) of the recorded size; each 1 MiB block a read touches
    is checked against its recorded CRC-32 the first time it is read.
    """

    def __init__(
        self, path: str, dtype: torch.dtype, numel: int, nbytes: int, blocks: list[int], verify: bool = True
    ) -> None:
        self.path, self.dtype, self.nbytes, self.blocks, self.verify = path, dtype, nbytes, blocks, verify
        self.shape = (numel,)
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * self._itemsize > nbytes:
            raise CheckpointError(path, f"recorded as {nbytes} bytes, too small for {numel} {dtype} elements")
        if len(blocks) != -(-nbytes // BLOCK):
            raise CheckpointError(path, f"recorded with {len(blocks)} block CRCs for {nbytes} bytes")
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    def numel(self) -> int:
        """Number of elements, like `torch.Tensor.numel`."""
        return math.prod(self.shape)

    def _open(self) -> int:
        """The file, opened without following a link, after checking it is a regular file of the recorded size."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise CheckpointError(self.path, f"swap file cannot be opened ({exc.strerror})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != self.nbytes:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes"
            raise CheckpointError(self.path, f"swap file is {what}, the save recorded {self.nbytes} bytes")
        return fd

    def _pread(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(self.path, "swap file ended before the recorded size")
            done += got

    def _read_checked(self, fd: int, dst: memoryview, first: int) -> None:
        """Bytes [first, first+len(dst)) into `dst`, through whole blocks, each checked once."""
        end = first + len(dst)
        start = first // BLOCK * BLOCK
        while start < end:
            stop = min(start + _SPAN, math.ceil(end / BLOCK) * BLOCK, self.nbytes)
            span = bytearray(stop - start)
            self._pread(fd, memoryview(span), start)
            for i, crc in enumerate(block_crcs(memoryview(span))):
                block = start // BLOCK + i
                if block not in self._checked:
                    if crc != self.blocks[block]:
                        raise CheckpointError(
                            self.path,
                            f"block {block} (bytes {block * BLOCK}-{min((block + 1) * BLOCK, self.nbytes) - 1}) "
                            "fails its CRC-32 recorded at save (damaged or replaced)",
                        )
                    with self._lock:
                        self._checked.add(block)
            lo, hi = max(start, first), min(stop, end)
            dst[lo - first : hi - first] = span[lo - start : hi - start]
            start = stop

    def read(self, start: int = 0, numel: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read elements [start, start+numel), into `out` if given."""
        total = self.numel()
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(self.path, f"read of [{start}, {start + numel}) outside tensor of {total} elements")
        if out is None:
            out = torch.empty(numel, dtype=self.dtype)
        fd = self._open()
        try:
            if numel:
                view = memoryview(out.view(torch.uint8).numpy().data).cast("B")
                offset = start * self._itemsize
                if self.verify:
                    self._read_checked(fd, view, offset)
                else:
                    self._pread(fd, view, offset)
        finally:
            os.close(fd)
        return out

    def load(self) -> torch.Tensor:
        """Read the whole tensor."""
        return self.read()

    def check(self) -> None:
        """Raise unless the whole file, padding included, has the recorded size and CRCs."""
        fd = self._open()
        try:
            for first in range(0, self.nbytes, _SPAN):
                self._read_checked(fd, memoryview(bytearray(min(_SPAN, self.nbytes - first))), first)
        finally:
            os.close(fd)
