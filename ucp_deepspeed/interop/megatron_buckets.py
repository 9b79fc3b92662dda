"""megatron-core's `DistributedOptimizer` saved `dp_reshardable` (Megatron-LM's default), placed back on the parameters.

    [chained_<c>.]optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_(<param>, <grad>).bucket_idx_<b>.<state>
        one flat tensor per bucket and state (`param`: the fp32 copy; `exp_avg`, `exp_avg_sq`), as long as the
        bucket's parameters without its end padding; <c> is the optimizer of a ChainedOptimizer (dense, experts),
        <i> the rank in that optimizer's model-parallel group (TP x PP; for experts expert-TP x EP x PP), <g> a
        grad buffer of megatron-core's DDP
    [chained_<c>.]optimizer.distributed.dp_group_idx_<i>.per_bucket_numel_unpadded   those lengths, per buffer
    [chained_<c>.]optimizer.distributed.dp_group_idx_<i>.optimizer                   the param groups, with `step`

Nothing there names a parameter or an offset. megatron-core's DDP lays a buffer out by rule
(`param_and_grad_buffer.py`): its parameters in reverse `named_parameters` order, each starting on a multiple of 64
elements; a bucket closes once it holds the bucket size (only with `--overlap-grad-reduce`, on the first pipeline
stage) and around a tied embedding shared between pipeline stages, which gets a bucket of its own. This module
rebuilds that layout from the model the checkpoint stores beside it (its stacked tensors give every parameter's
shape) and the saving job's `args` (its TP, PP and EP sizes), checks every bucket's length against
`per_bucket_numel_unpadded`, and checks each parameter's range of `param` against the model's own weight stored
whole in the same checkpoint: a layout rebuilt wrong is refused, never read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.geometry.layout import Layout, merge, split
from ucp_deepspeed.sources.dcp import DcpCheckpoint, RangedReads

DISTRIBUTED = "optimizer.distributed.dp_group_idx_"
MASTER = "param"
ALIGN = 64  # a parameter starts on a multiple of 64 elements (128-byte alignment at 16 bits)
LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.experts."
# a transformer layer's modules in the order megatron-core registers them (local and Transformer Engine specs)
_LAYER_ORDER = (
    "input_layernorm.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.router.",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
    EXPERTS,
    "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
    "mlp.shared_experts.gate_weight",
)
_BUCKET_STATE = re.compile(r"(.*\.bucket_idx_[0-9]+)\.(.+)")  # a bucket's key, then the state it holds
# a module's parameters in registration order (Transformer Engine's fused norm first)
_LEAF_ORDER = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")
_BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


@dataclass(frozen=True)
class Local:
    """One parameter of one saving rank: a slice of a stored model tensor at that rank's tensor-parallel share."""

    key: str  # the stacked model tensor in the checkpoint
    index: tuple[int, ...]  # its layer (and expert) index in that tensor
    layout: Layout  # how the rank's tensor relates to the per-layer full tensor
    rank: int  # the tensor-parallel (expert-TP) rank
    size: int  # the tensor-parallel (expert-TP) size
    shape: tuple[int, ...]  # the rank's tensor
    shared: bool = False  # a tied embedding shared between pipeline stages: a bucket of its own
    copy: bool = False  # the last stage's copy of the tied embedding: the first stage's state, not read


@dataclass(frozen=True)
class Placed:
    """Where a parameter's state sits in its bucket: elements [start, start + numel)."""

    local: Local
    start: int

    @property
    def numel(self) -> int:
        """Its element count."""
        return math.prod(self.local.shape)


@dataclass(frozen=True)
class Saving:
    """The saving job's parallel sizes and DDP settings, from Megatron-LM's `args`."""

    tp: int
    pp: int
    ep: int
    etp: int
    layers: tuple[int, ...]  # layers per pipeline stage
    gated: bool
    tied: bool
    local_spec: bool  # megatron-core's local modules (`--transformer-impl local`), else Transformer Engine's
    grouped: bool  # `--moe-grouped-gemm`: Transformer Engine's GroupedLinear holds a layer's local experts
    bucket_size: int | None  # on the first pipeline stage; None: one bucket per buffer


def _count(a: dict[str, Any], key: str, path: str, default: int) -> int:
    """A non-negative integer of the saved args, or `default` where it is absent or None."""
    value = a.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise CheckpointError(path, f"args.{key} {value!r} is not a count")
    return value


