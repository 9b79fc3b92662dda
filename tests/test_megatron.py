"""Tensor- and pipeline-parallel megatron-core GPT: save at one TP x PP x DP layout, resume at another.

Sources are saved once per session (conftest's `megatron_sources`, one launch per world size); every
target layout of one world size loads its sources in one launch, megatron-core's groups rebuilt per
layout. Every full fp32 weight and Adam state (gathered over TP, PP and DP, merged with the same
layouts the converter uses) must be torch.equal to the state gathered before saving, a last stage's
tied copy of the embedding must equal the first stage's, and the next 3 losses must match the
uninterrupted run. Layouts are `arch zZERO tpT ppP`; DP is the rest of the world size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import launch_jobs, load_results
from fakeworld import FakeWorld
from megatron.core import parallel_state as ps
from safetensors.torch import load_file

import ucp_deepspeed
from ucp_deepspeed import CheckpointError, convert
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.tools.cli import main as cli_main
from ucp_deepspeed.tools.compare import diff

LOSS_RTOL = 1e-5
# the default run loads at one rank (TP2 -> DP1, PP2 -> DP1, EP2 -> EP1: one launch) from the 2-rank sources; the
# launch demo.sh makes covers TP2 x PP2 -> DP2; every other cell is a launch of its own world size
SLOW = pytest.mark.slow

# (world, zero, ep, sources): megatron-core MoE on the llama variant
MOE_TARGETS = [
    pytest.param(1, 1, 1, ("moe-z1-ep2",), id="moe-ep1<-ep2"),
    pytest.param(2, 1, 2, ("moe-z1-ep1", "moe-z1-ep2"), id="moe-ep2<-ep1,ep2-same", marks=SLOW),
    pytest.param(4, 1, 4, ("moe-z1-ep2",), id="moe-ep4<-ep2", marks=SLOW),
    pytest.param(3, 2, 1, ("moe-z2-ep2-w4",), id="moe-z2-ep1-dp3<-z2-ep2-edp2-dp4", marks=SLOW),
]

# (world size, arch, zero, tp, pp, extra args, sources); sources are conftest's MEGATRON_SOURCES
TARGETS = [
    # from the TE spec's names (fused norms) to the local spec's, and back: one name per parameter in a checkpoint
    # (PP=2 un-staged: the TE-named target below, and gpt-z1-tp2<-pp2)
    pytest.param(1, "gpt", 1, 1, 1, (), ("gpt-z1-tp2", "gpt-te-z1-tp2"), id="gpt-z1-dp1<-tp2,te"),
    pytest.param(1, "gpt", 1, 1, 1, (), ("gpt-z1-pp2",), id="gpt-z1-dp1<-pp2", marks=SLOW),
    # into TP=2: the two TP ranks get random streams of their own from stage 0's (`client_state_ok`), here as
    # TE-named layers; the local spec's run is slow
    pytest.param(2, "gpt", 1, 2, 1, ("--te-names",), ("gpt-z1-pp2",), id="gpt-te-z1-tp2<-pp2"),
    pytest.param(2, "gpt", 1, 2, 1, (), ("gpt-z1-pp2",), id="gpt-z1-tp2<-pp2", marks=SLOW),
    pytest.param(3, "gpt", 2, 1, 1, (), ("gpt-z2-tp2dp2", "gpt-z1-tp2"), id="gpt-z2-dp3<-z2tp2dp2,z1tp2", marks=SLOW),
    pytest.param(4, "gpt", 2, 2, 1, (), ("gpt-z2-tp2dp2",), id="gpt-z2-tp2dp2<-same-native", marks=SLOW),
    # a DP change at TP=2: each TP rank keeps its role, and its own client state (its random stream)
    pytest.param(4, "gpt", 1, 2, 1, (), ("gpt-z1-tp2",), id="gpt-z1-tp2dp2<-tp2dp1", marks=SLOW),
    pytest.param(4, "llama", 1, 2, 2, (), ("llama-z1-dp4",), id="llama-z1-tp2pp2<-dp4", marks=SLOW),
    pytest.param(2, "llama", 1, 2, 1, (), ("llama-z1-dp2",), id="llama-z1-tp2<-dp2", marks=SLOW),
    pytest.param(
        2,
        "llama",
        1,
        1,
        2,
        ("--first-stage-layers", "1"),
        ("llama-z1-dp2", "llama-z3-tp2"),
        id="llama-z1-pp2uneven<-dp2,z3tp2",
        marks=SLOW,
    ),
    pytest.param(
        4,
        "llama",
        3,
        2,
        1,
        (),
        ("llama-z1-tp2pp2", "llama-z3-tp2"),
        id="llama-z3-tp2dp2<-tp2pp2,z3tp2",
        marks=SLOW,
    ),
]


def _layout_args(arch: str, zero: int, tp: int, pp: int) -> list[str]:
    return ["--arch", arch, "--zero", str(zero), "--tp", str(tp), "--pp", str(pp)]


def _loads() -> dict[str, tuple[int, bool, list[str], tuple[str, ...]]]:
    """Every load of this module: id -> (world size, slow, layout arguments, source names)."""
    loads = {}
    for p in TARGETS:
        world, arch, zero, tp, pp, extra, names = p.values
        loads[p.id] = (world, bool(p.marks), [*_layout_args(arch, zero, tp, pp), *extra], names)
    for p in MOE_TARGETS:
        world, zero, ep, names = p.values
        loads[p.id] = (world, bool(p.marks), [*_layout_args("llama", zero, 1, 1), "--moe", "--ep", str(ep)], names)
    # re-saved at TP1xDP4 for test_universal_is_independent_of_source_layout
    loads["resave"] = (4, True, _layout_args("llama", 1, 1, 1), ("llama-z1-tp2pp2",))
    return loads


LOADS = _loads()


class Launches:
    """Every load of one world size (slow ones apart) runs in one launch, the first time a test asks for one."""

    def __init__(self, sources: dict[str, Path], root: Path):
        self.sources, self.root = sources, root
        self.done: dict[tuple[int, bool], str | None] = {}  # launch -> its failure, if it failed

    def results(self, load_id: str) -> list[dict]:
        world, slow, _, _ = LOADS[load_id]
        if (world, slow) not in self.done:
            self.done[world, slow] = "the shared launch did not finish"  # a failed launch is not run again
            runs = [
                [
                    "load",
                    *args,
                    *(["--resave", str(self.root / "resaved")] if i == "resave" else []),
                    "--results",
                    str(self.root / f"{n}.json"),
                    "--source",
                    *(str(self.sources[s]) for s in names),
                ]
                for n, (i, (w, sl, args, names)) in enumerate(LOADS.items())
                if (w, sl) == (world, slow)
            ]
            try:
                launch_jobs(world, runs)
            except BaseException as exc:
                self.done[world, slow] = f"the shared launch of world size {world} failed:\n{exc}"[-6000:]
                raise
            self.done[world, slow] = None
        failure = self.done[world, slow]
        if failure is not None:
            pytest.fail(failure)
        return load_results(self.root / f"{list(LOADS).index(load_id)}.json")


@pytest.fixture(scope="module")
def launched(megatron_sources, tmp_path_factory) -> Launches:
    return Launches(megatron_sources, tmp_path_factory.mktemp("megatron_loads"))


@pytest.mark.parametrize("world,zero,ep,names", MOE_TARGETS)
def test_megatron_moe_reshard(launched, request, world, zero, ep, names):
    """Experts by global id: every expert's fp32 weight and Adam states equal after a change of EP/DP/ZeRO."""
    results = launched.results(request.node.callspec.id)
    assert len(results) == len(names)
    for r in results:
        label = f"{r['saved']} -> {r['live']}"
        assert r["mode"] == "resharded", f"{label}: megatron-core experts always load through the universal copy"
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 150, label  # 4 layers x 4 experts x 2 weights x 3 states, plus the dense part
        assert r["client_state_ok"], f"{label}: a rank got another model-parallel rank's client state"
        assert r["max_rel_loss"] <= LOSS_RTOL, f"{label}: losses {r['losses']} vs uninterrupted {r['reference_losses']}"


