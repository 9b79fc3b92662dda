"""Synthetic DeepSpeed checkpoints at any rank count, written in seconds without training anything.

Conversion and resharding have to be measured and tested at data-parallel sizes of hundreds or a thousand ranks,
and at tensor x pipeline x data layouts of hundreds, but a real save needs that many ranks (or, in one process,
minutes per world). Here the files of a checkpoint tag are written directly: DeepSpeed's ZeRO-1/2/3 optimizer and
model-states files with the keys, nesting, dtypes and partition geometry DeepSpeed's own save gives them (fp32
training, AdamW), our metadata files, and `latest`. Every element of every state of every parameter holds its own
value, drawn from one counter, so a conversion that puts anything in the wrong place fails `torch.equal` against
`Synthetic.expected`. `tests/test_synth_source.py` keeps the files in step with a real DeepSpeed save.
"""

from __future__ import annotations

import math
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ucp_deepspeed import compat
from ucp_deepspeed.format.metadata import FP32, VALUE, ExtraTensor, ParamSlot, SaveMeta, write_meta
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.geometry.layout import REPLICATED, Layout
from ucp_deepspeed.io.torch_file import stamp
from ucp_deepspeed.version import __version__

STATES = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element states, saved beside the fp32 master."""
MICRO_BATCH = 2
WEIGHT_DECAY = (0.1, 0.0)
"""Per optimizer param group: weights decay, biases and norms do not."""
LR = 0.001
# float32 holds every integer up to 2**24 exactly: beyond it two elements could share a value
_MAX_VALUES = 1 << 24


@dataclass(frozen=True)
class SynthTensor:
    """One tensor of the synthetic model: a trainable parameter, a frozen one, or a buffer.

    `shape` is the full (tensor-parallel-merged) shape; `split` the dim tensor-parallel ranks cut it along (None:
    every rank holds it whole); `stage` the pipeline stage holding it; `local` its name in that stage's module when
    it differs from the global `name` (a stage numbers its layers from 0).
    """

    name: str
    shape: tuple[int, ...]
    group: int = 0
    kind: str = "param"
    split: int | None = None
    stage: int = 0
    local: str = ""

    @property
    def trainable(self) -> bool:
        """Whether the optimizer owns it (fp32 master and AdamW states in the flat partitions)."""
        return self.kind == "param"


@dataclass(frozen=True)
class SynthSpec:
    """The parallel layout and the tiny GPT-like model of a synthetic checkpoint.

    `tensors`, when given, replaces the GPT-like stack (`layers`, `hidden`, `vocab`), e.g. to mirror a real
    model's parameter list; they are listed in module state-dict order.
    """

    dp: int
    zero_stage: int
    tp: int = 1
    pp: int = 1
    layers: int = 4
    hidden: int = 8
    vocab: int = 32
    step: int = 3
    tensors: tuple[SynthTensor, ...] = ()

    def model(self) -> tuple[SynthTensor, ...]:
        """The tensors of the model, with their groups, tensor-parallel splits and pipeline stages."""
        return self.tensors or gpt_stack(self.layers, self.hidden, self.vocab, self.pp)


def gpt_stack(layers: int, hidden: int, vocab: int, pp: int) -> tuple[SynthTensor, ...]:
    """A vocab-parallel embedding, pre-norm MLP blocks (column- then row-parallel), a final norm and an untied head.

    Biases and norms are the second param group, small enough that at a large DP most ranks save nothing of it.
    Stage s holds a contiguous run of layers, numbered from 0 in its module as megatron-core numbers them; the
    embedding (with a frozen position table and a buffer) is on the first stage, the final norm and head on the
    last, so every stage holds a parameter of both groups.
    """
    if layers < pp:
        raise ValueError(f"{layers} layers cannot fill {pp} pipeline stages")
    first = [layer * pp // layers for layer in range(layers)]
    out = [
        SynthTensor("embed.weight", (vocab, hidden), 0, split=0),
        SynthTensor("embed.positions", (4, hidden), kind="frozen"),
        SynthTensor("embed.scale", (hidden,), kind="buffer"),
    ]
    for layer, stage in enumerate(first):
        number = layer - first.index(stage)
        for suffix, shape, group, split in (
            ("norm.weight", (hidden,), 1, None),
            ("norm.bias", (hidden,), 1, None),
            ("fc1.weight", (4 * hidden, hidden), 0, 0),
            ("fc1.bias", (4 * hidden,), 1, 0),
            ("fc2.weight", (hidden, 4 * hidden), 0, 1),
            ("fc2.bias", (hidden,), 1, None),
        ):
            local = f"layers.{number}.{suffix}" if number != layer else ""
            out.append(SynthTensor(f"layers.{layer}.{suffix}", shape, group, split=split, stage=stage, local=local))
    last = pp - 1
    out += [
        SynthTensor("final_norm.weight", (hidden,), 1, stage=last),
        SynthTensor("final_norm.bias", (hidden,), 1, stage=last),
        SynthTensor("head.weight", (vocab, hidden), 0, split=0, stage=last),
    ]
    return tuple(out)


@dataclass(frozen=True)
class Synthetic:
    """A written checkpoint tag and the full tensor of every state of every parameter it holds."""

    ckpt_dir: Path
    tag: str
    expected: dict[str, dict[str, torch.Tensor]]


def _values(model: tuple[SynthTensor, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Distinct values for every element of every state of every tensor, from one counter (0 stays for padding)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    counter = 1
    for t in model:
        numel = math.prod(t.shape)
        out[t.name] = {}
        for state in (FP32, *STATES) if t.trainable else (VALUE,):
            out[t.name][state] = torch.arange(counter, counter + numel, dtype=torch.float32).view(t.shape)
            counter += numel
    if counter > _MAX_VALUES:
        raise ValueError(f"{counter} values do not fit float32's exact integers; make the model smaller")
    return out


def _shard(full: torch.Tensor, t: SynthTensor, tp: int, tp_rank: int) -> torch.Tensor:
    """A tensor-parallel rank's share, as megatron-core cuts it: equal contiguous chunks along the split dim."""
    return full if t.split is None else full.chunk(tp, t.split)[tp_rank].clone()


