"""PyTorch Distributed Checkpoint (DCP) folders of FSDP2 / torchtitan jobs, imported and exported.

A DCP save of `{"model": model_sd, "optim": optim_sd, ...}` (the state dicts of
`torch.distributed.checkpoint.state_dict.get_state_dict`) flattens every nested key: the model's tensors sit under
the model's prefix by parameter name, Adam's moments under `<optim>.state.<name>.<state>`, its hyperparameters
under `<optim>.param_groups.<g>.<key>` (or per parameter, `param_groups.<name>.<key>`, in the flattened form
torchtitan saves). `import_dcp` finds those prefixes from the optimizer's entries, so the names a user chose do not
matter; every other entry becomes `client_state`.

`export_dcp` writes the same layout from a universal folder, one item per tensor, so `dcp.load` reads it into a
model and optimizer sharded any way (FSDP2 at any size, or one process).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from ucp_deepspeed import compat
from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Counters, GroupRecord, SourceRecord
from ucp_deepspeed.format.metadata import FP32, VALUE, check_name
from ucp_deepspeed.format.paths import check_output, locate
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint, decode_value, encode_value
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.plugins import ForeignFormat, register_foreign_format
from ucp_deepspeed.sources.dcp import DcpCheckpoint, is_dcp_folder

_RANK_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class _Layout:
    """Which entries of a DCP checkpoint are the model's, the optimizer's states and hyperparameters, and the rest."""

    def __init__(self, ckpt: DcpCheckpoint):
        self.states: dict[str, dict[str, str]] = {}  # param name -> state name -> key
        self.group_keys: dict[Any, dict[str, str]] = {}  # group index (or param name, flattened) -> hyper -> key
        optim_prefixes: Counter[tuple] = Counter()
        for key, path in ckpt.paths.items():
            found = self._optimizer_entry(path)
            if found is None:
                continue
            prefix, kind, owner, name = found
            optim_prefixes[prefix] += 1
            if kind == "state":
                self.states.setdefault(owner, {})[name] = key
            else:
                self.group_keys.setdefault(owner, {})[name] = key
        if not self.states:
            raise CheckpointError(ckpt.path, "holds no optimizer state (`<optim>.state.<param>.<state>` entries)")
        self.optim_keys = {k for per in (*self.states.values(), *self.group_keys.values()) for k in per.values()}
        prefixes: Counter[str] = Counter()
        for name in self.states:
            for key in ckpt.tensors:
                if key not in self.optim_keys and (key == name or key.endswith("." + name)):
                    prefixes[key[: len(key) - len(name)]] += 1
        if not prefixes:
            raise CheckpointError(ckpt.path, "holds optimizer state but none of its parameters' values")
        self.model_prefix = prefixes.most_common(1)[0][0]
        self.model = {
            k[len(self.model_prefix) :]: k
            for k in ckpt.tensors
            if k.startswith(self.model_prefix) and k not in self.optim_keys
        }
        missing = [n for n in self.states if n not in self.model]
        if missing:
            raise CheckpointError(ckpt.path, f"has optimizer state for {missing[:4]} but no model tensor of that name")
        self.rest = [
            k for k in [*ckpt.tensors, *ckpt.objects] if k not in self.optim_keys and k not in self.model.values()
        ]

    @staticmethod
    def _optimizer_entry(path: tuple[Any, ...]) -> tuple[tuple, str, Any, str] | None:
        """(optimizer prefix, "state" or "group", param name or group index, entry name), or None."""
        if len(path) >= 3 and path[-3] in ("state", "param_groups") and isinstance(path[-1], str):
            kind = "state" if path[-3] == "state" else "group"
            return path[:-3], kind, path[-2], path[-1]
        last = path[-1] if path else None
        for head, kind in (("state.", "state"), ("param_groups.", "group")):  # flatten_optimizer_state_dict
            if isinstance(last, str) and last.startswith(head) and "." in last[len(head) :]:
                owner, _, name = last[len(head) :].rpartition(".")
                return path[:-1], kind, owner, name
        return None


def _groups(ckpt: DcpCheckpoint, layout: _Layout) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The param groups: their parameter names and hyperparameters."""
    if all(isinstance(g, int) for g in layout.group_keys):
        names: list[list[str]] = []
        hypers: list[dict[str, Any]] = []
        for g in sorted(layout.group_keys):
            entries = {k: ckpt.object(key) for k, key in layout.group_keys[g].items()}
            params = entries.pop("params", None)
            if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
                raise CheckpointError(ckpt.path, f"param group {g} does not list its parameters by name")
            names.append(params)
            hypers.append(entries)
        return names, hypers
    names, hypers = [], []  # flattened: every parameter carries its group's hyperparameters
    for name in layout.model:
        if name not in layout.group_keys:
            continue
        entries = {k: ckpt.object(key) for k, key in layout.group_keys[name].items()}
        if entries not in hypers:
            hypers.append(entries)
            names.append([])
        names[hypers.index(entries)].append(name)
    return names, hypers


