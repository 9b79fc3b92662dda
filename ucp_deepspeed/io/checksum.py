"""CRC-32 for everything we read or write, fast enough to check every byte on every load.

One checksum family serves both formats: torch archives are zip files whose directory holds a
CRC-32 per record, and our universal files record a CRC-32 per block. `isal` computes it at memory
speed. Reads that cover a record in pieces, in any order, are checked with `crc32_combine`, which
joins the CRCs of adjacent byte ranges without the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from isal.isal_zlib import crc32

__all__ = ["BLOCK", "BlockHasher", "block_crcs", "combine_pieces", "crc32", "crc32_combine"]

BLOCK = 1 << 20  # universal files carry one CRC per MiB: a read checks at most 2 MiB more than it needs
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial, in reflected bit order (zlib's `multmodp`)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()  # x^(2^k) mod p


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B)."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2 if len2 else crc1


def block_crcs(data: memoryview | bytes, block: int = BLOCK) -> list[int]:
    """CRC-32 of each `block`-sized piece of `data` (the last may be shorter)."""
    view = memoryview(data).cast("B")
    return [crc32(view[i : i + block]) for i in range(0, len(view), block)]


class BlockHasher:
    """CRC-32 of a stream per block and as a whole, fed in pieces of any size as it is written."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.blocks: list[int] = []
        self.total = 0
        self._crc = 0  # of the whole stream
        self._partial = 0  # of the current, unfinished block
        self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        """Account for the next bytes of the stream."""
        view = memoryview(data).cast("B")
        self._crc = crc32(view, self._crc)
        self.total += len(view)
        while len(view):
            take = min(self.block - self._filled, len(view))
            self._partial = crc32(view[:take], self._partial)
            self._filled += take
            view = view[take:]
            if self._filled == self.block:
                self.blocks.append(self._partial)
                self._partial, self._filled = 0, 0

    def finish(self) -> tuple[int, list[int]]:
        """The whole stream's CRC and the per-block CRCs."""
        if self._filled:
            self.blocks.append(self._partial)
            self._partial, self._filled = 0, 0
        return self._crc, self.blocks


def combine_pieces(size: int, pieces: Iterable[tuple[int, int, int]], read: Callable[[int, int], bytes]) -> int:
    """CRC-32 of `size` bytes known as (start, length, crc) pieces; bytes no piece covers are read.

    Pieces may come in any order and overlap; `read(start, length)` fetches what is missing, so a
    record read in full costs no extra IO and padding nobody reads costs only its own bytes.
    """
    crc, pos = 0, 0
    for start, length, piece in sorted(pieces):
        if start + length <= pos:
            continue
        if start > pos or start < pos:  # a gap, or a partial overlap: read up to the piece's end
            end = start if start > pos else start + length
            crc = crc32_combine(crc, crc32(read(pos, end - pos)), end - pos)
            pos = end
            if start < pos:
                continue
        crc = crc32_combine(crc, piece, length)
        pos = start + length
    if pos < size:
        crc = crc32_combine(crc, crc32(read(pos, size - pos)), size - pos)
    return crc
