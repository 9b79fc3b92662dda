"""DeepSpeed's own universal layout (what `ds_to_universal` writes), in both directions.

    <ckpt>/<tag>_universal/zero/<param>/fp32.pt     {"param": full fp32 tensor, "cat_dim": d, ...}
    <ckpt>/<tag>_universal/zero/<param>/<state>.pt  the same for exp_avg, exp_avg_sq, ...
    <ckpt>/<tag>_universal/zero/<param>/step.pt     the param group's step, as the optimizer keeps it
    <ckpt>/<tag>_universal/zero/optimizer_state.pt  optimizer-wrapper state and param_groups
    <ckpt>/<tag>_universal/*model_states.pt         copies of the source's model-states files
    <ckpt>/latest_universal                          "<tag>_universal"

`export_deepspeed` writes that layout from a native checkpoint, so stock DeepSpeed with
`"checkpoint": {"load_universal": true}` can load it. `import_deepspeed` turns such a folder into
ours. DeepSpeed's folder does not say which tensors are trainable, which are frozen or buffers,
or which param group a parameter is in; those come from the model-states file in the folder, and
the manifest lists them under `notes`.
"""

from __future__ import annotations

import io
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tqdm import tqdm

from ucp_deepspeed.compat import rebuild
from ucp_deepspeed.convert.core import assemble
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.paths import check_output
from ucp_deepspeed.format.universal import (
    BUFFERS,
    STATE,
    FileRecord,
    atomic_write,
    encode_value,
    param_file,
    write_manifest,
    write_object,
    write_tensors,
)
from ucp_deepspeed.io.torch_file import load_file, plain
from ucp_deepspeed.runtime.plugins import ForeignFormat, register_foreign_format
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.keys import DEEPSPEED_KEYS
from ucp_deepspeed.sources.model_states import ModelStatesFile
from ucp_deepspeed.sources.plan import FullTensor
from ucp_deepspeed.version import __version__

# key names of deepspeed.checkpoint.constants, spelled out so the `ucp` command need not import DeepSpeed
PARAM, CAT_DIM, VOCAB_TENSOR, PARAM_N_SUB_PARAMS = "param", "cat_dim", "vocab_tensor", "param_n_sub_params"
LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"


def _save_pt(path: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getbuffer())


def _geometry(tensor: FullTensor) -> dict[str, Any]:
    """The keys DeepSpeed's loader uses to cut a tensor-parallel slice of a full tensor."""
    layout = tensor.layout
    out: dict[str, Any] = {CAT_DIM: layout.dim}  # like ds_to_universal; ignored when the shapes already match
    if layout.vocab:
        out[VOCAB_TENSOR] = True
    if layout.parts:
        if len(set(layout.parts)) != 1 or layout.dim != 0:
            raise CheckpointError(
                tensor.name,
                f"DeepSpeed's universal format cannot describe fused parts {list(layout.parts)} on dim {layout.dim}",
            )
        out[PARAM_N_SUB_PARAMS] = len(layout.parts)
    return out


def default_deepspeed_output(src: NativeCheckpoint) -> str:
    """`<ckpt>/<tag>_universal`, where DeepSpeed's own converter is usually pointed."""
    return os.path.join(src.ckpt_dir, f"{src.tag}_universal")


def export_deepspeed(
    ckpt_dir: str, tag: str | None = None, output: str | None = None, workers: int = 1, progress: bool = True
) -> str:
    """Write a native checkpoint in DeepSpeed's universal layout; return the output folder."""
    src = NativeCheckpoint(ckpt_dir, tag)
    try:
        out = os.path.abspath(output or default_deepspeed_output(src))
        check_output(out, [src.tag_dir])
        if os.path.exists(out) and os.listdir(out):
            raise CheckpointError(out, "exists and is not empty; refusing to write into it")
        _, scalars = src.optimizer_groups()
        keys = [FP32] + src.state_keys()
        trainable = [t for t in src.tensors if t.kind == "param"]

        def write_param(t: FullTensor) -> None:
            folder = os.path.join(out, ZERO, t.name)
            for key in keys:
                _save_pt(os.path.join(folder, f"{key}.pt"), {PARAM: assemble(src, t, key), **_geometry(t)})
            step = scalars.get(t.group, {}).get("step") if t.group is not None else None
            if step is not None:
                _save_pt(os.path.join(folder, "step.pt"), step)

        bar = tqdm(total=len(trainable), unit="param", desc="ucp convert --format deepspeed", disable=not progress)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for _ in pool.map(write_param, trainable):
                bar.update()
        bar.close()
        src.check_reads()
        _save_pt(
            os.path.join(out, ZERO, OPTIMIZER_STATE), {k: rebuild(v) for k, v in src.optim(0).global_state().items()}
        )
        for rank in src.ranks:
            for path in rank.model_paths:
                shutil.copyfile(path, os.path.join(out, os.path.basename(path)))
        atomic_write(os.path.join(os.path.dirname(out), LATEST_UNIVERSAL), os.path.basename(out).encode())
        return out
    finally:
        src.close()


def deepspeed_universal_folder(path: str) -> str | None:
    """The DeepSpeed universal folder at `path` (or named by `path/latest_universal`), if there is one."""
    latest = os.path.join(path, LATEST_UNIVERSAL)
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    return path if os.path.isfile(os.path.join(path, ZERO, OPTIMIZER_STATE)) else None


