"""Canaries for `ucp_deepspeed.compat`: one per function, in this process, on real framework objects.

Each test names the compat function it guards. When a DeepSpeed, megatron-core, transformers or
accelerate upgrade moves an internal we rely on, the failure is here, by name, in seconds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
import torch.distributed as dist
from conftest import pickled_by_name

from ucp_deepspeed import compat
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.hf.models import activation_func as megatron_activation
from ucp_deepspeed.runtime.native_io import unbound

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            env.setenv(key, value)
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        yield


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.b = torch.nn.Linear(10, 3)
        self.frozen = torch.nn.Linear(3, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer("counts", torch.arange(4.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(torch.relu(self.a(x))))


def _engine(stage: int, bf16: bool = False):
    torch.manual_seed(0)
    net = Net()
    groups = [
        {"params": [net.a.weight, net.b.weight], "weight_decay": 0.1},
        {"params": [net.a.bias, net.b.bias], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
    }
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config)
    loss = engine(torch.randn(2, 6, dtype=torch.bfloat16 if bf16 else torch.float32)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


@pytest.fixture(scope="module", params=[(1, False), (2, False), (1, True)], ids=["zero1", "zero2", "zero1-bf16"])
def zero12(request):
    return _engine(*request.param)


@pytest.fixture(scope="module")
def zero3():
    return _engine(3)


def test_buffer_names(zero12):
    assert compat.buffer_names(zero12) == ["counts"]


def test_engine_config(zero12):
    assert type(compat.engine_config(zero12)).__name__ == "DeepSpeedConfig"
    assert compat.engine_config(zero12).zero_optimization_stage == zero12.zero_optimization_stage()


def test_commit_decoupled_checkpoint(zero12):
    """Called only after a decoupled (async) save; here only its presence and signature are checked."""
    import inspect

    assert list(inspect.signature(zero12._commit_decoupled_checkpoint).parameters) == []


def test_before_model_step(zero3):
    """The check runs on every optimizer step, of a plain engine and of a PipelineEngine, whose step goes through the
    same `_take_model_step`."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "self._take_model_step(" in inspect.getsource(PipelineEngine._exec_optimizer_step)
    calls = []
    compat.before_model_step(zero3, lambda: calls.append(zero3.global_steps))
    loss = zero3(torch.randn(2, 6)).pow(2).mean()
    zero3.backward(loss)
    zero3.step()
    assert calls == [zero3.global_steps - 1]


def test_is_bf16_optimizer(zero12):
    """DeepSpeed's BF16_Optimizer (ZeRO-0, bf16, fp32 gradient accumulation) cannot be built on this CPU
    accelerator, so its attributes are checked in its source; ZeRO optimizers must not look like it."""
    import inspect

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    assert not compat.is_bf16_optimizer(zero12.optimizer)
    source = inspect.getsource(BF16_Optimizer)
    for attribute in (
        "self.bf16_groups ",
        "self.bf16_groups_flat ",
        "self.fp32_groups_flat_partition ",
        "self.real_dp_process_group ",
    ):
        assert attribute in source, f"BF16_Optimizer no longer sets {attribute.strip()}"


def test_zero12_groups(zero12):
    groups = compat.zero12_groups(zero12.optimizer)
    assert len(groups) == 2
    assert {id(p) for g in groups for p in g.params} == {id(p) for p in zero12.module.parameters() if p.requires_grad}
    for g in groups:
        assert g.dp == 1 and g.fp32.dtype == torch.float32 and g.fp32.numel() == g.numel
        for p, offset in zip(g.params, g.offsets):
            master = g.fp32.narrow(0, offset, p.numel()).view(p.shape)
            assert torch.equal(master.to(p.dtype), p.data), "a parameter's fp32 master is not at its offset"


def test_zero12_fragment(zero12):
    from deepspeed.utils import safe_get_full_fp32_param

    for p in zero12.module.parameters():
        if not p.requires_grad:
            continue
        piece = compat.zero12_fragment(p)
        assert (piece.start, piece.numel) == (0, p.numel()) and piece.offset >= 0
        assert torch.equal(piece.fp32.view(p.shape), safe_get_full_fp32_param(p))


def test_relink_optimizer_states(zero12):
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = zero12.optimizer
    group = compat.zero12_groups(opt)[0]
    state = opt.optimizer.state[group.fp32]
    state["exp_avg"] = torch.full_like(group.fp32, 7.0)
    compat.relink_optimizer_states(opt)
    assert torch.equal(
        safe_get_full_optimizer_state(group.params[0], "exp_avg"), torch.full(group.params[0].shape, 7.0)
    )


def test_native_load_files(zero12, zero3, tmp_path):
    """The files DeepSpeed's own load reads on this rank are the ones its save writes (`use_node_local_storage`
    loads check them on each node)."""
    for engine in (zero12, zero3):
        deepspeed.DeepSpeedEngine.save_checkpoint(engine, str(tmp_path / "ds"), tag="t")
        files = compat.native_load_files(engine, str(tmp_path / "ds"), "t")
        assert len(files) == 2 and all(Path(f).is_file() for f in files), files
        assert {Path(f).name for f in files} <= {p.name for p in (tmp_path / "ds" / "t").iterdir()}


def test_zero3_params(zero3):
    weight, frozen = zero3.module.a.weight, zero3.module.frozen.weight
    assert compat.is_zero3_param(weight) and not compat.is_zero3_param(torch.zeros(1))
    assert compat.full_shape(weight) == (10, 6) and weight.numel() == 0
    assert compat.storage_dtype(weight) == torch.float32
    assert compat.zero3_partition_numel(weight) == 60
    part = compat.zero3_partition(frozen)
    assert (part.start, part.numel) == (0, 6) and part.tensor.numel() >= 6


def test_zero3_subgroups_and_position(zero3):
    opt = zero3.optimizer
    subs = compat.zero3_subgroups(opt)
    assert sorted({s.group for s in subs}) == [0, 1]
    for sub in subs:
        assert sub.fp32.dtype == torch.float32 and sub.lp.numel() == sub.fp32.numel()
        for p in sub.params:
            position = compat.zero3_position(opt, p)
            assert subs[position.sub_group] is sub and position.start == 0
            assert position.partition == math.prod(compat.full_shape(p))
            assert position.offset + position.partition <= sub.fp32.numel()


def test_zero3_fragment(zero3):
    from deepspeed.utils import safe_get_full_fp32_param

    for p in zero3.module.parameters():
        if not p.requires_grad:
            continue
        piece = compat.zero3_fragment(zero3.optimizer, p)
        assert (piece.start, piece.numel) == (0, math.prod(compat.full_shape(p)))
        assert piece.offset == compat.zero3_position(zero3.optimizer, p).offset
        assert torch.equal(piece.fp32.view(compat.full_shape(p)), safe_get_full_fp32_param(p))


def _owned_fragments_are_deepspeeds_own(engine) -> None:
    """On one rank every trainable parameter is wholly owned: the fp32 master and each optimizer state
    `owned_fragments` reports are what DeepSpeed's own accessors read."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    held = compat.owned_fragments(engine, ["exp_avg", "exp_avg_sq"])
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        owned = held(p)
        shape = compat.full_shape(p)
        assert owned is not None and owned.start == 0
        assert torch.equal(owned.tensors["fp32"].view(shape), safe_get_full_fp32_param(p))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(owned.tensors[key].view(shape), safe_get_full_optimizer_state(p, key))


def test_owned_fragments(zero12):
    _owned_fragments_are_deepspeeds_own(zero12)


def test_owned_fragments_zero3(zero3):
    _owned_fragments_are_deepspeeds_own(zero3)


def test_zero3_regather(zero3):
    compat.zero3_regather(zero3.optimizer)
    with deepspeed.zero.GatheredParameters([zero3.module.a.weight]):
        assert zero3.module.a.weight.shape == (10, 6)


def test_expert_groups_and_container():
    from deepspeed.moe.layer import MoE

    layer = MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=1)
    container = compat.expert_container(layer)
    assert (container.num_local, container.group) == (2, "ep_size_1")
    assert f"{container.path}1" in dict(layer.named_modules())
    assert compat.expert_container(torch.nn.Linear(2, 2)) is None
    solo = dist.new_group([0])
    compat.register_expert_groups("ep_size_1", solo, solo)
    assert compat.expert_parallel("ep_size_1") == compat.ExpertParallel(ep_size=1, ep_rank=0, edp_rank=0)


def test_deepspeed_sees_megatron_moe():
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime import engine as ds_engine
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert compat.is_megatron_moe(MoELayer.__new__(MoELayer))
    original = ds_engine.MoE
    assert original is MoE, "DeepSpeed's engine no longer checks MoE layers against the name MoE"
    with compat.deepspeed_sees_megatron_moe():
        assert isinstance(MoELayer.__new__(MoELayer), ds_engine.MoE)
        assert not isinstance(torch.nn.Linear(1, 1), ds_engine.MoE)
    assert ds_engine.MoE is original


@pytest.fixture(scope="module")
def megatron_model():
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    sys.path.insert(0, str(LAUNCH))
    import megatron_cpu

    ps.initialize_model_parallel(1, 1)
    megatron_cpu.install()
    megatron_cpu.seed(1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=24,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        gated_linear_unit=True,
    )
    with megatron_cpu.cpu_model_construction():
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=32,
            max_sequence_length=8,
            share_embeddings_and_output_weights=True,
        )
    yield model
    ps.destroy_model_parallel()
    sys.path.remove(str(LAUNCH))


def test_megatron_split(megatron_model):
    params = dict(megatron_model.named_parameters())
    split = compat.MegatronSplit
    assert compat.megatron_split(params["embedding.word_embeddings.weight"]) == split(
        dim=0, stride=1, vocab_parallel=True
    )
    assert compat.megatron_split(params["decoder.layers.0.self_attention.linear_qkv.weight"]) == split(
        dim=0, stride=1, vocab_parallel=False
    )
    assert compat.megatron_split(params["decoder.layers.0.mlp.linear_fc1.weight"]) == split(
        dim=0, stride=2, vocab_parallel=False
    )
    assert compat.megatron_split(params["decoder.layers.0.self_attention.linear_proj.weight"]) == split(
        dim=1, stride=1, vocab_parallel=False
    )
    assert compat.megatron_split(params["decoder.final_layernorm.weight"]) is None


def test_megatron_modules(megatron_model):
    layers = dict(megatron_model.named_modules())
    assert compat.is_megatron_module(megatron_model) and not compat.is_megatron_module(torch.nn.Linear(1, 1))
    assert [compat.megatron_layer_number(layers[f"decoder.layers.{i}"]) for i in (0, 1)] == [1, 2]
    assert compat.megatron_layer_number(layers["decoder"]) is None
    assert not compat.megatron_tied_output_stage(megatron_model)  # first and last stage at once
    megatron_model.pre_process = False
    try:
        assert compat.megatron_tied_output_stage(megatron_model)
    finally:
        megatron_model.pre_process = True


def test_megatron_gpt_architecture(megatron_model):
    fields = compat.megatron_gpt_architecture(megatron_model)
    assert fields is not None and ModelSpec(**fields) == ModelSpec(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=8,
        vocab_size=32,
        max_sequence_length=8,
        layernorm_epsilon=1e-5,
        activation="gelu",
        gated_linear_unit=True,
        tied=True,
    )
    assert compat.megatron_gpt_architecture(torch.nn.Linear(1, 1)) is None
    config = megatron_model.config
    original = config.qk_layernorm, config.activation_func
    config.qk_layernorm, config.activation_func = True, megatron_activation("gelu_tanh")
    try:
        fields = compat.megatron_gpt_architecture(megatron_model)
        assert fields["unmapped"] == {"qk_layernorm": True} and fields["activation"] == "gelu_tanh"
    finally:
        config.qk_layernorm, config.activation_func = original


def test_base_optimizer_and_unpartitioned(zero12):
    assert isinstance(compat.base_optimizer(zero12), torch.optim.AdamW) and not compat.is_unpartitioned(zero12)
    plain = _engine(0)
    assert compat.base_optimizer(plain) is plain.optimizer and compat.is_unpartitioned(plain)
    assert compat.data_parallel_rank(plain) == 0 and compat.data_parallel_rank(zero12) == 0


@pytest.mark.parametrize("config", [{}, {"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 3}}])
def test_trains(zero12, zero3, config):
    """An engine built without an optimizer trains nothing: none at ZeRO-0 in fp32, DeepSpeed's parameter partitioner
    alone at ZeRO-3, its BF16_Optimizer over a DummyOptim in bf16."""
    assert compat.trains(zero12) and compat.trains(zero3) and compat.trains(_engine(0))
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": 2, **config})
    assert not compat.trains(engine)


def test_group_order(zero12, zero3):
    """Each param group's parameters in the order the script gave them, as torch's state dict numbers them: ZeRO-1/2
    and ZeRO-3 keep them in flat groups and sub-groups of their own."""
    for engine in (zero12, zero3, _engine(0)):
        names = {p: n for n, p in engine.module.named_parameters()}
        assert [[names[p] for p in g] for g in compat.group_order(engine)] == [
            ["a.weight", "b.weight"],
            ["a.bias", "b.bias"],
        ]


def test_checkpoint_writes(zero12, monkeypatch):
    """How DeepSpeed's checkpoint engines write a file: torch's and the python writer's at once, whole, at the path
    given; the decoupled writer's later, in its process."""
    import inprocess

    assert compat.checkpoint_writes(zero12.checkpoint_engine) is compat.Writes.WHOLE
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    for writer, expected in (({}, compat.Writes.WHOLE), ({"decoupled": True}, compat.Writes.LATER)):
        engine = inprocess.build(0, writer={"type": "python", "data_parallel": "replica", **writer})
        try:
            assert compat.checkpoint_writes(unbound(engine)) is expected
        finally:
            engine.destroy()


def test_fastpersist_parts_are_whole_archives(tmp_path):
    """`written_suffix` renames each FastPersist part to DeepSpeed's name because each is the whole archive: torch
    writes through the writer's `write` and never hands it the storages to split over its writers
    (`save_torch_storage_object_list`), which a patched torch does. A torch that calls it breaks this."""
    import inspect

    import torch.serialization

    assert "save_torch_storage_object_list" not in inspect.getsource(torch.serialization)
    from deepspeed.io import FastFileWriter

    assert hasattr(FastFileWriter, "save_torch_storage_object_list")  # the hook a patched torch would call


def test_data_sampler(zero3, tmp_path):
    """DeepSpeed's curriculum sampler is found on an engine that has one, and its state and generator, put back,
    draw the same next batch again."""
    import copy
    import importlib.util

    worker = Path(__file__).parent / "workers" / "data_sampler.py"
    spec = importlib.util.spec_from_file_location("data_sampler_worker", worker)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = module.Net()  # DeepSpeed's own initialize: ucp_deepspeed's would take up a megatron-core state left here
    engine, _, loader, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=module.config(1, tmp_path), training_data=module.Samples()
    )
    sampler = compat.data_sampler(engine)
    assert sampler is loader.data_sampler and compat.data_sampler(zero3) is None
    batches = iter(loader)
    next(batches)
    state, rng = copy.deepcopy(sampler.state_dict()), compat.sampler_rng(engine)  # it shares lists it mutates
    drawn = next(batches)[1].tolist()
    next(batches)
    compat.restore_sampler(sampler, state, rng)
    assert next(iter(loader))[1].tolist() == drawn
    engine.destroy()


