"""A resuming rank of a 1024-rank job costs what its own share costs, not what the job has.

Synthetic checkpoints (`benchmarks/synth_source.py`: DeepSpeed's exact layout, every element distinct) of one tiny
GPT-like model are saved at DP=64 and DP=1024 (ZeRO-1 and ZeRO-3), and at TP2 x PP2 x DP128 (512 ranks). Every
rank of a resharding job (1024 -> 768, 1024 -> 1536, ZeRO-1 -> ZeRO-3, ZeRO-3 -> ZeRO-1, a pipeline-parallel
change at TP=2) plans and reads exactly what a direct resharding load reads (`tests/simulate.py`), one rank after
another. All ranks' pieces together must cover every element of every state of every parameter exactly once and
equal the source with `torch.equal`. What each rank spent is counted (`ucp_deepspeed.io.stats`) and bounded:

- it opens only source files that hold its ranges (counted independently from the saved partition geometry);
- it reads no metadata file: the metadata and manifest are read once and shared;
- its files, requests and metadata bytes at DP=1024 are no more than at DP=64 for the same model, and its
  planning time stays within a small factor: nothing per rank grows with the source's rank count;
- reads that fall into one file are merged: a ZeRO-1/2 -> ZeRO-1/2 or ZeRO-3 -> ZeRO-1/2 rank sends at most
  `REQUESTS_PER_FILE` requests per file it opens, whatever the number of parameters in its range.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from simulate import KEYS, Simulation, Target, check_exact, plan, simulate
from synth_source import Synthetic, SynthSpec, gpt_stack, synthesize

from ucp_deepspeed.geometry.fragments import fragments_in
from ucp_deepspeed.geometry.layout import REPLICATED, Layout
from ucp_deepspeed.sources.native import tag_metas

LAYERS, HIDDEN, VOCAB = 4, 16, 64
GROUPS = 2
"""Param groups: a ZeRO-1/2 file holds one flat buffer of each, with one record per state."""


def layouts_of(spec: SynthSpec) -> dict[str, Layout]:
    return {t.name: Layout("split", t.split) if t.split is not None else REPLICATED for t in spec.model()}


def params_for(spec: SynthSpec, target: Target) -> list:
    """(name, full shape, layout, group, target stage) of every trainable parameter, in module order."""
    stages = {t.name: t.stage for t in gpt_stack(LAYERS, HIDDEN, VOCAB, target.pp)}
    layouts = layouts_of(spec)
    return [(t.name, t.shape, layouts[t.name], t.group, stages[t.name]) for t in spec.model() if t.trainable]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    made: dict[tuple[int, int, int, int], tuple[SynthSpec, Synthetic]] = {}

    def get(dp: int, zero: int, tp: int = 1, pp: int = 1) -> tuple[SynthSpec, Synthetic]:
        if (dp, zero, tp, pp) not in made:
            spec = SynthSpec(dp, zero, tp, pp, layers=LAYERS, hidden=HIDDEN, vocab=VOCAB)
            out = tmp_path_factory.mktemp(f"synth-dp{dp}-z{zero}-tp{tp}-pp{pp}")
            made[(dp, zero, tp, pp)] = (spec, synthesize(out, spec))
        return made[(dp, zero, tp, pp)]

    return get


def run(saved_source: tuple[SynthSpec, Synthetic], target: Target) -> Simulation:
    spec, synthetic = saved_source
    sim = simulate(str(synthetic.ckpt_dir), synthetic.tag, params_for(spec, target), target)
    assert len(sim.costs) == target.world
    assert check_exact(sim, synthetic.expected, layouts_of(spec)) >= 3 * 10
    return sim


def files_holding(synthetic: Synthetic, spec: SynthSpec, target: Target) -> list[set[tuple[int, int]]]:
    """Per target rank, the (model-parallel rank, data-parallel rank) files whose partitions overlap its runs, from
    the saved geometry alone: what a rank may open."""

    metas, _ = tag_metas(str(Path(synthetic.ckpt_dir, synthetic.tag)))
    slots = {(s.name, meta.tp_rank): (mp, s) for mp, meta in enumerate(metas) for s in meta.params if not s.alias}
    layouts = layouts_of(spec)
    out = []
    for _, runs in plan(params_for(spec, target), target):
        files = set()
        for run in runs:
            # a replicated parameter's range is read from every tensor-parallel rank's copy, which must agree
            held_by = [run.tp_rank] if layouts[run.name].is_split else range(spec.tp)
            for tp_rank in held_by:
                mp, slot = slots[(run.name, tp_rank)]
                for frag in fragments_in(slot, spec.zero_stage, spec.dp, run.start, run.start + run.numel):
                    files.add((mp, frag.rank))
        out.append(files)
    return out


def percentile(sim: Simulation, share: float) -> float:
    times = sorted(c.plan_s for c in sim.costs)
    return times[int(share * (len(times) - 1))]


def worst(sim: Simulation, field: str) -> int:
    return max(getattr(c.stats, field) for c in sim.costs)


CASES = [
    # (source stage, target stage, target DP as a fraction of the source's)
    (1, 1, 0.75, "shrink-to-3/4-zero1"),
    (1, 3, 1.0, "zero1-to-zero3"),
    (3, 1, 1.5, "zero3-to-zero1-grow-3/2"),
    (3, 3, 1.5, "grow-3/2-zero3"),
]


def check_bounds(sim: Simulation, holding: list[set[tuple[int, int]]], merged: bool) -> None:
    """Each rank opens only files that hold its ranges, reads no metadata (the index is shared), and sends one
    request per run of adjacent bytes: with `merged`, one per state of each param group's flat buffer per file."""
    for rank, cost in enumerate(sim.costs):
        stats = cost.stats
        assert stats.files_opened <= len(holding[rank]), (rank, stats, len(holding[rank]))
        assert stats.metadata_bytes == 0, (rank, stats)
        if merged:
            assert stats.requests <= len(KEYS) * GROUPS * stats.files_opened, (rank, stats)


