"""megatron-core's own distributed checkpoints (`dist_checkpointing`, the `torch_dist` backend), imported.

    <dir>/metadata.json    {"sharded_backend": "torch_dist", ...}
    <dir>/.metadata        DCP metadata of every sharded tensor, at its global shape (`sources/dcp.py`)
    <dir>/__R_T.distcp     the tensors, each rank's chunks
    <dir>/common.pt        what is not sharded: `iteration`, `args`, the optimizer's `param_groups` (without their
                           parameters) and `state.common_step`, the LR scheduler, ...

A tensor is stored whole, at the shape a TP=1 model has: the tensor-parallel chunks of a `linear_qkv` (grouped
query order), a gated `linear_fc1` ([gate; up]) or a vocabulary-parallel embedding sit where a TP=1 weight has them,
which is the universal format's full tensor. The layers of `decoder.layers` are stacked along a leading dimension
(and the experts of a layer along the next one); the import cuts them into the per-layer names a megatron-core
module has under DeepSpeed, with Transformer Engine's fused-norm names mapped to the local spec's as the save path
does. Adam's moments are `optimizer.state.<state>.<key>`, with the same shapes.

megatron-core does not save which parameters each param group holds. The import places them by megatron-core's
own default rule (`_get_param_groups`: biases and 1-D weights take no weight decay; experts, `is_expert_parallel`,
in groups of their own), which needs, for the dense and for the expert parameters, one group, or two of which one
has no weight decay; anything else is refused. The expert groups go after the dense ones, where DeepSpeed's
`split_params_into_different_moe_groups_for_optimizer` puts them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from ucp_deepspeed import compat
from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Counters, GroupRecord, Manifest, SourceRecord, dtype_name
from ucp_deepspeed.format.metadata import FP32, check_name
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.paths import check_output, locate
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint, decode_value, encode_value
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.interop.megatron_buckets import EXPERTS, LAYERS, BucketStates, States
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import load_file, to_bytes
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.plugins import ForeignFormat, register_foreign_format
from ucp_deepspeed.sources.dcp import DcpCheckpoint, RangedReads

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
OPTIM = "optimizer.state."
# the optimizer's fp32 copy of each weight: Float16OptimizerWithFloat16Params' and the DistributedOptimizer's
# `fully_sharded_model_space` name it `fp32_param`, its `fully_reshardable` format `param`
MASTERS = ("fp32_param", "param")
# the DistributedOptimizer formats that store each parameter's state whole (the others store its flat buffers)
RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
BUCKETS = "dp_reshardable"  # flat per-bucket buffers (Megatron-LM's default), rebuilt by `megatron_buckets`
SHARDING = "param_state_sharding_type"
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_CHAINED = re.compile(r"chained_[0-9]+\.")
_RANK_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")


def is_torch_dist(path: str) -> bool:
    """Whether `path` is a megatron-core `torch_dist` checkpoint folder."""
    meta = st.join(path, METADATA_JSON)
    if not st.isfile(meta):
        return False
    try:
        return json.loads(st.read(meta, 1 << 16)).get("sharded_backend") == "torch_dist"
    except (ValueError, AttributeError):
        return False


def _pieces(key: str, shape: tuple[int, ...], fused: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
    """The per-layer (and per-expert) names of a stored tensor, with the index of each piece in its leading dims."""
    if not key.startswith(LAYERS) or key[len(LAYERS) :][:1].isdigit():
        return [(key, ())]  # not stacked, or saved with per-layer keys already
    rest = key[len(LAYERS) :]
    te = next((t for t in fused if rest.startswith(t)), None)
    if te is not None:
        rest = fused[te] + rest[len(te) :]
    if rest.startswith(EXPERTS):
        leaf = rest[len(EXPERTS) :]
        return [
            (f"{LAYERS}{layer}.mlp.experts.local_experts.{e}.{leaf}", (layer, e))
            for layer in range(shape[0])
            for e in range(shape[1])
        ]
    return [(f"{LAYERS}{layer}.{rest}", (layer,)) for layer in range(shape[0])]


def _spec(args: Any, vocab: int) -> ModelSpec | None:
    """The GPT that Megatron-LM's `args` describe, when they are there."""
    a = vars(args) if isinstance(args, SimpleNamespace) else args if isinstance(args, dict) else None
    if not a or "num_layers" not in a or "hidden_size" not in a or "num_attention_heads" not in a:
        return None
    heads = int(a["num_attention_heads"])
    groups = int(a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    return ModelSpec(
        num_layers=int(a["num_layers"]),
        hidden_size=int(a["hidden_size"]),
        ffn_hidden_size=int(a.get("ffn_hidden_size") or 4 * a["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(a.get("kv_channels") or a["hidden_size"] // heads),
        vocab_size=vocab,
        max_sequence_length=int(a.get("max_position_embeddings") or a.get("seq_length") or 1),
        normalization=str(a.get("normalization") or "LayerNorm"),
        layernorm_epsilon=float(a.get("norm_epsilon") or 1e-5),
        activation="silu" if a.get("swiglu") else "gelu",
        gated_linear_unit=bool(a.get("swiglu")),
        add_bias_linear=bool(a.get("add_bias_linear", True)),
        add_qkv_bias=bool(a.get("add_qkv_bias", False)),
        position_embedding_type=str(a.get("position_embedding_type") or "learned_absolute"),
        rotary_base=float(a.get("rotary_base") or 10000),
        tied=not a.get("untie_embeddings_and_output_weights", False),
        num_moe_experts=int(a.get("num_experts") or 0),
        moe_router_topk=int(a.get("moe_router_topk") or 0),
    )


def _unpadded(tensors: dict[str, torch.Tensor], vocab: int, path: str, name: str) -> dict[str, torch.Tensor]:
    """The first `vocab` rows of a vocabulary-parallel tensor and its states; refuses padding that holds weights."""
    rows = tensors[FP32].shape[0]
    if vocab > rows:
        raise CheckpointError(path, f"{name} has {rows} rows, fewer than the vocabulary of {vocab}")
    if rows > vocab and tensors[FP32][vocab:].abs().max().item() != 0.0:
        raise CheckpointError(path, f"{name}'s rows past {vocab} hold non-zero weights: not vocabulary padding")
    return {k: t[:vocab] for k, t in tensors.items()}


def _plain(value: Any) -> Any:
    """`args` and other namespaces as dicts, so `client_state` holds only plain data."""
    if isinstance(value, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _optimizers(common: dict[str, Any], path: str) -> tuple[list[dict[str, Any]], bool]:
    """The torch optimizer states megatron-core saved: one (`FP32Optimizer`), or a `ChainedOptimizer`'s, its dense
    then its expert optimizer (`{0: ..., 1: ...}`, as Megatron-LM builds for an MoE model); a
    `Float16OptimizerWithFloat16Params` wraps its own under `optimizer`, beside its grad scaler. Also whether they
    are `DistributedOptimizer`s saved `dp_reshardable`, whose param groups are in the DCP table, not here."""
    optim = common.get("optimizer")
    chain: list[Any] = []
    if isinstance(optim, dict) and ("param_groups" in optim or "optimizer" in optim or SHARDING in optim):
        chain = [optim]
    elif isinstance(optim, dict) and optim and set(optim) == set(range(len(optim))):
        chain = [optim[i] for i in range(len(optim))]
    elif isinstance(optim, list):
        chain = optim
    kinds = {o.get(SHARDING) if isinstance(o, dict) else None for o in chain or [optim]}
    for sharding in kinds:  # each optimizer's entry names its DistributedOptimizer format
        if sharding is not None and sharding not in (*RESHARDABLE, BUCKETS):
            raise CheckpointError(
                path,
                f"holds a DistributedOptimizer state saved {sharding!r}, tied to the saving DP layout; save with "
                "--dist-ckpt-optim-fully-reshardable, or in Megatron-LM's default dp_reshardable",
            )
    if BUCKETS in kinds:
        if kinds != {BUCKETS}:
            raise CheckpointError(path, f"mixes DistributedOptimizer formats {sorted(map(str, kinds))}")
        return [{} for _ in chain], True
    chain = [o["optimizer"] if isinstance(o, dict) and "param_groups" not in o else o for o in chain]
    if not chain or not all(
        isinstance(o, dict)
        and isinstance(o.get("param_groups"), list)
        and o["param_groups"]
        and all(isinstance(h, dict) for h in o["param_groups"])
        for o in chain
    ):
        raise CheckpointError(path, "holds no optimizer param_groups; a model-only save")
    return chain, False


def _optimizer_keys(ckpt: DcpCheckpoint, model_keys: list[str]) -> dict[str, str]:
    """`optimizer.state.<state>.<key>` -> the stored key, which a `ChainedOptimizer` prefixes with `chained_<i>.`.

    Refuses optimizer entries that are not a model tensor's state: Megatron-LM's `DistributedOptimizer` saves its
    flat buffers that way (`dp_reshardable`, `dp_zero_gather_scatter`), tied to the saving job's DP layout.
    """
    model = set(model_keys)
    out: dict[str, str] = {}
    for key in [*ckpt.tensors, *ckpt.objects]:
        found = _CHAINED.match(key)
        plain = key[found.end() :] if found else key
        if not plain.startswith("optimizer."):
            continue
        of = plain[len(OPTIM) :].partition(".")[2]
        if not plain.startswith(OPTIM) or of not in model or key not in ckpt.tensors:
            raise CheckpointError(
                ckpt.path,
                f"holds {key}, which is not a model tensor's optimizer state (a DistributedOptimizer's buffers, "
                "tied to the saving DP layout?); save with --dist-ckpt-optim-fully-reshardable",
            )
        if plain in out:
            raise CheckpointError(ckpt.path, f"holds {plain} twice ({out[plain]}, {key})")
        out[plain] = key
    if not out:
        raise CheckpointError(ckpt.path, "holds no optimizer state tensors (optimizer.state.<state>.<key>)")
    return out


class _WholeStates:
    """A `fully_reshardable` save's optimizer states (and an `FP32Optimizer`'s): each stored whole beside its
    parameter, `optimizer.state.<state>.<key>`, with the fp32 copy of a bf16 weight among them."""

    def __init__(self, ckpt: DcpCheckpoint, model_keys: list[str]) -> None:
        self.ckpt = ckpt
        self.stored = _optimizer_keys(ckpt, model_keys)
        self.states = sorted({k[len(OPTIM) :].split(".", 1)[0] for k in self.stored} - set(MASTERS))

    def pieces(self, reads: RangedReads, key: str) -> Callable[[tuple[int, ...]], States]:
        """`at(index)`: the fp32 copy and the other states of the model tensor `key` at `index` of its leading dims
        (a layer), read alone."""
        stored, path = self.stored, self.ckpt.path
        missing = [s for s in self.states if f"{OPTIM}{s}.{key}" not in stored]
        if missing:
            raise CheckpointError(path, f"{key} lacks optimizer state {missing}")
        master = next((stored[f"{OPTIM}{m}.{key}"] for m in MASTERS if f"{OPTIM}{m}.{key}" in stored), None)
        dtype = self.ckpt.tensors[key].dtype
        if master is None and dtype in (torch.bfloat16, torch.float16):
            raise CheckpointError(path, f"{key} is {dtype} and has no fp32 copy ({' or '.join(MASTERS)})")

        def at(index: tuple[int, ...]) -> States:
            return States(
                master=None if master is None else reads.at(master, index),
                others={s: reads.at(stored[f"{OPTIM}{s}.{key}"], index) for s in self.states},
            )

        return at


def _is_step(value: Any) -> bool:
    """A saved step count: a scalar tensor (`common_step`) or a number (a DistributedOptimizer's group `step`)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return type(value) in (int, float)


def _step_tensor(value: Any) -> torch.Tensor:
    """A step as torch's Adam keeps it: a float tensor (a DistributedOptimizer's group keeps a number)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def _is_expert(name: str) -> bool:
    """Whether a parameter (by its universal name) belongs to an MoE layer's experts."""
    return ".mlp.experts." in name


class Kind(NamedTuple):
    """What megatron-core's default grouping tells parameters apart by."""

    expert: bool  # `is_expert_parallel`: an MoE expert under expert parallelism
    decays: bool  # `wd_mult` 1, not 0
    decoupled: bool  # the embedding and output layer under `--decoupled-lr`


class Grouping(NamedTuple):
    """megatron-core's rule placing a parameter (`get_standard_config_overrides`): biases and 1-D weights take no
    weight decay (except the q/k layer norms with `apply_wd_to_qk_layernorm`); the embedding and the output layer
    form groups of their own under a decoupled learning rate."""

    qk_decay: bool = False
    decoupled: bool = False

    def kind(self, name: str, shape: tuple[int, ...]) -> Kind:
        """The kind of a parameter, by its universal name and shape."""
        exempt = self.qk_decay and ("q_layernorm." in name or "k_layernorm." in name)
        decays = exempt or not (name.endswith(".bias") or len(shape) == 1)
        return Kind(expert=_is_expert(name), decays=decays, decoupled=self.decoupled and name in VOCAB_PARALLEL)


def _group_kind(group: dict[str, Any], path: str) -> Kind:
    """The kind of parameters a saved group holds, by megatron-core's own keys: `wd_mult`, `is_expert_parallel`, and
    a decoupled learning rate (`is_decoupled_lr`, or since megatron-core 0.15 a group whose override sets the
    learning rate, `default_config` False). `weight_decay` and `lr` are what the scheduler set last: with a weight
    decay of 0 both groups hold 0."""
    decoupled = bool(group.get("is_decoupled_lr")) or group.get("default_config") is False
    if type(group["wd_mult"]) not in (int, float):
        raise CheckpointError(path, f"a param group's wd_mult {group['wd_mult']!r} is not a number")
    return Kind(expert=bool(group.get("is_expert_parallel", False)), decays=group["wd_mult"] != 0, decoupled=decoupled)


def _classes(groups: list[dict[str, Any]], path: str) -> dict[Kind, int]:
    """Each kind of parameter -> the saved group that trains it."""
    if all("wd_mult" in h for h in groups):
        classes: dict[Kind, int] = {}
        for g, h in enumerate(groups):
            kind = _group_kind(h, path)
            if kind in classes:
                raise CheckpointError(
                    path,
                    f"param groups {classes[kind]} and {g} hold the same kind of parameters ({kind}); they differ "
                    "by an override (lr_mult, ...) whose parameters megatron-core does not record",
                )
            classes[kind] = g
        for kind, g in list(classes.items()):  # a kind without a group of its own trains in the default one
            if kind.decoupled:
                continue
            classes.setdefault(kind._replace(decays=not kind.decays), g)
        return classes
    # groups without megatron-core's keys (torch's own AdamW groups): told apart by their weight decay
    classes = {}
    experts = [bool(h.get("is_expert_parallel", False)) for h in groups]
    for expert in (False, True):
        mine = [g for g in range(len(groups)) if experts[g] == expert]
        no_decay = [g for g in mine if float(groups[g].get("weight_decay", 0.0)) == 0.0]
        plain, decaying = (Kind(expert=expert, decays=d, decoupled=False) for d in (False, True))
        if len(mine) == 1:
            classes[plain] = classes[decaying] = mine[0]
        elif len(mine) == 2 and len(no_decay) == 1:
            classes[plain] = no_decay[0]
            classes[decaying] = next(g for g in mine if g != no_decay[0])
        elif mine:
            raise CheckpointError(
                path,
                f"{len(groups)} param groups without megatron-core's wd_mult, which do not list their parameters; "
                "only one group, or one with and one without weight decay, can be placed",
            )
    return classes


def _placement(
    groups: list[dict[str, Any]], present: set[Kind], path: str, grouping: Grouping
) -> tuple[list[tuple[int, bool]], Any]:
    """megatron-core's default grouping (`_get_param_groups`), which `torch_dist` does not record by parameter.

    megatron-core keys a group by its overrides (`wd_mult`, a decoupled learning rate) and by whether its parameters
    are experts (`is_expert_parallel`, which it sets only under expert parallelism: at EP=1 experts train in the
    dense groups). The universal folder keeps DeepSpeed's order: the dense groups, then the expert groups that
    `split_params_into_different_moe_groups_for_optimizer` appends, which a DeepSpeed MoE job always has; an EP=1
    save's experts get such groups, each a copy of the group they trained in. `present` holds the kinds of the
    saved parameters. Returns each universal group as (the saved group it comes from, whether it is such a copy)
    and a function placing a parameter by name and shape; refuses groups this rule cannot tell apart.
    """
    experts = [bool(h.get("is_expert_parallel", False)) for h in groups]
    classes = _classes(groups, path)
    split = not any(experts)
    if split:
        classes.update({k._replace(expert=True): g for k, g in list(classes.items())})
    slots = [(g, False) for g in range(len(groups)) if not experts[g]]
    if split:
        used = {classes[k] for k in present if k.expert and k in classes}
        slots += [(g, True) for g in range(len(groups)) if g in used]
    else:
        slots += [(g, False) for g in range(len(groups)) if experts[g]]
    position = {slot: i for i, slot in enumerate(slots)}

    def group_of(name: str, shape: tuple[int, ...]) -> int:
        kind = grouping.kind(name, shape)
        if kind not in classes:
            raise CheckpointError(path, f"no param group holds {name} ({kind})")
        return position[(classes[kind], kind.expert and split)]

    return slots, group_of


def import_megatron(folder: str, output: str, vocab_size: int | None = None) -> str:
    """Write a megatron-core `torch_dist` checkpoint (model and optimizer) as a universal folder; return it.

    Args:
        folder: the checkpoint folder (`iter_0000100` of a Megatron-LM run), local or a store URL.
        output: the universal folder to write.
        vocab_size: the unpadded vocabulary; the embedding's and output layer's rows beyond it are padding
            (Megatron-LM's `padded_vocab_size`), dropped as a save at another TP size would, after checking that
            they hold only zeros in the weights. None keeps every row.

    Example:
        >>> import_megatron("ckpt/iter_0000100", "ckpt/iter_0000100.ucp", vocab_size=50257)
    """
    folder = st.normalize(folder)
    check_output(output, [folder])
    if not is_torch_dist(folder):
        raise CheckpointError(st.join(folder, METADATA_JSON), "is not a megatron-core torch_dist checkpoint")
    common = load_file(st.join(folder, COMMON))
    if not isinstance(common, dict):
        raise CheckpointError(st.join(folder, COMMON), "does not hold a dict")
    chain, buckets = _optimizers(common, st.join(folder, COMMON))
    with DcpCheckpoint(folder) as ckpt:
        fused = compat.megatron_fused_norms()
        model_keys = [k for k in ckpt.tensors if not k.startswith("optimizer.") and not _CHAINED.match(k)]
        optimizer: _WholeStates | BucketStates | None = None
        if buckets:  # its param groups are in the DCP table
            optimizer = BucketStates(ckpt, model_keys, _plain(common.get("args")), len(chain), fused)
            chain = [{"param_groups": groups} for groups in optimizer.param_groups]
        hypers = [h for optim in chain for h in optim["param_groups"]]
        # the step: `common_step` of each optimizer, or (DistributedOptimizer) each group's own
        steps = [(o.get("state") or {}).get("common_step", h.get("step")) for o in chain for h in o["param_groups"]]
        args = _plain(common.get("args"))
        slots, group_of = _groups(ckpt, model_keys, hypers, args, fused, st.join(folder, COMMON))
        if optimizer is None:
            optimizer = _WholeStates(ckpt, model_keys)
        stepless = [g for g, _ in slots if not _is_step(steps[g])]
        if optimizer.states and stepless:
            raise CheckpointError(
                st.join(folder, COMMON),
                f"param group {stepless[0]} has optimizer state ({', '.join(optimizer.states)}) but no step count "
                "(the optimizer's state.common_step, or the group's step); it could not take its next step",
            )
        with UniversalWriter(root=output) as writer:
            dtypes = _write_params(writer, ckpt, model_keys, optimizer, fused, vocab_size, group_of)
            writer.add_buffers({})
            client = {k: _plain(v) for k, v in common.items() if k != "optimizer"}
            writer.set_state(TrainingState(client_state=client))
            params = writer.params
            vocab = params[VOCAB_PARALLEL[0]].shape[0] if VOCAB_PARALLEL[0] in params else 0
            spec = _spec(common.get("args"), vocab) if vocab else None
            ranks = {m.group(1) for f in st.listdir(folder) if (m := _RANK_FILE.fullmatch(f))}
            iteration = common.get("iteration")
            writer.finish(
                source=SourceRecord(
                    folder,
                    None,
                    Topology(
                        dp=max(1, len(ranks)),
                        zero_stage=0,
                        dtype=next((_DTYPES[d] for d in dtypes if d in _DTYPES), "fp32"),
                        optimizer="megatron",
                    ),
                    {},
                    extra={"format": "megatron torch_dist"},
                ),
                counters=Counters(
                    global_steps=iteration if type(iteration) is int and iteration >= 0 else 0,
                    global_samples=_consumed(args, st.join(folder, COMMON)),
                ),
                param_groups=[
                    GroupRecord(
                        {
                            **{k: encode_value(v) for k, v in hypers[g].items() if k != "params"},
                            **({"is_expert_parallel": True} if copy else {}),
                        },
                        {"step": encode_value(_step_tensor(steps[g]))} if _is_step(steps[g]) else {},
                    )
                    for g, copy in slots
                ],
                extra={
                    **({"model": spec.encode()} if spec is not None else {}),
                    "notes": [
                        "param groups placed by megatron-core's default rule (biases and 1-D weights without weight "
                        "decay); the topology's dp counts the saving ranks; common.pt's entries other than the "
                        "optimizer are client_state"
                    ],
                },
            )
        return output


def _groups(
    ckpt: DcpCheckpoint,
    model_keys: list[str],
    hypers: list[dict[str, Any]],
    args: Any,
    fused: dict[str, str],
    common: str,
) -> tuple[list[tuple[int, bool]], Any]:
    """The saved param groups matched to the kinds of parameter the model holds (`_placement`): each group's slot,
    and the group of a parameter by name and shape."""
    grouping = Grouping(
        qk_decay=bool(isinstance(args, dict) and args.get("apply_wd_to_qk_layernorm")),
        decoupled=any("wd_mult" in h and _group_kind(h, common).decoupled for h in hypers),
    )
    present = {
        grouping.kind(name, ckpt.tensors[key].shape[len(index) :])
        for key in model_keys
        for name, index in _pieces(key, ckpt.tensors[key].shape, fused)
    }
    return _placement(hypers, present, common, grouping)


def _write_params(
    writer: UniversalWriter,
    ckpt: DcpCheckpoint,
    model_keys: list[str],
    optimizer: _WholeStates | BucketStates,
    fused: dict[str, str],
    vocab_size: int | None,
    group_of: Any,
) -> set[torch.dtype]:
    """Each model tensor's parameters (a stacked key's layers, a fused norm's pieces), with the fp32 master and
    optimizer states, vocabulary padding dropped; returns the dtypes the model was saved in."""
    dtypes: set[torch.dtype] = set()
    with ckpt.ranged() as reads:  # one layer held at a time; every record read is checked before the commit
        for key in model_keys:
            entry = ckpt.tensors[key]
            dtypes.add(entry.dtype)
            states_at = optimizer.pieces(reads, key)
            for name, index in _pieces(key, entry.shape, fused):
                try:
                    check_name(name)
                except ValueError as exc:
                    raise CheckpointError(ckpt.path, str(exc)) from None
                states = states_at(index)
                weight = reads.at(key, index) if states.master is None else states.master
                tensors = {FP32: weight, **states.others}
                if vocab_size and name in VOCAB_PARALLEL:
                    tensors = _unpadded(tensors, vocab_size, ckpt.path, name)
                tensors = {k: t.float() for k, t in tensors.items()}
                shape = tuple(tensors[FP32].shape)
                writer.add_param(name, tensors, group=group_of(name, shape), dtype=dtype_name(entry.dtype))
    return dtypes


def _consumed(args: Any, path: str) -> int:
    """Megatron-LM's `args.consumed_train_samples`: where its sampler resumes, whatever the DP size. A DeepSpeed job
    counts the same samples as `global_samples` (one global batch per step)."""
    value = args.get("consumed_train_samples", 0) if isinstance(args, dict) else 0
    if type(value) is not int or value < 0:
        raise CheckpointError(path, f"args.consumed_train_samples {value!r} is not a sample count")
    return value


def _megatron_args(client: dict[str, Any], counters: Counters) -> argparse.Namespace:
    """The `args` Megatron-LM reads back (`getattr(checkpoint_args, ...)`, so a namespace, not the dict an import
    keeps) of a job imported from Megatron-LM, with the samples consumed so far, from which its sampler resumes. A job
    that did not come from Megatron-LM has no `args` to write: Megatron-LM checks the model's sizes in them without
    defaults (`check_checkpoint_args`), so none are written and its sampler starts from its own count."""
    return argparse.Namespace(**{**client["args"], "consumed_train_samples": counters.global_samples})


def _loaded_folder(engine: Engine, load_dir: str) -> str | None:
    """A megatron-core torch_dist folder named directly by a load."""
    return load_dir if is_torch_dist(load_dir) else None


def _stacked(manifest: Manifest) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """megatron-core's sharded key of every parameter -> (index in its stacked tensor, universal name)."""
    local_to_te = {local: te for te, local in compat.megatron_fused_norms().items()}
    out: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for name in manifest.params:
        found = re.fullmatch(r"decoder\.layers\.([0-9]+)\.(.+)", name, re.S)
        if found is None:
            out.setdefault(name, []).append(((), name))
            continue
        layer, rest = int(found.group(1)), found.group(2)
        expert = re.fullmatch(r"mlp\.experts\.local_experts\.([0-9]+)\.(.+)", rest, re.S)
        if expert is not None:
            key = f"{LAYERS}{EXPERTS}{expert.group(2)}"
            out.setdefault(key, []).append(((layer, int(expert.group(1))), name))
            continue
        prefix = next((p for p in local_to_te if rest.startswith(p)), None)
        if prefix is not None:
            rest = local_to_te[prefix] + rest[len(prefix) :]
        out.setdefault(f"{LAYERS}{rest}", []).append(((layer,), name))
    return out


def export_megatron(
    path: str,
    output: str,
    padded_vocab_size: int | None = None,
    expert_model_parallel_size: int | None = None,
    distributed_optimizer: bool = False,
) -> str:
    """Write a checkpoint as a megatron-core `torch_dist` folder that `dist_checkpointing.load` reads at any TP/PP.

    Args:
        path: a universal folder, or a native checkpoint directory (its latest tag is converted first).
        output: the folder to write; `metadata.json` is written last.
        padded_vocab_size: rows of the embedding and output layer in the loading model (Megatron-LM's
            `padded_vocab_size`); the rows past the vocabulary are written as zeros. None writes the vocabulary.
        expert_model_parallel_size: the loading job's, for an MoE model. megatron-core gives experts an optimizer
            of their own only under expert parallelism; at 1 the expert groups are written into the dense groups
            they match (the same hyperparameters and step). None writes them apart, for EP > 1.
        distributed_optimizer: write the `DistributedOptimizer`'s `fully_reshardable` layout (each state whole,
            the fp32 copy as `optimizer.state.param.<key>`, each group's `step`), which a Megatron-LM job with
            `--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable` loads at any DP size; else the
            `FP32Optimizer`'s (`common_step`; a `ChainedOptimizer`'s keys prefixed `chained_<i>.`).

    Example:
        >>> export_megatron("checkpoints", "megatron/iter_0000100", padded_vocab_size=50304)
    """
    check_output(output, [locate(path).path])
    if not st.isfile(st.join(path, MANIFEST)):
        path = convert(path, progress=False)
    with UniversalCheckpoint(path) as ckpt:
        manifest = ckpt.manifest
        if any(not r.trainable for r in manifest.params.values()) or manifest.buffers:
            raise CheckpointError(path, "holds frozen parameters or buffers, which a megatron-core GPT does not have")
        chains = _chains(manifest, path)
        merged = expert_model_parallel_size == 1 and len(chains) > 1
        if merged:
            _check_dense_twins(manifest, chains, path)
        chain_of = {g: 0 if merged else c for c, members in enumerate(chains) for g in members}
        chains = chains[:1] if merged else chains
        writer = compat.DcpWriter(output)
        try:
            for key, pieces in _stacked(manifest).items():
                record = manifest.params[pieces[0][1]]
                c = chain_of[record.group or 0]  # every parameter is trainable, checked above
                # Megatron-LM's `chained_optim_avoid_prefix`: a fully reshardable format's keys are not prefixed
                prefix = f"chained_{c}." if len(chains) > 1 and not distributed_optimizer else ""
                for state in record.keys:
                    full = _stack(ckpt, pieces, state, padded_vocab_size if key in VOCAB_PARALLEL else None)
                    blob = to_bytes(full)
                    stored = key if state == FP32 else f"{prefix}{OPTIM}{state}.{key}"
                    path_of = ("model", key) if state == FP32 else ("optimizer", c, "state", state, key)
                    writer.tensor(stored, path_of, full, blob)
                    if state == FP32 and distributed_optimizer:  # its fp32 copy, `param`
                        writer.tensor(f"{OPTIM}{MASTERS[1]}.{key}", ("optimizer", c, "state", "param", key), full, blob)
            for name in _extra_states(_stacked(manifest)):
                writer.object(name, ("model", name), to_bytes([None]))
            optimizers = [
                _distributed(manifest, members, c == 1, st.join(path, MANIFEST))
                if distributed_optimizer
                else {
                    "param_groups": [_megatron_group(manifest, g, c == 1, st.join(path, MANIFEST)) for g in members],
                    "state": {"common_step": _common_step([manifest.param_groups[g] for g in members])},
                }
                for c, members in enumerate(chains)
            ]
            client = ckpt.load_state().get("client_state") or {}
            common = {
                **client,
                **({"args": _megatron_args(client, manifest.counters)} if isinstance(client.get("args"), dict) else {}),
                "iteration": manifest.counters.global_steps,
                "checkpoint_version": 3.0,
                "optimizer": optimizers[0] if len(chains) == 1 else dict(enumerate(optimizers)),
            }
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        st.write(st.join(output, COMMON), to_bytes(common))
        st.write(st.join(output, METADATA_JSON), json.dumps(TORCH_DIST).encode())
        return output


TORCH_DIST = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _extra_states(stacked: dict[str, list[tuple[tuple[int, ...], str]]]) -> list[str]:
    """The `_extra_state` objects megatron-core's linear layers ask a load for (`<module>._extra_state/shard_<i>_<n>`,
    one per layer, per expert as `<l>.<e>_<L>.<E>`), which hold nothing outside Transformer Engine's FP8 state."""
    out = []
    for key, pieces in stacked.items():
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or not module.rpartition(".")[2].startswith("linear_") or not pieces[0][0]:
            continue
        lead = [max(i[d] for i, _ in pieces) + 1 for d in range(len(pieces[0][0]))]
        for index, _ in pieces:
            out.append(f"{module}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, lead))}")
    return out


def _chains(manifest: Manifest, path: str) -> list[list[int]]:
    """The param groups of each optimizer megatron-core builds for the model: one for a dense model; for an MoE model
    a `ChainedOptimizer`'s dense, then expert groups (a group must hold only one kind)."""
    kinds: dict[int, set[bool]] = {g: set() for g in range(len(manifest.param_groups))}
    for name, record in manifest.params.items():
        if record.group is not None:
            kinds[record.group].add(_is_expert(name))
    mixed = [g for g, k in kinds.items() if len(k) > 1]
    if mixed:
        raise CheckpointError(
            path, f"param group {mixed[0]} holds experts and dense parameters; megatron-core keeps them apart"
        )
    experts = [g for g, k in kinds.items() if k == {True}]
    dense = [g for g in kinds if g not in experts]
    return [dense, experts] if experts else [dense]


def _check_dense_twins(manifest: Manifest, chains: list[list[int]], path: str) -> None:
    """Refuse to write experts into the dense groups unless each expert group has a dense group with the same
    hyperparameters and step (DeepSpeed's MoE split copies them from the group the experts came from)."""

    def settings(g: int) -> tuple[dict[str, Any], Any]:
        record = manifest.param_groups[g]
        kept = {k: v for k, v in (record.hyperparams or {}).items() if k not in ("moe", "name", "is_expert_parallel")}
        return kept, record.scalars.get("step")

    dense = [settings(g) for g in chains[0]]
    for g in chains[1]:
        if settings(g) not in dense:
            raise CheckpointError(
                path,
                f"expert param group {g} matches no dense group in hyperparameters and step; megatron-core at "
                "expert-parallel size 1 trains experts in the dense groups",
            )


def _megatron_group(manifest: Manifest, g: int, expert: bool, where: str) -> dict[str, Any]:
    """A group's hyperparameters as megatron-core's optimizer keeps them (DeepSpeed's `moe` marker left out), with
    the keys megatron-core finds its groups by (`DistributedOptimizer.load_state_dict` matches saved and live groups
    on them; its scheduler multiplies by them) where the saving job had none: `wd_mult` by megatron-core's own rule
    for the group's parameters, `lr_mult` 1, no decoupled learning rate. `max_lr` and `min_lr` stay the loading
    job's (its `--lr`, `--min-lr`)."""
    record = manifest.param_groups[g]
    out = {k: decode_value(v) for k, v in (record.hyperparams or {}).items() if k != "moe"}
    if "wd_mult" not in out:
        decays = {Grouping().kind(n, r.shape).decays for n, r in manifest.params.items() if r.group == g}
        if len(decays) > 1:
            raise CheckpointError(
                where,
                f"param group {g} holds parameters megatron-core puts in groups of wd_mult 1 and 0 (weights, and "
                "biases or norms); split them as megatron-core does to export them",
            )
        out = {"wd_mult": float(decays != {False}), "lr_mult": 1.0, "is_decoupled_lr": False, **out}
    return {**out, "is_expert_parallel": expert}


def _distributed(manifest: Manifest, members: list[int], expert: bool, where: str) -> dict[str, Any]:
    """A `DistributedOptimizer`'s common entry in its `fully_reshardable` layout: the torch optimizer's groups, each
    with its own step, and the format's name."""
    groups = []
    for g in members:
        record = manifest.param_groups[g]
        if "step" not in record.scalars:
            raise CheckpointError(where, f"param group {g} has no step; a DistributedOptimizer keeps one per group")
        step = float(torch.as_tensor(decode_value(record.scalars["step"])))
        groups.append({**_megatron_group(manifest, g, expert, where), "step": step})
    return {"optimizer": {"param_groups": groups}, SHARDING: RESHARDABLE[0]}


def _common_step(groups: Any) -> Any:
    steps = {float(torch.as_tensor(decode_value(g.scalars["step"]))) for g in groups if "step" in g.scalars}
    if len(steps) > 1:
        raise CheckpointError("param groups", f"are at different steps {sorted(steps)}; megatron-core keeps one")
    return torch.tensor(steps.pop()) if steps else None


def _stack(ckpt: Any, pieces: list[tuple[tuple[int, ...], str]], state: str, padded: int | None) -> torch.Tensor:
    """One stored tensor: the universal tensors of its pieces placed at their layer (and expert) indices."""
    shape = ckpt.manifest.params[pieces[0][1]].shape
    lead = tuple(max(i[d] for i, _ in pieces) + 1 for d in range(len(pieces[0][0])))
    if padded is not None:
        shape = (padded, *shape[1:])
    out = torch.zeros((*lead, *shape), dtype=torch.float32)
    for index, name in pieces:
        rec = ckpt.manifest.params[name]
        value = ckpt.read(name, state).reshape(rec.shape)
        out[index][: rec.shape[0]] = value
    return out


register_foreign_format(
    ForeignFormat(
        "megatron torch_dist",
        _loaded_folder,
        lambda folder, out, options: import_megatron(folder, out, options.vocab_size or None),
    )
)