def test_pipeline_layer_files():
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class Norm(torch.nn.LayerNorm):
        def __init__(self) -> None:
            super().__init__(4)
            self.register_buffer("seen", torch.zeros(()))

    specs = [
        TiedLayerSpec("embed", torch.nn.Embedding, 8, 4),
        LayerSpec(Norm),
        torch.relu,  # a function: no state, no file
        TiedLayerSpec("embed", torch.nn.Embedding, 8, 4, forward_fn=lambda m, x: x @ m.weight.T),
    ]
    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule builds its grid through deepspeed.comm
    pipe = PipelineModule(specs, num_stages=1, loss_fn=torch.nn.functional.cross_entropy)
    where = compat.LayerFile
    assert compat.pipeline_layer_files(pipe) == {
        "tied_modules.embed.weight": where(file="layer_00-model_states.pt", key="weight"),
        "1.weight": where(file="layer_01-model_states.pt", key="weight"),
        "1.bias": where(file="layer_01-model_states.pt", key="bias"),
        "1.seen": where(file="layer_01-model_states.pt", key="seen"),
    }
    assert compat.pipeline_layer_files(torch.nn.Linear(2, 2)) == {}


def test_trainer_and_accelerate_restores():
    import inspect

    hook = compat.trainer_rng_restore()
    assert list(inspect.signature(getattr(hook.owner, hook.name)).parameters)[:2] == ["self", "checkpoint"]
    hook = compat.accelerate_state_restore()
    params = inspect.signature(getattr(hook.owner, hook.name)).parameters
    assert "input_dir" in params and "process_index" in params


