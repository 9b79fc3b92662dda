"""The reach into DeepSpeed's engines: the classes it pickles, engine privates, its parallel groups (Ulysses,
pipeline layer files, expert groups) and the metadata AutoTP and AutoEP attach to the parameters they build.

ZeRO optimizers are in `compat/zero.py`, optimizer kernels in `compat/optimizers.py`. DeepSpeed is imported inside
the functions that need it, so the `ucp` command imports none of it.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ucp_deepspeed.compat.megatron import is_megatron_moe
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.safe_pickle import DEEPSPEED_CLASSES, PickledObject, member_by_name, zero_stage
from ucp_deepspeed.protocols import Engine

ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def _class(qualname: str) -> Any:
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed pickles into its checkpoint files, for `torch.load(weights_only=True)`: the ZeRO stage as
    the int it is (torch lets a pickle set state on an allowed class's instance, here the process's one enum member),
    and `getattr` as early Python 3.11 pickles the stage with it (checked: an enum member by name, nothing else)."""
    checked = [(zero_stage, ZERO_STAGE_ENUM), (member_by_name, "builtins.getattr")]
    return [_class(q) for q in DEEPSPEED_CLASSES] + checked


def rebuild(value: Any) -> Any:
    """A real DeepSpeed object from a stand-in (`PickledObject`) or its plain-data form; anything else as is.

    Only the classes in `DEEPSPEED_CLASSES` are built, the way pickle would build them: `__new__`,
    then the saved attributes.
    """
    if isinstance(value, PickledObject):
        qualname, args, state = value.qualname, value.args, value.state
    elif isinstance(value, dict) and set(value) == {"__class__", "args", "state"}:
        qualname, args, state = value["__class__"], tuple(value["args"]), value["state"]
    else:
        return value
    if qualname not in DEEPSPEED_CLASSES:
        raise CheckpointError(qualname, "is not a class ucp_deepspeed rebuilds")
    cls = _class(qualname)
    obj = cls.__new__(cls, *args)
    if isinstance(state, dict):
        obj.__dict__.update(state)
    return obj


# --- engines: their private methods and parallel groups ------------------------------------------------


def buffer_names(engine: Engine) -> list[str]:
    """The module buffers DeepSpeed saves (persistent ones), by local name."""
    return list(engine._get_buffer_names())


def engine_config(engine: Engine) -> Any:
    """The engine's parsed `DeepSpeedConfig` (what a checkpoint engine is built from)."""
    return engine._config


def commit_decoupled_checkpoint(engine: Engine) -> None:
    """Let DeepSpeed finish a save whose files a decoupled checkpoint engine wrote (moves `latest`)."""
    engine._commit_decoupled_checkpoint()


def store_recovery_scripts(engine: Engine, remote: Callable[[str], bool], write: Callable[[str, bytes], None]) -> None:
    """DeepSpeed copies its `zero_to_fp32.py` scripts into the save folder with `shutil.copyfile`, which cannot reach
    an object store: for a `remote` folder, send them through `write` instead."""
    native = engine._copy_recovery_script

    def copy_recovery_script(save_path: str) -> None:
        if not remote(save_path):
            native(save_path)
            return
        import deepspeed

        utils = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            source = os.path.join(utils, script)
            if os.path.isfile(source):
                with open(source, "rb") as f:
                    write(save_path.rstrip("/") + "/" + script, f.read())
        return None

    engine._copy_recovery_script = copy_recovery_script


def before_model_step(engine: Engine, check: Callable[[], None]) -> None:
    """Run `check` before every optimizer step of `engine` (plain and pipeline engines step through
    `_take_model_step`); it refuses the step by raising."""
    native = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        check()
        return native(*args, **kwargs)

    engine._take_model_step = take_model_step


def data_sampler(engine: Engine) -> Any:
    """The engine's own data sampler, where DeepSpeed saves and loads one (`deepspeed_io` with data efficiency's
    curriculum learning: `DeepSpeedDataSampler`, whose state is one global position); None otherwise."""
    loader = getattr(engine, "training_dataloader", None)
    if loader is None or not engine.curriculum_learning_enabled():
        return None
    return loader.data_sampler


