"""Tensor- and pipeline-parallel megatron-core GPT: save at one TP x PP x DP layout, resume at another.

Sources are saved once per session; each target layout is one torchrun launch that loads several
of them. Every full fp32 weight and Adam state (gathered over TP, PP and DP, merged with the same
layouts the converter uses) must be torch.equal to the state gathered before saving, a last
stage's tied copy of the embedding must equal the first stage's, and the next 3 losses must match
the uninterrupted run. Layouts are `arch zZERO tpT ppP`; DP is the rest of the world size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import GPT_WORKER, load_results, torchrun
from safetensors.torch import load_file

from ucp_deepspeed import CheckpointError, convert
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.tools.cli import main as cli_main
from ucp_deepspeed.tools.compare import diff

LOSS_RTOL = 1e-5

# name: (world size, arch, zero, tp, pp)
SOURCES = {
    "gpt-z1-tp2": (2, "gpt", 1, 2, 1),
    "gpt-z1-pp2": (2, "gpt", 1, 1, 2),
    "gpt-z2-tp2dp2": (4, "gpt", 2, 2, 1),
    "llama-z1-tp2pp2": (4, "llama", 1, 2, 2),
    "llama-z1-dp4": (4, "llama", 1, 1, 1),
    "llama-z1-dp2": (2, "llama", 1, 1, 1),
    "llama-z3-tp2": (2, "llama", 3, 2, 1),
}

# megatron-core MoE (4 experts, top-2, SequentialMLP) on the llama variant: name: (world, zero, ep)
MOE_SOURCES = {"moe-z1-ep2": (2, 1, 2), "moe-z1-ep1": (1, 1, 1), "moe-z2-ep2-w4": (4, 2, 2)}

# (world, zero, ep, sources)
MOE_TARGETS = [
    pytest.param(1, 1, 1, ("moe-z1-ep2",), id="moe-ep1<-ep2"),
    pytest.param(2, 1, 2, ("moe-z1-ep1", "moe-z1-ep2"), id="moe-ep2<-ep1,ep2-same"),
    pytest.param(4, 1, 4, ("moe-z1-ep2",), id="moe-ep4<-ep2"),
    pytest.param(3, 2, 1, ("moe-z2-ep2-w4",), id="moe-z2-ep1-dp3<-z2-ep2-edp2-dp4"),
]

# (world size, arch, zero, tp, pp, extra args, sources)
TARGETS = [
    pytest.param(1, "gpt", 1, 1, 1, (), ("gpt-z1-tp2", "gpt-z1-pp2"), id="gpt-z1-dp1<-tp2,pp2"),
    pytest.param(3, "gpt", 2, 1, 1, (), ("gpt-z2-tp2dp2", "gpt-z1-tp2"), id="gpt-z2-dp3<-z2tp2dp2,z1tp2"),
    pytest.param(4, "gpt", 2, 2, 1, (), ("gpt-z2-tp2dp2",), id="gpt-z2-tp2dp2<-same-native"),
    pytest.param(4, "llama", 1, 2, 2, (), ("llama-z1-dp4",), id="llama-z1-tp2pp2<-dp4"),
    pytest.param(2, "llama", 1, 2, 1, (), ("llama-z1-dp2",), id="llama-z1-tp2<-dp2"),
    pytest.param(
        2,
        "llama",
        1,
        1,
        2,
        ("--first-stage-layers", "1"),
        ("llama-z1-dp2", "llama-z3-tp2"),
        id="llama-z1-pp2uneven<-dp2,z3tp2",
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
        marks=pytest.mark.slow,
    ),
]


def _layout_args(arch: str, zero: int, tp: int, pp: int) -> list[str]:
    return ["--arch", arch, "--zero", str(zero), "--tp", str(tp), "--pp", str(pp)]


@pytest.fixture(scope="session")
def gpt_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every source layout, trained 3 steps and saved once per session."""
    out = tmp_path_factory.mktemp("gpt_sources")
    for world in sorted({w for w, *_ in SOURCES.values()}):  # one launch per world size saves all its layouts
        first, *rest = [(name, layout) for name, (w, *layout) in SOURCES.items() if w == world]
        name, (arch, zero, tp, pp) = first
        more = [a for n, (ar, z, t, p) in rest for a in ("--each", f"{out / n}:{ar}:{z}:{t}:{p}")]
        torchrun(
            world,
            "save",
            "--out",
            str(out / name),
            *_layout_args(arch, zero, tp, pp),
            *more,
            worker=GPT_WORKER,
            attempts=2,
        )
    return {name: out / name for name in SOURCES}


@pytest.fixture(scope="session")
def moe_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """megatron-core MoE GPTs at several expert-parallel sizes, trained 3 steps and saved once per session."""
    out = tmp_path_factory.mktemp("gpt_moe_sources")
    for name, (world, zero, ep) in MOE_SOURCES.items():
        torchrun(
            world,
            "save",
            "--out",
            str(out / name),
            *_layout_args("llama", zero, 1, 1),
            "--moe",
            "--ep",
            str(ep),
            worker=GPT_WORKER,
            attempts=2,
        )
    return {name: out / name for name in MOE_SOURCES}


@pytest.mark.parametrize("world,zero,ep,names", MOE_TARGETS)
def test_megatron_moe_reshard(moe_sources, tmp_path, world, zero, ep, names):
    """Experts by global id: every expert's fp32 weight and Adam states equal after a change of EP/DP/ZeRO."""
    results = _load(
        tmp_path, world, _layout_args("llama", zero, 1, 1), [moe_sources[n] for n in names], "--moe", "--ep", str(ep)
    )
    assert len(results) == len(names)
    for r in results:
        label = f"{r['saved']} -> {r['live']}"
        assert r["mode"] == "resharded", f"{label}: megatron-core experts always load through the universal copy"
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 150, label  # 4 layers x 4 experts x 2 weights x 3 states, plus the dense part
        assert r["max_rel_loss"] <= LOSS_RTOL, f"{label}: losses {r['losses']} vs uninterrupted {r['reference_losses']}"