def test_deepspeed_safe_globals_and_rebuild():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    assert LossScaler in compat.deepspeed_safe_globals()
    rebuilt = compat.rebuild(
        {"__class__": "deepspeed.runtime.fp16.loss_scaler.LossScaler", "args": [], "state": {"cur_scale": 4.0}}
    )
    assert isinstance(rebuilt, LossScaler) and rebuilt.cur_scale == 4.0


def test_enum_members_by_name_read_as_by_value():
    """Early Python 3.11 pickles an enum member as `getattr(Enum, NAME)`: every member of DeepSpeed's ZeRO stage and
    megatron-core's model type, the enums kept here, reads as the same member pickled by value does."""
    import pickle

    from deepspeed.runtime.zero.config import ZeroStageEnum
    from megatron.core.enums import ModelType

    from ucp_deepspeed.io import safe_pickle

    for member in [*ZeroStageEnum.__members__.values(), *ModelType.__members__.values()]:
        data = pickled_by_name(member)
        assert b"getattr" in data
        assert safe_pickle.loads(data) == safe_pickle.loads(pickle.dumps(member, protocol=2)), member


def test_bigscience_args_are_kept_as_data(monkeypatch):
    """BigScience's Megatron-DeepSpeed (BLOOM's) pickles `args.position_embedding_type` as its own enum into every
    model-states file: read by value or by name, without that fork installed, as a stand-in naming the member."""
    import argparse
    import enum
    import pickle
    import types

    from ucp_deepspeed.io import safe_pickle

    class PositionEmbeddingType(enum.Enum):  # megatron/enums.py of bigscience-workshop/Megatron-DeepSpeed
        rotary = 1
        absolute = 2
        alibi = 3

    PositionEmbeddingType.__module__, PositionEmbeddingType.__qualname__ = "megatron.enums", "PositionEmbeddingType"
    module = types.ModuleType("megatron.enums")
    module.PositionEmbeddingType = PositionEmbeddingType  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.enums", module)  # so that pickle can name the class, as the fork does

    for member in PositionEmbeddingType:
        state = {"args": argparse.Namespace(position_embedding_type=member, num_attention_heads=2)}
        by_value = safe_pickle.loads(pickle.dumps(state, protocol=2))
        by_name = safe_pickle.loads(pickled_by_name(state))
        kept = by_value["args"].position_embedding_type
        assert by_name == by_value and by_value["args"].num_attention_heads == 2
        qualname = "megatron.enums.PositionEmbeddingType"
        assert kept.to_data() == {"__class__": qualname, "args": [member.value], "state": None}


