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

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tqdm import tqdm

from ucp_deepspeed.compat import rebuild
from ucp_deepspeed.convert.core import assemble
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import GroupRecord, SourceRecord
from ucp_deepspeed.format.metadata import FP32, LAYER_FILE, check_name
from ucp_deepspeed.format.paths import check_output, latest_tag
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import encode_value
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import load_file, plain, to_bytes
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.plugins import ForeignFormat, register_foreign_format
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.keys import DEEPSPEED_KEYS, OPTIMIZER_WRAPPER_KEYS
from ucp_deepspeed.sources.model_states import LayerStatesFile, ModelStatesFile
from ucp_deepspeed.sources.plan import FullTensor

# key names of deepspeed.checkpoint.constants, spelled out so the `ucp` command need not import DeepSpeed
PARAM, CAT_DIM, VOCAB_TENSOR, PARAM_N_SUB_PARAMS = "param", "cat_dim", "vocab_tensor", "param_n_sub_params"
LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"


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
    return st.join(src.ckpt_dir, f"{src.tag}_universal")


def export_deepspeed(
    ckpt_dir: str,
    tag: str | None = None,
    output: str | None = None,
    workers: int = 1,
    progress: bool = True,
    layout_rules: Any = None,
) -> str:
    """Write a native checkpoint in DeepSpeed's universal layout; return the output folder (`layout_rules`: how a
    tensor-parallel checkpoint saved without ucp metadata or a record of its own was split)."""
    with NativeCheckpoint(ckpt_dir, tag, layout_rules) as src:
        out = st.normalize(output or default_deepspeed_output(src))
        check_output(out, [src.tag_dir])
        if st.exists(out) and st.listdir(out):
            raise CheckpointError(out, "exists and is not empty; refusing to write into it")
        _, scalars = src.optimizer_groups()
        keys = [FP32] + src.state_keys()
        trainable = [t for t in src.tensors if t.kind == "param"]

        def write_param(t: FullTensor) -> None:
            folder = st.join(out, ZERO, t.name)
            for key in keys:
                st.write(st.join(folder, f"{key}.pt"), to_bytes({PARAM: assemble(src, t, key), **_geometry(t)}))
            step = scalars.get(t.group, {}).get("step") if t.group is not None else None
            if step is not None:
                st.write(st.join(folder, "step.pt"), to_bytes(step))

        bar = tqdm(total=len(trainable), unit="param", desc="ucp convert --format deepspeed", disable=not progress)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for _ in pool.map(write_param, trainable):
                bar.update()
        bar.close()
        src.check_reads()
        if src.meta.topology.unpartitioned:  # a torch optimizer's state dict: only its param groups are global
            hyperparams, _ = src.optimizer_groups()
            version = src.model_states(0).entry("ds_version")
            global_state: dict[str, Any] = {"param_groups": hyperparams, "zero_stage": 0, "ds_version": version}
        else:
            global_state = {k: rebuild(v) for k, v in src.optim(0).global_state().items()}
        st.write(st.join(out, ZERO, OPTIMIZER_STATE), to_bytes(global_state))
        for rank in src.ranks:  # DeepSpeed reads these; a PipelineModule's layer files keep its buffers for us
            for path in [*rank.model_paths, *rank.layer_paths]:
                st.copy(path, st.join(out, st.basename(path)))
        st.write(st.join(st.dirname(out), LATEST_UNIVERSAL), st.basename(out).encode())
        return out


def deepspeed_universal_folder(path: str) -> str | None:
    """The DeepSpeed universal folder at `path` (or named by `path/latest_universal`), if there is one."""
    named = latest_tag(path, LATEST_UNIVERSAL)
    if named is not None:
        path = st.join(path, named)
    return path if st.isfile(st.join(path, ZERO, OPTIMIZER_STATE)) else None


def _stage_files(folder: str) -> list[str]:
    """The model-states files of a DeepSpeed universal folder (one per model-parallel rank), layer files apart."""
    names = sorted(f for f in st.listdir(folder) if f.endswith("model_states.pt") and not LAYER_FILE.fullmatch(f))
    if not names:
        raise CheckpointError(
            folder,
            "no *model_states.pt in this DeepSpeed universal folder; its param groups, "
            "buffers and frozen parameters cannot be recovered",
        )
    return [st.join(folder, n) for n in names]


