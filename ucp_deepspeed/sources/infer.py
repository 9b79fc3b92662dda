"""Metadata for checkpoints saved without ucp_deepspeed: plain DeepSpeed, HF Trainer, Accelerate.

DeepSpeed's own files say enough for data parallelism: the model-states file lists every trainable
parameter's shape per flat buffer (`param_shapes`), the tied copies (`shared_params`), buffers and
frozen parameters, and each optimizer file holds its partition of the flat buffers. Offsets follow
from the shapes: ZeRO-1/2 flatten a group's parameters back to back and pad only the end; ZeRO-3
gives every rank ceil(numel / dp) elements of each parameter. Both are checked against the files
(DeepSpeed's `param_slice_mappings`, flat sizes) so a different packing fails loudly instead of
loading wrong values.

How a tensor-parallel rank's slice was cut from the full tensor is recorded by DeepSpeed's AutoTP
(`sources.autotp`) and by Megatron-DeepSpeed (`sources.megatron_deepspeed`); any other TP-split checkpoint needs
layout rules. A DeepSpeed `PipelineModule` names its parameters by global layer index and keeps its layers' buffers
and frozen weights in per-layer files (`layer_XX[-model_YY]-model_states.pt`), which are read here; other pipeline
stages (numbering their layers locally) are refused. A ZeRO-0 save's numbered torch optimizer state is named by the
loading engine's groups, a bf16 pipeline's BF16_Optimizer partitions by their `param_slice_mappings`, and the experts
of DeepSpeed's MoE and AutoEP by the expert-parallel placement DeepSpeed uses, checked against its expert files.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.format.metadata import FP32, LAYER_FILE, ExtraTensor, ParamSlot, SaveMeta
from ucp_deepspeed.format.paths import optim_prefix
from ucp_deepspeed.format.topology import BF16_OPTIMIZER, Topology
from ucp_deepspeed.geometry.fragments import saved_numel
from ucp_deepspeed.geometry.layout import REPLICATED, Axis, Layout
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.naming.rules import Rule
from ucp_deepspeed.sources.autotp import autotp_layouts, is_autotp_record
from ucp_deepspeed.sources.keys import DEEPSPEED_KEYS
from ucp_deepspeed.sources.megatron_deepspeed import is_megatron_deepspeed_record, megatron_deepspeed_layouts
from ucp_deepspeed.sources.model_states import LayerStatesFile, ModelStatesFile
from ucp_deepspeed.sources.optim_file import OptimRankFile

INFERRED = "from DeepSpeed's files, no ucp metadata"

GroupOrder = tuple[tuple[str, ...], ...]
"""The names of each optimizer param group's parameters, in the order torch's state dict numbers them."""


class Placement(enum.Enum):
    """How a plain ZeRO-0 save's numbered optimizer state is named when no loading engine's groups name it."""

    STRICT = "strict"
    """A position only where its shape names one parameter, else refused: what a conversion needs."""
    LOOSE = "loose"
    """Where shapes repeat, in module order: enough to check and describe the files (`ucp inspect`, `ucp verify`),
    never to convert them."""


_LAYER_INDEX = re.compile(r"([0-9]+)\.")  # a PipelineModule names its layers' tensors `<layer index>.<name>`

RULES_HINT = (
    'Pass layout rules (`ucp convert --layout-rules rules.json`, or "checkpoint": {"universal": '
    '{"layout_rules": ...}}) saying how each parameter was split, e.g. '
    '[{"match": ".*\\\\.(q|k|v)_proj\\\\.weight", "layout": "split", "dim": 0}, '
    '{"match": ".*\\\\.o_proj\\\\.weight", "layout": "split", "dim": 1}, '
    '{"match": ".*", "layout": "replicated"}]'
)


def _model_states_paths(tag_dir: str) -> dict[int, str]:
    """Model-parallel rank -> its (data-parallel rank 0) model-states file."""
    out = {}
    for name in st.listdir(tag_dir):
        m = re.fullmatch(r"(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt", name)
        if m:
            out[int(m.group(1))] = st.join(tag_dir, name)
    return out


def _dtype(ds_config: dict[str, Any]) -> str:
    for name in ("bf16", "fp16"):
        if (ds_config.get(name) or {}).get("enabled"):
            return name
    return "fp32"


def infer_metas(
    tag_dir: str, rules: Sequence[Rule] = (), order: GroupOrder | Placement | None = None
) -> list[SaveMeta]:
    """Save-time metadata of every model-parallel rank, rebuilt from DeepSpeed's own files (`order`: the names of the
    loading engine's optimizer groups, which place a ZeRO-0 save's numbered optimizer state)."""
    paths = _model_states_paths(tag_dir)
    if not paths:
        raise CheckpointError(tag_dir, "no DeepSpeed model-states file (mp_rank_XX_model_states.pt)")
    with ModelStatesFile(paths[min(paths)]) as first:
        tp, pp, sp = first.parallel_sizes()
        layered = first.layers_apart()
    if pp > 1 and not layered:
        raise CheckpointError(
            tag_dir,
            f"saved with pipeline parallelism ({pp} stages) and without ucp_deepspeed "
            "metadata: stage files number their layers locally, so the full model's layer "
            "order is unknown. Save through ucp_deepspeed to reshard pipeline checkpoints",
        )
    missing = [f"mp_rank_{r:02d}" for r in range(tp * pp) if r not in paths]
    if missing:
        raise CheckpointError(
            tag_dir,
            f"saved at tensor-parallel size {tp} and pipeline size {pp} but model-states files of "
            f"{', '.join(missing)} are missing",
        )
    if len(paths) != tp * pp:  # DeepSpeed before checkpoint_parallel_dimensions: stage files look like more ranks
        raise CheckpointError(
            tag_dir,
            f"{len(paths)} model-parallel ranks' files for tensor-parallel size {tp}: "
            "pipeline stages, whose layer order is unknown without ucp_deepspeed metadata",
        )
    recorded = _recorded_layouts(paths, tp, pp) if tp > 1 else {}
    metas = [_infer_rank(tag_dir, paths[r], r, tp, rules, pp, layered, recorded, order) for r in range(tp * pp)]
    return [dataclasses.replace(m, topology=dataclasses.replace(m.topology, sp=sp)) for m in metas]


def _recorded_layouts(paths: dict[int, str], tp: int, pp: int) -> dict[str, Layout]:
    """Layouts from a record DeepSpeed's files carry, over each pipeline stage's tensor-parallel ranks: AutoTP's
    (`sources.autotp`) or Megatron-DeepSpeed's (`sources.megatron_deepspeed`); empty for a checkpoint without one."""
    out: dict[str, Layout] = {}
    for stage in range(pp):
        shapes: list[dict[str, tuple[int, ...]]] = []
        for rank in range(tp):
            with ModelStatesFile(paths[stage * tp + rank]) as states:
                if rank == 0:
                    info, args = states.entry("universal_checkpoint_info"), states.entry("args")
                    if pp == 1 and is_autotp_record(info, states.entry("ds_config") or {}):
                        layouts: Any = autotp_layouts
                    elif is_megatron_deepspeed_record(info, args):
                        layouts = functools.partial(megatron_deepspeed_layouts, args=args)
                    else:
                        return {}
                shapes.append(_local_shapes(states))
        out |= layouts(info, shapes, path=paths[stage * tp])
    return out


