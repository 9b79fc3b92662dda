"""Row-wise quantization of embedding rows for Check-N-Run checkpoints (Eisenman et al., NSDI'22).

Every row of a table is quantized on its own, with `bits` in {2, 3, 4, 8}:

- `symmetric`: levels spaced `scale = max|x| / (2^(b-1) - 1)` around zero; error <= scale / 2.
- `asymmetric`: `2^b` levels from the row's min to its max; error <= scale / 2 with
  `scale = (max - min) / (2^b - 1)`.
- `adaptive`: asymmetric over a range shrunk from either end, the shrink chosen per row (from a
  fixed grid that includes no shrink) to minimise the row's L2 error. Its L2 error is therefore
  never above `asymmetric`'s; outliers are clipped to the range.
- `kmeans`: non-uniform, `2^b` centroids per row found by Lloyd's iterations started from the
  asymmetric levels. Lloyd's iterations never increase the squared error, so its L2 error is never
  above `asymmetric`'s either.

Codes are bit-packed, so a row of D values costs ceil(D * b / 8) bytes plus its per-row parameters
(scale and offset, or the centroids), kept in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("symmetric", "asymmetric", "adaptive", "kmeans")
BITS = (2, 3, 4, 8)
_SHRINK = torch.tensor([0.0, 0.05, 0.1, 0.15, 0.2, 0.3])  # fraction of the range cut from each end
_KMEANS_ITERS = 8
_CHUNK_ROWS = 4096  # a multiple of 8, so every chunk's packed codes end on a byte boundary


@dataclass(frozen=True)
class Quantized:
    """Packed codes of a (rows, dim) block and what is needed to decode them."""

    method: str
    bits: int
    shape: tuple[int, int]
    codes: torch.Tensor  # uint8, bit-packed row-major codes
    params: torch.Tensor  # fp32 per row: (scale,) | (scale, offset) | centroids

    def tensors(self) -> dict[str, torch.Tensor]:
        """What goes into the checkpoint file."""
        return {"codes": self.codes, "params": self.params}

    @property
    def nbytes(self) -> int:
        """Bytes stored for this block."""
        return self.codes.numel() + self.params.numel() * 4


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) into a uint8 bitstream, `bits` per code."""
    flat = codes.reshape(-1).to(torch.int64)
    if bits == 8:
        return flat.to(torch.uint8)
    shifts = torch.arange(bits - 1, -1, -1)
    stream = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
    return (stream.reshape(-1, 8) << torch.arange(7, -1, -1)).sum(1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack`: the first `count` codes, as int64."""
    if bits == 8:
        return packed[:count].to(torch.int64)
    stream = ((packed.to(torch.int64).unsqueeze(1) >> torch.arange(7, -1, -1)) & 1).reshape(-1)
    stream = stream[: count * bits].reshape(count, bits)
    return (stream << torch.arange(bits - 1, -1, -1)).sum(1)


def _uniform(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-row scale of asymmetric quantization of rows `x` onto [lo, hi]."""
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((x - lo.unsqueeze(1)) / scale.unsqueeze(1)).clamp_(0, levels)
    return codes, scale


def _asym_decode(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return codes * scale.unsqueeze(1) + lo.unsqueeze(1)


def quantize(x: torch.Tensor, bits: int, method: str) -> Quantized:
    """Quantize each row of a 2-D fp32 block, a chunk of rows at a time to bound memory."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    x = x.detach().to(torch.float32).reshape(x.shape[0], -1)
    codes, params = [], []
    for chunk in x.split(_CHUNK_ROWS):
        c, p = _quantize_rows(chunk, bits, method)
        codes.append(pack(c, bits))
        params.append(p)
    empty = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 1)
    return Quantized(
        method,
        bits,
        (x.shape[0], x.shape[1]),
        torch.cat(codes) if codes else empty[0],
        torch.cat(params).contiguous() if params else empty[1],
    )


def _quantize_rows(x: torch.Tensor, bits: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    if method == "symmetric":
        half = 2 ** (bits - 1) - 1
        scale = (x.abs().amax(1) / half).clamp_min(torch.finfo(torch.float32).tiny)
        return torch.round(x / scale.unsqueeze(1)).clamp_(-half, half) + half, scale.unsqueeze(1)
    if method == "adaptive":
        return _adaptive(x, bits)
    lo, hi = x.amin(1), x.amax(1)
    codes, scale = _uniform(x, lo, hi, bits)
    if method == "asymmetric":
        return codes, torch.stack([scale, lo], 1)
    levels = _asym_decode(torch.arange(2**bits, dtype=torch.float32).expand(x.shape[0], -1), scale, lo)
    return _kmeans(x, levels, codes.to(torch.int64))


def _adaptive(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric quantization on the per-row shrunken range [lo, hi] with the least L2 error."""
    lo, hi = x.amin(1), x.amax(1)
    span = hi - lo
    best_err = torch.full((x.shape[0],), float("inf"))
    best_lo, best_hi = lo.clone(), hi.clone()
    for cut_lo in _SHRINK:
        for cut_hi in _SHRINK:
            if cut_lo + cut_hi >= 0.9:
                continue
            a, b = lo + cut_lo * span, hi - cut_hi * span
            codes, scale = _uniform(x, a, b, bits)
            err = (_asym_decode(codes, scale, a) - x).pow(2).sum(1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, a, best_lo), torch.where(better, b, best_hi)
    codes, scale = _uniform(x, best_lo, best_hi, bits)
    return codes, torch.stack([scale, best_lo], 1)


def _kmeans(x: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's iterations per row from the given centroids and assignment (which must be nearest-centroid)."""
    for _ in range(_KMEANS_ITERS):
        sums = torch.zeros_like(centroids).scatter_add_(1, codes, x)
        counts = torch.zeros_like(centroids).scatter_add_(1, codes, torch.ones_like(x))
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
        codes = (x.unsqueeze(2) - centroids.unsqueeze(1)).abs().argmin(2)
    return codes, centroids


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 (rows, dim) block a `Quantized` stands for."""
    rows, dim = q.shape
    out = torch.empty(rows, dim)
    per_chunk = _CHUNK_ROWS * dim * q.bits // 8
    for i, start in enumerate(range(0, rows, _CHUNK_ROWS)):
        n = min(_CHUNK_ROWS, rows - start)
        codes = unpack(q.codes[i * per_chunk : (i + 1) * per_chunk], q.bits, n * dim).reshape(n, dim)
        params = q.params[start : start + n]
        if q.method == "symmetric":
            out[start : start + n] = (codes - (2 ** (q.bits - 1) - 1)) * params[:, 0:1]
        elif q.method == "kmeans":
            out[start : start + n] = torch.gather(params, 1, codes)
        else:
            out[start : start + n] = _asym_decode(codes.to(torch.float32), params[:, 0], params[:, 1])
    return out


def row_window(lo: int, hi: int, rows: int, dim: int, bits: int) -> tuple[int, int, int, int]:
    """Rows [first, last) and code bytes [start, end) to decode for rows [lo, hi) of a packed (rows, dim) block.

    Only a chunk's first code starts on a byte, so the window is widened to whole chunks; a range read of a
    quantized table then decodes at most two chunks more than it needs.
    """
    first = lo // _CHUNK_ROWS * _CHUNK_ROWS
    last = min(rows, -(-hi // _CHUNK_ROWS) * _CHUNK_ROWS)
    end = -(-(last * dim * bits) // 8) if last == rows else last * dim * bits // 8
    return first, last, first * dim * bits // 8, end


def from_tensors(method: str, bits: int, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Quantized:
    """Rebuild a `Quantized` from what `Quantized.tensors` stored."""
    return Quantized(method, bits, (int(shape[0]), int(shape[1])), tensors["codes"], tensors["params"])


def error_bound(x: torch.Tensor, bits: int, method: str) -> torch.Tensor:
    """Per-row bound on the max abs error of `symmetric`/`asymmetric` (half a step), for tests and docs."""
    x = x.reshape(x.shape[0], -1).to(torch.float32)
    if method == "symmetric":
        return x.abs().amax(1) / (2 ** (bits - 1) - 1) / 2
    if method == "asymmetric":
        return (x.amax(1) - x.amin(1)) / (2**bits - 1) / 2
    raise ValueError(f"{method} has an L2 bound relative to asymmetric, not a per-element one")


def choose_bits(expected_restores: int, restores_so_far: int = 0) -> int:
    """Bit width for the next checkpoint: fewer expected restores tolerate fewer bits; 8 once exceeded.

    Each restore from a quantized checkpoint adds its error to the weights, so the error budget is
    split over the expected number of restores. Thresholds: 1 restore -> 2 bits, up to 3 -> 3 bits,
    up to 10 -> 4 bits, more -> 8 bits. When more restores have happened than expected, 8 bits.
    """
    if restores_so_far > expected_restores or expected_restores > 10:
        return 8
    if expected_restores <= 1:
        return 2
    return 3 if expected_restores <= 3 else 4
