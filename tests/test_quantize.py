"""Row-wise checkpoint quantization: each method meets its stated error bound at every bit width."""

from __future__ import annotations

import pytest
import torch

from ucp_deepspeed.checkn_run.quantize import (
    BITS,
    METHODS,
    choose_bits,
    dequantize,
    error_bound,
    from_tensors,
    pack,
    quantize,
    row_window,
    unpack,
)


def _rows(n: int = 5000, dim: int = 24) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(n, dim) * torch.rand(n, 1) * 3 + torch.randn(n, 1)
    x[0] = 0.0  # a constant row
    x[1, 3] = 40.0  # an outlier, which the adaptive method may clip
    return x


@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip(bits):
    codes = torch.randint(0, 2**bits, (1001,))
    assert torch.equal(unpack(pack(codes, bits), bits, 1001), codes)
    assert pack(codes, bits).numel() == -(-1001 * bits // 8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("method", ["symmetric", "asymmetric"])
def test_uniform_error_is_at_most_half_a_step(method, bits):
    x = _rows()
    q = quantize(x, bits, method)
    err = (dequantize(q) - x).abs().amax(1)
    bound = error_bound(x, bits, method)
    assert (err <= bound * (1 + 1e-5) + 1e-6).all(), (err - bound).max()
    assert torch.equal(dequantize(q)[0], torch.zeros(x.shape[1]))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("method", ["adaptive", "kmeans"])
def test_adaptive_and_kmeans_never_worse_than_asymmetric(method, bits):
    x = _rows(n=1200 if method == "kmeans" else 5000)
    l2 = (dequantize(quantize(x, bits, method)) - x).pow(2).sum(1)
    l2_asym = (dequantize(quantize(x, bits, "asymmetric")) - x).pow(2).sum(1)
    assert (l2 <= l2_asym * (1 + 1e-5) + 1e-9).all()
    if method == "adaptive" and bits <= 3:
        assert l2.sum() < 0.9 * l2_asym.sum(), "shrinking the range pays off on heavy-tailed rows"


@pytest.mark.parametrize("method", METHODS)
def test_stored_tensors_rebuild_the_block(method):
    x = _rows(n=100)
    q = quantize(x, 3, method)
    again = from_tensors(method, 3, q.shape, q.tensors())
    assert torch.equal(dequantize(again), dequantize(q))
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == -(-100 * 24 * 3 // 8)


def test_bits_follow_expected_restores_and_fall_back_to_8():
    assert [choose_bits(n) for n in (1, 2, 3, 5, 10, 11)] == [2, 3, 3, 4, 4, 8]
    assert choose_bits(5, restores_so_far=5) == 4
    assert choose_bits(5, restores_so_far=6) == 8


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(2, 2), 5, "adaptive")
    with pytest.raises(ValueError, match="method"):
        quantize(torch.zeros(2, 2), 4, "log")


@pytest.mark.parametrize("method", METHODS)
def test_a_window_of_rows_decodes_as_the_whole_block_does(method):
    """A range read of a quantized table decodes only the chunks its rows fall in (5 codes of 3 bits a row: rows
    do not start on bytes, chunks do), and gets exactly the rows a whole decode gives."""
    x = torch.randn(9000, 5)
    q = quantize(x, 3, method)
    whole = dequantize(q)
    for lo, hi in [(0, 1), (4095, 4097), (4096, 8192), (100, 9000), (8999, 9000), (5000, 5000)]:
        first, last, start, end = row_window(lo, hi, 9000, 5, 3)
        assert first <= lo <= hi <= last and end <= q.codes.numel()
        part = from_tensors(method, 3, (last - first, 5), {"codes": q.codes[start:end], "params": q.params[first:last]})
        assert torch.equal(dequantize(part)[lo - first : hi - first], whole[lo:hi]), (lo, hi)