def _local_shapes(states: ModelStatesFile) -> dict[str, tuple[int, ...]]:
    """The local shape of every parameter a rank saved: trainable (`param_shapes`) and frozen ones."""
    local = {n: tuple(s) for group in states.entry("param_shapes") or [] for n, s in group.items()}
    local |= {n: tuple(s) for n, s in (states.entry("frozen_param_shapes") or {}).items()}
    # ZeRO-1/2 keep frozen parameters in the module, beside buffers and tied copies, which have no layout
    others = set(states.entry("buffer_names") or []) | set(states.entry("shared_params") or {})
    for name, tensor in states.module_tensors().items():
        if name not in others:
            local.setdefault(name, tuple(tensor.shape))
    return local


def _layer_extras(
    tag_dir: str,
    mp_rank: int,
    tp: int,
    trainable: list[str],
    buffers: list[str],
    rules: Sequence[Rule],
    path: str,
    recorded: dict[str, Layout],
) -> list[ExtraTensor]:
    """A `PipelineModule` stage's buffers and frozen weights, from the layer files of the layers it trains.

    Frozen weights are what those files hold beyond the trainable parameters and buffers; DeepSpeed names
    neither per layer, so a buffer of a tied module (no layer index in its name) is refused.
    """
    known = set(trainable) | set(buffers)
    layers = sorted({int(m.group(1)) for n in [*trainable, *buffers] if (m := _LAYER_INDEX.match(n))})
    extras = []
    for layer in layers:
        # the topology's tensor-parallel axis, when it has one, names the file (even at size 1)
        names = [f"layer_{layer:02d}-model_{mp_rank % tp:02d}-model_states.pt"]
        names += [f"layer_{layer:02d}-model_states.pt"] if tp == 1 else []
        file = next((n for n in names if st.isfile(st.join(tag_dir, n))), None)
        if file is None:
            raise CheckpointError(st.join(tag_dir, names[-1]), "pipeline layer file is missing")
        with LayerStatesFile(st.join(tag_dir, file)) as states:
            for key in states.keys():
                name = f"{layer}.{key}"
                if name in trainable:
                    continue
                tensor = states.tensor(key)
                kind = "buffer" if name in known else "frozen"
                dtype = dtype_name(tensor.dtype)
                extras.append(ExtraTensor(name, tuple(tensor.shape), dtype, kind, file=file, key=key))
    layouts = _layouts([e.name for e in extras if e.kind == "frozen"], tp, rules, path, recorded)
    extras = [dataclasses.replace(e, layout=layouts[e.name]) if e.name in layouts else e for e in extras]
    unplaced = sorted(set(buffers) - {e.name for e in extras})
    if unplaced:
        raise CheckpointError(
            path,
            f"buffers {unplaced[:6]} of a PipelineModule saved without ucp_deepspeed metadata are in no layer "
            "file named by their layer index (a tied module's?). Save through ucp_deepspeed to reshard them",
        )
    return extras


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """What one model-parallel rank's model-states file says of its parameters (DeepSpeed's own entries)."""

    ds_config: dict[str, Any]
    dp: int
    stage: int
    shapes: list[dict[str, tuple[int, ...]]]
    shared: dict[str, str]
    buffers: list[str]
    frozen: list[str]
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen_excluded: bool
    frozen_tensors: dict[str, Any]
    buffer_tensors: dict[str, Any]
    client_keys: tuple[str, ...]
    version: str
    stacks: dict[str, int] = dataclasses.field(default_factory=dict)
    """DeepSpeed AutoEP's expert stacks (`<layer>.experts.w1`, ...): their local experts per expert-parallel rank."""


