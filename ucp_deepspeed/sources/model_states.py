"""Read DeepSpeed model-states files: module tensors, counters, scheduler and client state; pipeline layer files."""

from __future__ import annotations

import re
from typing import Any

from ucp_deepspeed import compat
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Counters
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import LazyTensor, TorchFile, materialize, plain

COUNTERS = ("global_steps", "global_samples", "skipped_steps")
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_\d+_mp_rank_(\d+)_optim_states\.pt")


class ModelStatesFile(st.Closeable):
    """One `*model_states.pt` file, opened lazily."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self._file = TorchFile(path, verify)
        self.save_id = self._file.save_id
        if not isinstance(self._file.obj, dict) or "module" not in self._file.obj:
            self._file.close()  # the caller gets no object to close
            raise CheckpointError(path, "no 'module' entry; not a DeepSpeed model-states file")
        self._obj: dict[str, Any] = self._file.obj

    def module_tensor(self, name: str) -> LazyTensor:
        """A tensor of the saved module state dict (a buffer or an un-partitioned parameter)."""
        tensor = (self._obj.get("module") or {}).get(name)
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(self.path, f"module state has no tensor '{name}'")
        return tensor

    def module_names(self) -> list[str]:
        """Names in the saved module state dict (empty at ZeRO-3, which saves no module)."""
        return list(self._obj.get("module") or {})

    def fp8_states(self) -> dict[str, int]:
        """Module entries holding Transformer Engine extra state (`*._extra_state`: FP8 scales and amax history,
        serialized into a byte tensor), with their sizes; empty ones (a module without FP8 state) are left out."""
        module = self._obj.get("module") or {}
        return {
            k: v.numel()
            for k, v in module.items()
            if k.endswith("_extra_state") and isinstance(v, LazyTensor) and v.numel() > 0
        }

    def module_tensors(self) -> dict[str, LazyTensor]:
        """Every tensor of the saved module state dict (skipping non-tensor entries such as `_extra_state`)."""
        return {k: v for k, v in (self._obj.get("module") or {}).items() if isinstance(v, LazyTensor)}

    def layers_apart(self) -> bool:
        """Whether the module's tensors are in per-layer files, as a `PipelineModule` saves them (`module` is None)."""
        return "module" in self._obj and self._obj["module"] is None and "param_shapes" in self._obj

    def optimizer_state(self, index: int, key: str) -> LazyTensor:
        """A state tensor of entry `index` of the torch optimizer state dict saved whole (ZeRO-0 in fp32)."""
        tensor = self._optimizer_entries().get(index, {}).get(key)
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(self.path, f"optimizer state has no tensor '{key}' for parameter {index}")
        return tensor

    def optimizer_state_keys(self) -> list[str]:
        """Per-element state keys (shaped like the parameter, not scalars such as `step`) of that state dict."""
        first = next(iter(self._optimizer_entries().values()), {})
        return [k for k, v in first.items() if isinstance(v, LazyTensor) and len(v.shape) > 0]

    def optimizer_groups(self) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
        """Hyperparameters of each param group of that state dict, and the scalar state of its first parameter."""
        groups = (self._obj.get("optimizer") or {}).get("param_groups")
        if not isinstance(groups, list):
            raise CheckpointError(self.path, "no optimizer param_groups: not a ZeRO-0 fp32 checkpoint")
        hyperparams, scalars = [], {}
        for g, group in enumerate(groups):
            hyperparams.append({k: plain(v) for k, v in group.items() if k != "params"})
            found = self.optimizer_scalars(group["params"][0]) if group.get("params") else {}
            if found:
                scalars[g] = found
        return hyperparams, scalars

    def optimizer_group_indices(self) -> list[list[int]]:
        """The state-dict indices of each param group's parameters, in order."""
        groups = (self._obj.get("optimizer") or {}).get("param_groups") or []
        return [[int(i) for i in group.get("params", [])] for group in groups]

    def optimizer_scalars(self, index: int) -> dict[str, Any]:
        """The scalar states (such as `step`) of entry `index` of that state dict, materialised."""
        entry = self._optimizer_entries().get(index, {})
        return {k: materialize(v) for k, v in entry.items() if not (isinstance(v, LazyTensor) and len(v.shape))}

    def _optimizer_entries(self) -> dict[Any, dict[str, Any]]:
        state = (self._obj.get("optimizer") or {}).get("state")
        if not isinstance(state, dict):
            raise CheckpointError(self.path, "no optimizer state: not a ZeRO-0 fp32 checkpoint")
        return state

    def frozen_fragment(self, name: str) -> LazyTensor:
        """This rank's ZeRO-3 fragment of a frozen parameter."""
        tensor = (self._obj.get("frozen_param_fragments") or {}).get(name)
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(self.path, f"no ZeRO-3 fragment of frozen parameter '{name}'")
        return tensor

    def parallel_sizes(self) -> tuple[int, int, int]:
        """(tensor-parallel, pipeline, Ulysses sequence-parallel) sizes of the saving job, from DeepSpeed's record.

        DeepSpeed records a Ulysses job's sequence-parallel size as `tp_degree` in `checkpoint_parallel_dimensions`
        (its mpu's "model parallel" getters alias the sequence-parallel group) while `mp_world_size` says 1: every
        rank holds the whole model. Before it recorded the dimensions (0.19.5), such a job named each rank's optimizer
        file by its sequence-parallel rank (`zero_pp_rank_{d}_mp_rank_{d % sp}`) beside one model-parallel rank's
        model states, which is then the only trace of it.
        """
        dims = self.entry("checkpoint_parallel_dimensions") or {}
        mp_world = int(self.entry("mp_world_size", 1))
        tp, pp, sp = int(dims.get("tp_degree", mp_world)), int(dims.get("pp_degree", 1)), 1
        if tp > 1 and mp_world == 1 and pp == 1:
            sp, tp = tp, 1
        elif not dims and mp_world == 1:
            names = st.listdir(st.dirname(self.path))
            models = {m.group(1) for n in names if (m := _MODEL_STATES.fullmatch(n))}
            if models == {"00"}:  # pipeline stages, which also number files past 0, write model states of their own
                sp = 1 + max((int(m.group(1)) for n in names if (m := _OPTIM_STATES.fullmatch(n))), default=0)
        return tp, pp, sp

    def entry(self, key: str, default: Any = None) -> Any:
        """A top-level entry, materialised (for small bookkeeping such as `param_shapes`)."""
        return materialize(self._obj[key]) if key in self._obj else default

    def keys(self) -> list[str]:
        """Top-level keys: DeepSpeed's own, plus the user's client_state entries."""
        return list(self._obj)

    def counters(self) -> Counters:
        """Engine step counters (DeepSpeed saves all three; an absent one reads as 0), the samples as the
        data-parallel ranks consumed them: an AutoTP job's count of each tensor-parallel rank's copy, divided out."""
        found = {k: int(self._obj[k]) for k in COUNTERS if k in self._obj}
        copies = compat.recorded_sample_copies(plain(self._obj.get("ds_config")))
        if "global_samples" in found:
            found["global_samples"] //= copies
        return Counters(**found)

    def lr_scheduler(self) -> Any:
        """The LR scheduler state dict, if one was saved."""
        return plain(self._obj.get("lr_scheduler"))

    def data_sampler(self) -> Any:
        """DeepSpeed's data sampler state (data efficiency's curriculum learning), if one was saved: one global
        position, the same on every data-parallel rank."""
        return plain(self._obj.get("data_sampler"))

    def client_state(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The user's `client_state` entries, which DeepSpeed merges into the top level."""
        missing = [k for k in keys if k not in self._obj]
        if missing:
            raise CheckpointError(self.path, f"client_state keys {missing} recorded in metadata are missing")
        return {k: plain(self._obj[k]) for k in keys}

    @property
    def file(self) -> TorchFile:
        """The archive, for checking what was read from it."""
        return self._file

    def close(self) -> None:
        """Release the underlying file."""
        self._file.close()


class LayerStatesFile(st.Closeable):
    """One `PipelineModule` layer file (`layer_XX[-model_YY]-model_states.pt`): a layer's state dict, opened lazily."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self._file = TorchFile(path, verify)
        self.save_id = self._file.save_id
        if not isinstance(self._file.obj, dict):
            self._file.close()  # the caller gets no object to close
            raise CheckpointError(path, "not a pipeline layer file: it holds no state dict")
        self._obj: dict[str, Any] = self._file.obj

    def tensor(self, key: str) -> LazyTensor:
        """A tensor of the layer's state dict."""
        tensor = self._obj.get(key)
        if not isinstance(tensor, LazyTensor):
            raise CheckpointError(self.path, f"layer state has no tensor '{key}'")
        return tensor

    def keys(self) -> list[str]:
        """Names of the tensors in the layer's state dict."""
        return [k for k, v in self._obj.items() if isinstance(v, LazyTensor)]

    @property
    def file(self) -> TorchFile:
        """The archive, for checking what was read from it."""
        return self._file

    def close(self) -> None:
        """Release the underlying file."""
        self._file.close()