@pytest.mark.parametrize("stage,to_stage,factor,label", CASES, ids=[c[3] for c in CASES])
def test_a_rank_of_1024_costs_no_more_than_a_rank_of_64(saved, stage, to_stage, factor, label):
    sims = {}
    for dp in (64, 1024):
        target = Target(int(dp * factor), to_stage)
        spec, synthetic = saved(dp, stage)
        sims[dp] = run((spec, synthetic), target)
        check_bounds(sims[dp], files_holding(synthetic, spec, target), merged=to_stage != 3)
    small, large = sims[64], sims[1024]
    params = sum(1 for t in spec.model() if t.trainable)
    # O(parameters + overlaps): a ZeRO-3 rank holds a piece of every parameter, each perhaps in another file
    for field, per_param in (("files_opened", 1), ("requests", len(KEYS)), ("metadata_bytes", 0)):
        bound = max(worst(small, field), per_param * params if to_stage == 3 else 0)
        assert worst(large, field) <= bound, (label, field, worst(small, field), worst(large, field))
    # medians and 99th percentiles: a garbage collection pauses a single rank for up to 0.4 s here
    for share in (0.5, 0.99):
        plan_small, plan_large = percentile(small, share), percentile(large, share)
        assert plan_large <= 3 * plan_small + 0.002, (share, plan_small, plan_large)


def test_a_pipeline_change_at_512_ranks_reads_only_each_ranks_share(saved):
    """TP2 x PP2 x DP128 resumed at TP2 x PP1 x DP256: every rank reads its tensor-parallel share of the saved
    rank that held it, by element range."""
    spec, synthetic = saved(128, 1, tp=2, pp=2)
    target = Target(256, 1, tp=2, pp=1)
    sim = run((spec, synthetic), target)
    check_bounds(sim, files_holding(synthetic, spec, target), merged=True)


@pytest.mark.scale
@pytest.mark.parametrize("source_stage,world,stage", [(1, 768, 1), (1, 1536, 3), (3, 768, 2)])
def test_real_engines_restore_a_1024_rank_checkpoint(tmp_path, monkeypatch, source_stage, world, stage):
    """The simulation's claim with DeepSpeed's own partitioning: `inprocess.Net` synthesized at DP=1024 is loaded by
    a real engine on every rank of a job of 768 or 1536 (fake process group), and all ranks' pieces equal an
    offline conversion (`test_fake_world.restore_every_rank`). About 60 ms a rank here."""
    import inprocess
    from test_fake_world import restore_every_rank
    from test_synth_source import NET

    from ucp_deepspeed import UniversalCheckpoint, convert

    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)  # ZeRO-3's constructor: 0.45 s a rank, frees only
    synthetic = synthesize(tmp_path / "src", SynthSpec(1024, source_stage, tensors=NET))
    reference = UniversalCheckpoint(convert(str(synthetic.ckpt_dir), synthetic.tag, output=str(tmp_path / "ref")))
    elapsed = restore_every_rank(
        synthetic.ckpt_dir, reference, world, stage, lambda rank: inprocess.build(stage, seed=rank + 1)
    )
    print(
        f"1024 -> {world} ZeRO-{source_stage} -> ZeRO-{stage}: {elapsed:.0f} s, {1000 * elapsed / world:.0f} ms a rank"
    )


def test_a_tensor_parallel_change_at_512_ranks_is_exact(saved):
    """TP2 x PP2 x DP128 resumed at TP1 x PP2 x DP256: a parameter the change cuts differently is merged whole from
    its two saved shards by every rank that holds part of it (the bound this costs is stated in the docs)."""
    spec, synthetic = saved(128, 1, tp=2, pp=2)
    sim = run((spec, synthetic), Target(256, 1, tp=1, pp=2))
    assert all(c.stats.metadata_bytes == 0 for c in sim.costs)