def _stage(states: ModelStatesFile) -> int:
    """The ZeRO stage of the save: ZeRO-3 names its model-states files per data-parallel rank."""
    ds_config = states.entry("ds_config") or {}
    zero3 = st.basename(states.path).startswith("zero_pp_rank_")
    return 3 if zero3 else int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def _recorded(states: ModelStatesFile) -> _Recorded:
    """Read the model-states file's own account of the parameters (ZeRO-1/2/3), refusing what it cannot tell."""
    ds_config = states.entry("ds_config") or {}
    stage = _stage(states)
    shapes = [{name: tuple(shape) for name, shape in group.items()} for group in states.entry("param_shapes")]
    shared = dict(states.entry("shared_params") or {})
    buffers = list(states.entry("buffer_names") or [])
    frozen_shapes = {n: tuple(s) for n, s in (states.entry("frozen_param_shapes") or {}).items()}
    module = states.module_tensors()
    trainable = {n for group in shapes for n in group}
    if stage != 3:  # a module reached under two names (AutoEP's `gate` for its `router`) saves one storage twice
        shared |= _aliases(module, trainable, set(shared) | set(buffers))
    # ZeRO-3 saves empty placeholders for partitioned parameters; below ZeRO-3 frozen ones are in the module
    frozen = (
        list(frozen_shapes) if stage == 3 else [n for n in module if n not in trainable | set(shared) | set(buffers)]
    )
    return _Recorded(
        ds_config=ds_config,
        dp=int(states.entry("dp_world_size")),
        stage=stage,
        shapes=shapes,
        shared=shared,
        buffers=buffers,
        frozen=frozen,
        frozen_shapes=frozen_shapes,
        # ZeRO-2/3 record frozen parameters unless saved with exclude_frozen_parameters=True, which writes None
        frozen_excluded=stage >= 2 and states.entry("frozen_param_shapes") is None,
        frozen_tensors={n: states.frozen_fragment(n) if stage == 3 else module[n] for n in frozen},
        buffer_tensors={n: module[n] for n in buffers if n in module},
        client_keys=tuple(k for k in states.keys() if k not in DEEPSPEED_KEYS),
        version=str(states.entry("ds_version", "")),
        stacks=_autoep_stacks(states),
    )


def _aliases(module: dict[str, Any], trainable: set[str], known: set[str]) -> dict[str, str]:
    """Module entries that are another parameter under a second name (one storage, saved once by torch): alias ->
    the name DeepSpeed records for it (`trainable`), else the first name."""
    owners: dict[tuple[str, int, tuple[int, ...]], str] = {}
    for name in sorted(module, key=lambda n: n not in trainable):  # stable: module order within each kind
        if name not in known:
            tensor = module[name]
            owners.setdefault((tensor.key, tensor.storage_offset, tuple(tensor.shape)), name)
    out = {}
    for name, tensor in module.items():
        owner = owners.get((tensor.key, tensor.storage_offset, tuple(tensor.shape)))
        if owner is not None and owner != name and name not in known:
            out[name] = owner
    return out


def _autoep_stacks(states: ModelStatesFile) -> dict[str, int]:
    """Each AutoEP expert stack's local expert count, from the layers DeepSpeed records (`ds_autoep_layers`), whose
    placement must give each expert-parallel rank its contiguous run of experts in rank order (AutoEP's default)."""
    out = {}
    for layer in states.entry("ds_autoep_layers") or []:
        local, size = int(layer["num_local_experts"]), int(layer["ep_size"])
        placement = layer.get("expert_placement") or {}
        runs = {int(r["rank"]): [int(e) for e in r["experts"]] for r in placement.get("ranks") or []}
        if runs != {r: list(range(r * local, (r + 1) * local)) for r in range(size)}:
            raise CheckpointError(
                states.path,
                f"AutoEP layer {layer.get('module_path')!r} places its experts {runs}; only each rank's contiguous "
                "run in rank order (AutoEP's default placement) is supported",
            )
        for weight in ("w1", "w2", "w3"):
            out[f"{layer['expert_key_prefix']}.{weight}"] = local
    return out