def import_dcp(folder: str, output: str) -> str:
    """Write a DCP checkpoint of a model and its `torch.optim` state as a universal folder; return it."""
    folder = st.normalize(folder)
    check_output(output, [folder])
    with DcpCheckpoint(folder) as ckpt:
        layout = _Layout(ckpt)
        group_names, hypers = _groups(ckpt, layout)
        group_of = {n: g for g, names in enumerate(group_names) for n in names}
        steps: dict[int, Any] = {}
        for name in layout.model:
            try:
                check_name(name)
            except ValueError as exc:
                raise CheckpointError(ckpt.path, str(exc)) from None
        with UniversalWriter(root=output) as writer:
            for name, key in layout.model.items():
                if name not in layout.states and name not in group_of:
                    continue
                if name not in group_of:
                    raise CheckpointError(ckpt.path, f"parameter {name!r} has optimizer state but is in no param group")
                g = group_of[name]
                tensors = {FP32: ckpt.tensor(key).float()}
                for state, skey in sorted(layout.states.get(name, {}).items()):
                    value = ckpt.tensor(skey) if skey in ckpt.tensors else ckpt.object(skey)
                    if state == "step":
                        if g in steps and not torch.equal(torch.as_tensor(steps[g]), torch.as_tensor(value)):
                            raise CheckpointError(ckpt.path, f"param group {g} has parameters at different steps")
                        steps[g] = value
                        continue
                    if not isinstance(value, torch.Tensor) or value.shape != tensors[FP32].shape:
                        raise CheckpointError(ckpt.path, f"state {state!r} of {name!r} is not a tensor of its shape")
                    tensors[state] = value.float()
                writer.add_param(name, tensors, group=g)
            # a tensor without optimizer state is a buffer or a frozen parameter (or a tied copy): DCP does not say
            # which, so it is listed as both and the loading model takes it as whichever it has
            buffers = {n: ckpt.tensor(k) for n, k in layout.model.items() if n not in writer.params}
            for name, value in buffers.items():
                writer.add_frozen(name, value)
            writer.add_buffers(buffers)
            client = {k: ckpt.tensor(k) if k in ckpt.tensors else ckpt.object(k) for k in layout.rest}
            writer.set_state(TrainingState(client_state=client))
            step = max((int(torch.as_tensor(s).item()) for s in steps.values()), default=0)
            ranks = {m.group(1) for f in st.listdir(folder) if (m := _RANK_FILE.fullmatch(f))}
            weights = next((ckpt.tensors[k].dtype for k in layout.model.values()), torch.float32)
            writer.finish(
                source=SourceRecord(
                    folder,
                    None,
                    Topology(dp=max(1, len(ranks)), zero_stage=3, dtype=_DTYPES.get(weights, "fp32"), optimizer="dcp"),
                    {"torch": str(ckpt.extra.get("version") or "")},
                    extra={"format": "dcp"},
                ),
                counters=Counters(global_steps=step),
                param_groups=[
                    GroupRecord(
                        {k: encode_value(v) for k, v in hyper.items()},
                        {"step": encode_value(steps[g])} if g in steps else {},
                    )
                    for g, hyper in enumerate(hypers)
                ],
                extra={
                    "notes": [
                        f"model tensors under {layout.model_prefix!r}; those without optimizer state are listed both "
                        "as frozen parameters and as buffers; the other entries are client_state; global_steps is "
                        "the optimizer's step"
                    ]
                },
            )
        return output


