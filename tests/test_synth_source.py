"""The synthetic checkpoints of `benchmarks/synth_source.py` are DeepSpeed's own layout, and read back exactly.

Drift: real DeepSpeed saves, every rank of a fake world in this process (`tests/fakeworld.py`), are compared file by
file with the generator's files of the same model. DP=4 at ZeRO-1, 2 and 3 saves `inprocess.Net`; TP=2 x DP=2 at
ZeRO-1 and 3 saves a module built from the generator's own one-layer GPT-like stack, its split parameters given to
ucp_deepspeed by layout rules and DeepSpeed given an `mpu` over groups of the fake backend. Every file of the tag must
exist in both, with the same nested keys (in order), list lengths, types, tensor dtypes and shapes, and the same
non-tensor values (partition counts, paddings, `param_slice_mappings`, counters, config) except the learning rate,
which DeepSpeed's WarmupLR has moved; our metadata must be equal apart from the save id.

Readable: at DP=8 and 64 (1024 with `-m scale`) at each ZeRO stage, and at TP x PP x DP of 2x2x4 (4x2x64 = 512
ranks with `-m scale`), the tag passes `ucp verify`, opens and checks as a `NativeCheckpoint`, and converts offline
to exactly the values the generator says every state of every tensor holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import inprocess
import pytest
import torch
import torch.distributed as dist
from synth_source import Synthetic, SynthSpec, SynthTensor, gpt_stack, synthesize
from test_fake_world import save_every_rank

import ucp_deepspeed
from ucp_deepspeed import UniversalCheckpoint, convert
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.io.torch_file import save_id_of
from ucp_deepspeed.sources.native import NativeCheckpoint
from ucp_deepspeed.tools.cli import main as ucp

TAG = "global_step3"

NET = (
    SynthTensor("scale", (3,), kind="buffer"),
    SynthTensor("table.weight", (64, 8), 0),
    SynthTensor("norm.weight", (8,), 1),
    SynthTensor("norm.bias", (8,), 1),
    SynthTensor("head.weight", (3, 8), 0),
    SynthTensor("head.bias", (3,), 1),
    SynthTensor("frozen.weight", (1, 3), kind="frozen"),
    SynthTensor("frozen.bias", (1,), kind="frozen"),
)
"""`inprocess.Net` as the generator's table: its tensors in state-dict order, its two optimizer param groups."""

TP_STACK = gpt_stack(layers=1, hidden=8, vocab=32, pp=1)


class GroupsMpu:
    """DeepSpeed's `mpu` for a tensor x data-parallel grid of the fake world (rank = dp_rank * tp + tp_rank), its
    groups made by every rank in the same order as a real job makes them."""

    def __init__(self, tp: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.tp, self.dp, self.tp_rank, self.dp_rank = tp, world // tp, rank % tp, rank // tp
        for first in range(0, world, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first == rank - self.tp_rank:
                self.tp_group, self.tp_src = group, first
        for first in range(tp):
            group = dist.new_group(list(range(first, world, tp)))
            if first == self.tp_rank:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_src

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


class Holder(torch.nn.Module):
    """A module of `TableNet` holding tensors; called, so that ZeRO-3 gathers its parameters for the forward."""

    def forward(self) -> torch.Tensor:
        return sum(p.pow(2).mean() for p in self.parameters(recurse=False) if p.requires_grad)


class TableNet(torch.nn.Module):
    """A module holding one tensor-parallel rank's share of a generator table, nested by name; its loss touches every
    trainable parameter so each gets a gradient."""

    def __init__(self, tensors: tuple[SynthTensor, ...], tp: int) -> None:
        super().__init__()
        for t in tensors:
            *path, leaf = t.name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, Holder())
                module = getattr(module, part)
            shape = list(t.shape)
            if t.split is not None:
                shape[t.split] //= tp
            if t.kind == "buffer":
                module.register_buffer(leaf, torch.randn(shape))
            else:
                module.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape), requires_grad=t.kind == "param"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        trained = [m for m in self.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        return sum(m() for m in trained) * ids.float().mean()


def build_tp(stage: int) -> Any:
    """An engine of `TP_STACK` at tensor-parallel size 2, with the generator's param groups and config."""
    torch.manual_seed(0)
    model = TableNet(TP_STACK, 2)
    named = dict(model.named_parameters())
    groups = [
        {"params": [named[t.name] for t in TP_STACK if t.trainable and t.group == g], "weight_decay": decay}
        for g, decay in enumerate((0.1, 0.0))
    ]
    rules = [
        {"match": t.name.replace(".", r"\."), "layout": "split", "dim": t.split}
        for t in TP_STACK
        if t.split is not None
    ]
    rules.append({"match": ".*", "layout": "replicated"})
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "checkpoint": {"universal": {"enabled": True, "progress": False, "layout_rules": rules}},
    }
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    return ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=GroupsMpu(2))[0]