def _recorded_bf16_stages(tag_dir: str, states: ModelStatesFile, mp_rank: int, tp: int, layered: bool) -> _Recorded:
    """A bf16 `PipelineModule` at ZeRO-0, which DeepSpeed trains with its BF16_Optimizer: its model-states files
    record no `param_shapes`, so each flat group's parameters and places come from the `param_slice_mappings` of every
    data-parallel rank's optimizer file (which fragment of which parameter each partition holds) and their shapes
    from the layer files; a tied module's weights from the layer file that holds its first copy."""
    path = states.path
    if not layered:
        raise CheckpointError(path, "saved in bf16 at ZeRO stage 0 without a PipelineModule: DeepSpeed's FP16 wrapper")
    ds_config = states.entry("ds_config") or {}
    dp = int(states.entry("dp_world_size"))
    fragments: dict[int, dict[str, tuple[int, int]]] = {}  # flat -> name -> (first element, elements)
    for rank in range(dp):
        optim_path = st.join(tag_dir, f"bf16_zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
        if not st.isfile(optim_path):
            raise CheckpointError(optim_path, f"optimizer file of data-parallel rank {rank} is missing")
        with OptimRankFile(optim_path, 0) as optim:
            mappings = optim.entry("param_slice_mappings")
            if not isinstance(mappings, list) or len(mappings) != optim.num_flat:
                raise CheckpointError(optim_path, "records no param_slice_mappings of its flat groups")
            for flat, mapping in enumerate(mappings):
                partition = int(optim.flat(flat, FP32).shape[0])  # every rank's, padding included
                for name, address in (mapping or {}).items():
                    begin, count = rank * partition + int(address.start), int(address.numel)
                    first, total = fragments.setdefault(flat, {}).get(name, (begin, 0))
                    if first + total != begin:
                        raise CheckpointError(optim_path, f"'{name}': its fragments are not contiguous in flat {flat}")
                    fragments[flat][name] = (first, total + count)
    shapes = _layer_shapes(tag_dir, mp_rank, tp, {n for group in fragments.values() for n in group}, path)
    ordered = []
    for flat in range(len(fragments)):
        by_place = sorted(fragments[flat].items(), key=lambda item: item[1][0])
        group = {}
        for name, (_, count) in by_place:
            if math.prod(shapes[name]) != count:
                raise CheckpointError(path, f"'{name}' is {list(shapes[name])} in its layer file, {count} elements")
            group[name] = shapes[name]
        ordered.append(group)
    return _Recorded(
        ds_config=ds_config,
        dp=dp,
        stage=0,
        shapes=ordered,
        shared={},
        buffers=list(states.entry("buffer_names") or []),
        frozen=[],
        frozen_shapes={},
        frozen_excluded=False,
        frozen_tensors={},
        buffer_tensors={},
        client_keys=tuple(k for k in states.keys() if k not in DEEPSPEED_KEYS),
        version=str(states.entry("ds_version", "")),
    )


def _layer_shapes(tag_dir: str, mp_rank: int, tp: int, names: set[str], path: str) -> dict[str, tuple[int, ...]]:
    """The shape of each `PipelineModule` parameter named `<layer>.<key>` or `tied_modules.<tie>.<key>`, from the
    layer files: a tied module's weights are in the file of the layer that holds its first copy, whichever stage."""
    files = sorted(n for n in st.listdir(tag_dir) if LAYER_FILE.fullmatch(n))
    mine = [n for n in files if tp == 1 or f"-model_{mp_rank % tp:02d}-" in n]
    out: dict[str, tuple[int, ...]] = {}
    tied = {n for n in names if n.startswith("tied_modules.")}
    numbered = {int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))}
    for file in mine:
        layer = int(file.split("_", 1)[1].split("-", 1)[0])
        with LayerStatesFile(st.join(tag_dir, file)) as states:
            for key in states.keys():
                shape = tuple(states.tensor(key).shape)
                if f"{layer}.{key}" in names:
                    out[f"{layer}.{key}"] = shape
                for name in tied:  # the tied module's file: a layer no numbered parameter names
                    if layer not in numbered and name.split(".", 2)[2] == key:
                        out.setdefault(name, shape)
    missing = sorted(names - set(out))
    if missing:
        raise CheckpointError(path, f"parameters {missing[:6]} are in no pipeline layer file of this stage's rank")
    return out


