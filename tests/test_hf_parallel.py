"""Hugging Face models that DeepSpeed parallelizes itself: AutoTP checkpoints resume at any AutoTP size, DP size and
ZeRO stage, AutoTP on or off, whether ucp_deepspeed or plain DeepSpeed saved them.

The model is a tiny `LlamaForCausalLM` that AutoTP splits unevenly at size 2 (`tests/workers/hf_parallel.py`). Each
target launch compares every full fp32 master, Adam moment, weight, step and hyperparameter with the saved run's
(full tensors merged with DeepSpeed's own affine maps) using torch.equal, and the next 3 losses with the
uninterrupted run. AutoTP's replicated tensors (the embedding and the norms) are compared on every rank; a
checkpoint whose replicas drifted apart is refused. The records DeepSpeed has written (versions 0.2 to 0.4) are read
in this process from hand-made ones.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, OnDemand, load_results, torchrun

from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.geometry.layout import REPLICATED, Layout
from ucp_deepspeed.sources import native
from ucp_deepspeed.sources.autotp import autotp_layouts, is_autotp_record

WORKER = ROOT / "tests" / "workers" / "hf_parallel.py"
# Another AutoTP size sums the same products in another order (measured up to 1e-7); DeepSpeed's ZeRO-1/2 under Ulysses
# steps apart from its ZeRO-3 and from plain data parallelism by up to 2e-5 after 3 steps (the sources' own runs)
LOSS_RTOL = 1e-4
TENSORS = 84  # 21 parameters x (fp32 master, weight, exp_avg, exp_avg_sq)

# launch -> (world size, runs: (folder, variants, extra save flags)); in a launch, engines without AutoTP come first
SAVES = {
    "w2": (
        2,
        [
            ("ucp", ("z1", "tp2z1", "tp2z2", "tp2z3"), ()),
            ("plain", ("tp2z1", "tp2z2"), ("--plain",)),
            ("drift", ("tp2z1",), ("--drift", "model.norm.weight")),
        ],
    ),
    "w3": (3, [("ucp", ("z1", "sp3z1", "sp3z3"), ()), ("plain", ("sp3z2",), ("--plain",))]),
    "w4": (4, [("ucp", ("tp2z2",), ())]),
    "w6": (6, [("ucp", ("sp3z2",), ())]),
}


@pytest.fixture(scope="session")
def autotp_sources(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """`LAUNCH/FOLDER/VARIANT` after three steps: one launch per world size, run when a test first reads one."""
    out = tmp_path_factory.mktemp("autotp_sources")

    def launch(name: str) -> None:
        world, runs = SAVES[name]
        argv = [["save", "--out", str(out / name / folder), "--variant", *v, *flags] for folder, v, flags in runs]
        torchrun(world, *argv[0], *(a for rest in argv[1:] for a in ("--each", " ".join(rest))), worker=WORKER)
        if name == "w3":  # DeepSpeed before its #8226 named a Ulysses rank's files by its sequence-parallel rank
            shutil.copytree(out / "w3/plain/sp3z2", out / "w3/prefix/sp3z2")
            for path in (out / "w3/prefix/sp3z2/global_step3").glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"):
                dp = int(path.name.split("_")[3])
                path.rename(path.with_name(path.name.replace("mp_rank_00", f"mp_rank_{dp % 3:02d}")))

    names = [
        f"{name}/{folder}/{v}" for name, (_, runs) in SAVES.items() for folder, variants, _ in runs for v in variants
    ]
    return OnDemand(out, [*names, "w3/prefix/sp3z2"], lambda name: name.split("/")[0], launch)


def load(sources: OnDemand, tmp: Path, world: int, cases: list[tuple[str, tuple[str, ...]]], refuse: list = ()) -> list:
    """One launch at `world` ranks: `refuse` cases first (each load must fail), then `cases`; both results."""

    def case_args(pairs):
        return [a for target, names in pairs for a in ("--case", target, *(str(sources[n]) for n in names))]

    runs = []
    if refuse:
        runs.append(["load", "--refuse", "--results", str(tmp / "refused.json"), *case_args(refuse)])
    runs.append(["load", "--results", str(tmp / "loaded.json"), *case_args(cases)])
    torchrun(world, *runs[0], *(a for rest in runs[1:] for a in ("--each", " ".join(rest))), worker=WORKER, timeout=600)
    return [load_results(tmp / "refused.json") if refuse else [], load_results(tmp / "loaded.json")]


def check(results: list[dict], expected: int) -> None:
    assert len(results) == expected
    for r in results:
        label = f"{r['source']} -> {r['target']} at {r['world']} ranks ({r['how']})"
        assert r["diffs"] == [], f"{label}: {r['diffs'][:8]}"
        assert r["tensors"] == TENSORS, label
        assert r["max_rel_loss"] < LOSS_RTOL, f"{label}: {r['losses']} vs {r['reference_losses']}"


def test_autotp_checkpoints_resume_at_any_autotp_dp_and_stage(autotp_sources, tmp_path):
    cases = [
        ("z1", ("w2/ucp/tp2z1", "w2/plain/tp2z1")),  # AutoTP 2 -> off, DP 1 -> 2; plain DeepSpeed's save too
        ("z2", ("w2/ucp/tp2z2",)),  # AutoTP 2 -> off at ZeRO-2
        ("z3", ("w2/ucp/tp2z1",)),  # AutoTP 2 -> ZeRO-3
        ("tp2z1", ("w2/ucp/z1", "w2/ucp/tp2z3")),  # DP 2 -> AutoTP 2; ZeRO-3 -> 1 with AutoTP
        ("tp2z3", ("w2/ucp/tp2z2",)),
        ("tp2z2", ("w2/plain/tp2z1", "w3/ucp/sp3z1")),  # plain DeepSpeed's AutoTP save, another stage; Ulysses 3
    ]
    refused, loaded = load(autotp_sources, tmp_path, 2, cases, refuse=[("z1", ("w2/drift/tp2z1",))])
    check(loaded, 9)
    (r,) = refused
    assert r["untouched"], "a refused load changed the engine"
    assert len(set(r["errors"])) == 1 and r["errors"][0] is not None, r["errors"]
    assert "'model.norm.weight' (fp32) is replicated over tensor parallelism" in r["errors"][0]


@pytest.mark.slow  # the budget: a 3-rank load launch; Ulysses 3 -> AutoTP 2 and its namings stay in the default run
def test_ulysses_checkpoints_resume_at_any_sp_dp_and_stage(autotp_sources, tmp_path):
    cases = [
        # Ulysses 3 -> off (DP 3); plain DeepSpeed's save, named as now and as before its #8226; AutoTP 2 -> DP 3
        ("z1", ("w3/ucp/sp3z1", "w3/plain/sp3z2", "w3/prefix/sp3z2", "w2/ucp/tp2z1")),
        ("z3", ("w3/ucp/sp3z3",)),
        ("sp3z1", ("w3/ucp/z1", "w2/ucp/tp2z1")),  # DP 3 -> Ulysses 3; AutoTP 2 -> Ulysses 3
        ("sp3z3", ("w3/ucp/sp3z1",)),
        ("sp3z2", ("w3/plain/sp3z2", "w3/prefix/sp3z2")),  # DeepSpeed's own load; ours for the old names
    ]
    _, loaded = load(autotp_sources, tmp_path, 3, cases)
    check(loaded, 10)
    assert loaded[-2]["how"] == "native load"


@pytest.mark.slow  # the suite's budget: a 3-rank launch of its own (DeepSpeed keeps a process's first Ulysses groups)
def test_ulysses_from_the_config_mesh_is_refused_by_name(tmp_path):
    torchrun(3, "refused", "--variant", "msp3z2", "--results", str(tmp_path / "refused.json"), worker=WORKER)
    (r,) = load_results(tmp_path / "refused.json")
    assert "sequence_parallel_size and data_parallel_size" in r["error"] and "pass the Ulysses mpu" in r["error"]
    assert r["drifted"], "plain DeepSpeed's ranks stayed equal: the refusal's reason no longer holds"


def test_ulysses_saves_of_every_deepspeed_naming_convert_to_the_saved_tensors(autotp_sources, tmp_path):
    """Plain DeepSpeed's Ulysses 3 save as named now, as named before #8226, and as DeepSpeed 0.19.4 wrote it (old
    names and no `checkpoint_parallel_dimensions`: the file names are the only trace of sequence parallelism)."""
    ref = torch.load(autotp_sources["w3/plain/sp3z2"] / "reference.pt", weights_only=False)["snapshot"]
    oldest = tmp_path / "v0.19.4"
    shutil.copytree(autotp_sources["w3/prefix/sp3z2"], oldest)
    model_states = oldest / "global_step3" / "mp_rank_00_model_states.pt"
    states = torch.load(model_states, weights_only=False)
    del states["checkpoint_parallel_dimensions"]
    torch.save(states, model_states)
    for name, source in (
        ("now", autotp_sources["w3/plain/sp3z2"]),
        ("before-8226", autotp_sources["w3/prefix/sp3z2"]),
        ("0.19.4", oldest),
    ):
        universal = UniversalCheckpoint(convert(str(source), output=str(tmp_path / name), progress=False))
        assert universal.manifest.source.topology.describe() == "zero2 dp=3 sp=3 fp32", name
        for param, record in universal.params.items():
            for key in (FP32, "exp_avg"):
                got = universal.read(param, key).reshape(record.shape)
                assert torch.equal(got, ref["fp32" if key == FP32 else key][param]), (name, param, key)


def test_a_rank_told_how_a_ulysses_tag_names_its_files_asks_nothing_about_it(autotp_sources, monkeypatch):
    """The rank that reads a tag's metadata answers how its Ulysses files are named, and the others are handed the
    answer (`by_sp_rank`, as the load planner broadcasts it): a rank told makes none of the two requests asking costs
    on a store, and finds the files by it; one not told asks once for the tag, not once per model-parallel rank."""
    tag = autotp_sources["w3/prefix/sp3z2"]
    asked: list = []
    ask = native.named_by_sp_rank
    monkeypatch.setattr(native, "named_by_sp_rank", lambda *a: asked.append(a) or ask(*a))
    metas = native.tag_metas(str(tag / "global_step3"), None)
    with native.NativeCheckpoint(str(tag), metas=metas, by_sp_rank=True) as told:  # it checks every file exists
        assert not asked
        names = [Path(p).name for p in told.ranks[0].optim_paths]
    assert names == [f"zero_pp_rank_{dp}_mp_rank_{dp % 3:02d}_optim_states.pt" for dp in range(3)]
    with native.NativeCheckpoint(str(tag), metas=metas):
        assert len(asked) == 1


def test_a_refresh_reads_ranges_without_comparing_their_replicas_again(autotp_sources, monkeypatch):
    """A ZeRO-1/2 refresh reads the fragments other ranks restored, whose replicas those ranks compared while staging:
    inside `replicas_compared` a replicated parameter's range is read from one tensor-parallel rank's copy alone (half
    the reads at TP 2); outside it, from every copy."""
    reads: list[int] = []
    read = native.RankFiles.read_param_range
    monkeypatch.setattr(
        native.RankFiles, "read_param_range", lambda files, *a: reads.append(files.mp_rank) or read(files, *a)
    )
    with native.NativeCheckpoint(str(autotp_sources["w2/ucp/tp2z1"])) as src:
        ckpt = DirectCheckpoint(src)
        whole = ckpt.read("model.norm.weight", FP32)
        assert sorted(set(reads)) == [0, 1], reads
        reads.clear()
        with ckpt.replicas_compared():
            again = ckpt.read("model.norm.weight", FP32)
        assert set(reads) == {0} and torch.equal(again, whole), reads
        reads.clear()
        ckpt.read("model.norm.weight", FP32)
        assert sorted(set(reads)) == [0, 1], "the block's end did not restore the comparisons"


@pytest.mark.slow
def test_autotp_by_dp_resumes_at_another_dp_size(autotp_sources, tmp_path):
    _, loaded = load(autotp_sources, tmp_path, 3, [("z2", ("w4/ucp/tp2z2",)), ("z3", ("w4/ucp/tp2z2",))])
    check(loaded, 2)


@pytest.mark.slow
def test_ulysses_by_dp_resumes_at_another_dp_size(autotp_sources, tmp_path):
    """Ulysses 3 x DP 2 (6 ranks, ZeRO partitions over all 6) resumed at DP 3 and at Ulysses 3 x DP 1."""
    cases = [("z1", ("w6/ucp/sp3z2",)), ("sp3z3", ("w6/ucp/sp3z2",))]
    _, loaded = load(autotp_sources, tmp_path, 3, cases)
    check(loaded, 2)


def test_plain_autotp_checkpoint_converts_to_the_saved_full_tensors(autotp_sources, tmp_path):
    source = autotp_sources["w2/plain/tp2z1"]
    ref = torch.load(source / "reference.pt", weights_only=False)["snapshot"]
    universal = UniversalCheckpoint(convert(str(source), output=str(tmp_path / "universal"), progress=False))
    assert sorted(universal.params) == sorted(ref["fp32"])
    for name, record in universal.params.items():
        for key, state in ((FP32, "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            got = universal.read(name, key).reshape(record.shape)
            assert torch.equal(got, ref[state][name]), f"{name}/{key}"
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' \(fp32\) is replicated"):
        convert(str(autotp_sources["w2/drift/tp2z1"]), output=str(tmp_path / "drifted"), progress=False)
    # the same save as DeepSpeed 0.19.5 recorded it (version 0.3: categories only, split sizes from the shapes)
    older = tmp_path / "v0.3"
    shutil.copytree(source, older)
    for path in (older / "global_step3").glob("mp_rank_*_model_states.pt"):
        states = torch.load(path, weights_only=False)
        info = states["universal_checkpoint_info"]
        for key in ("affine_map", "autotp_unsupported_parameter_patterns", "sub_param_shard_widths"):
            info.pop(key, None)
        info["universal_checkpoint_version"] = 0.3
        torch.save(states, path)
    again = UniversalCheckpoint(convert(str(older), output=str(tmp_path / "universal-0.3"), progress=False))
    for name, record in again.params.items():
        assert torch.equal(again.read(name, FP32).reshape(record.shape), ref["fp32"][name]), name


def test_an_autotp_checkpoint_exports_to_the_model_from_pretrained_loads(autotp_sources, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from workers.hf_parallel import CONFIG

    from ucp_deepspeed.hf.export import export_hf

    source = autotp_sources["w2/ucp/tp2z1"]
    ref = torch.load(source / "reference.pt", weights_only=False)["snapshot"]["fp32"]
    exported = AutoModelForCausalLM.from_pretrained(export_hf(str(source), str(tmp_path / "hf"), progress=False))
    weights = dict(exported.named_parameters())
    assert sorted(weights) == sorted(ref) and all(torch.equal(weights[n], ref[n]) for n in ref)
    saved = LlamaForCausalLM(LlamaConfig(**CONFIG))
    saved.load_state_dict(ref)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, saved(tokens).logits)
    # plain DeepSpeed recorded no config: the one the job started from is given
    plain = autotp_sources["w2/plain/tp2z1"]
    with pytest.raises(CheckpointError, match="records no transformers config.*--hf-config"):
        export_hf(str(plain), str(tmp_path / "no-config"), progress=False)
    folder = export_hf(str(plain), str(tmp_path / "plain"), progress=False, hf_config=LlamaConfig(**CONFIG).to_dict())
    assert torch.equal(AutoModelForCausalLM.from_pretrained(folder).model.norm.weight, ref["model.norm.weight"])


# --- AutoTP's record, as each DeepSpeed version wrote it -------------------------------------------------------

Q, K, OUT, NORM, QKV, HEAD = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "lm_head.weight",
)


def pattern(name: str) -> str:
    return "^" + name.replace(".", r"\.") + "$"


def record(version: float, **extra) -> dict:
    """A record as DeepSpeed wrote it at `version` (the unsupported patterns came with 0.4)."""
    return {
        "universal_checkpoint_version": version,
        "parameter_with_row_parallelism_patterns": [pattern(OUT)],
        "tp_replicated_parameter_patterns": [pattern(NORM)],
        "vocabulary_parameter_patterns": [pattern(HEAD)],
        "parameter_with_sub_params": [],
        **({"autotp_unsupported_parameter_patterns": {}} if version >= 0.4 else {}),
        "original_vocab_size": 125,
        **extra,
    }


def rows(shape: tuple[int, ...], full_start: int, logical: list[int], at: int = 0) -> dict:
    """An affine piece: rows [full_start, full_start + shape[0]) of the full tensor at row `at` of the shard."""
    stride = [math.prod(logical[1:]), 1][: len(logical)]
    return {"shape": list(shape), "source": [full_start * stride[0], stride], "dest": [at * stride[0], stride]}


def test_a_record_of_every_version_gives_each_rank_its_run():
    shapes = [
        {Q: (32, 48), K: (16, 48), OUT: (48, 32), NORM: (48,), HEAD: (63, 48)},
        {Q: (16, 48), K: (8, 48), OUT: (48, 16), NORM: (48,), HEAD: (63, 48)},
    ]
    layouts = autotp_layouts(record(0.4), shapes, "mp_rank_00_model_states.pt")
    assert layouts[Q] == Layout("split", 0, shards=((32, 16),)) and layouts[K] == Layout("split", 0, shards=((16, 8),))
    assert layouts[OUT] == Layout("split", 1, shards=((32, 16),)) and layouts[NORM] == REPLICATED
    assert layouts[HEAD] == Layout("split", 0, vocab=125)  # padded to 126 rows, 125 kept
    fused = {"patterns": [pattern(QKV)], "shape": [3, -1], "partition_dim": 0}
    even = [{QKV: (36, 8)}, {QKV: (36, 8)}]
    for version in (0.2, 0.3):  # a count of equal parts, split evenly, before per-rank widths were recorded
        assert autotp_layouts(record(version, parameter_with_sub_params=[fused]), even, "f")[QKV] == Layout(
            "split", 0, parts=(24, 24, 24)
        )
    tuple_spec = {**fused, "shape": [[32, 16, 16], -1]}  # a tuple of sizes
    assert autotp_layouts(record(0.3, parameter_with_sub_params=[tuple_spec]), [{QKV: (32, 8)}] * 2, "f")[
        QKV
    ] == Layout("split", 0, parts=(32, 16, 16))
    widths = {pattern(QKV): [[32, 16], [16, 8], [16, 8]]}
    uneven = record(0.4, parameter_with_sub_params=[tuple_spec], sub_param_shard_widths=widths)
    assert autotp_layouts(uneven, [{QKV: (64, 8)}, {QKV: (32, 8)}], "f")[QKV] == Layout(
        "split", 0, shards=((32, 16), (16, 8), (16, 8))
    )
    with pytest.raises(CheckpointError, match="without its sub-parameters' shard widths"):
        autotp_layouts(record(0.4, parameter_with_sub_params=[tuple_spec]), [{QKV: (64, 8)}, {QKV: (32, 8)}], "f")
    with pytest.raises(CheckpointError, match="do not split evenly"):
        autotp_layouts(record(0.3, parameter_with_sub_params=[fused]), [{QKV: (35, 8)}, {QKV: (34, 8)}], "f")
    with pytest.raises(CheckpointError, match="version 0.5"):
        autotp_layouts(record(0.5), shapes, "f")


def test_records_before_0_4_are_recognized_by_the_saving_config():
    autotp = {"tensor_parallel": {"autotp_size": 2}}
    assert is_autotp_record(record(0.2), autotp) and is_autotp_record(record(0.4), {})
    assert not is_autotp_record(record(0.3), {})  # Megatron-DeepSpeed writes the same categories


def test_a_rank_with_no_heads_and_a_scalar_are_placed():
    # more ranks than key-value heads: AutoTP gives the last rank none of o_proj's columns; an untouched scalar
    shapes = [{OUT: (48, 48), "model.scale": ()}, {OUT: (48, 0), "model.scale": ()}]
    logical = [48, 48]
    columns = {
        "logical_shape": logical,
        "ranks": {
            "0": {
                "shard_shape": [48, 48],
                "pieces": [{"shape": [48, 48], "source": [0, [48, 1]], "dest": [0, [48, 1]]}],
            },
            "1": {"shard_shape": [48, 0], "pieces": [{"shape": [48, 0], "source": [48, [48, 1]], "dest": [0, [0, 1]]}]},
        },
    }
    scalar = {
        "logical_shape": [],
        "ranks": {r: {"shard_shape": [], "pieces": [{"shape": [], "source": [0, []], "dest": [0, []]}]} for r in "01"},
    }
    info = record(0.4, tp_replicated_parameter_patterns=[pattern("model.scale")])
    info["affine_map"] = {"version": 1, "params": {pattern(OUT): columns, pattern("model.scale"): scalar}}
    layouts = autotp_layouts(info, shapes, "f")
    assert layouts[OUT] == Layout("split", 1, shards=((48, 0),)) and layouts["model.scale"] == REPLICATED


def test_a_live_parameter_held_scaled_is_refused_even_when_replicated():
    from ucp_deepspeed.naming.model import autotp_layout

    bias = {"replicated": True, "conversion": {"affine_map": {"ranks": {"1": {"pieces": [{"scale": 0.5}]}}}}}
    with pytest.raises(ValueError, match="dense.bias: AutoTP holds it scaled by 0.5"):
        autotp_layout("dense.bias", bias, (8,), 2)
    assert autotp_layout("norm.weight", {"replicated": True}, (8,), 2) == REPLICATED


def test_what_deepspeed_refuses_or_a_map_contradicts_is_refused_by_name():
    shapes = [{Q: (32, 48)}, {Q: (16, 48)}]
    unsupported = record(0.4, autotp_unsupported_parameter_patterns={pattern(Q): "rowwise_split_input"})
    with pytest.raises(CheckpointError, match=r"q_proj.weight'.*\(rowwise_split_input\)"):
        autotp_layouts(unsupported, shapes, "f")
    logical = [48, 48]
    agreed = {
        "logical_shape": logical,
        "ranks": {
            "0": {"shard_shape": [32, 48], "pieces": [rows((32, 48), 0, logical)]},
            "1": {"shard_shape": [16, 48], "pieces": [rows((16, 48), 32, logical)]},
        },
    }
    assert autotp_layouts(record(0.4, affine_map={"version": 1, "params": {pattern(Q): agreed}}), shapes, "f")
    swapped = {
        **agreed,
        "ranks": {**agreed["ranks"], "1": {"shard_shape": [16, 48], "pieces": [rows((16, 48), 0, logical)]}},
    }
    with pytest.raises(CheckpointError, match="affine map places rank 1's shard"):
        autotp_layouts(record(0.4, affine_map={"version": 1, "params": {pattern(Q): swapped}}), shapes, "f")
    scaled = {
        **agreed,
        "ranks": {
            **agreed["ranks"],
            "1": {"shard_shape": [16, 48], "pieces": [rows((16, 48), 32, logical) | {"scale": 0.5}]},
        },
    }
    with pytest.raises(CheckpointError, match="scaled by 0.5"):
        autotp_layouts(record(0.4, affine_map={"version": 1, "params": {pattern(Q): scaled}}), shapes, "f")


def test_autotp_with_ulysses_is_refused_by_name():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    import ucp_deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "tensor_parallel": {"autotp_size": 2},
        "checkpoint": {"universal": True},
    }
    for extra, mpu in (({}, parallel_state_sp), ({"sequence_parallel_size": 2}, None)):
        with pytest.raises(NotImplementedError, match="AutoTP .* together with Ulysses sequence parallelism"):
            ucp_deepspeed.initialize(model=torch.nn.Linear(2, 2), config={**config, **extra}, mpu=mpu)