def import_deepspeed(folder: str, output: str) -> str:
    """Rewrite a DeepSpeed universal folder in our format (with a manifest saying what was inferred)."""
    model_files = sorted(f for f in os.listdir(folder) if f.endswith("model_states.pt"))
    if not model_files:
        raise CheckpointError(
            folder,
            "no *model_states.pt in this DeepSpeed universal folder; its param groups, "
            "buffers and frozen parameters cannot be recovered",
        )
    model_path = os.path.join(folder, model_files[0])
    check_output(output, [folder])
    model = ModelStatesFile(model_path)
    try:
        groups = [list(g) for g in model.entry("param_shapes", [])]
        if not groups:
            raise CheckpointError(model_path, "no param_shapes; cannot tell trainable parameters and their groups")
        optim_state = load_file(os.path.join(folder, ZERO, OPTIMIZER_STATE))
        records: list[FileRecord] = []
        params: dict[str, Any] = {}
        scalars: dict[int, dict[str, Any]] = {}
        keys: list[str] = []
        for g, names in enumerate(groups):
            for name in names:
                pdir = os.path.join(folder, ZERO, name)
                if not os.path.isdir(pdir):
                    raise CheckpointError(pdir, f"parameter '{name}' listed in {model_files[0]} has no folder")
                tensors = {}
                for fname in sorted(os.listdir(pdir)):
                    key = fname.removesuffix(".pt")
                    if key == "step":
                        scalars.setdefault(g, {"step": load_file(os.path.join(pdir, fname))})
                    else:
                        tensors[key] = load_file(os.path.join(pdir, fname))[PARAM].float().contiguous()
                if FP32 not in tensors:
                    raise CheckpointError(pdir, "no fp32.pt")
                keys = [FP32] + sorted(k for k in tensors if k != FP32)
                records.append(write_tensors(output, param_file(name), tensors))
                params[name] = {
                    "shape": list(tensors[FP32].shape),
                    "dtype": "float32",
                    "group": g,
                    "trainable": True,
                    "file": param_file(name),
                    "keys": keys,
                }
        trainable = {n for names in groups for n in names}
        buffer_names = model.entry("buffer_names", [])
        aliases = model.entry("shared_params") or {}
        frozen = model.entry("frozen_param_shapes") or [
            n for n in model.module_names() if n not in trainable and n not in buffer_names and n not in aliases
        ]
        for name in frozen:
            value = model.module_tensor(name).load()
            records.append(write_tensors(output, param_file(name), {VALUE: value}))
            params[name] = {
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "group": None,
                "trainable": False,
                "file": param_file(name),
                "keys": [VALUE],
            }
        buffers = {n: model.module_tensor(n).load() for n in buffer_names}
        records.append(write_tensors(output, BUFFERS, buffers))
        client = model.client_state(tuple(k for k in model.keys() if k not in DEEPSPEED_KEYS))
        wrapper = {
            k: plain(optim_state[k])
            for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
            if k in optim_state
        }
        records.append(
            write_object(
                output,
                STATE,
                {"lr_scheduler": model.lr_scheduler(), "client_state": client, "optimizer_wrapper": wrapper},
            )
        )
        hyper = optim_state.get("param_groups") or []
        manifest = {
            "created_by": {"ucp_deepspeed": __version__},
            "source": {
                "path": os.path.abspath(folder),
                "format": "deepspeed_universal",
                "topology": {
                    "dp": int(model.entry("dp_world_size", 1)),
                    "tp": int(model.entry("mp_world_size", 1)),
                    "pp": 1,
                    "ep": 1,
                    "zero_stage": int(optim_state.get("zero_stage", 0)),
                    "dtype": "fp32",
                    "optimizer": "deepspeed_universal",
                },
                "versions": {"deepspeed": str(model.entry("ds_version", ""))},
                "fingerprint": [],
            },
            "counters": model.counters(),
            "param_groups": [
                {
                    "hyperparams": {k: encode_value(v) for k, v in hyper[g].items() if k != "params"}
                    if g < len(hyper)
                    else None,
                    "scalars": {k: encode_value(v) for k, v in scalars.get(g, {}).items()},
                }
                for g in range(len(groups))
            ],
            "params": params,
            "buffers": {
                n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")} for n, b in buffers.items()
            },
            "tied": dict(aliases),
            "notes": [
                f"param groups, frozen parameters, buffers, counters, LR scheduler and client_state "
                f"taken from {model_files[0]}: DeepSpeed's universal folder does not record them"
            ],
        }
        model.file.check_reads()
        write_manifest(output, Manifest.decode(manifest, output), records)
        return output
    finally:
        model.close()


def _loaded_folder(engine: Any, load_dir: str) -> str | None:
    """The DeepSpeed universal folder a load of `load_dir` means: named directly, or asked for with
    DeepSpeed's own `load_universal` switch."""
    folder = deepspeed_universal_folder(load_dir)
    if folder is not None and (folder == load_dir or engine.load_universal_checkpoint()):
        return folder
    return None


register_foreign_format(ForeignFormat("deepspeed universal", _loaded_folder, import_deepspeed))