def _infer_whole(
    states: ModelStatesFile, tp: int, pp: int, layered: bool, order: GroupOrder | Placement | None
) -> SaveMeta:
    """ZeRO-0 in fp32: DeepSpeed saved the module whole and the torch optimizer's state dict, which numbers the
    parameters of each group by position, as torch's own `load_state_dict` reads them. The positions are named by the
    loading engine's groups (`order`), or, without one, by shape where a shape names one parameter; the states'
    shapes must equal the parameters' either way."""
    path = states.path
    if tp > 1 or pp > 1 or layered:
        raise CheckpointError(
            path,
            "saved without ucp_deepspeed metadata at ZeRO stage 0 with tensor or pipeline parallelism: each stage's "
            "torch optimizer numbers its own parameters, and which is which is not recorded. Save through "
            "ucp_deepspeed, or use ZeRO stage 1, 2 or 3",
        )
    ds_config = states.entry("ds_config") or {}
    if _dtype(ds_config) != "fp32":
        raise CheckpointError(path, f"saved at ZeRO stage 0 in {_dtype(ds_config)}: DeepSpeed's FP16 optimizer wrapper")
    hyperparams, _ = states.optimizer_groups()
    indices = states.optimizer_group_indices()
    buffers = list(states.entry("buffer_names") or [])
    module = states.module_tensors()
    # tied parameters are one tensor under two names (torch.save keeps a storage once): the first name owns it
    tied = _aliases(module, set(), set(buffers))
    candidates = [n for n in module if n not in tied and n not in buffers]
    keys = states.optimizer_state_keys()
    placed = _place_whole(states, indices, keys, candidates, module, order)
    slots = [
        ParamSlot(name, tuple(module[name].shape), group=g, flat=index, offset=0, partition=module[name].numel())
        for (g, index), name in placed.items()
    ]
    owned = set(placed.values())
    extras = [
        ExtraTensor(n, tuple(module[n].shape), dtype_name(module[n].dtype), "frozen")
        for n in candidates
        if n not in owned
    ]
    extras += [ExtraTensor(n, tuple(module[n].shape), dtype_name(module[n].dtype), "buffer") for n in buffers]
    return SaveMeta(
        topology=Topology(dp=int(states.entry("dp_world_size")), zero_stage=0, dtype="fp32"),
        params=tuple(slots),
        extras=tuple(extras),
        tied=tied,
        num_groups=len(hyperparams),
        client_state_keys=tuple(k for k in states.keys() if k not in DEEPSPEED_KEYS),
        versions={"deepspeed": str(states.entry("ds_version", "")), "inferred": INFERRED},
    )


def _place_whole(
    states: ModelStatesFile,
    indices: list[list[int]],
    keys: list[str],
    candidates: list[str],
    module: dict[str, Any],
    order: GroupOrder | Placement | None,
) -> dict[tuple[int, int], str]:
    """(param group, state index) -> parameter name, for every parameter of the saved torch optimizer."""
    path = states.path

    def saved_shape(index: int) -> tuple[int, ...] | None:
        found = {tuple(states.optimizer_state(index, key).shape) for key in keys if _has_state(states, index, key)}
        return found.pop() if len(found) == 1 else None

    out: dict[tuple[int, int], str] = {}
    if isinstance(order, tuple):
        if [len(g) for g in order] != [len(g) for g in indices]:
            raise CheckpointError(
                path,
                f"the saved optimizer's groups hold {[len(g) for g in indices]} parameters, the loading engine's "
                f"{[len(g) for g in order]}: not this model's optimizer, or its groups are built another way",
            )
        for g, (names, saved) in enumerate(zip(order, indices)):
            for name, index in zip(names, saved):
                shape = saved_shape(index)
                if shape is None and name in module:  # never stepped: frozen in the saving job
                    continue
                if name not in module or shape != tuple(module[name].shape):
                    have = list(module[name].shape) if name in module else "no such tensor"
                    raise CheckpointError(
                        path,
                        f"the loading engine's optimizer puts '{name}' at position {index} of group {g}, where the "
                        f"saved state is shaped {list(shape or ())} and the saved module has {have}",
                    )
                out[g, index] = name
        return out
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name in candidates:
        by_shape.setdefault(tuple(module[name].shape), []).append(name)
    unclear = []
    for g, saved in enumerate(indices):
        for index in saved:
            shape = saved_shape(index)
            if shape is None:  # never stepped: frozen in the saving job
                continue
            matches = by_shape.get(shape, [])
            if len(matches) == 1 or (order is Placement.LOOSE and matches):
                out[g, index] = matches.pop(0)  # claimed: no other position takes it
            else:
                unclear.append((index, matches or [f"no tensor of shape {list(shape)}"]))
    if unclear:
        shown = "; ".join(f"position {i}: {', '.join(n[:4])}" for i, n in unclear[:6])
        raise CheckpointError(
            path,
            "saved without ucp_deepspeed metadata at ZeRO stage 0: the torch optimizer's state numbers its "
            f"parameters, and their shapes do not tell which is which ({shown}). Load it into the engine with "
            "engine.load_checkpoint (its optimizer's groups name them), or save through ucp_deepspeed",
        )
    return out


