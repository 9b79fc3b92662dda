"""Read a tensor from one of DeepSpeed's NVMe swap files, checked against the size and CRC-32 recorded at save.

ZeRO-3 with `offload_optimizer: nvme` keeps a sub-group's fp32 partition and each of its optimizer states
in a file of its own, `<ds_id>.tensor.swp`: the raw elements, then padding up to the I/O alignment; no
header. The optimizer file holds an empty tensor in its place. A save copies these files next to the
optimizer files (`offloaded_tensors/rank<NN>/`), and ucp_deepspeed records each one's element count,
byte size and CRC-32 beside them (`format.swap`), since the files themselves carry nothing to check.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.checksum import crc32

_CHUNK = 1 << 24


def file_crc32(path: str) -> int:
    """CRC-32 of a whole file, read in 16 MiB pieces."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = crc32(chunk, value)
    return value


class SwapTensor:
    """A 1-D tensor in a swap file, read by element range like `torch_file.LazyTensor`.

    The whole file is checked (size, then CRC-32) before the first read returns, once per object.
    """

    def __init__(self, path: str, dtype: torch.dtype, numel: int, nbytes: int, crc: int, verify: bool = True):
        self.path, self.dtype, self.nbytes, self.crc, self.verify = path, dtype, nbytes, crc, verify
        self.shape = (numel,)
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * self._itemsize > nbytes:
            raise CheckpointError(path, f"recorded as {nbytes} bytes, too small for {numel} {dtype} elements")
        self._checked = False
        self._lock = threading.Lock()

    def numel(self) -> int:
        """Number of elements, like `torch.Tensor.numel`."""
        return math.prod(self.shape)

    def check(self) -> None:
        """Raise unless the file has the recorded size and CRC-32."""
        with self._lock:
            if self._checked:
                return
            try:
                size = os.path.getsize(self.path)
            except OSError as exc:
                raise CheckpointError(self.path, f"swap file cannot be read ({exc.strerror})") from None
            if size != self.nbytes:
                raise CheckpointError(self.path, f"swap file is {size} bytes, the save recorded {self.nbytes}")
            if self.verify and file_crc32(self.path) != self.crc:
                raise CheckpointError(self.path, "swap file fails its CRC-32 recorded at save (damaged or replaced)")
            self._checked = True

    def read(self, start: int = 0, numel: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read elements [start, start+numel) with one pread, into `out` if given."""
        total = self.numel()
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(self.path, f"read of [{start}, {start + numel}) outside tensor of {total} elements")
        self.check()
        if out is None:
            out = torch.empty(numel, dtype=self.dtype)
        if numel == 0:
            return out
        view = memoryview(out.view(torch.uint8).numpy().data).cast("B")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done, offset, want = 0, start * self._itemsize, numel * self._itemsize
            while done < want:
                got = os.preadv(fd, [view[done:want]], offset + done)
                if got == 0:
                    raise CheckpointError(self.path, "swap file ended before the recorded size")
                done += got
        finally:
            os.close(fd)
        return out

    def load(self) -> torch.Tensor:
        """Read the whole tensor."""
        return self.read()