def _entries(ckpt: UniversalCheckpoint, model_key: str, optim_key: str) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path in the nested state dict, value) for every entry of the exported checkpoint, one tensor at a time."""
    manifest = ckpt.manifest
    for name, rec in manifest.params.items():
        yield (model_key, name), ckpt.read(name, FP32 if rec.trainable else VALUE).reshape(rec.shape)
    for name in manifest.buffers:
        if name not in manifest.params:  # an imported tensor of unknown kind is listed as both
            yield (model_key, name), ckpt.read_buffer(name)
    for alias, owner in manifest.tied.items():  # `state_dict()` holds a tied weight under each of its names
        if alias not in manifest.params and owner in manifest.params:
            yield (
                (model_key, alias),
                ckpt.read(owner, FP32 if manifest.params[owner].trainable else VALUE).reshape(
                    manifest.params[owner].shape
                ),
            )
    groups: list[list[str]] = [[] for _ in manifest.param_groups]
    for name, rec in manifest.params.items():
        if not rec.trainable or rec.group is None:
            continue
        groups[rec.group].append(name)
        scalars = manifest.param_groups[rec.group].scalars
        if "step" in scalars:
            yield (
                (optim_key, "state", name, "step"),
                torch.as_tensor(decode_value(scalars["step"]), dtype=torch.float32),
            )
        for key in rec.keys:
            if key != FP32:
                yield (optim_key, "state", name, key), ckpt.read(name, key).reshape(rec.shape)
    for g, group in enumerate(manifest.param_groups):
        hyper = {k: decode_value(v) for k, v in (group.hyperparams or {}).items()}
        for k, v in {**hyper, "params": groups[g]}.items():
            yield (optim_key, "param_groups", g, k), v


def export_dcp(
    path: str, output: str, model_key: str = "model", optim_key: str = "optim", progress: bool = True
) -> str:
    """Write a checkpoint as DCP holding `{model_key: model_sd, optim_key: optim_sd, **client_state}`; return it.

    Args:
        path: a universal folder, or a native checkpoint directory (its latest tag is converted first).
        output: the DCP folder to write (a local path or a store URL); `.metadata` is written last.
        model_key, optim_key: the top-level keys the loading job's state dict uses.

    Example:
        >>> export_dcp("checkpoints", "dcp-out")
        >>> dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id="dcp-out")
    """
    check_output(output, [locate(path).path])
    if not st.isfile(st.join(path, MANIFEST)):
        path = convert(path, progress=progress)
    with UniversalCheckpoint(path) as ckpt:
        writer = compat.DcpWriter(output)
        try:
            client = ckpt.load_state().get("client_state") or {}
            named = (((str(k),), v) for k, v in client.items())
            for where, value in [*_entries(ckpt, model_key, optim_key), *named]:
                writer.put(where, value)
        except BaseException:
            writer.abort()
            raise
        writer.finish()
        return output


def _loaded_folder(engine: Engine, load_dir: str) -> str | None:
    """A DCP folder named directly by a load (megatron-core's torch_dist folders, DCP too, are `megatron`'s)."""
    return load_dir if is_dcp_folder(load_dir) and not st.isfile(st.join(load_dir, "metadata.json")) else None


register_foreign_format(ForeignFormat("dcp", _loaded_folder, lambda folder, out, _options: import_dcp(folder, out)))