REAL = {
    "dp4-zero1": (4, lambda: inprocess.build(1), SynthSpec(dp=4, zero_stage=1, tensors=NET)),
    "dp4-zero2": (4, lambda: inprocess.build(2), SynthSpec(dp=4, zero_stage=2, tensors=NET)),
    "dp4-zero3": (4, lambda: inprocess.build(3), SynthSpec(dp=4, zero_stage=3, tensors=NET)),
    "tp2-dp2-zero1": (4, lambda: build_tp(1), SynthSpec(dp=2, zero_stage=1, tp=2, layers=1)),
    "tp2-dp2-zero3": (4, lambda: build_tp(3), SynthSpec(dp=2, zero_stage=3, tp=2, layers=1)),
}


def differences(real: Any, ours: Any, where: str) -> Iterator[str]:
    """Where two loaded files differ in structure, dtype, shape or a non-tensor value (the learning rate excepted)."""
    if torch.is_tensor(real) or torch.is_tensor(ours):
        if not (torch.is_tensor(real) and torch.is_tensor(ours)):
            yield f"{where}: {type(real).__name__} vs {type(ours).__name__}"
        elif (real.dtype, real.shape) != (ours.dtype, ours.shape):
            yield f"{where}: {real.dtype}{list(real.shape)} vs {ours.dtype}{list(ours.shape)}"
    elif type(real) is not type(ours):
        yield f"{where}: {type(real).__name__} vs {type(ours).__name__}"
    elif isinstance(real, dict):
        if list(real) != list(ours):
            yield f"{where}: keys {list(real)} vs {list(ours)}"
        for key in real.keys() & ours.keys():
            yield from differences(real[key], ours[key], f"{where}.{key}")
    elif isinstance(real, (list, tuple)) and not isinstance(real, torch.Size):
        if len(real) != len(ours):
            yield f"{where}: {len(real)} entries vs {len(ours)}"
        for i, (a, b) in enumerate(zip(real, ours)):
            yield from differences(a, b, f"{where}[{i}]")
    elif type(real).__module__.startswith("deepspeed") and hasattr(real, "__dict__"):  # the loss scaler
        yield from differences(vars(real), vars(ours), where)
    elif real != ours and not where.endswith(".lr"):  # WarmupLR's value after 3 steps, ours is constant
        yield f"{where}: {real!r} vs {ours!r}"


@pytest.fixture(scope="module")
def real_saves(tmp_path_factory) -> Callable[[str], Path]:
    """The real save of a `REAL` case, made once."""
    made: dict[str, Path] = {}

    def save(case: str) -> Path:
        if case not in made:
            world, build, _ = REAL[case]
            made[case] = save_every_rank(tmp_path_factory.mktemp("real") / case, world, 0, build)
        return made[case]

    return save