def test_deepspeed_keys(zero12, tmp_path):
    """Every top-level key DeepSpeed writes into a model-states file is in our one list; the rest is client_state."""
    from ucp_deepspeed.io.torch_file import load_file
    from ucp_deepspeed.sources.keys import DEEPSPEED_KEYS

    zero12.save_checkpoint(str(tmp_path), tag="t", client_state={"mine": 1})
    keys = set(load_file(str(tmp_path / "t" / "mp_rank_00_model_states.pt")).keys())
    assert "mine" in keys and keys - {"mine"} <= DEEPSPEED_KEYS, keys - DEEPSPEED_KEYS
    # a DeepSpeed MoE model's save writes its own (one expert-parallel rank here)
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), MoE(6, torch.nn.Linear(6, 6), num_experts=2, ep_size=1))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(net.parameters()), "name": "all"}])
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config)
    engine.save_checkpoint(str(tmp_path), tag="moe", client_state={"mine": 1})
    keys = set(load_file(str(tmp_path / "moe" / "mp_rank_00_model_states.pt")).keys())
    assert "num_experts" in keys and keys - {"mine"} <= DEEPSPEED_KEYS, keys - DEEPSPEED_KEYS


def test_kernel_table_names_deepspeed_classes():
    """A canary: DeepSpeed's kernel classes still live where the table looks them up (built without their ops)."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    def bare(cls, **attrs):
        obj = cls.__new__(cls)
        obj.__dict__.update(attrs)
        return obj

    assert compat.optimizer_kernel(bare(DeepSpeedCPUAdam, adam_w_mode=True)).algorithm == "adamw"
    assert compat.optimizer_kernel(bare(FusedAdam, adam_w_mode=0)) == compat.Kernel(
        qualname="deepspeed.ops.adam.fused_adam.FusedAdam", algorithm="adam", step=compat.StepCount.INT, states={}
    )
    assert compat.optimizer_kernel(bare(DeepSpeedCPUAdagrad)).states == {"exp_avg_sq": "sum"}
    assert {compat.optimizer_kernel(bare(c)).algorithm for c in (DeepSpeedCPULion, FusedLion)} == {"lion"}
    sgd = compat.optimizer_kernel(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    assert sgd.step is compat.StepCount.NONE
    rmsprop = compat.optimizer_kernel(torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))]))
    assert rmsprop.step is compat.StepCount.TENSOR

    class Elsewhere(torch.optim.SGD):
        pass

    elsewhere = compat.optimizer_kernel(Elsewhere([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    assert elsewhere.step is compat.StepCount.AS_SAVED


def test_scalar_device():
    flat = torch.zeros(2)
    assert compat.scalar_device({"fused": True}, flat) == flat.device
    assert compat.scalar_device({}, flat) == torch.device("cpu")


def test_nvme_swap_and_zero3_resident(tmp_path):
    from conftest import nvme_unavailable

    if nvme_unavailable():
        pytest.skip(nvme_unavailable())
    torch.manual_seed(0)
    net = torch.nn.Linear(512, 600)  # the weight's partition reaches DeepSpeed's 1 MiB swap threshold, the bias not
    groups = [{"params": [net.weight]}, {"params": [net.bias]}]
    offload = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=config)
    engine.backward(engine(torch.randn(2, 512)).pow(2).mean())
    engine.step()
    swap = compat.nvme_swap(engine, str(tmp_path / "ckpt"), "t")
    assert swap is not None and swap.folder == "rank00" and swap.dtype == torch.float32
    assert swap.optim_file == "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert list(swap.swapped.values()) == [512 * 600]
    opt = engine.optimizer
    flat = opt.fp32_partitioned_groups_flat[0]
    assert flat.numel() == 0  # swapped out between steps
    with compat.zero3_resident(opt, 0):  # the states a step made, swapped in with the partition: written in place
        state = opt.optimizer.state[flat]
        assert flat.numel() == 512 * 600 == state["exp_avg"].numel()
        flat.data.fill_(0.5)
        state["exp_avg"].fill_(2.0)
        state["exp_avg_sq"].fill_(3.0)
    assert flat.numel() == 0
    with compat.zero3_resident(opt, 0):  # read back from the swap files
        assert torch.equal(flat.data, torch.full((512 * 600,), 0.5))
        assert torch.equal(state["exp_avg"], torch.full_like(flat, 2.0))
        assert torch.equal(state["exp_avg_sq"], torch.full_like(flat, 3.0))
    with compat.zero3_resident(opt, 1):  # kept in memory: nothing to swap
        assert opt.fp32_partitioned_groups_flat[1].numel() == 600


def test_nvme_param_offload(zero3, zero12):
    """DeepSpeed's `zero_offload_param()` is read for its device: a ZeRO-3 engine keeping its parameters in memory
    and a ZeRO-1/2 engine are not swapping to NVMe (the refusal itself: test_config)."""
    assert not compat.nvme_param_offload(zero3) and not compat.nvme_param_offload(zero12)
    assert zero3.zero_offload_param() is None


def test_megatron_transformer_engine_names():
    """What the TE <-> local naming reads off megatron-core: its map between the two specs' norm names, the expert
    classes by name (TEGroupedMLP cannot be built without Transformer Engine), and its TransformerLayer."""
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.transformer_layer import TransformerLayer

    assert compat.megatron_fused_norms() == {
        "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
        "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    }
    assert experts.TEGroupedMLP.__module__.startswith("megatron.core.transformer.moe")
    assert experts.GroupedMLP.__module__.startswith("megatron.core.transformer.moe")
    layer = TransformerLayer.__new__(TransformerLayer)
    assert compat.is_megatron_transformer_layer(layer) and not compat.is_megatron_transformer_layer(
        torch.nn.Linear(1, 1)
    )
    assert compat.megatron_grouped_experts(experts.SequentialMLP.__new__(experts.SequentialMLP)) is None
    te = compat.megatron_grouped_experts(experts.TEGroupedMLP.__new__(experts.TEGroupedMLP))
    fused = compat.megatron_grouped_experts(experts.GroupedMLP.__new__(experts.GroupedMLP))
    assert (te, fused) == (compat.GroupedExperts.TE, compat.GroupedExperts.FUSED)


def test_dcp_writer_is_read_by_dcp_load(tmp_path):
    """`DcpWriter` builds DCP's metadata from its dataclasses and `filesystem._StorageInfo`: `dcp.load` must read
    what it writes, a tensor split over chunks and an object alike."""
    import io
    import warnings

    import torch.distributed.checkpoint as dcp

    def saved(value):
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()

    weight = torch.arange(12.0).reshape(3, 4)
    writer = compat.DcpWriter(str(tmp_path / "dcp"))
    writer.tensor("model.w", ("model", "w"), weight, saved(weight))
    writer.object("epoch", ("epoch",), saved(7))
    writer.finish()
    state = {"model": {"w": torch.zeros(3, 4)}, "epoch": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(state["model"]["w"], weight) and state["epoch"] == 7


def test_autotp_meta_and_model_mark():
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    deepspeed.init_distributed(dist_backend="gloo")
    solo = dist.new_group([0])
    column, row = LinearLayer(torch.nn.Linear(8, 6), solo), LinearAllreduce(torch.nn.Linear(8, 6), solo)
    meta = compat.autotp_meta(column.weight)
    assert meta is not None and meta["partition_dim"] == 0 and list(meta["partition_sizes"]) == [6]
    assert list(meta["logical_shape"]) == [6, 8] and not meta["replicated"]
    assert compat.autotp_meta(row.weight)["partition_dim"] == 1
    assert compat.autotp_meta(row.bias)["replicated"]
    assert compat.autotp_meta(torch.nn.Linear(2, 2).weight) is None
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    # the engine marks the model once AutoTP has partitioned it; a run at autotp_size > 1 needs two ranks
    assert 'setattr(model, "ds_autotp_parsed", True)' in inspect.getsource(DeepSpeedEngine)
    net = torch.nn.Linear(2, 2)
    assert not compat.is_autotp_model(net)
    net.ds_autotp_parsed = True
    assert compat.is_autotp_model(net)


def test_hf_model_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2)
    recorded = compat.hf_model_config(LlamaForCausalLM(config))
    assert recorded["model_type"] == "llama" and recorded["hidden_size"] == 8 and recorded["vocab_size"] == 16
    assert compat.hf_model_config(torch.nn.Linear(2, 2)) is None


def test_ulysses_mpu_and_partition_count(zero12, zero3):
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    from ucp_deepspeed.runtime.mpu import MegatronMpu

    assert compat.is_ulysses_mpu(parallel_state_sp)
    assert not compat.is_ulysses_mpu(MegatronMpu.__new__(MegatronMpu)) and not compat.is_ulysses_mpu(None)
    for engine in (zero12, zero3):
        assert compat.sequence_parallel_size(engine) == 1 and not compat.ulysses_outside_zero(engine)
        assert compat.zero_world_size(engine) == engine.dp_world_size == 1
    # what the Ulysses checks reach into: the engine's sequence-data-parallel group and DeepSpeed's sequence group
    assert zero12.seq_dp_world_size == 1 and zero12.seq_data_parallel_group is not None
    assert callable(groups._get_sequence_parallel_group)


def test_autoep_stack_and_groups():
    """AutoEP's per-parameter placement (read by `autoep_stack`) and the layer attributes `autoep_groups` reads. Its
    engines need transformers 5.22.2 (tests/test_hf_autoep.py launches them); here, the names they rely on."""
    import inspect

    from deepspeed.checkpoint.constants import (
        AUTOEP_EXPERT_PLACEMENT,
        AUTOEP_PARAM_EP_RANK,
        AUTOEP_PARAM_LOCAL_EXPERTS,
        DS_AUTOEP_UC_META,
    )
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    source = inspect.getsource(AutoEPMoELayer)
    for needle in ("self.ep_size = ", "self.ep_group_name = ", "DS_AUTOEP_UC_META", "AUTOEP_PARAM_LOCAL_EXPERTS"):
        assert needle in source, needle
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert compat.autoep_stack(p) is None
    placement = {"version": 1, "num_experts": 4, "ep_size": 2, "ranks": [{"rank": 1, "experts": [2, 3]}]}
    setattr(
        p,
        DS_AUTOEP_UC_META,
        {AUTOEP_EXPERT_PLACEMENT: placement, AUTOEP_PARAM_EP_RANK: 1, AUTOEP_PARAM_LOCAL_EXPERTS: [2, 3]},
    )
    assert compat.autoep_stack(p) == compat.ExpertStack(ep_size=2, ep_rank=1, experts=(2, 3))
    assert compat.autoep_groups(torch.nn.Linear(2, 2)) == {}


def test_s3_read_into() -> None:
    """`s3_read_into` sends s3fs's `_call_s3("get_object", ...)` and fills the views by aiobotocore's
    `StreamingBody.readinto`: the bytes asked for, across views, and fewer where the object ends."""
    from s3server import s3_server

    from ucp_deepspeed.io import storage as st

    with s3_server() as s3:
        bucket = s3.bucket()
        data = bytes(range(256)) * 64
        st.write(f"s3://{bucket}/o", data)
        fs = st.storage_of(f"s3://{bucket}").fs  # type: ignore[attr-defined]
        first, second = bytearray(100), bytearray(300)
        assert compat.s3_read_into(fs, f"{bucket}/o", 1000, [memoryview(first), memoryview(second)]) == 400
        assert bytes(first + second) == data[1000:1400]
        assert compat.s3_read_into(fs, f"{bucket}/o", len(data) - 5, [memoryview(bytearray(50))]) == 5


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_loader_position(workers):
    """torchdata's loader state: the indices taken are where `samples_taken` reads them, and `state_at` starts a
    fresh loader after exactly that many, over a plain and a stateful `DistributedSampler`, with and without
    workers."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    data = list(range(48))
    for kind in (DistributedSampler, StatefulDistributedSampler):

        def build(kind=kind) -> StatefulDataLoader:
            sampler = kind(data, num_replicas=2, rank=1, seed=5)
            return StatefulDataLoader(data, batch_size=3, sampler=sampler, num_workers=workers)

        loader = build()
        batches = iter(loader)
        next(batches), next(batches)
        assert compat.samples_taken(loader, loader.state_dict()) == (6, False), kind
        assert compat.state_workers(loader.state_dict()) == workers
        assert compat.distributed_sampler(loader) is loader.sampler and compat.is_stateful_loader(loader)
        fresh = build()
        fresh.load_state_dict(compat.state_at(fresh, 7))
        assert [x for b in fresh for x in b.tolist()] == list(kind(data, num_replicas=2, rank=1, seed=5))[7:], kind