# Megatron-LM settings that change a buffer's layout in ways this import does not rebuild
_UNSUPPORTED = {
    "virtual_pipeline_model_parallel_size": "a virtual pipeline (one buffer per model chunk)",
    "fp8": "FP8 parameters (a buffer of their own)",
    "use_precision_aware_optimizer": "a precision-aware optimizer",
    "ddp_num_buckets": "--ddp-num-buckets",
    "pipeline_model_parallel_layout": "a custom pipeline layout",
    "account_for_embedding_in_pipeline_split": "a pipeline split that counts the embedding",
    "account_for_loss_in_pipeline_split": "a pipeline split that counts the loss",
    "moe_use_legacy_grouped_gemm": "the legacy GroupedMLP (fused expert weights)",
}


def saving(args: Any, path: str, num_layers: int) -> Saving:
    """The layout facts of the saving job, refusing what its buffers cannot be rebuilt for."""
    a = args if isinstance(args, dict) else None
    if not a or "tensor_model_parallel_size" not in a:
        raise CheckpointError(
            path,
            "holds no Megatron-LM args (tensor_model_parallel_size, ...): the dp_reshardable buffers' layout "
            "cannot be rebuilt without the saving job's parallel sizes",
        )
    for key, what in _UNSUPPORTED.items():
        value = a.get(key)
        if value is None or value is False or (key == "virtual_pipeline_model_parallel_size" and value == 1):
            continue
        raise CheckpointError(path, f"was saved with {what} (args.{key}); its buffers are not rebuilt")
    tp, pp = _count(a, "tensor_model_parallel_size", path, 1), _count(a, "pipeline_model_parallel_size", path, 1)
    ep = _count(a, "expert_model_parallel_size", path, 1)
    head = _count(a, "decoder_first_pipeline_num_layers", path, 0)
    tail = _count(a, "decoder_last_pipeline_num_layers", path, 0)
    middle, rest = pp - (head > 0) - (tail > 0), num_layers - head - tail
    if pp == 1:
        layers: tuple[int, ...] = (num_layers,)
    elif min(tp, pp, ep) < 1 or rest < 0 or middle < 0 or (middle and rest % middle) or (not middle and rest):
        raise CheckpointError(path, f"{num_layers} layers do not split over {pp} pipeline stages as args say")
    else:
        each = [rest // middle] * middle if middle else []
        layers = tuple(([head] if head else []) + each + ([tail] if tail else []))
    dp_cp = _count(a, "data_parallel_size", path, 1) * _count(a, "context_parallel_size", path, 1)
    bucket = _count(a, "ddp_bucket_size", path, 0) or max(40_000_000, 1_000_000 * dp_cp)
    return Saving(
        tp=tp,
        pp=pp,
        ep=ep,
        etp=_count(a, "expert_tensor_parallel_size", path, tp),
        layers=layers,
        gated=bool(a.get("swiglu")),
        tied=not a.get("untie_embeddings_and_output_weights", False),
        local_spec=a.get("transformer_impl", "transformer_engine") == "local",
        grouped=bool(a.get("moe_grouped_gemm")),
        bucket_size=bucket if a.get("overlap_grad_reduce") else None,
    )


def _layout(name: str, rows: int, gated: bool) -> Layout:
    """How megatron-core splits a parameter over tensor-parallel ranks (its module by name)."""
    leaf = name.rpartition(".")[2]
    module = name.rpartition(".")[0]
    if leaf in ("layer_norm_weight", "layer_norm_bias"):
        return Layout()
    if module.endswith(("linear_qkv", "word_embeddings")) or name == "output_layer.weight":
        return Layout("split", 0)
    if module.endswith("linear_fc1"):
        return Layout("split", 0, parts=(rows // 2, rows // 2)) if gated else Layout("split", 0)
    if module.endswith(("linear_proj", "linear_fc2")) and leaf == "weight":
        return Layout("split", 1)
    return Layout()


def _order(suffix: str) -> tuple[int, int]:
    """Where a layer's parameter comes in megatron-core's registration order: its module, then its leaf."""
    module = next((i for i, m in enumerate(_LAYER_ORDER) if suffix.startswith(m)), None)
    leaf = suffix.rpartition(".")[2]
    if module is None or (leaf not in _LEAF_ORDER and not suffix.endswith("gate_weight")):
        raise ValueError(suffix)
    return module, _LEAF_ORDER.index(leaf) if leaf in _LEAF_ORDER else 0


@dataclass(frozen=True)
class Bucket:
    """One bucket of a buffer: its parameters and its length without the end padding."""

    params: tuple[Placed, ...]
    numel: int


class Plan:
    """Each saving rank's buffers: which parameter sits where, rebuilt from the stored model and the saving args."""

    def __init__(
        self, ckpt: DcpCheckpoint, model_keys: list[str], job: Saving, experts_apart: bool, fused: dict[str, str]
    ) -> None:
        self.ckpt, self.job, self.experts_apart = ckpt, job, experts_apart
        # the local spec saves its norms under Transformer Engine's fused names; its modules keep their own order
        self.fused = fused if job.local_spec else {}
        self.shapes = {k: tuple(ckpt.tensors[k].shape) for k in model_keys}
        suffixes = [k[len(LAYERS) :] for k in model_keys if k.startswith(LAYERS) and not k[len(LAYERS) :][:1].isdigit()]
        try:
            self.suffixes = sorted((s for s in suffixes if not s.startswith(EXPERTS)), key=self._order)
            leaves = (s[len(EXPERTS) :] for s in suffixes if s.startswith(EXPERTS))
            self.expert_leaves = sorted(leaves, key=lambda leaf: _order("mlp." + leaf))
        except ValueError as exc:
            raise CheckpointError(
                ckpt.path,
                f"{LAYERS}{exc} is not a parameter of megatron-core's GPT layer whose order this import knows",
            ) from None
        unknown = [k for k in self.shapes if not k.startswith(LAYERS) and k not in _BEFORE + _AFTER]
        if unknown:
            raise CheckpointError(
                ckpt.path, f"{unknown[0]} is not a parameter of megatron-core's GPT this import knows"
            )
        stacks = [self.shapes[LAYERS + EXPERTS + leaf] for leaf in self.expert_leaves]
        if any(len(shape) < 3 for shape in stacks):
            raise CheckpointError(ckpt.path, f"{LAYERS}{EXPERTS}* are not stacked [layer, expert, ...] tensors")
        self.num_experts = stacks[0][1] if stacks else 0
        if self.num_experts % job.ep:
            raise CheckpointError(ckpt.path, f"{self.num_experts} experts do not split over {job.ep} EP ranks")
        if stacks and not experts_apart and job.etp != job.tp:
            raise CheckpointError(
                ckpt.path, f"experts in the dense optimizer at expert-TP {job.etp} != TP {job.tp}; not supported"
            )

    def _order(self, suffix: str) -> tuple[int, int]:
        """Where a layer's parameter comes in its module order, by the name of the module that holds it."""
        te = next((t for t in self.fused if suffix.startswith(t)), None)
        return _order(suffix if te is None else self.fused[te] + suffix[len(te) :])

    def _local(self, key: str, index: tuple[int, ...], rank: int, size: int, **flags: bool) -> Local:
        """Saving rank `rank` of `size`'s share of one stored tensor's part `index`."""
        full = self.shapes[key][len(index) :]
        layout = _layout(key.removeprefix(LAYERS), full[0] if full else 0, self.job.gated)
        shape = list(full)
        if layout.is_split:
            if shape[layout.dim] % size:
                raise CheckpointError(self.ckpt.path, f"{key} {tuple(full)} does not split over {size} ranks")
            shape[layout.dim] //= size
        return Local(key=key, index=index, layout=layout, rank=rank, size=size, shape=tuple(shape), **flags)

    def _experts(self, layer: int, ep: int, rank: int, size: int) -> list[Local]:
        """A layer's experts on expert-parallel rank `ep`: megatron-core's SequentialMLP registers expert after
        expert, each with its parameters in module order; Transformer Engine's GroupedLinear (`--moe-grouped-gemm`)
        registers one module's weights of every local expert, then its biases, then the next module's."""
        per_rank = self.num_experts // self.job.ep
        pairs = (
            [(leaf, j) for leaf in self.expert_leaves for j in range(per_rank)]
            if self.job.grouped
            else [(leaf, j) for j in range(per_rank) for leaf in self.expert_leaves]
        )
        return [self._local(LAYERS + EXPERTS + leaf, (layer, ep * per_rank + j), rank, size) for leaf, j in pairs]

    def _layer(self, layer: int, tp: int) -> list[Local]:
        """A transformer layer's dense parameters in module order, with its experts where they train in the dense
        optimizer (megatron-core marks them apart only under expert parallelism)."""
        out: list[Local] = []
        inline = bool(self.expert_leaves) and not self.experts_apart
        for suffix in self.suffixes:
            if inline and self._order(suffix)[0] > _LAYER_ORDER.index(EXPERTS):
                out += self._experts(layer, 0, tp, self.job.tp)
                inline = False
            out.append(self._local(LAYERS + suffix, (layer,), tp, self.job.tp))
        return out + (self._experts(layer, 0, tp, self.job.tp) if inline else [])

    def buckets_of(self, chain: int, group_index: int) -> list[Bucket]:
        """The buckets of one saving rank's buffer: chain 0 the dense (or only) optimizer, whose `dp_group_idx` is
        pp * TP + tp; chain 1 the experts', pp * ETP * EP + ep * ETP + etp."""
        job = self.job
        experts = chain == 1
        pp, within = divmod(group_index, job.etp * job.ep if experts else job.tp)
        ep, tp = divmod(within, job.etp) if experts else (0, within)
        if pp >= job.pp:
            raise CheckpointError(self.ckpt.path, f"dp_group_idx_{group_index} is past the saving job's ranks")
        return self._buckets(self._params(experts, pp, ep, tp), first_stage=pp == 0)

    def _params(self, experts: bool, pp: int, ep: int, tp: int) -> list[Local]:
        """The parameters of one saving rank's buffer, in `named_parameters` order."""
        job = self.job
        first = sum(job.layers[:pp])
        layers = range(first, first + job.layers[pp])
        if experts:
            return [local for layer in layers for local in self._experts(layer, ep, tp, job.etp)]
        shared = job.tied and job.pp > 1
        out: list[Local] = []
        if pp == 0:
            out += [
                self._local(k, (), tp, job.tp, shared=shared and k == _BEFORE[0]) for k in _BEFORE if k in self.shapes
            ]
        for layer in layers:
            out += self._layer(layer, tp)
        if pp == job.pp - 1:
            out += [self._local(k, (), tp, job.tp) for k in _AFTER if k in self.shapes]
            if shared:
                out.append(self._local(_BEFORE[0], (), tp, job.tp, shared=True, copy=True))
        return out

    def _buckets(self, params: list[Local], first_stage: bool) -> list[Bucket]:
        """megatron-core's `_ParamAndGradBuffer` layout of `params`: reverse order, 64-aligned starts, a bucket closed
        at the bucket size (first pipeline stage only) and around a shared embedding; offsets within each bucket."""
        size = self.job.bucket_size if first_stage else None
        out: list[Bucket] = []
        placed: list[Placed] = []
        at = 0
        for local in reversed(params):
            at = -(-at // ALIGN) * ALIGN
            if local.shared and placed:  # the bucket before it ends at the aligned start
                out.append(Bucket(params=tuple(placed), numel=at))
                placed, at = [], 0
            placed.append(Placed(local=local, start=at))
            at += math.prod(local.shape)
            if (size is not None and at >= size) or local.shared:
                out.append(Bucket(params=tuple(placed), numel=at))
                placed, at = [], 0
        if placed:
            out.append(Bucket(params=tuple(placed), numel=at))
        return out


def _unwrapped(value: Any) -> Any:
    """A `ShardedObject`'s value: torch_dist stores each as a one-element list. Every object read here is a dict
    or a list of one buffer's dict, so unwrapping one level never takes a value apart."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _share(full: torch.Tensor, local: Local) -> torch.Tensor:
    """A saving rank's tensor-parallel share of a per-layer full tensor."""
    return split(local.layout, local.shape, local.rank, local.size, full.narrow, dtype=full.dtype)


class States(NamedTuple):
    """A model tensor's (or one layer's) optimizer states: its fp32 copy (None: the weight is fp32 itself) and the
    others by name."""

    master: torch.Tensor | None
    others: dict[str, torch.Tensor]


class BucketStates:
    """The per-parameter optimizer states of a `dp_reshardable` save: for each stored model tensor, every state of
    one layer (or expert) at a time, read range by range from the buckets of every saving rank.

    Args:
        ckpt: the torch_dist folder's DCP table.
        model_keys: its model tensors (stacked, as megatron-core saves them).
        args: Megatron-LM's saved `args`, as a dict.
        chains: how many optimizers the save holds (2: a ChainedOptimizer's dense and expert ones).
        fused: Transformer Engine's fused-norm prefixes -> the local spec's (`compat.megatron_fused_norms`).

    Example:
        >>> states = BucketStates(ckpt, model_keys, args, chains=1, fused=compat.megatron_fused_norms())
        >>> with ckpt.ranged() as reads:
        ...     master, others = states.pieces(reads, "decoder.layers.mlp.linear_fc1.weight")((0,))
    """

    def __init__(
        self, ckpt: DcpCheckpoint, model_keys: list[str], args: Any, chains: int, fused: dict[str, str]
    ) -> None:
        self.ckpt = ckpt
        # indexed once: each saving rank's buffer looks up its objects and each bucket its states
        self._objects: dict[str, str] = {}
        for k in ckpt.objects:
            self._objects.setdefault(k.partition("/")[0], k)
        self._bucket_states: dict[str, set[str]] = {}
        for k in ckpt.tensors:
            if held := _BUCKET_STATE.match(k):
                self._bucket_states.setdefault(held.group(1), set()).add(held.group(2))
        layers = next((ckpt.tensors[k].shape[0] for k in model_keys if k.startswith(LAYERS)), 0)
        self.job = saving(args, ckpt.path, int(layers))
        self.plan = Plan(ckpt, model_keys, self.job, experts_apart=chains > 1, fused=fused)
        self.prefixes = [self._prefix(c, chains) for c in range(chains)]
        self.where: dict[str, list[tuple[str, Placed]]] = {}
        self.param_groups: list[list[dict[str, Any]]] = []
        states: set[str] = set()
        for c, prefix in enumerate(self.prefixes):
            expected = (self.job.etp * self.job.ep if c else self.job.tp) * self.job.pp
            found = sorted(
                {int(m.group(1)) for k in ckpt.objects if (m := re.match(re.escape(prefix) + r"([0-9]+)\.", k))}
            )
            if found != list(range(expected)):
                missing = sorted(set(range(expected)) - set(found))
                raise CheckpointError(
                    ckpt.path,
                    f"holds the buffers of dp_group_idx {found}, not of all {expected} saving model-parallel "
                    f"ranks{f' (missing {missing})' if missing else ''}",
                )
            groups = None
            for i in found:
                states |= self._place(c, i, prefix)
                saved = self._object(f"{prefix}{i}.optimizer")
                saved = saved.get("optimizer", saved) if isinstance(saved, dict) else {}
                mine = saved.get("param_groups") if isinstance(saved, dict) else None
                if not isinstance(mine, list) or not mine or not all(isinstance(h, dict) for h in mine):
                    raise CheckpointError(ckpt.path, f"{prefix}{i}.optimizer holds no param_groups")
                if groups is not None and mine != groups:
                    raise CheckpointError(ckpt.path, f"{prefix}{i}.optimizer's param groups differ from {prefix}0's")
                groups = mine
            self.param_groups.append(list(groups or []))
        if MASTER not in states:
            raise CheckpointError(ckpt.path, "holds dp_reshardable buckets without the fp32 copies (param)")
        self.stored = sorted(states)
        self.states = sorted(states - {MASTER})

    def _object(self, name: str) -> Any:
        """A `ShardedObject` of the save by its key (stored as `<key>/shard_0_1`)."""
        key = self._objects.get(name)
        if key is None:
            raise CheckpointError(self.ckpt.path, f"holds no {name}")
        return _unwrapped(self.ckpt.object(key))

    def _prefix(self, chain: int, chains: int) -> str:
        """The key prefix of an optimizer's entries: `chained_<c>.` when the save chains several."""
        chained = f"chained_{chain}.{DISTRIBUTED}"
        return chained if chains > 1 or any(k.startswith(chained) for k in self.ckpt.objects) else DISTRIBUTED

    def _place(self, chain: int, group_index: int, prefix: str) -> set[str]:
        """Rebuild one saving rank's buffer, check it against what the save records, and index where each
        parameter's state sits; returns the states its buckets hold."""
        lengths = self._object(f"{prefix}{group_index}.per_bucket_numel_unpadded")
        name = f"{prefix}{group_index}"
        if (
            not isinstance(lengths, list)
            or len(lengths) != 1
            or not isinstance(lengths[0], dict)
            or len(lengths[0]) != 1
        ):
            raise CheckpointError(
                self.ckpt.path,
                f"{name}.per_bucket_numel_unpadded: {lengths!r} is not one buffer of one dtype (FP8 "
                "or mixed-dtype buffers are not supported)",
            )
        ((dtypes, saved),) = lengths[0].items()
        if not isinstance(saved, list) or not all(type(n) is int for n in saved):
            raise CheckpointError(
                self.ckpt.path, f"{name}.per_bucket_numel_unpadded: {saved!r} is not a list of lengths"
            )
        buckets = self.plan.buckets_of(chain, group_index)
        base = f"{name}.gbuf_idx_0.dtype_{dtypes}"
        if len(buckets) != len(saved):
            raise CheckpointError(
                self.ckpt.path,
                f"{base}: the save records {len(saved)} buckets, megatron-core's layout of the "
                f"model's parameters gives {len(buckets)}",
            )
        states: set[str] = set()
        for b, (bucket, length) in enumerate(zip(buckets, saved)):
            key = f"{base}.bucket_idx_{b}"
            if bucket.numel != length:
                raise CheckpointError(
                    self.ckpt.path,
                    f"{key}: {length} elements recorded (per_bucket_numel_unpadded), but megatron-core's "
                    f"layout of the model's parameters gives {bucket.numel}; not the saving job's model or layout",
                )
            mine = self._bucket_states.get(key, set())
            if not mine:
                raise CheckpointError(self.ckpt.path, f"{key}: the bucket is missing (no state tensors)")
            if states and mine != states:
                raise CheckpointError(self.ckpt.path, f"{key} holds states {sorted(mine)}, not {sorted(states)}")
            states = mine
            for state in mine:
                if tuple(self.ckpt.tensors[f"{key}.{state}"].shape) != (length,):
                    raise CheckpointError(self.ckpt.path, f"{key}.{state} is not {length} elements long")
            for placed in bucket.params:
                if not placed.local.copy:
                    self.where.setdefault(placed.local.key, []).append((key, placed))
        return states

    def pieces(self, reads: RangedReads, key: str) -> Callable[[tuple[int, ...]], States]:
        """`at(index)`: the fp32 copy and the other states of the stored model tensor `key` at `index` of its
        leading dims (a layer, a layer's expert), each rank's `param` range checked against the model's own weight.
        One part (the index the buckets place, a layer) is held at a time, not the whole stacked tensor."""
        shards: dict[tuple[int, ...], list[tuple[str, Placed]]] = {}
        for bucket, placed in self.where.get(key, []):
            shards.setdefault(placed.local.index, []).append((bucket, placed))
        shape = self.ckpt.tensors[key].shape
        depth = len(next(iter(shards))) if shards else 0
        expected = math.prod(shape[:depth])
        if not shards or len(shards) != expected or any(len(i) != depth for i in shards):
            raise CheckpointError(
                self.ckpt.path, f"{key}: the buckets hold the state of {len(shards)} of its {expected} parts"
            )
        held: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}

        def at(index: tuple[int, ...]) -> States:
            part, rest = index[:depth], index[depth:]
            if part not in held:
                if part not in shards:
                    raise CheckpointError(self.ckpt.path, f"{key}: the buckets hold no state of {key}{list(part)}")
                held.clear()
                held[part] = self._part(reads, key, part, shards[part])
            states = {s: t[rest] for s, t in held[part].items()}
            return States(master=states.pop(MASTER), others=states)

        return at

    def _part(
        self, reads: RangedReads, key: str, index: tuple[int, ...], mine: list[tuple[str, Placed]]
    ) -> dict[str, torch.Tensor]:
        """Every state of `key[index]`, merged from the tensor-parallel ranks' ranges of the buckets."""
        mine.sort(key=lambda item: item[1].local.rank)
        ranks = [placed.local.rank for _, placed in mine]
        if ranks != list(range(mine[0][1].local.size)):
            raise CheckpointError(self.ckpt.path, f"{key}{list(index)} is placed on ranks {ranks}")
        model = reads.at(key, index)
        read: dict[str, list[torch.Tensor]] = {s: [] for s in self.stored}
        for bucket, placed in mine:
            local = placed.local
            values = {
                s: reads.region(f"{bucket}.{s}", placed.start, placed.numel).view(local.shape) for s in self.stored
            }
            weight = _share(model, local)
            if not torch.equal(values[MASTER].to(weight.dtype), weight):
                raise CheckpointError(
                    self.ckpt.path,
                    f"{bucket}.{MASTER} [{placed.start}, {placed.start + placed.numel}) does not hold "
                    f"the weights of {key}{list(index)} (rank {local.rank}): megatron-core's layout, rebuilt "
                    "from the model, is not the saving job's",
                )
            for s in self.stored:
                read[s].append(values[s].float())
        layout = mine[0][1].local.layout
        for s in self.stored:
            if not layout.is_split and not all(torch.equal(read[s][0], other) for other in read[s][1:]):
                raise CheckpointError(
                    self.ckpt.path, f"{key}{list(index)}: the tensor-parallel ranks' copies of its {s} differ"
                )
        return {s: merge(layout, read[s], key) for s in self.stored}