def _check(results: list[dict], expected: int) -> None:
    assert len(results) == expected
    for r in results:
        label = f"{r['saved']} -> {r['live']}"
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 50, label  # an empty snapshot would pass vacuously
        assert r["mode"] == ("native" if r["saved"] == r["live"] else "resharded"), label
        assert r["client_state_ok"], f"{label}: a rank got another model-parallel rank's client state"
        assert r["max_rel_loss"] <= LOSS_RTOL, f"{label}: losses {r['losses']} vs uninterrupted {r['reference_losses']}"


@pytest.mark.parametrize("world,arch,zero,tp,pp,extra,names", TARGETS)
def test_megatron_reshard(launched, request, world, arch, zero, tp, pp, extra, names):
    results = launched.results(request.node.callspec.id)
    _check(results, len(names))
    if pp > 1:
        assert all(r["aliases"] > 0 for r in results), "the last stage's tied embedding copy was not checked"


def _tensors(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = UniversalCheckpoint(str(root))
    return {name: load_file(str(root / rec.file)) for name, rec in ckpt.params.items()}


@SLOW
def test_universal_is_independent_of_source_layout(launched, megatron_sources, tmp_path):
    """The TP2xPP2 checkpoint, and the same state re-saved at TP1xDP4, convert to identical tensors."""
    _check(launched.results("resave"), 1)
    resaved = launched.root / "resaved"
    a = Path(convert(str(megatron_sources["llama-z1-tp2pp2"]), output=str(tmp_path / "a"), progress=False))
    b = Path(convert(str(resaved), output=str(tmp_path / "b"), progress=False))
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    assert len(ta) >= 26
    for name in ta:
        assert sorted(ta[name]) == sorted(tb[name]) == ["exp_avg", "exp_avg_sq", "fp32"], name
        for key in ta[name]:
            assert torch.equal(ta[name][key], tb[name][key]), f"{name}/{key}"
    ma, mb = UniversalCheckpoint(str(a)).manifest, UniversalCheckpoint(str(b)).manifest
    for key in ("params", "param_groups", "counters", "buffers"):
        assert getattr(ma, key) == getattr(mb, key), key
    assert ma.source.topology.tp == 2 and mb.source.topology.tp == 1
    assert ta["embedding.word_embeddings.weight"]["fp32"].shape[0] == 70, "vocab padding must be trimmed"
    native = diff(str(megatron_sources["llama-z1-tp2pp2"]), str(resaved))  # the native files, compared directly
    assert native.identical and len(native.states) == 3 * len(ta), native


MISSING = [  # (source, file removed, message); the 2-rank source runs by default, the TP2xPP2 one with -m slow
    ("gpt-z1-tp2", "ucp_meta_mp_rank_01.json", "metadata is missing: ucp_meta_mp_rank_01.json"),
    ("gpt-z1-tp2", "mp_rank_01_model_states.pt", "rank files are missing: mp_rank_01_model_states.pt"),
    ("llama-z1-tp2pp2", "ucp_meta_mp_rank_03.json", "metadata is missing: ucp_meta_mp_rank_03.json"),
    ("llama-z1-tp2pp2", "mp_rank_02_model_states.pt", "rank files are missing: mp_rank_02_model_states.pt"),
    (
        "llama-z1-tp2pp2",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "rank files are missing: zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ),
]


@pytest.mark.parametrize(
    "source,victim,message", [pytest.param(*m, marks=[SLOW] if "pp2" in m[0] else []) for m in MISSING]
)
def test_missing_model_parallel_rank_is_named(megatron_sources, tmp_path, source, victim, message):
    """A TP2 or TP2xPP2 checkpoint with one model-parallel rank's file gone fails before anything is written."""
    src = tmp_path / "ckpt"
    shutil.copytree(megatron_sources[source], src, ignore=shutil.ignore_patterns("*.universal"))
    (src / "global_step3" / victim).unlink()
    before = sorted(p.name for p in (src / "global_step3").iterdir())
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        convert(str(src), output=str(tmp_path / "out"), progress=False)
    assert ("tp=2 pp=2" if "pp2" in source else "tp=2 fp32") in str(info.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (src / "global_step3").iterdir()) == before


def test_inspect_shows_full_shapes_of_a_split_checkpoint(megatron_sources, capsys):
    """A TP=2 ZeRO-3 checkpoint: every parameter shown at its full size, the tied output layer not at all."""
    assert cli_main(["inspect", "--json", str(megatron_sources["llama-z3-tp2"])]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["source_topology"]["tp"] == 2 and summary["source_topology"]["zero_stage"] == 3
    params = summary["params"]
    assert params["embedding.word_embeddings.weight"]["shape"] == [70, 64]
    assert params["decoder.layers.3.mlp.linear_fc1.weight"]["shape"] == [192, 64]
    assert params["decoder.layers.3.mlp.linear_fc2.weight"]["shape"] == [64, 96]
    assert params["decoder.layers.3.self_attention.linear_qkv.weight"]["shape"] == [128, 64]
    assert "output_layer.weight" not in params


GPT_TP_RULES = [
    {"match": r"embedding\.word_embeddings\.weight", "layout": "split", "dim": 0, "vocab": 70},
    {"match": r".*\.(linear_qkv|linear_fc1)\.(weight|bias)", "layout": "split", "dim": 0},
    {"match": r".*\.(linear_proj|linear_fc2)\.weight", "layout": "split", "dim": 1},
    {"match": r".*", "layout": "replicated"},
]


def test_tp_checkpoint_without_metadata_needs_rules(megatron_sources, tmp_path, capsys):
    """A TP=2 checkpoint whose ucp metadata is gone (as if saved by plain DeepSpeed): refused without layout
    rules, naming the parameters; with rules, converted to exactly what the metadata would have given."""
    bare = tmp_path / "bare"
    shutil.copytree(megatron_sources["gpt-z1-tp2"], bare, ignore=shutil.ignore_patterns("*.universal", "*.lock"))
    removed = [p.unlink() for p in bare.glob("*/ucp_meta_mp_rank_*.json")]
    assert len(removed) == 2
    assert cli_main(["convert", str(bare), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tensor-parallel size 2 without ucp_deepspeed metadata" in err
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in err and "--layout-rules" in err
    assert not list(bare.glob("*.universal"))
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"match": ".*", "layout": "sideways"}]))
    assert cli_main(["convert", str(bare), "--layout-rules", str(rules), "--no-progress"]) == 2
    assert f"{rules}: bad layout rules: layout rule 0" in capsys.readouterr().err
    rules.write_text(json.dumps(GPT_TP_RULES))
    out = tmp_path / "from_rules"
    assert cli_main(["convert", str(bare), "--layout-rules", str(rules), "--output", str(out), "--no-progress"]) == 0
    report = diff(str(out), str(megatron_sources["gpt-z1-tp2"]))
    assert report.identical and len(report.states) > 40, report
    # inspect, verify and DeepSpeed's format take the same rules (they refused such a checkpoint, or ignored them)
    for command in (["inspect"], ["verify"], ["convert", "--format", "deepspeed", "--no-progress"]):
        assert cli_main([*command, str(bare)]) == 2, command
        assert "--layout-rules" in capsys.readouterr().err
        assert cli_main([*command, str(bare), "--layout-rules", str(rules)]) == 0, command


def test_context_parallelism_is_refused_at_initialize():
    """megatron-core at CP=2 (rank 1 of 4, fake process groups): DeepSpeed would get a data-parallel group without
    the context-parallel ranks, so `initialize` refuses before building an engine."""
    with FakeWorld(4).rank(1):
        ps.initialize_model_parallel(context_parallel_size=2, create_gloo_process_groups=False)
        try:
            assert ps.get_context_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 2
            config = {"train_batch_size": 4, "optimizer": {"type": "Adam"}, "checkpoint": {"universal": True}}
            with pytest.raises(NotImplementedError, match=r"context parallelism \(context_parallel_size=2\)"):
                ucp_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
        finally:
            ps.destroy_model_parallel()