def _load(tmp_path: Path, world: int, layout: list[str], sources: list[Path], *extra: str) -> list[dict]:
    results = tmp_path / "results.json"
    torchrun(
        world, "load", *layout, *extra, "--results", str(results), "--source", *map(str, sources), worker=GPT_WORKER
    )
    return load_results(results)


def _check(results: list[dict], expected: int) -> None:
    assert len(results) == expected
    for r in results:
        label = f"{r['saved']} -> {r['live']}"
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 50, label  # an empty snapshot would pass vacuously
        assert r["mode"] == ("native" if r["saved"] == r["live"] else "resharded"), label
        assert r["max_rel_loss"] <= LOSS_RTOL, f"{label}: losses {r['losses']} vs uninterrupted {r['reference_losses']}"


@pytest.mark.parametrize("world,arch,zero,tp,pp,extra,names", TARGETS)
def test_megatron_reshard(gpt_sources, tmp_path, world, arch, zero, tp, pp, extra, names):
    results = _load(tmp_path, world, _layout_args(arch, zero, tp, pp), [gpt_sources[n] for n in names], *extra)
    _check(results, len(names))
    if pp > 1:
        assert all(r["aliases"] > 0 for r in results), "the last stage's tied embedding copy was not checked"


def _tensors(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = UniversalCheckpoint(str(root))
    return {name: load_file(str(root / rec["file"])) for name, rec in ckpt.params.items()}


def test_universal_is_independent_of_source_layout(gpt_sources, tmp_path):
    """The TP2xPP2 checkpoint, and the same state re-saved at TP1xDP4, convert to identical tensors."""
    resaved = tmp_path / "resaved"
    results = _load(
        tmp_path, 4, _layout_args("llama", 1, 1, 1), [gpt_sources["llama-z1-tp2pp2"]], "--resave", str(resaved)
    )
    _check(results, 1)
    a = Path(convert(str(gpt_sources["llama-z1-tp2pp2"]), output=str(tmp_path / "a"), progress=False))
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
        assert ma[key] == mb[key], key
    assert ma["source"]["topology"]["tp"] == 2 and mb["source"]["topology"]["tp"] == 1
    assert ta["embedding.word_embeddings.weight"]["fp32"].shape[0] == 70, "vocab padding must be trimmed"
    native = diff(str(gpt_sources["llama-z1-tp2pp2"]), str(resaved))  # the native files, compared directly
    assert native.identical and len(native.states) == 3 * len(ta), native


@pytest.mark.parametrize(
    "victim,message",
    [
        ("ucp_meta_mp_rank_03.json", "metadata is missing: ucp_meta_mp_rank_03.json"),
        ("mp_rank_02_model_states.pt", "rank files are missing: mp_rank_02_model_states.pt"),
        (
            "zero_pp_rank_0_mp_rank_01_optim_states.pt",
            "rank files are missing: zero_pp_rank_0_mp_rank_01_optim_states.pt",
        ),
    ],
)
def test_missing_model_parallel_rank_is_named(gpt_sources, tmp_path, victim, message):
    """A TP2xPP2 checkpoint with one model-parallel rank's file gone fails before anything is written."""
    src = tmp_path / "ckpt"
    shutil.copytree(gpt_sources["llama-z1-tp2pp2"], src, ignore=shutil.ignore_patterns("*.universal"))
    (src / "global_step3" / victim).unlink()
    before = sorted(p.name for p in (src / "global_step3").iterdir())
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        convert(str(src), output=str(tmp_path / "out"), progress=False)
    assert "tp=2 pp=2" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (src / "global_step3").iterdir()) == before


def test_inspect_shows_full_shapes_of_a_split_checkpoint(gpt_sources, capsys):
    assert cli_main(["inspect", "--json", str(gpt_sources["llama-z1-tp2pp2"])]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["source_topology"]["tp"] == 2 and summary["source_topology"]["pp"] == 2
    params = summary["params"]
    assert params["embedding.word_embeddings.weight"]["shape"] == [70, 64]
    assert params["decoder.layers.3.mlp.linear_fc1.weight"]["shape"] == [192, 64]
    assert params["decoder.layers.3.self_attention.linear_qkv.weight"]["shape"] == [128, 64]
    assert "output_layer.weight" not in params


GPT_TP_RULES = [
    {"match": r"embedding\.word_embeddings\.weight", "layout": "split", "dim": 0, "vocab": 70},
    {"match": r".*\.(linear_qkv|linear_fc1)\.(weight|bias)", "layout": "split", "dim": 0},
    {"match": r".*\.(linear_proj|linear_fc2)\.weight", "layout": "split", "dim": 1},
    {"match": r".*", "layout": "replicated"},
]


def test_tp_checkpoint_without_metadata_needs_rules(gpt_sources, tmp_path, capsys):
    """A TP=2 checkpoint whose ucp metadata is gone (as if saved by plain DeepSpeed): refused without layout
    rules, naming the parameters; with rules, converted to exactly what the metadata would have given."""
    bare = tmp_path / "bare"
    shutil.copytree(gpt_sources["gpt-z2-tp2dp2"], bare, ignore=shutil.ignore_patterns("*.universal", "*.lock"))
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
    report = diff(str(out), str(gpt_sources["gpt-z2-tp2dp2"]))
    assert report.identical and len(report.states) > 40, report
