"""The layout language: every operator split then merged gives back the full tensor, at several TP sizes."""

from __future__ import annotations

import pytest
import torch

from ucp_deepspeed.geometry.layout import Layout, dropped_padding, merge, split
from ucp_deepspeed.naming.model import param_infos
from ucp_deepspeed.naming.rules import parse_rules

LAYOUTS = {
    "replicated": (Layout(), (6, 8)),
    "split-dim0": (Layout("split", 0), (8, 6)),
    "split-dim1": (Layout("split", 1), (6, 8)),
    "fused-qkv": (Layout("split", 0, parts=(8, 4, 4)), (16, 3)),
    "swiglu": (Layout("split", 0, parts=(8, 8)), (16, 5)),
    "vocab": (Layout("split", 0, vocab=13), (13, 4)),
    "split-1d": (Layout("split", 0), (8,)),
}


def _shards(layout: Layout, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    if not layout.is_split:
        local_shape = tuple(full.shape)
    else:
        local_shape = list(full.shape)
        padded = -(-local_shape[layout.dim] // tp) * tp if layout.vocab else local_shape[layout.dim]
        local_shape[layout.dim] = padded // tp
    return [
        split(
            layout, tuple(local_shape), r, tp, lambda d, s, n: full.narrow(d, s, n) if full.dim() else full.reshape(1)
        )
        for r in range(tp)
    ]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_split_then_merge_is_identity(name, tp):
    layout, shape = LAYOUTS[name]
    full = torch.randn(shape)
    shards = _shards(layout, full, tp)
    assert torch.equal(merge(layout, shards, name), full)
    if layout.is_split and tp > 1:
        assert not torch.equal(shards[0], shards[1]), "ranks must hold different slices"


def test_fused_parts_take_a_chunk_of_every_part():
    full = torch.arange(16).view(16, 1).float()  # gate rows 0..7, up rows 8..15
    shards = _shards(Layout("split", 0, parts=(8, 8)), full, 2)
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert shards[1].flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_vocab_padding_is_zero_and_dropped():
    layout = Layout("split", 0, vocab=13)
    full = torch.randn(13, 4)
    shards = _shards(layout, full, 4)  # padded to 16: the last rank holds 1 real row and 3 padding rows
    assert [s.shape[0] for s in shards] == [4, 4, 4, 4]
    assert torch.equal(shards[3][1:], torch.zeros(3, 4))
    assert dropped_padding(layout, shards) == 0.0
    shards[3][2, 1] = 0.5
    assert dropped_padding(layout, shards) == 0.5
    assert torch.equal(merge(layout, shards), full)


def test_average_keeps_identical_replicas_exactly_and_means_drifted_ones():
    a = torch.randn(5) / 3
    assert torch.equal(merge(Layout("average"), [a.clone(), a.clone(), a.clone()]), a)
    b = torch.tensor([1.0, 2.0])
    assert torch.equal(merge(Layout("average"), [b, b + 2]), b + 1)


def test_stride_two_matches_megatron_core_initialisation():
    """megatron-core splits a stride-2 (SwiGLU) master weight into the same chunks as our fused parts."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    master = torch.randn(12, 5)
    for tp in (1, 2, 3):
        for rank in range(tp):
            weight = torch.nn.Parameter(torch.empty(12 // tp, 5))
            _initialize_affine_weight_cpu(
                weight, 12, 5, 12 // tp, 0, lambda w: w.copy_(master), stride=2, rank=rank, world_size=tp
            )
            ours = split(
                Layout("split", 0, parts=(6, 6)), (12 // tp, 5), rank, tp, lambda d, s, n: master.narrow(d, s, n)
            )
            assert torch.equal(weight.data, ours), (tp, rank)


@pytest.mark.parametrize(
    "layout,shape,tp,message",
    [
        (Layout("split", 0, parts=(6, 6)), (4, 2), 4, "sum to 12"),
        (Layout("split", 0, parts=(6, 2)), (2, 2), 4, "cannot be split evenly"),
        (Layout("split", 0, vocab=20), (4, 2), 4, "exceeds"),
        (Layout("split", 2), (4, 2), 2, "split dim 2"),
    ],
)
def test_impossible_layouts_are_refused(layout, shape, tp, message):
    with pytest.raises(ValueError, match=message):
        layout.full_shape(shape, tp)


def test_layout_constructor_rejects_nonsense():
    with pytest.raises(ValueError, match="unknown layout"):
        Layout("shard")
    with pytest.raises(ValueError, match="only apply to split"):
        Layout("replicated", parts=(2, 2))
    with pytest.raises(ValueError, match="at most one of"):
        Layout("split", parts=(2, 2), vocab=3)
    with pytest.raises(ValueError, match="one length per rank"):
        Layout("split", shards=((2, 1), (1,)))


@pytest.mark.parametrize(
    "layout,full_shape",
    [
        (Layout("split", 0, shards=((6, 4, 4),)), (14, 3)),  # 7 heads of 2 rows over 3 ranks: 3, 2, 2 heads
        (Layout("split", 1, shards=((3, 2),)), (4, 5)),
        (Layout("split", 0, shards=((4, 2), (2, 2), (2, 2))), (14, 2)),  # fused q|k|v, q split unevenly
    ],
)
def test_uneven_splits_merge_back_and_each_rank_holds_its_lengths(layout, full_shape):
    """AutoTP gives whole heads or grains to the first ranks: each rank's share has its own length, and the
    ranks' shares merge back into the full tensor."""
    tp = len(layout.shards[0])
    full = torch.randn(full_shape)
    shards = []
    for rank in range(tp):
        local = list(full_shape)
        local[layout.dim] = layout.local_length(rank)
        shards.append(split(layout, tuple(local), rank, tp, lambda d, s, n: full.narrow(d, s, n)))
    assert [s.shape[layout.dim] for s in shards] == [layout.local_length(r) for r in range(tp)]
    assert layout.full_shape(tuple(shards[-1].shape), tp) == full_shape
    assert torch.equal(merge(layout, shards), full)
    assert Layout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="tensor-parallel rank 0 holds"):
        merge(layout, [shards[1], *shards[1:]])
    with pytest.raises(ValueError, match="uneven split over"):
        layout.full_shape(tuple(shards[0].shape), tp + 1)


def test_an_uneven_fused_split_takes_each_ranks_run_of_every_part():
    full = torch.arange(14).view(14, 1).float()  # q rows 0..5, k rows 6..9, v rows 10..13
    layout = Layout("split", 0, shards=((4, 2), (2, 2), (2, 2)))
    rank0 = split(layout, (8, 1), 0, 2, lambda d, s, n: full.narrow(d, s, n))
    rank1 = split(layout, (6, 1), 1, 2, lambda d, s, n: full.narrow(d, s, n))
    assert rank0.flatten().tolist() == [0, 1, 2, 3, 6, 7, 10, 11]
    assert rank1.flatten().tolist() == [4, 5, 8, 9, 12, 13]


def test_an_uneven_split_takes_only_its_own_ranks_length():
    layout = Layout("split", 0, shards=((6, 4, 4),))
    assert [p.length for p in layout.pieces((4, 3), 2, 3)] == [4]
    with pytest.raises(ValueError, match=r"rank 0 of the uneven split \[\[6, 4, 4\]\] holds 6 along dim 0, not 4"):
        layout.pieces((4, 3), 0, 3)  # rank 1's length, which rank 0 does not hold


def test_recorded_widths_give_the_layout_that_holds_at_any_size_where_one_does():
    assert Layout.from_widths(1, [[3, 3]]) == Layout("split", 1)
    assert Layout.from_widths(0, [[3, 3]], fused=True) == Layout("split", 0, parts=(6,))
    assert Layout.from_widths(0, [[3, 3], [1, 1]]) == Layout("split", 0, parts=(6, 2))
    assert Layout.from_widths(0, [[4, 2], [2, 2]]) == Layout("split", 0, shards=((4, 2), (2, 2)))


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.qkv = torch.nn.Linear(4, 12)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


def test_rules_place_every_parameter_first_match_wins():
    rules = parse_rules(
        [
            {"match": r"embed\.weight", "layout": "split", "dim": 0, "vocab": 15},
            {"match": r"qkv\..*", "layout": "split", "dim": 0, "parts": [8, 8, 8]},
            {"match": r"proj\.weight", "layout": "split", "dim": 1},
            {"match": r"proj\.weight", "layout": "replicated"},
            {"match": r".*", "layout": "replicated"},
        ]
    )
    model = Plain()
    infos = param_infos(model, model.named_parameters(), tp=2, rules=rules)
    assert infos["embed.weight"].layout == Layout("split", 0, vocab=15)
    assert infos["qkv.bias"].layout == Layout("split", 0, parts=(8, 8, 8))
    assert infos["proj.weight"].layout == Layout("split", 1)
    assert infos["norm.weight"].layout == Layout()
    assert all(i.name == n and not i.alias for n, i in infos.items())
    (uneven,) = parse_rules([{"match": "qkv.weight", "layout": "split", "dim": 0, "shards": [[6, 2], [3, 1]]}])
    assert uneven.layout == Layout("split", 0, shards=((6, 2), (3, 1)))


def test_unmatched_parameters_of_a_tensor_parallel_model_are_an_error():
    model = Plain()
    rules = parse_rules([{"match": r"qkv\..*", "layout": "split", "dim": 0}])
    with pytest.raises(ValueError) as info:
        param_infos(model, model.named_parameters(), tp=2, rules=rules)
    message = str(info.value)
    assert "5 parameters have no layout at tensor-parallel size 2" in message
    assert "'embed.weight'" in message and "'norm.bias'" in message and "qkv" not in message.split("]")[0]
    assert "layout_rules" in message
    assert all(i.layout == Layout() for i in param_infos(model, model.named_parameters(), tp=1).values())


@pytest.mark.parametrize(
    "rule,message",
    [
        ({"match": "x", "layout": "diagonal"}, "unknown layout"),
        ({"match": "x", "layout": "split", "dims": 1}, "unknown keys"),
        ({"match": "(", "layout": "split"}, "rule 0"),
        ({"layout": "split"}, "match"),
    ],
)
def test_bad_rules_name_the_rule(rule, message):
    with pytest.raises(ValueError, match=message):
        parse_rules([rule])


def test_rename_maps_prefixes_and_refuses_collisions():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    placed = param_infos(net, net.named_parameters(), 1, rename={"0.": "tied_modules.embed."})
    assert placed["0.weight"].name == "tied_modules.embed.weight" and placed["1.bias"].name == "1.bias"
    with pytest.raises(ValueError, match="would both be '1.weight'"):
        param_infos(net, net.named_parameters(), 1, rename={"0.": "1."})


def _megatron_class(name: str, module: str) -> type:
    """A stand-in for a megatron-core class that needs Transformer Engine or a GPU to build: same name and module,
    so it is recognised as that class."""
    return type(name, (torch.nn.Module,), {"__module__": module})


def test_grouped_gemm_experts_are_named_as_sequential_ones():
    """TEGroupedMLP keeps local expert i as `linear_fc1.weight<i>` (TE's GroupedLinear); in a checkpoint it is
    SequentialMLP's `local_experts.<i>.linear_fc1.weight`, by global id: expert 1 of expert-parallel rank 1 of 2
    local experts is expert 3. megatron-core's GroupedMLP, one fused weight for all local experts, is refused."""
    from ucp_deepspeed.naming.model import global_namer

    def moe(experts: torch.nn.Module) -> torch.nn.Module:
        layer = _megatron_class("MoELayer", "megatron.core.transformer.moe.moe_layer")()
        layer.num_local_experts, layer.expert_group_name, layer.experts = 2, "ep_size_2", experts
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.layers[0].mlp = layer
        return model

    grouped = _megatron_class("TEGroupedMLP", "megatron.core.transformer.moe.experts")()
    for linear in ("linear_fc1", "linear_fc2"):
        setattr(grouped, linear, torch.nn.Module())
        for i in range(2):
            getattr(grouped, linear).register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(4, 4)))
    to_global = global_namer(moe(grouped), {"ep_size_2": 1})
    assert (
        to_global("layers.0.mlp.experts.linear_fc1.weight1") == "layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    assert (
        to_global("layers.0.mlp.experts.linear_fc2.weight0") == "layers.0.mlp.experts.local_experts.2.linear_fc2.weight"
    )
    fused = _megatron_class("GroupedMLP", "megatron.core.transformer.moe.experts")()
    fused.weight1 = torch.nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="layers.0.mlp.experts: megatron-core's GroupedMLP keeps all local experts"):
        global_namer(moe(fused))