class _ModuleTensors(st.Closeable):
    """Buffers and frozen parameters of a DeepSpeed universal folder, which `ds_to_universal` does not convert:
    from the copied model-states files, or for a `PipelineModule` from its layer files when they are in the folder
    (`ucp convert --format deepspeed` copies them; DeepSpeed's converter does not)."""

    def __init__(self, folder: str, models: list[ModelStatesFile]):
        self.folder, self.models = folder, models
        self.layers: dict[str, LayerStatesFile] = {}

    def load(self, name: str) -> torch.Tensor | None:
        for model in self.models:
            if name in model.module_tensors():
                return model.module_tensor(name).load()
        found = re.fullmatch(r"([0-9]+)\.(.+)", name, re.S)
        if found is None:
            return None
        layer, key = found.groups()
        # tensor-parallel layer files sort model_00 first: what a replicated buffer needs
        files = st.glob(self.folder, f"layer_{int(layer):02d}-*model_states.pt")
        if not files:
            return None
        if files[0] not in self.layers:
            self.layers[files[0]] = LayerStatesFile(files[0])
        return self.layers[files[0]].tensor(key).load()

    def layer_frozen(self, trainable: set[str], known: set[str]) -> list[str]:
        """Frozen weights in the layer files of layers that also train something (`<layer>.<key>`, not yet `known`).

        A layer with nothing trainable is skipped: its file may be a tied module's, whose tensors have other names;
        a frozen layer left out this way is reported by name when the checkpoint is loaded.
        """
        trained_layers = {n.split(".", 1)[0] for n in trainable}
        out = []
        for path in st.glob(self.folder, "layer_*-model_states.pt"):
            found = LAYER_FILE.fullmatch(st.basename(path))
            layer = str(int(st.basename(path)[len("layer_") :].split("-", 1)[0])) if found else ""
            if layer not in trained_layers:
                continue
            if path not in self.layers:
                self.layers[path] = LayerStatesFile(path)
            names = (f"{layer}.{key}" for key in self.layers[path].keys())
            out += [n for n in names if n not in trainable and n not in known and n not in out]
        return out

    def check_reads(self) -> None:
        """Raise if anything read from these files fails its CRC-32."""
        for f in self._files():
            f.file.check_reads()

    def close(self) -> None:
        """Release every opened file."""
        for f in self._files():
            f.close()

    def _files(self) -> list[ModelStatesFile | LayerStatesFile]:
        return [*self.models, *self.layers.values()]


def _frozen_names(model: ModelStatesFile, trainable: set[str], buffers: list[str], aliases: dict) -> list[str]:
    """Frozen parameters of one model-states file: listed by ZeRO-2/3, else whatever else its module holds."""
    listed = model.entry("frozen_param_shapes")
    if listed:
        return list(listed)
    return [n for n in model.module_names() if n not in trainable and n not in buffers and n not in aliases]


def import_deepspeed(folder: str, output: str) -> str:
    """Rewrite a DeepSpeed universal folder in our format (with a manifest saying what was inferred)."""
    check_output(output, [folder])
    with _ModuleTensors(folder, []) as module:
        for path in _stage_files(folder):
            module.models.append(ModelStatesFile(path))
        model, model_files = module.models[0], [st.basename(m.path) for m in module.models]
        groups = _param_groups(folder, module.models)
        frozen, buffer_names, aliases, values = _untrained(folder, module, {n for names in groups for n in names})
        optim_state = load_file(st.join(folder, ZERO, OPTIMIZER_STATE))
        with UniversalWriter(root=output) as writer:
            scalars = _write_params(writer, folder, groups, model_files)
            for name in frozen:
                writer.add_frozen(name, values[name])
            writer.add_buffers({n: values[n] for n in buffer_names})
            client = model.client_state(tuple(k for k in model.keys() if k not in DEEPSPEED_KEYS))
            wrapper = {k: plain(optim_state[k]) for k in OPTIMIZER_WRAPPER_KEYS if k in optim_state}
            writer.set_state(
                TrainingState(
                    lr_scheduler=model.lr_scheduler(),
                    client_state=client,
                    optimizer_wrapper=wrapper,
                    data_sampler=model.data_sampler(),  # its generator's state is DeepSpeed's to lose: not there
                )
            )
            hyper = optim_state.get("param_groups") or []
            saved = _saved_topology(model, optim_state)
            module.check_reads()
            writer.finish(
                source=SourceRecord(
                    st.normalize(folder),
                    None,
                    saved,
                    {"deepspeed": str(model.entry("ds_version", ""))},
                    extra={"format": "deepspeed_universal"},
                ),
                counters=model.counters(),
                param_groups=[
                    GroupRecord(
                        {k: encode_value(v) for k, v in hyper[g].items() if k != "params"} if g < len(hyper) else None,
                        {k: encode_value(v) for k, v in scalars.get(g, {}).items()},
                    )
                    for g in range(len(groups))
                ],
                tied=aliases,
                extra={
                    "notes": [
                        f"param groups, frozen parameters, buffers, counters, LR scheduler and client_state "
                        f"taken from {', '.join(model_files)}: DeepSpeed's universal folder does not record them"
                    ]
                },
            )
        return output