def _local_shape(t: SynthTensor, tp: int) -> tuple[int, ...]:
    if t.split is None:
        return t.shape
    if t.shape[t.split] % tp:
        raise ValueError(f"{t.name}: dim {t.split} of {t.shape} cannot be split over {tp} tensor-parallel ranks")
    return tuple(n // tp if d == t.split else n for d, n in enumerate(t.shape))


def _ds_config(stage: int) -> dict[str, Any]:
    """The config `ucp_deepspeed.initialize` hands DeepSpeed (its own `checkpoint.universal` section taken out)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "checkpoint": {},
    }


def _param_groups(count: int) -> list[dict[str, Any]]:
    """The param groups of the base optimizer's state dict, one flat parameter each: those of a real AdamW given the
    same groups, so that a new torch's hyperparameter keys (and their order) follow."""
    groups = [{"params": [torch.zeros(1)], "weight_decay": WEIGHT_DECAY[g]} for g in range(count)]
    return torch.optim.AdamW(groups, lr=LR).state_dict()["param_groups"]


class _Stage:
    """One model-parallel rank (a tensor x pipeline coordinate): its tensors, flat groups and metadata."""

    def __init__(self, spec: SynthSpec, model: tuple[SynthTensor, ...], values: dict, tp_rank: int, pp_rank: int):
        self.spec, self.tp_rank, self.pp_rank = spec, tp_rank, pp_rank
        self.mp_rank = pp_rank * spec.tp + tp_rank
        self.tensors = [t for t in model if t.stage == pp_rank]
        self.groups = [[t for t in self.tensors if t.trainable and t.group == g] for g in range(2)]
        if not all(self.groups):
            raise ValueError(f"pipeline stage {pp_rank} holds no parameter of some param group; DeepSpeed drops it")
        self.local = {
            t.name: {k: _shard(v, t, spec.tp, tp_rank) for k, v in values[t.name].items()} for t in self.tensors
        }
        # a group's local parameters concatenated in group order: ZeRO's flat buffer before partitioning
        self.flat = [
            {k: torch.cat([self.local[t.name][k].reshape(-1) for t in group]) for k in (FP32, *STATES)}
            for group in self.groups
        ]

    def local_name(self, t: SynthTensor) -> str:
        return t.local or t.name

    def meta(self, save_id: str) -> SaveMeta:
        """What `runtime.capture.describe` records for this rank of a real engine."""
        spec, slots = self.spec, []
        for g, group in enumerate(self.groups):
            offset = 0
            for t in group:
                numel = math.prod(_local_shape(t, spec.tp))
                if spec.zero_stage == 3:
                    partition = -(-numel // spec.dp)
                else:
                    partition = self.zero12_partition(g)
                slots.append(
                    ParamSlot(
                        t.name,
                        _local_shape(t, spec.tp),
                        group=g,
                        flat=g,
                        offset=offset,
                        partition=partition,
                        layout=self.layout(t),
                        local=t.local,
                    )
                )
                offset += partition if spec.zero_stage == 3 else numel
        extras = [
            ExtraTensor(
                t.name,
                _local_shape(t, spec.tp),
                "float32",
                "frozen",
                -(-math.prod(_local_shape(t, spec.tp)) // spec.dp) if spec.zero_stage == 3 else 0,
                self.layout(t),
                t.local,
            )
            for t in self.tensors
            if t.kind == "frozen"
        ]
        extras += [
            ExtraTensor(t.name, t.shape, "float32", "buffer", local=t.local) for t in self.tensors if t.kind == "buffer"
        ]
        kernel = compat.optimizer_kernel(torch.optim.AdamW([torch.zeros(1)]))
        return SaveMeta(
            topology=Topology(
                dp=spec.dp,
                zero_stage=spec.zero_stage,
                dtype="fp32",
                tp=spec.tp,
                pp=spec.pp,
                optimizer="DeepSpeedZeroOptimizer_Stage3" if spec.zero_stage == 3 else "DeepSpeedZeroOptimizer",
            ),
            params=tuple(slots),
            extras=tuple(extras),
            num_groups=len(self.groups),
            versions={
                "ucp_deepspeed": __version__,
                "deepspeed": deepspeed.__version__,
                "torch": torch.__version__,
                "base_optimizer": "AdamW",
            },
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            save_id=save_id,
            optimizer={"class": kernel.qualname, "algorithm": kernel.algorithm, "states": kernel.states},
        )

    def layout(self, t: SynthTensor) -> Layout:
        return REPLICATED if t.split is None else Layout("split", t.split)

    def zero12_partition(self, g: int) -> int:
        """ZeRO-1/2 pads a flat group to a multiple of 2 x DP (`nccl_start_alignment_factor`) and cuts it in DP."""
        align = 2 * self.spec.dp
        return -(-self.flat[g][FP32].numel() // align) * align // self.spec.dp

    def common(self, module: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """A model-states file's entries (`DeepSpeedEngine._common_checkpoint_state`)."""
        spec = self.spec
        return {
            "module": module,
            "buffer_names": [self.local_name(t) for t in self.tensors if t.kind == "buffer"],
            "optimizer": None,
            "param_shapes": [
                OrderedDict((self.local_name(t), torch.Size(_local_shape(t, spec.tp))) for t in group)
                for group in self.groups
            ],
            "frozen_param_shapes": None
            if frozen is None
            else OrderedDict(
                (self.local_name(t), torch.Size(_local_shape(t, spec.tp))) for t in self.tensors if t.kind == "frozen"
            ),
            "shared_params": {},
            "frozen_param_fragments": frozen,
            "lr_scheduler": {"last_batch_iteration": spec.step - 1},
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": spec.step,
            "global_samples": spec.step * MICRO_BATCH * spec.dp,
            "dp_world_size": spec.dp,
            "mp_world_size": spec.tp * spec.pp,
            "checkpoint_parallel_dimensions": {"pp_degree": spec.pp, "tp_degree": spec.tp},
            "ds_config": _ds_config(spec.zero_stage),
            "ds_version": deepspeed.__version__,
        }

    def value(self, t: SynthTensor) -> torch.Tensor:
        return self.local[t.name][FP32 if t.trainable else VALUE]

    def write(self, tag_dir: str, save_id: str) -> None:
        if self.spec.zero_stage == 3:
            self.write_zero3(tag_dir, save_id)
        else:
            self.write_zero12(tag_dir, save_id)
        write_meta(self.meta(save_id), tag_dir, self.mp_rank)

    def write_zero12(self, tag_dir: str, save_id: str) -> None:
        spec, dp = self.spec, self.spec.dp
        frozen = (
            OrderedDict((self.local_name(t), self.value(t)) for t in self.tensors if t.kind == "frozen")
            if spec.zero_stage == 2
            else None
        )
        module = OrderedDict((self.local_name(t), self.value(t)) for t in self.tensors)
        _save(self.common(module, frozen), f"{tag_dir}/mp_rank_{self.mp_rank:02d}_model_states.pt", save_id)
        partitions = [self.zero12_partition(g) for g in range(len(self.groups))]
        padded = []
        for g, flat in enumerate(self.flat):
            rows = {}
            for key, tensor in flat.items():
                rows[key] = torch.zeros(dp * partitions[g])
                rows[key][: tensor.numel()] = tensor
            padded.append(rows)
        spans = [self.spans(group) for group in self.groups]
        groups = _param_groups(len(self.groups))
        for rank in range(dp):
            fp32, state, paddings, mappings = [], {}, [], []
            for g, part in enumerate(partitions):
                begin, numel = rank * part, self.flat[g][FP32].numel()
                saved = max(0, min(part, numel - begin))
                # the fp32 partition is saved without its alignment padding, the optimizer states with it
                fp32.append(padded[g][FP32][begin : begin + saved].clone())
                state[g] = {
                    "step": torch.tensor(float(spec.step)),
                    **{k: padded[g][k][begin : begin + part].clone() for k in STATES},
                }
                paddings.append(part - saved)
                # where each parameter overlapping this partition starts in it, and how much of it is here
                mappings.append(
                    OrderedDict(
                        (name, fragment_address(numel=min(end, begin + part) - max(start, begin), start=lo - begin))
                        for name, start, end in spans[g]
                        for lo in [max(start, begin)]
                        if start < begin + part and end > begin
                    )
                )
            optim = {
                "loss_scaler": LossScaler(scale=1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": {"state": state, "param_groups": groups},
                "single_partition_of_fp32_groups": fp32,
                "zero_stage": ZeroStageEnum.gradients if spec.zero_stage == 2 else ZeroStageEnum.optimizer_states,
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(group) for group in self.groups],
                "partition_count": [dp] * len(self.groups),
                "ds_version": deepspeed.__version__,
                "param_slice_mappings": mappings,
            }
            self.save_optim(tag_dir, rank, optim, save_id)

    def spans(self, group: list[SynthTensor]) -> list[tuple[str, int, int]]:
        """(local name, first element, end) of each parameter of a flat group."""
        out, offset = [], 0
        for t in group:
            numel = math.prod(_local_shape(t, self.spec.tp))
            out.append((self.local_name(t), offset, offset + numel))
            offset += numel
        return out

    def write_zero3(self, tag_dir: str, save_id: str) -> None:
        spec, dp = self.spec, self.spec.dp
        # rank r's fp32 sub-group is row r: each parameter padded to a multiple of DP, cut in DP rows, side by side
        rows = [
            {key: torch.cat([_rows(self.local[t.name][key], dp) for t in group], dim=1) for key in (FP32, *STATES)}
            for group in self.groups
        ]
        frozen = [t for t in self.tensors if t.kind == "frozen"]
        frozen_rows = {t.name: _rows(self.value(t), dp) for t in frozen}
        groups = _param_groups(len(self.groups))
        for rank in range(dp):
            # a ZeRO-3 module keeps only placeholders of its partitioned parameters; buffers stay whole
            module = OrderedDict(
                (self.local_name(t), self.value(t) if t.kind == "buffer" else torch.empty(0)) for t in self.tensors
            )
            fragments = OrderedDict((self.local_name(t), frozen_rows[t.name][rank].clone()) for t in frozen)
            name = f"{tag_dir}/zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_model_states.pt"
            _save(self.common(module, fragments), name, save_id)
            state = {
                g: {"step": torch.tensor(float(spec.step)), **{k: row[k][rank].clone() for k in STATES}}
                for g, row in enumerate(rows)
            }
            optim = {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": LossScaler(scale=1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": dp,
                "optimizer_state_dict": {"state": state, "param_groups": groups},
                "fp32_flat_groups": [row[FP32][rank].clone() for row in rows],
            }
            self.save_optim(tag_dir, rank, optim, save_id)

    def save_optim(self, tag_dir: str, rank: int, optim: dict[str, Any], save_id: str) -> None:
        """An optimizer file as `DeepSpeedEngine._save_zero_checkpoint` writes it."""
        state = {
            "optimizer_state_dict": optim,
            "ds_config": _ds_config(self.spec.zero_stage),
            "ds_version": deepspeed.__version__,
        }
        _save(state, f"{tag_dir}/zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_optim_states.pt", save_id)


def _rows(tensor: torch.Tensor, dp: int) -> torch.Tensor:
    """A tensor flattened, zero-padded to a multiple of `dp` and cut in `dp` rows: ZeRO-3's partitions of it."""
    flat = tensor.reshape(-1)
    out = torch.zeros(-(-flat.numel() // dp) * dp)
    out[: flat.numel()] = flat
    return out.view(dp, -1)


def _save(obj: Any, path: str, save_id: str) -> None:
    torch.save(obj, path)
    stamp(path, save_id)


def synthesize(out: Path, spec: SynthSpec, tag: str = "global_step3") -> Synthetic:
    """Write checkpoint tag `tag` of a synthetic model at `spec`'s layout under `out`, as DeepSpeed and
    ucp_deepspeed would have saved it after `spec.step` AdamW steps.

    Args:
        out: the checkpoint folder (created); the tag folder and `latest` go in it.
        spec: parallel sizes, ZeRO stage and model.
        tag: the tag folder's name, also written to `latest`.

    Returns:
        Where the tag is, and the full value of every state (`FP32`, `exp_avg`, `exp_avg_sq`; `VALUE` for frozen
        parameters and buffers) of every tensor, by global name.
    """
    if spec.zero_stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {spec.zero_stage}: only the partitioned stages 1, 2 and 3 are synthesized")
    model = spec.model()
    values = _values(model)
    tag_dir = os.path.join(out, tag)
    os.makedirs(tag_dir, exist_ok=True)
    # one save, one id: every file carries it, as `runtime.checkpointer` stamps them
    save_id = f"{secrets.token_hex(8)}-1"
    for pp_rank in range(spec.pp):
        for tp_rank in range(spec.tp):
            _Stage(spec, model, values, tp_rank, pp_rank).write(tag_dir, save_id)
    Path(out, "latest").write_text(tag)
    return Synthetic(Path(out), tag, values)