def sampler_rng(engine: Engine) -> dict[str, Any] | None:
    """The engine's curriculum sampler's own numpy generator state (`np_rng`, which draws its clusters and shuffles
    its batches; its `state_dict` saves the process-wide numpy state instead), or None without one."""
    sampler = data_sampler(engine)
    if sampler is None:
        return None
    state: dict[str, Any] = sampler.np_rng.bit_generator.state
    return state


def check_sampler(sampler: Any, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """Raise, naming the file or value, if `restore_sampler` would fail with these: the rank that draws the batches
    reopens the saved clusters from the live config's `data_cluster_path`, and both random states must be valid."""
    import numpy as np

    if hasattr(sampler, "data_clusters"):  # the rank that reads the clusters
        root = sampler.data_efficiency_config["data_sampling"]["curriculum_learning"]["data_cluster_path"]
        for name in state.get("data_cluster_paths") or ():
            for ext in (".bin", ".idx"):
                path = os.path.join(root, str(name).split("/")[-1] + ext)
                if not os.path.isfile(path):
                    raise CheckpointError(path, "a data cluster the saved data sampler reads is missing")
    try:
        np.random.RandomState().set_state(state["np_rng_state"])
        if rng is not None:
            type(sampler.np_rng.bit_generator)().state = rng
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError("data_sampler", f"a saved random state does not fit the sampler ({exc})") from None


def restore_sampler(sampler: Any, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """Put a sampler where `state` (its `state_dict`) and `rng` (`sampler_rng`, where saved) say the data stands."""
    if getattr(sampler, "data_clusters", None):  # rank 0's open clusters: its `load_state_dict` appends to them
        sampler.data_clusters, sampler.data_cluster_sizes = [], []
    sampler.load_state_dict(state)
    if rng is not None:
        sampler.np_rng.bit_generator.state = rng  # numpy checks the generator's name and fields


def base_optimizer(engine: Engine) -> Any:
    """The torch optimizer DeepSpeed steps: ZeRO and bf16 wrap it (`.optimizer`); ZeRO-0 in fp32 uses it as is."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


class Writes(enum.Enum):
    """How a checkpoint engine writes a file it is asked to save, on this rank."""

    WHOLE = "whole"
    """Now, whole, at the path given (or at `written_path`): torch's engine, DeepSpeed's python and fast writers."""
    NOTHING = "nothing"
    """Not at all: DeepSpeed's writer config gives this rank no writer, or a mock one."""
    LATER = "later"
    """Later or elsewhere: a decoupled writer's process, an engine this package does not know."""


def checkpoint_writes(ce: Any) -> Writes:
    """How checkpoint engine `ce` writes the files DeepSpeed saves through it on this rank."""
    from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.model_checkpointing.constants import CheckpointWriterType

    if type(ce) is TorchCheckpointEngine:
        return Writes.WHOLE
    if type(ce) is FastCheckpointEngine:
        writer = ce._writer
        if writer is None or writer._type == CheckpointWriterType.MOCK:
            return Writes.NOTHING
        return Writes.WHOLE
    return Writes.LATER


def written_suffix(engine: Engine) -> str:
    """What the engine's checkpoint engine adds to the name of each file it is asked to save, so a save can give the
    file DeepSpeed's name: FastPersist's data-parallel writers (`"writer": {"type": "fast"}` at ZeRO-0/1/2, decoupled
    or not) write `<path>-<writer rank>.<writers>`, every other writer `path` itself. On torch 2.13 each such file
    is the whole archive: torch never hands the writer its storages to split (`save_torch_storage_object_list`),
    which the canary test checks."""
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.model_checkpointing.constants import (
        CHECKPOINT_IO_MULTIPLIER,
        CHECKPOINT_WRITER,
        CHECKPOINT_WRITER_TYPE,
        CheckpointWriterType,
    )

    ce = getattr(engine.checkpoint_engine, "inner", engine.checkpoint_engine)  # under our binding or not
    writer = engine_config(engine).checkpoint_config.get(CHECKPOINT_WRITER)
    if writer is None or writer[CHECKPOINT_WRITER_TYPE] != CheckpointWriterType.FAST:
        return ""
    if type(ce) is FastCheckpointEngine:
        dp = None if ce._writer is None else ce._writer._data_parallel_writer
    elif type(ce) is DecoupledCheckpointEngine:
        dp = ce.dp_writer_config
    else:
        return ""
    if dp is None or not ce.optimize_dp_state:
        return ""
    return f"-{dp.rank}.{dp.world_size * writer[CHECKPOINT_IO_MULTIPLIER]}"


def native_load_files(engine: Engine, load_dir: str, tag: str) -> list[str] | None:
    """The files of a tag DeepSpeed's own load reads on this rank: its model-states file, its pipeline stage's layer
    files, and under ZeRO its optimizer file; None where it reads other ranks' files as well (MoE experts' files,
    an elastic ZeRO checkpoint's every partition)."""
    if getattr(engine, "has_moe_layers", False) or (engine.zero_optimization() and engine.zero_elastic_checkpoint()):
        return None
    files = [engine._get_ckpt_name(load_dir, tag)]
    layers = {f.file for f in pipeline_layer_files(engine.module).values()}
    files += [os.path.join(load_dir, str(tag), name) for name in sorted(layers)]
    if engine.zero_optimization():
        files.append(engine._get_zero_ckpt_name(load_dir, tag))
    return files


def trains(engine: Engine) -> bool:
    """Whether the engine has an optimizer to step, and so training state to checkpoint: `deepspeed.initialize`
    without one builds no optimizer at ZeRO-0 in fp32, only a parameter partitioner (`DeepSpeedZeRoOffload`) at
    ZeRO-3, and a ZeRO or bf16 wrapper of a `DummyOptim` otherwise (TRL's reference and reward models, Lightning's
    validate, test and predict)."""
    from deepspeed.runtime.utils import DummyOptim
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    opt = engine.optimizer
    return (
        opt is not None
        and not isinstance(opt, DeepSpeedZeRoOffload)
        and not isinstance(base_optimizer(engine), DummyOptim)
    )


def is_unpartitioned(engine: Engine) -> bool:
    """Whether the engine steps a plain torch optimizer on whole fp32 parameters (ZeRO-0 without bf16/fp16)."""
    import torch

    return isinstance(engine.optimizer, torch.optim.Optimizer)


def is_ulysses_mpu(mpu: Any) -> bool:
    """Whether an engine's `mpu` is DeepSpeed's Ulysses sequence-parallel state (`parallel_state_sp`), whose
    "model parallel" getters alias the sequence-parallel group although every rank holds the whole model."""
    return hasattr(mpu, "get_sequence_parallel_world_size") and not hasattr(mpu, "get_tensor_model_parallel_rank")


def sequence_parallel_size(engine: Engine) -> int:
    """The engine's Ulysses sequence-parallel size (1 without)."""
    return int(getattr(engine, "sequence_parallel_size", 1) or 1)


def ulysses_outside_zero(engine: Engine) -> bool:
    """Whether a Ulysses engine's sequence-parallel ranks fall outside its ZeRO group, as when DeepSpeed 0.19.8 builds
    them from the config's device mesh (`sequence_parallel_size` and `data_parallel_size`): ZeRO then partitions, and
    sums gradients, over the mesh's data-parallel dimension alone."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if sequence_parallel_size(engine) == 1:
        return False
    sequence = set(dist.get_process_group_ranks(groups._get_sequence_parallel_group()))
    return not sequence <= set(dist.get_process_group_ranks(engine.seq_data_parallel_group))


def zero_world_size(engine: Engine) -> int:
    """How many ranks ZeRO partitions over: under Ulysses the sequence x data-parallel ranks (DeepSpeed then leaves
    `dp_world_size` None), else the data-parallel ones."""
    if sequence_parallel_size(engine) > 1:
        return int(engine.seq_dp_world_size)
    return int(engine.dp_world_size)


def data_parallel_rank(engine: Engine) -> int:
    """This rank's index in its data-parallel group (a pipeline stage's replicas; not the global rank)."""
    import torch.distributed as dist

    return dist.get_rank(group=engine.seq_data_parallel_group)


def data_place(engine: Engine) -> tuple[int, int]:
    """This rank's index and the size of its data-parallel group without sequence parallelism: which of the streams
    of different samples it reads (Ulysses' ranks of one group share their samples)."""
    import torch.distributed as dist

    group = engine.data_parallel_group
    return dist.get_rank(group=group), dist.get_world_size(group=group)


class LayerFile(NamedTuple):
    """Where a `PipelineModule` saves one tensor of a layer: the layer file's name, and the tensor's key in it."""

    file: str
    key: str


def pipeline_layer_files(module: Any) -> dict[str, LayerFile]:
    """Where a `PipelineModule` saves each tensor of its layers, by module name.

    DeepSpeed writes each layer's `state_dict` to `layer_XX[-model_YY]-model_states.pt` (XX the global
    layer index) instead of the model-states file; a tied layer once per stage that builds it with a
    state dict, and a layer without `state_dict` (a function, a tied `forward_fn`) nowhere. Empty for
    any other module.
    """
    from deepspeed.pipe import PipelineModule

    if not isinstance(module, PipelineModule):
        return {}
    path_of = {id(sub): path for path, sub in module.named_modules()}
    out: dict[str, LayerFile] = {}
    for local_idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict") or id(layer) not in path_of:
            continue
        file = module.ckpt_layer_path("", local_idx)
        for key in layer.state_dict():
            out.setdefault(f"{path_of[id(layer)]}.{key}", LayerFile(file=file, key=key))
    return out


# --- mixture of experts: DeepSpeed's expert groups, widened to megatron-core's MoE layers --------------


class ExpertParallel(NamedTuple):
    """This rank's place in a DeepSpeed expert group: the expert-parallel size, its expert-parallel rank, and its rank
    among the replicas of its experts (expert-data-parallel)."""

    ep_size: int
    ep_rank: int
    edp_rank: int


def expert_parallel(group: str) -> ExpertParallel:
    """This rank's place in a DeepSpeed expert group (what decides which experts, and which files of them, it holds)."""
    from deepspeed.utils import groups

    return ExpertParallel(
        ep_size=groups._get_expert_parallel_world_size(group),
        ep_rank=groups._get_expert_parallel_rank(group),
        edp_rank=groups._get_expert_data_parallel_rank(group),
    )


def register_expert_groups(name: str, ep_group: Any, edp_group: Any) -> None:
    """Register existing expert-parallel / expert-data-parallel process groups with DeepSpeed under `name`."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    for registry, ranks, group in (
        (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ep_group),
        (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, edp_group),
    ):
        registry[name] = group
        ranks[name] = dist.get_process_group_ranks(group)


class _MoEOrMegatron(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        from deepspeed.moe.layer import MoE

        return isinstance(obj, MoE) or is_megatron_moe(obj)


class _MoEClass(metaclass=_MoEOrMegatron):
    """Matches DeepSpeed's MoE layer and megatron-core's, for DeepSpeed's `has_moe_layers` check."""


@contextlib.contextmanager
def deepspeed_sees_megatron_moe() -> Iterator[None]:
    """While an engine is built, DeepSpeed's engine module counts megatron-core MoE layers as its own MoE.

    DeepSpeed decides `has_moe_layers` with `isinstance(module, MoE)` on the name `MoE` in
    `deepspeed.runtime.engine`; only that lookup is widened, and only inside this block.
    """
    from deepspeed.runtime import engine as ds_engine

    original = ds_engine.MoE
    ds_engine.MoE = _MoEClass
    try:
        yield
    finally:
        ds_engine.MoE = original


class ExpertContainer(NamedTuple):
    """Where an MoE layer keeps its local experts: their path inside the layer (a prefix ending in `.`), how many
    there are, and the expert group they belong to."""

    path: str
    num_local: int
    group: str


def expert_container(module: Any) -> ExpertContainer | None:
    """Where a DeepSpeed `MoE` or a registered megatron-core `MoELayer` keeps its local experts, whose ids restart on
    each expert-parallel rank; None for anything else."""
    if not (hasattr(module, "num_local_experts") and hasattr(module, "expert_group_name")):
        return None
    kind = type(module).__module__
    if kind.startswith("deepspeed.moe"):
        path = "deepspeed_moe.experts.deepspeed_experts."
    elif kind.startswith("megatron.core.transformer.moe"):
        path = "experts.local_experts."
    else:
        return None
    return ExpertContainer(path=path, num_local=int(module.num_local_experts), group=module.expert_group_name)


# --- AutoTP and AutoEP: how their layers cut a Hugging Face model's parameters -------------------------


def autotp_meta(p: Any) -> dict[str, Any] | None:
    """The restore metadata DeepSpeed's AutoTP attaches to a parameter it partitioned or marked
    (`ds_autotp_universal_checkpoint_meta`: partition dim and sizes, fused sub-parameters, replication); None for
    a parameter AutoTP left untouched (which every tensor-parallel rank holds whole)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(p, DS_AUTOTP_UC_META, None)
    return dict(meta) if isinstance(meta, dict) else None


def is_autotp_model(module: Any) -> bool:
    """Whether DeepSpeed's AutoTP partitioned this module for training (it marks the model when done)."""
    return bool(getattr(module, "ds_autotp_parsed", False))


def recorded_sample_copies(ds_config: Any) -> int:
    """How many copies of each sample `global_samples` counts in a checkpoint whose model states record `ds_config`:
    DeepSpeed sizes the batch over every process before AutoTP's groups exist, so each tensor-parallel rank counts
    the batch it shares (a TP=2 x DP=1 job of 12 sequences a step counts 24). Ulysses' ranks are not counted."""
    size = ((ds_config if isinstance(ds_config, dict) else {}).get("tensor_parallel") or {}).get("autotp_size")
    return size if type(size) is int and size > 1 else 1


def sample_copies(engine: Any) -> int:
    """`recorded_sample_copies` of a live engine: its AutoTP size."""
    return max(1, int(engine.autotp_size() or 1))


class ExpertStack(NamedTuple):
    """Where one AutoEP expert parameter's stack of experts sits: this rank's run of the layer's experts."""

    ep_size: int
    ep_rank: int
    experts: tuple[int, ...]


def autoep_stack(p: Any) -> ExpertStack | None:
    """The expert placement DeepSpeed's AutoEP attaches to each stacked expert parameter it built
    (`ds_autoep_uc_meta`: its placement descriptor, expert-parallel rank and local experts); None for others."""
    from deepspeed.checkpoint.constants import (
        AUTOEP_EXPERT_PLACEMENT,
        AUTOEP_PARAM_EP_RANK,
        AUTOEP_PARAM_LOCAL_EXPERTS,
        DS_AUTOEP_UC_META,
    )

    meta = getattr(p, DS_AUTOEP_UC_META, None)
    if not isinstance(meta, dict):
        return None
    return ExpertStack(
        ep_size=int(meta[AUTOEP_EXPERT_PLACEMENT]["ep_size"]),
        ep_rank=int(meta[AUTOEP_PARAM_EP_RANK]),
        experts=tuple(int(e) for e in meta[AUTOEP_PARAM_LOCAL_EXPERTS]),
    )


def autoep_groups(module: Any) -> dict[str, int]:
    """The expert-parallel group name (`ep_size_<E>`) of each of DeepSpeed's AutoEP layers in a module, and its size."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return {m.ep_group_name: int(m.ep_size) for m in module.modules() if isinstance(m, AutoEPMoELayer)}
