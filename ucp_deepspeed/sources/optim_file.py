"""Read one rank's ZeRO optimizer file: flat fp32 partitions, optimizer states, hyperparameters.

ZeRO-1/2 (`DeepSpeedZeroOptimizer`, `BF16_Optimizer`) and ZeRO-3 store the same things under
different keys; `OptimRankFile` hides that so the converter sees one shape of data: per flat
buffer, a 1-D tensor for the fp32 master and for each per-element optimizer state. A ZeRO-3
sub-group swapped to NVMe is an empty tensor in the file; its elements come from the swap files
the save recorded (`format.swap`).
"""

from __future__ import annotations

from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.swap import SwapRecord
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.swap_file import SwapTensor
from ucp_deepspeed.io.torch_file import LazyTensor, StorageSpan, TorchFile, materialize, plain
from ucp_deepspeed.sources.keys import OPTIMIZER_WRAPPER_KEYS

_TENSORS = (LazyTensor, SwapTensor)


def _swap_tensor(folder: str, record: SwapRecord, file: str, verify: bool) -> SwapTensor:
    entry = record.files[file]
    return SwapTensor(f"{folder}/{file}", getattr(torch, record.dtype), entry.numel, entry.nbytes, entry.blocks, verify)


class OptimRankFile(st.Closeable):
    """The optimizer file of one data-parallel rank, opened lazily."""

    def __init__(
        self, path: str, zero_stage: int, verify: bool = True, swap: tuple[str, SwapRecord] | None = None
    ) -> None:
        self.path = path
        self.zero_stage = zero_stage
        self._file = TorchFile(path, verify)
        self.save_id = self._file.save_id
        try:
            self._parse(self._file.obj, swap, verify)
        except CheckpointError:
            self._file.close()
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            self._file.close()
            raise CheckpointError(path, f"malformed ZeRO-{zero_stage} optimizer state ({str(exc)[:200]})") from None

    def _parse(self, top: Any, swap: tuple[str, SwapRecord] | None, verify: bool) -> None:
        path, zero_stage = self.path, self.zero_stage
        sd = top.get("optimizer_state_dict") if isinstance(top, dict) else None
        if not isinstance(sd, dict):
            raise CheckpointError(path, "no 'optimizer_state_dict' entry; not a DeepSpeed ZeRO optimizer file")
        self._sd = sd
        try:
            if zero_stage == 3:
                self._flat_fp32 = sd["fp32_flat_groups"]
                base = sd["optimizer_state_dict"]
            else:
                self._flat_fp32 = sd["single_partition_of_fp32_groups"]
                base = sd["base_optimizer_state"]
        except KeyError as exc:
            raise CheckpointError(path, f"missing key {exc} for a ZeRO-{zero_stage} optimizer file") from None
        if isinstance(base, list):  # elastic ZeRO-1/2 form: one lean state dict per group, no hyperparameters
            self._states = list(base)
            self._hyperparams = None
        else:
            states = base["state"]
            self._states = [states.get(i, {}) for i in range(len(self._flat_fp32))]
            self._hyperparams = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
            self._flat_to_group = {i: g for g, group in enumerate(base["param_groups"]) for i in group["params"]}
        if zero_stage == 3:
            self._flat_fp32 = list(self._flat_fp32)
            self._swapped_in(swap, verify)

    def _swapped_in(self, swap: tuple[str, SwapRecord] | None, verify: bool) -> None:
        """Put each swapped sub-group's recorded swap files in place of its empty tensors."""
        for index, flat in enumerate(self._flat_fp32):
            if not (isinstance(flat, LazyTensor) and flat.swap_id and flat.numel() == 0):
                continue
            name = f"{flat.swap_id}.tensor.swp"
            if swap is None or name not in swap[1].files:
                where = f"{swap[0]}/{name}" if swap else f"offloaded_tensors/rank<NN>/{name}"
                raise CheckpointError(
                    self.path,
                    f"sub-group {index} was swapped to NVMe and {where} is not recorded by ucp_deepspeed "
                    "(saved without it, or its swap folder is missing): its fp32 weights cannot be read",
                )
            folder, record = swap
            if record.save_id != (self.save_id or ""):
                raise CheckpointError(
                    f"{folder}/ucp_swap_files.json",
                    f"belongs to save {record.save_id or '(none)'}, {self.path} to {self.save_id or '(none)'}",
                )

            self._flat_fp32[index] = _swap_tensor(folder, record, name, verify)
            state = dict(self._states[index])
            for key, value in state.items():
                if isinstance(value, LazyTensor) and value.swap_id and value.numel() == 0:
                    file = f"{value.swap_id}.tensor.swp"
                    if file not in record.files:
                        raise CheckpointError(
                            self.path, f"state {key} of swapped sub-group {index}: {file} is not recorded"
                        )
                    state[key] = _swap_tensor(folder, record, file, verify)
            self._states[index] = state

    @property
    def num_flat(self) -> int:
        """Number of flat fp32 buffers in this file."""
        return len(self._flat_fp32)

    def flat(self, index: int, state: str) -> LazyTensor | SwapTensor:
        """The 1-D fp32 master (`state == "fp32"`) or optimizer state of flat buffer `index`."""
        if index >= self.num_flat:
            raise CheckpointError(self.path, f"has {self.num_flat} flat buffers, metadata expects index {index}")
        tensor = self._flat_fp32[index] if state == FP32 else self._states[index].get(state)
        if not isinstance(tensor, _TENSORS):
            raise CheckpointError(self.path, f"flat buffer {index} has no state '{state}'")
        return tensor

    def spans(self) -> dict[tuple[int, str], StorageSpan]:
        """Where each flat buffer's fp32 master and per-element states lie in the file, for ranks that read it
        without parsing it (`IndexedArchive`); a state kept elsewhere (NVMe swap files) is left out."""
        found = {
            (index, state): lazy
            for index in range(self.num_flat)
            for state in (FP32, *self.state_keys(index))
            for lazy in [self.flat(index, state)]
            if isinstance(lazy, LazyTensor) and lazy.is_contiguous() and len(lazy.shape) == 1
        }
        self._file.locate(lazy.key for lazy in found.values())
        out = {}
        for where, lazy in found.items():
            name, begin, at = self._file.storage_span(lazy.key, lazy.dtype, lazy.storage_offset, lazy.numel())
            out[where] = StorageSpan(name, begin, at, lazy.numel(), dtype_name(lazy.dtype))
        return out

    def state_keys(self, index: int) -> list[str]:
        """Per-element optimizer state keys of a flat buffer (those shaped like the fp32 master)."""
        return [k for k, v in self._states[index].items() if isinstance(v, _TENSORS) and len(v.shape) == 1]

    def scalars(self, index: int) -> dict[str, Any]:
        """Scalar optimizer state of a flat buffer, such as Adam's `step`, materialised."""
        return {
            k: materialize(v)
            for k, v in self._states[index].items()
            if not (isinstance(v, _TENSORS) and len(v.shape) == 1)
        }

    def hyperparams(self) -> list[dict[str, Any]] | None:
        """Hyperparameters of each optimizer param group, or None when the file does not store them."""
        return self._hyperparams

    def group_of_flat(self, index: int) -> int:
        """Optimizer param group that flat buffer `index` belongs to."""
        return self._flat_to_group.get(index, index) if self._hyperparams is not None else index

    def entry(self, key: str, default: Any = None) -> Any:
        """A small top-level entry of the ZeRO state dict, materialised (e.g. `param_slice_mappings`)."""
        return materialize(self._sd[key]) if key in self._sd else default

    def wrapper_state(self) -> dict[str, Any]:
        """Loss-scaler and clipping state of DeepSpeed's optimizer wrapper, as plain data."""
        return {k: plain(self._sd[k]) for k in OPTIMIZER_WRAPPER_KEYS if k in self._sd}

    def global_state(self) -> dict[str, Any]:
        """Everything in the file except the per-rank tensors, plus param_groups: DeepSpeed's `optimizer_state.pt`."""
        sharded = {
            "base_optimizer_state",
            "param_slice_mappings",
            "single_partition_of_fp32_groups",
            "fp32_flat_groups",
            "optimizer_state_dict",
        }
        out = {k: materialize(v) for k, v in self._sd.items() if k not in sharded}
        base = self._sd.get("optimizer_state_dict" if self.zero_stage == 3 else "base_optimizer_state")
        if isinstance(base, dict):
            out["param_groups"] = materialize(base["param_groups"])
        return out

    @property
    def file(self) -> TorchFile:
        """The archive, for checking what was read from it."""
        return self._file

    def close(self) -> None:
        """Release the underlying file."""
        self._file.close()