def _has_state(states: ModelStatesFile, index: int, key: str) -> bool:
    try:
        states.optimizer_state(index, key)
    except CheckpointError:
        return False
    return True


def _optimizer_class(optim: OptimRankFile, stage: int, dtype: str) -> str:
    """The class of DeepSpeed's optimizer wrapper that wrote the file. Every bf16 engine's files are named alike; a
    ZeRO-1/2 optimizer records its `zero_stage`, DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16 and fp32 gradient
    accumulation) does not, and saves its partitions with the alignment padding."""
    if stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if optim.entry("zero_stage") is not None:
        return "DeepSpeedZeroOptimizer"
    if dtype == "bf16" and stage in (0, 1):
        return BF16_OPTIMIZER
    raise CheckpointError(optim.path, f"records no zero_stage, as a ZeRO-{stage} optimizer file does")


def _infer_rank(
    tag_dir: str,
    model_path: str,
    mp_rank: int,
    tp: int,
    rules: Sequence[Rule],
    pp: int,
    layered: bool,
    recorded: dict[str, Layout],
    order: GroupOrder | Placement | None,
) -> SaveMeta:
    """One model-parallel rank's metadata; `layered`: a `PipelineModule`, whose layers' tensors are in layer files;
    `recorded`: layouts AutoTP or Megatron-DeepSpeed recorded, which rules override; `order`: the loading engine's
    optimizer groups."""
    with ModelStatesFile(model_path) as states:
        if _stage(states) != 0:
            rec = _recorded(states)
        elif _dtype(states.entry("ds_config") or {}) == "fp32":
            return _infer_whole(states, tp, pp, layered, order)
        else:
            rec = _recorded_bf16_stages(tag_dir, states, mp_rank, tp, layered)
    if (rec.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise CheckpointError(
            model_path,
            "saved with zero_optimization.round_robin_gradients and without ucp_deepspeed "
            "metadata: the flat order differs from param_shapes and is not recorded",
        )
    dtype = _dtype(rec.ds_config)
    trainable = [n for group in rec.shapes for n in group]
    layouts = _layouts(trainable + rec.frozen, tp, rules, model_path, recorded)
    optim_path = st.join(tag_dir, f"{optim_prefix(dtype)}zero_pp_rank_0_mp_rank_{mp_rank:02d}_optim_states.pt")
    if not st.isfile(optim_path):
        raise CheckpointError(optim_path, "optimizer file of data-parallel rank 0 is missing")
    with OptimRankFile(optim_path, rec.stage) as optim:
        optimizer = _optimizer_class(optim, rec.stage, dtype)
        slots, num_groups, ep = _slots(optim, rec, layouts, padded=optimizer == BF16_OPTIMIZER)
    if ep > 1:
        _check_expert_placement(tag_dir, mp_rank, slots, dtype, rec.stacks)
    extras = _layer_extras(tag_dir, mp_rank, tp, trainable, rec.buffers, rules, model_path, recorded) if layered else []
    extras += _frozen_and_buffers(rec, layouts, buffers=not layered)
    return SaveMeta(
        topology=Topology(dp=rec.dp, zero_stage=rec.stage, dtype=dtype, tp=tp, pp=pp, ep=ep, optimizer=optimizer),
        params=tuple(slots),
        extras=tuple(extras),
        tied=rec.shared,
        num_groups=num_groups,
        client_state_keys=rec.client_keys,
        tp_rank=mp_rank % tp,
        pp_rank=mp_rank // tp,
        frozen_excluded=rec.frozen_excluded,
        versions={"deepspeed": rec.version, "inferred": INFERRED},
    )


def _frozen_and_buffers(rec: _Recorded, layouts: dict[str, Layout], buffers: bool) -> list[ExtraTensor]:
    """The frozen parameters the model-states file holds whole (at ZeRO-3, each rank's partition: its first dim),
    and, unless a pipeline's layer files hold them, its buffers."""
    extras = []
    for name in rec.frozen:
        tensor = rec.frozen_tensors[name]
        shape, partition = tuple(rec.frozen_shapes.get(name, tensor.shape)), tensor.shape[0] if rec.stage == 3 else 0
        extras.append(
            ExtraTensor(
                name=name,
                shape=shape,
                dtype=dtype_name(tensor.dtype),
                kind="frozen",
                partition=int(partition),
                layout=layouts[name],
            )
        )
    for name in rec.buffers if buffers else []:
        tensor = rec.buffer_tensors[name]
        extras.append(ExtraTensor(name=name, shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype), kind="buffer"))
    return extras