def _param_groups(folder: str, models: list[ModelStatesFile]) -> list[list[str]]:
    """The trainable parameters of each param group, over every stage's model-states file: each pipeline stage lists
    its own; tensor-parallel ranks list the same ones again."""
    groups: list[list[str]] = []
    counts = {len(stage.entry("param_shapes") or []) for stage in models}
    if len(counts) > 1:  # a stage without parameters of some group numbers its groups differently
        raise CheckpointError(folder, f"its stages list {sorted(counts)} param groups; their order cannot be matched")
    for stage in models:
        for g, names in enumerate(stage.entry("param_shapes") or []):
            groups.extend([] for _ in range(g + 1 - len(groups)))
            groups[g] += [n for n in names if n not in groups[g]]
    for name in (n for names in groups for n in names):
        try:
            check_name(name)
        except ValueError as exc:
            raise CheckpointError(models[0].path, str(exc)) from None
    if not groups:
        raise CheckpointError(models[0].path, "no param_shapes; cannot tell trainable parameters and their groups")
    return groups


def _untrained(
    folder: str, module: _ModuleTensors, trainable: set[str]
) -> tuple[list[str], list[str], dict[str, str], dict[str, torch.Tensor]]:
    """The frozen parameters, the buffers, the tied aliases, and the frozen parameters' and buffers' values, which
    the universal folder leaves in the model-states (and a pipeline's layer) files."""
    models = module.models
    buffer_names = list(dict.fromkeys(n for m in models for n in m.entry("buffer_names", [])))
    aliases = {k: v for m in models for k, v in (m.entry("shared_params") or {}).items()}
    frozen = list(dict.fromkeys(n for m in models for n in _frozen_names(m, trainable, buffer_names, aliases)))
    frozen += module.layer_frozen(trainable, {*frozen, *buffer_names, *aliases})
    found = {n: module.load(n) for n in [*frozen, *buffer_names]}
    missing = [n for n, v in found.items() if v is None]
    if missing:
        raise CheckpointError(
            folder,
            f"holds no value for {len(missing)} buffers or frozen parameters ({', '.join(missing[:6])}"
            f"{' ...' if len(missing) > 6 else ''}): DeepSpeed's ds_to_universal does not copy a "
            "PipelineModule's layer files. Copy the source tag's layer_*-model_states.pt files into this folder",
        )
    return frozen, buffer_names, aliases, {n: v for n, v in found.items() if v is not None}


def _write_params(
    writer: UniversalWriter, folder: str, groups: list[list[str]], model_files: list[str]
) -> dict[int, dict[str, Any]]:
    """Each trainable parameter's fp32 master and optimizer states, from its folder under `zero/`; returns each
    group's scalar states (its step), which the folder keeps per parameter."""
    scalars: dict[int, dict[str, Any]] = {}
    for g, names in enumerate(groups):
        for name in names:
            pdir = st.join(folder, ZERO, name)
            if not st.isdir(pdir):
                raise CheckpointError(pdir, f"parameter '{name}' listed in {', '.join(model_files)} has no folder")
            tensors = {}
            for fname in sorted(st.listdir(pdir)):
                key = fname.removesuffix(".pt")
                if key == "step":
                    scalars.setdefault(g, {"step": load_file(st.join(pdir, fname))})
                else:
                    tensors[key] = load_file(st.join(pdir, fname))[PARAM].float().contiguous()
            if FP32 not in tensors:
                raise CheckpointError(pdir, "no fp32.pt")
            writer.add_param(name, tensors, group=g)
    return scalars


def _saved_topology(model: ModelStatesFile, optim_state: dict[str, Any]) -> Topology:
    """The layout the folder was converted from, as its files record it (fp32 masters, DeepSpeed's own format)."""
    try:
        tp, pp, sp = model.parallel_sizes()
        return Topology(
            dp=int(model.entry("dp_world_size", 1)),
            zero_stage=int(optim_state.get("zero_stage", 0)),
            dtype="fp32",
            tp=tp,
            pp=pp,
            sp=sp,
            optimizer="deepspeed_universal",
        )
    except (TypeError, ValueError):
        raise CheckpointError(model.path, "its parallel sizes are not integers") from None


def _loaded_folder(engine: Engine, load_dir: str) -> str | None:
    """The DeepSpeed universal folder a load of `load_dir` means: named directly, or asked for with
    DeepSpeed's own `load_universal` switch."""
    folder = deepspeed_universal_folder(load_dir)
    if folder is not None and (folder == load_dir or engine.load_universal_checkpoint()):
        return folder
    return None


register_foreign_format(
    ForeignFormat("deepspeed universal", _loaded_folder, lambda folder, out, _options: import_deepspeed(folder, out))
)