def test_lightning_strategy_engine_and_status(zero12):
    """Lightning's DeepSpeed strategy holds the engine as `strategy.model` and tears down after an error too: whether
    the run ended normally is its trainer's status, read through the module the strategy was connected to."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.trainer.states import TrainerStatus

    strategy_class = compat.lightning_deepspeed_strategy()
    assert strategy_class is pl.strategies.DeepSpeedStrategy and callable(strategy_class.teardown)
    strategy = strategy_class.__new__(strategy_class)
    strategy._model, strategy._lightning_module = None, None
    assert compat.strategy_engine(strategy) is None and not compat.run_ended_normally(strategy)
    strategy.model = zero12
    assert compat.strategy_engine(strategy) is zero12
    module = pl.LightningModule()
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    strategy._lightning_module = module
    for status, normal in ((TrainerStatus.RUNNING, True), (TrainerStatus.INTERRUPTED, False)):
        module.trainer.state.status = status
        assert compat.run_ended_normally(strategy) is normal


def test_sample_copies(zero12):
    """DeepSpeed sizes the batch over every process whatever AutoTP's size (its groups come later): each
    tensor-parallel rank counts the batch it shares in `train_batch_size` and `global_samples`."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 3, "tensor_parallel": {"autotp_size": 2}}
    assert DeepSpeedConfig(config).train_batch_size == 3 * dist.get_world_size()
    assert compat.recorded_sample_copies(config) == 2 and compat.recorded_sample_copies({}) == 1
    assert compat.sample_copies(zero12) == 1


