"""Shims that let megatron-core 0.16+ train on a CPU with gloo (the demo, the tests, a laptop).

megatron-core assumes CUDA in a few places that have no CPU fallback :
the RNG tracker that attention always enters, `GlobalMemoryBuffer.get_tensor`, RoPE's move of its
frequencies to `torch.cuda.current_device()`, a `.cuda()` call when a tied output layer is set
up on the last pipeline stage, and MoE's reference to Transformer Engine's GEMM on 0.16. Nothing here is imported by
the library; the launch scripts call `install()` only when no GPU is present.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DATA_PARALLEL_RNG = "data-parallel-rng"
MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class CpuRngTracker:
    """megatron-core's RNG tracker interface, keeping one CPU generator state per name."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class CpuMemoryBuffer:
    """`GlobalMemoryBuffer` without `torch.cuda.current_device()`."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
        numel = 1
        for n in tensor_shape:
            numel *= n
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(*tensor_shape)


def seed(base: int) -> None:
    """CPU stand-in for `model_parallel_cuda_manual_seed`: the same three named streams, same offsets."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRngTracker()
    tracker.add(DATA_PARALLEL_RNG, base)
    tracker.add(MODEL_PARALLEL_RNG, base + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(
        EXPERT_PARALLEL_RNG,
        base + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(base)


def sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron-core's sliding-window mask (True = masked) without its `device="cuda"`: each query sees the keys
    from `window_size[0]` before it to `window_size[1]` after it."""
    keep = torch.ones(sq, skv, dtype=torch.bool)
    keep = torch.triu(keep, diagonal=skv - sq - window_size[0])
    return ~torch.tril(keep, diagonal=skv - sq + window_size[1])


def install() -> None:
    """Swap megatron-core's CUDA-only helpers for CPU ones; call after initialize_model_parallel."""
    from megatron.core import parallel_state as ps
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import moe_utils

    ps._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    fused_softmax.get_sliding_window_causal_mask = sliding_window_mask
    if not hasattr(moe_utils, "te_general_gemm"):  # referenced without Transformer Engine on 0.16 (fixed in 0.19)
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # RoPE moves its inverse frequencies to "the" device


@contextlib.contextmanager
def cpu_model_construction() -> Iterator[None]:
    """Make `.cuda()` a no-op while a model is built (the tied output layer of the last stage calls it)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