def test_a_split_over_expert_parallel_ranks_round_trips_and_places_experts():
    """AutoEP's expert stacks: dim 0 over the expert-parallel ranks, written with `over` and read back; the same
    geometry as a tensor-parallel split, so merge and split serve both."""
    from ucp_deepspeed import compat
    from ucp_deepspeed.geometry.layout import Axis
    from ucp_deepspeed.naming.model import autoep_layout

    layout = autoep_layout("w1", compat.ExpertStack(ep_size=2, ep_rank=1, experts=(2, 3)), (2, 5, 4))
    assert layout == Layout("split", 0, over=Axis.EXPERT) and layout.to_json()["over"] == "ep"
    assert Layout.from_json(layout.to_json()) == layout and "over" not in Layout("split", 0).to_json()
    full = torch.arange(4 * 5 * 4.0).reshape(4, 5, 4)
    stacks = [full[:2], full[2:]]
    assert torch.equal(merge(layout, stacks), full)
    assert torch.equal(split(layout, (2, 5, 4), 1, 2, lambda d, s, n: full.narrow(d, s, n)), full[2:])
    with pytest.raises(ValueError, match="places experts \\[0, 2\\] on expert-parallel rank 0"):
        autoep_layout("w1", compat.ExpertStack(ep_size=2, ep_rank=0, experts=(0, 2)), (2, 5, 4))
    with pytest.raises(ValueError, match="only a split layout"):
        Layout("replicated", over=Axis.EXPERT)