@pytest.mark.parametrize("case", list(REAL))
def test_synthetic_files_are_what_deepspeed_saves(real_saves, tmp_path, case):
    """Every file of a real save and of the generator's save of the same model agree, key for key, down to shapes."""
    real = real_saves(case) / TAG
    ours = synthesize(tmp_path / "synth", REAL[case][2]).ckpt_dir / TAG
    names = sorted(p.name for p in real.iterdir())
    assert names == sorted(p.name for p in ours.iterdir())
    assert (real.parent / "latest").read_text() == (ours.parent / "latest").read_text()
    found = []
    for name in names:
        if name.endswith(".json"):
            theirs, mine = json.loads((real / name).read_text()), json.loads((ours / name).read_text())
            assert save_id_of(str(next(ours.glob("*.pt")))) == mine["save_id"]
            theirs["save_id"] = mine["save_id"]
        else:
            theirs = torch.load(real / name, weights_only=False)
            mine = torch.load(ours / name, weights_only=False)
        found += differences(theirs, mine, name)
    assert not found, "\n".join(found)


SPECS = [
    *(SynthSpec(dp=dp, zero_stage=stage) for dp in (8, 64) for stage in (1, 2, 3)),
    SynthSpec(dp=4, zero_stage=1, tp=2, pp=2),
    SynthSpec(dp=4, zero_stage=3, tp=2, pp=2),
    *(pytest.param(SynthSpec(dp=1024, zero_stage=stage), marks=pytest.mark.scale) for stage in (1, 2, 3)),
    *(pytest.param(SynthSpec(dp=64, zero_stage=stage, tp=4, pp=2), marks=pytest.mark.scale) for stage in (1, 3)),
]


def _name(spec: SynthSpec) -> str:
    return f"tp{spec.tp}-pp{spec.pp}-dp{spec.dp}-zero{spec.zero_stage}"


def check_conversion(synthetic: Synthetic, output: Path) -> None:
    """An offline conversion holds exactly the generator's values of every state of every tensor."""
    folder = UniversalCheckpoint(convert(str(synthetic.ckpt_dir), synthetic.tag, output=str(output), progress=False))
    try:
        for name, states in synthetic.expected.items():
            for key, want in states.items():
                got = folder.read_buffer(name) if name in folder.buffers else folder.read(name, key)
                assert torch.equal(got.reshape(want.shape), want), (name, key)
        assert set(folder.params) | set(folder.buffers) == set(synthetic.expected)
    finally:
        folder.close()


@pytest.mark.parametrize("spec", SPECS, ids=_name)
def test_synthetic_checkpoints_verify_and_convert_exactly(tmp_path, capsys, spec):
    """`ucp verify`, a checked `NativeCheckpoint` and an offline conversion accept the tag and give back its values;
    at DP=64 and beyond the last ranks save nothing of the small param group."""
    synthetic = synthesize(tmp_path / "ckpt", spec)
    assert ucp(["verify", str(synthetic.ckpt_dir)]) == 0, capsys.readouterr()
    NativeCheckpoint(str(synthetic.ckpt_dir), synthetic.tag).close()
    check_conversion(synthetic, tmp_path / "universal")
    if spec.dp >= 64 and spec.zero_stage < 3:
        last = synthetic.ckpt_dir / synthetic.tag / f"zero_pp_rank_{spec.dp - 1}_mp_rank_00_optim_states.pt"
        groups = torch.load(last, weights_only=False)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        assert groups[1].numel() == 0


def test_values_differ_everywhere(tmp_path):
    """No two elements of any states of any tensors share a value, so a misplaced one cannot pass `torch.equal`."""
    expected = synthesize(tmp_path, SynthSpec(dp=2, zero_stage=1, tp=2, pp=2)).expected
    values = torch.cat([v.reshape(-1) for states in expected.values() for v in states.values()])
    assert values.unique().numel() == values.numel()
    assert {k for states in expected.values() for k in states} == {FP32, "exp_avg", "exp_avg_sq", VALUE}