def _slots(
    optim: OptimRankFile, rec: _Recorded, layouts: dict[str, Layout], padded: bool
) -> tuple[list[ParamSlot], int, int]:
    """Every trainable parameter's place in the flat buffers of data-parallel rank 0's optimizer file, how many
    param groups the optimizer has, and the expert-parallel size."""
    path = optim.path
    if optim.num_flat != len(rec.shapes):
        raise CheckpointError(path, f"{optim.num_flat} flat buffers but param_shapes lists {len(rec.shapes)}")
    sizes = [optim.flat(i, FP32).shape[0] for i in range(optim.num_flat)]
    groups = [optim.group_of_flat(i) for i in range(optim.num_flat)]
    experts = _expert_sizes(optim, rec)
    mappings = optim.entry("param_slice_mappings") if rec.stage != 3 else None
    slots = []
    for i, group in enumerate(rec.shapes):
        if rec.stage == 3:
            slots += _zero3_slots(group, i, groups[i], sizes[i], rec.dp, layouts, path)
            continue
        mapping = mappings[i] if mappings else None
        ep = experts.get(groups[i], 1)
        local = _zero12_slots(group, i, groups[i], sizes[i], rec.dp // ep, layouts, mapping, path, padded)
        slots += local if ep == 1 else _every_expert_rank(local, ep, rec.dp, rec.stacks, path)
    return slots, len(optim.hyperparams() or sizes), max(experts.values(), default=1)


_EXPERTS = re.compile(r"(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)([0-9]+)(\..*)")
"""A DeepSpeed MoE layer's local expert parameter: prefix, local id, rest."""


def _expert_sizes(optim: OptimRankFile, rec: _Recorded) -> dict[int, int]:
    """The expert-parallel size of each param group that holds DeepSpeed MoE experts (`moe`, named `ep_size_<E>`)."""
    out = {}
    for g, hyper in enumerate(optim.hyperparams() or []):
        if not (hyper or {}).get("moe"):
            continue
        found = re.fullmatch(r"ep_size_([0-9]+)", str(hyper.get("name", "")))
        if found is None or rec.dp % int(found.group(1)):
            raise CheckpointError(
                optim.path, f"param group {g} holds experts but its name {hyper.get('name')!r} gives no expert size"
            )
        if rec.stage == 3:
            raise CheckpointError(
                optim.path,
                "a DeepSpeed MoE model saved at ZeRO-3 without ucp_deepspeed metadata: which files hold which "
                "experts' partitions is not recorded. Save through ucp_deepspeed, or use ZeRO stage 1 or 2",
            )
        out[g] = int(found.group(1))
    return out


def _check_expert_placement(
    tag_dir: str, mp_rank: int, slots: list[ParamSlot], dtype: str, stacks: dict[str, int]
) -> None:
    """The experts the metadata puts in each optimizer file are the ones there: the first elements of each expert
    flat's first parameter, on the first rank of each expert-parallel rank's group, equal that expert's weights in
    DeepSpeed's expert file (`layer_<L>_expert_<id>_mp_rank_<mp>_model_states.pt`, an AutoEP stack's first expert
    under `<stack>.<id>`), rounded to the run's precision.
    A job built with `use_data_before_expert_parallel_` partitions them over other ranks, and is refused."""
    files: dict[int, list[str]] = {}
    for name in st.listdir(tag_dir):
        found = re.fullmatch(rf"layer_[0-9]+_expert_([0-9]+)_mp_rank_{mp_rank:02d}_model_states\.pt", name)
        if found:
            files.setdefault(int(found.group(1)), []).append(st.join(tag_dir, name))
    firsts = [s for s in slots if s.ranks and s.offset == 0]
    for slot in firsts:
        if slot.name in stacks:
            expert = slot.ep_rank * stacks[slot.name]
            key = f"{slot.name}.{expert}"
        else:
            expert, key = int(_EXPERTS.fullmatch(slot.name).group(2)), slot.name  # type: ignore[union-attr]
        rank = slot.ranks[0]
        optim_path = st.join(tag_dir, f"{optim_prefix(dtype)}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
        weights = None
        for path in files.get(expert, []):
            with LayerStatesFile(path) as states:
                if key in states.keys():
                    tensor = states.tensor(key)
                    weights = tensor.read(0, min(64, tensor.numel()))
        if weights is None:
            raise CheckpointError(tag_dir, f"no expert file of expert {expert} holds '{key}'")
        with OptimRankFile(optim_path, 1) as optim:
            saved = optim.flat(slot.flat, FP32).read(0, weights.numel())
        if not torch.equal(saved.to(weights.dtype), weights):
            raise CheckpointError(
                optim_path,
                f"its experts are not expert {expert}'s ({slot.name} differs from its expert file): saved with "
                "use_data_before_expert_parallel_, whose placement is not recorded. Save through ucp_deepspeed",
            )


def _every_expert_rank(local: list[ParamSlot], ep: int, dp: int, stacks: dict[str, int], path: str) -> list[ParamSlot]:
    """A MoE group's slots for every expert-parallel rank: each holds its own experts in the same flat layout,
    partitioned over its expert-data-parallel group, DeepSpeed's ranks `e, e + ep, e + 2 ep, ...` (data parallel
    after expert parallel, its default; `_check_expert_placement` checks that against the expert files). A DeepSpeed
    MoE expert is named by its global id, `rank x local experts + local id`, as DeepSpeed names its expert files; an
    AutoEP stack keeps its name and is cut over the expert-parallel ranks along dim 0."""
    counts: dict[str, set[int]] = {}
    for slot in local:
        found = _EXPERTS.fullmatch(slot.name)
        if found is not None:
            counts.setdefault(found.group(1), set()).add(int(found.group(2)))
        elif slot.name not in stacks:
            raise CheckpointError(path, f"'{slot.name}' is in a param group of experts but is no DeepSpeed expert")
    out = []
    for e in range(ep):
        ranks = tuple(range(e, dp, ep))
        for slot in local:
            if slot.name in stacks:
                layout = Layout("split", 0, over=Axis.EXPERT)
                out.append(dataclasses.replace(slot, layout=layout, ep_rank=e, ranks=ranks))
                continue
            prefix, index, rest = _EXPERTS.fullmatch(slot.name).groups()  # type: ignore[union-attr]
            name = f"{prefix}{e * len(counts[prefix]) + int(index)}{rest}"
            out.append(dataclasses.replace(slot, name=name, local=slot.name if name != slot.name else "", ranks=ranks))
    return out


def _layouts(
    names: list[str], tp: int, rules: Sequence[Rule], path: str, recorded: dict[str, Layout] | None = None
) -> dict[str, Any]:
    """Each parameter's tensor-parallel layout: replicated at TP=1, from the rules or AutoTP's record otherwise;
    never guessed."""
    if tp == 1:
        return {n: REPLICATED for n in names}
    out, unknown = {}, []
    for name in names:
        layout = next((r.layout for r in rules if r.matches(name)), (recorded or {}).get(name))
        if layout is None:
            unknown.append(name)
        else:
            out[name] = layout
    if unknown:
        raise CheckpointError(
            path,
            f"saved at tensor-parallel size {tp} without ucp_deepspeed metadata, and "
            f"{len(unknown)} parameters have no layout rule: {', '.join(unknown[:12])}"
            f"{f' and {len(unknown) - 12} more' if len(unknown) > 12 else ''}. {RULES_HINT}",
        )
    return out


def _zero12_slots(
    group: dict[str, tuple[int, ...]],
    flat: int,
    group_id: int,
    rank0: int,
    dp: int,
    layouts: dict[str, Any],
    mapping: Any,
    path: str,
    padded: bool,
) -> list[ParamSlot]:
    """ZeRO-1/2: parameters back to back in the flat buffer, padded to a multiple of 2 x dp elements (DeepSpeed's
    alignment) and cut into dp partitions; rank 0's file holds `rank0` elements of it (`padded`: whole partitions,
    as BF16_Optimizer saves them)."""
    total = sum(math.prod(shape) for shape in group.values())
    partition = -(-total // (2 * dp)) * 2
    expected = saved_numel(total, partition, 0, padded)
    if rank0 != expected:
        raise CheckpointError(
            path,
            f"flat buffer {flat} holds {rank0} elements on rank 0, but its parameters ({total} elements) in {dp} "
            f"partitions of {partition} put {expected} there",
        )
    slots, offset = [], 0
    for name, shape in group.items():
        slot = ParamSlot(
            name, shape, group=group_id, flat=flat, offset=offset, partition=partition, layout=layouts[name]
        )
        if mapping is not None and offset < partition:  # rank 0's file says where its parameters start
            address = mapping.get(name)
            if address is None or int(address.start) != offset:
                raise CheckpointError(
                    path,
                    f"'{name}' is not at element {offset} of flat buffer {flat}, as "
                    "param_shapes order implies; this packing is not one ucp_deepspeed knows",
                )
        slots.append(slot)
        offset += math.prod(shape)
    return slots


def _zero3_slots(
    group: dict[str, tuple[int, ...]], flat: int, group_id: int, size: int, dp: int, layouts: dict[str, Any], path: str
) -> list[ParamSlot]:
    """ZeRO-3: each rank holds ceil(numel / dp) elements of every parameter, back to back."""
    slots, offset = [], 0
    for name, shape in group.items():
        partition = -(-math.prod(shape) // dp)
        slots.append(
            ParamSlot(name, shape, group=group_id, flat=flat, offset=offset, partition=partition, layout=layouts[name])
        )
        offset += partition
    if offset != size:
        raise CheckpointError(
            path,
            f"flat buffer {flat} has {size} elements per rank, but ZeRO-3 partitions of its parameters need {offset}",
        )
    return slots