def test_torchrec_canaries():
    """Canaries of `compat.torchrec`: a 1-rank DLRM with a table-wise, a column-wise (two shards) and a
    data-parallel table, its fused row-wise Adagrad and a dense Adagrad in a `CombinedOptimizer`."""
    pytest.importorskip("torchrec", reason="TorchRec is not installed (the `torchrec` extra)")
    import importlib.util

    from torchrec.optim.keyed import CombinedOptimizer

    spec = importlib.util.spec_from_file_location("torchrec_job", Path(__file__).parent / "workers" / "torchrec_job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    model, dense = job.build("rowwise", "one_rank")
    t1, t2, t3 = (f"sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight" for t in ("t1", "t2", "t3"))
    assert compat.is_dmp(model) and not compat.is_dmp(model.module) and compat.torchrec_version()
    tables = compat.dmp_tables(model)
    assert (tables[t1].sharding, tables[t1].fused, tables[t1].optimizer) == (
        "table_wise",
        True,
        "exact_row_wise_adagrad",
    )
    assert tables[t2].column_split == (0, 4) and [s.cols for s in tables[t2].shards] == [4, 4]
    assert (tables[t3].sharding, tables[t3].fused) == ("data_parallel", False)
    states = compat.dmp_fused_states(model)
    shape, shards = states[t2]["momentum1"]  # the table's name taken off the state's key
    assert shape == (120,) and sorted(s.offsets for s in shards) == [(0,), (60,)]
    assert [compat.row_state_place(tables[t2], s.offsets[0]) for s in sorted(shards)] == [(0, 0), (1, 0)]
    local = compat.dmp_local_weights(model, {t1})[t1][0]
    local.tensor.add_(1.0)  # a view of the kernel's weights
    assert torch.equal(model.state_dict()[t1].local_shards()[0].tensor, local.tensor)
    (features,) = [f for _, f in compat.dmp_sparse_modules(model)]
    assert features == {"f1": t1, "f2": t2, "f3": t2, "f4": t3}
    _, kjt, _ = job.batch(1)
    assert set(compat.kjt_ids((kjt,), {})) == {"f1", "f2", "f3", "f4"} == set(compat.kjt_ids((), {"features": kjt}))
    combined = CombinedOptimizer([model.fused_optimizer, dense])
    assert compat.dense_optimizers(combined, model) == [dense] == compat.dense_optimizers(dense, model)
    lrs = compat.dmp_fused_lrs(model)
    assert sorted(lrs) == [t1, t2] and all(abs(lr - 0.05) < 1e-7 for lr in lrs.values())
    compat.set_dmp_fused_lrs(model, {t1: 0.01, t2: 0.02})  # one kernel per table here
    assert compat.dmp_fused_lrs(model) == pytest.approx({t1: 0.01, t2: 0.02})
    assert compat.dense_device(model) == torch.device("cpu") and not compat.is_2d_dmp(model)
    assert tables[t1].kernel == "fused" and tables[t3].kernel == "dense"
    job.DTENSOR = True  # `output_dtensor`: a DTensor over TorchRec's LocalShardsWrapper, both column shards local
    shards = compat.dmp_local_weights(job.build("rowwise", "one_rank")[0], {t2})[t2]
    assert sorted(s.offsets for s in shards) == [(0, 0), (0, 4)] and all(s.tensor.shape == (60, 4) for s in shards)


def test_shared_storage_opens_in_another_process():
    """The async save's staging: a storage moved into torch's named shared memory opens by its handle in a process
    started without multiprocessing (the writer), which sees its bytes without a copy; sharing again gives the
    same handle."""
    import pickle
    import subprocess

    storage = torch.UntypedStorage(4096)
    handle = compat.share_storage(storage)
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(7)
    assert compat.share_storage(storage) == handle
    child = """
import pickle, sys, torch
from ucp_deepspeed import compat
storage = compat.open_shared_storage(pickle.loads(sys.stdin.buffer.read()))
print(int(torch.empty(0, dtype=torch.uint8).set_(storage).sum()), storage.nbytes())
"""
    out = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(handle), capture_output=True, check=True)
    assert out.stdout.split() == [b"28672", b"4096"]


def test_crcs_left_to_us(tmp_path):
    """The async writer's `torch.save` skips torch's CRC pass: under the switch every record's CRC is 0 (so
    `fill_crcs` must write them), and the switch is back on after it."""
    import zipfile

    from torch.utils.serialization import config

    with compat.crcs_left_to_us() as switched:
        torch.save({"a": torch.arange(8.0)}, tmp_path / "x.pt")
    assert switched and config.save.compute_crc32
    with zipfile.ZipFile(tmp_path / "x.pt") as zf:
        assert {i.CRC for i in zf.infolist()} == {0}


def test_each_name_resolves_from_the_module_it_is_declared_in():
    """The package imports its modules at a name's first use (`compat.__getattr__`); what it hands out must be what
    the `TYPE_CHECKING` block, the one a type checker reads, says: the same object, from the same module, for
    exactly the names of `__all__`."""
    import ast
    import importlib

    tree = ast.parse(Path(compat.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = {a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert sorted(declared) == sorted(compat.__all__)
    for name, module in declared.items():
        assert getattr(compat, name) is getattr(importlib.import_module(module), name), name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        compat.not_a_name  # noqa: B018
