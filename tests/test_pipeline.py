"""DeepSpeed's `PipelineEngine` (a `PipelineModule` GPT, as Megatron-DeepSpeed builds `GPTModelPipe`): reshard across
pipeline size, stage split (`partition_method`), data-parallel size, ZeRO stage 0 <-> 1, and tensor-parallel size
when the blocks are megatron-core column/row-parallel layers; to and from a plain module and DeepSpeed's format.

Megatron-DeepSpeed itself is on no package index: `tests/workers/train_pipe.py` builds its `GPTModelPipe` (`mds`
variants) with its parameter names, a fused `query_key_value` that each tensor-parallel rank cuts into thirds
([q; k; v] per rank), SwiGLU's [gate; up] per rank, a vocabulary of 121 padded to 128, and the client state it hands
`save_checkpoint` (`args` with a tensor and megatron-core's `ModelType` inside, `universal_checkpoint_info`), and
plain DeepSpeed saves it, as Megatron-DeepSpeed does; `ucp convert --format deepspeed`, with no layout rules, writes
what its `--universal-checkpoint` (DeepSpeed's `load_universal`) loads at another layout.

Each load compares every fp32 master, Adam state, low-precision weight, buffer, step, per-group hyperparameter,
scheduler and counter with torch.equal (keyed by global name, merged over all stages; both copies of the tied
embedding must agree), then the next 3 losses with the uninterrupted run. One launch saves every source of a world
size and one loads every target of a world size; the default run makes two (`slow` says which cases), `-m slow`
the rest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, case_args, ds_to_universal, load_results, torch_env, torchrun

from ucp_deepspeed import UniversalCheckpoint
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import read_meta
from ucp_deepspeed.interop import import_deepspeed
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.tools.cli import main as cli_main

WORKER = ROOT / "tests" / "workers" / "train_pipe.py"
LOSS_RTOL = 1e-5
# bf16 gradients are accumulated and reduced in bf16 (DeepSpeed's pipeline refuses fp32 accumulation with bf16), so
# another DP size rounds every later step differently; the restored states themselves are compared exactly
LOSS_RTOL_BF16_OTHER_DP = 1e-4

# world size -> variants saved by one launch (data parallelism takes the rest of the world)
SAVES = {2: ("pp2", "bf16pp2z0", "plainpp2", "plainbf16pp2z0", "seq", "pp2z0", "tp1pp2", "tp2pp1", "mdstp2pp1")}
SAVES[4] = ("pp2u", "pp1", "tp2pp2", "plainbf16pp2z0")
# Megatron-DeepSpeed's GPTModelPipe, saved by plain DeepSpeed: TP2 in the 2-rank launch (the default run's), and at
# 4 ranks (TP2 x PP2; a Llama at TP2 x DP2; bf16 at PP2 x DP2) in a launch of its own, `slow`
MDS_SAVES = ("mdstp2pp2", "mdsllamatp2", "mdsbf16pp2")
LAUNCHES = {2: 2, 4: 4, "mds": 4}  # save launch -> world size

# (world, target variant, source "world/variant", expected mode)
CASES = [
    (2, "pp1", "2/pp2", "resharded"),  # PP2 DP1 -> PP1 DP2
    (2, "pp1", "4/pp2u", "resharded"),  # PP2 DP2 -> PP1 DP2
    (2, "pp1", "4/pp1", "resharded"),  # DP4 -> DP2
    (2, "pp2", "2/pp2", "native"),
    (2, "pp2", "4/pp2u", "resharded"),  # DP2 -> DP1 and another stage split
    (2, "pp2u", "2/pp2", "resharded"),  # same sizes, another stage split: DeepSpeed's own load would mix stages
    (2, "bf16pp1z0", "2/bf16pp2z0", "resharded"),
    (2, "bf16pp2", "2/bf16pp2z0", "resharded"),  # ZeRO-0 -> ZeRO-1
    # saved by plain DeepSpeed's BF16_Optimizer: no param_shapes; its param_slice_mappings place every parameter
    (2, "bf16pp1z0", "2/plainbf16pp2z0", "resharded"),
    (2, "bf16pp2", "4/plainbf16pp2z0", "resharded"),  # PP2 DP2: the mappings of both DP ranks, padding, to ZeRO-1
    (4, "pp2u", "2/pp2", "resharded"),  # PP2 DP1 -> PP2 DP2, another stage split
    (4, "pp2u", "4/pp1", "resharded"),  # PP1 DP4 -> PP2 DP2
    (4, "pp4", "4/pp2u", "resharded"),  # PP2 -> PP4 (split by block type)
    (4, "pp2ckpt", "2/pp2", "resharded"),  # into activation-checkpointed layers
    (2, "pp1", "4/pp2u/global_step3_universal", "imported"),  # ds_to_universal's folder, layer files copied in
    (4, "pp2u", "2/plainpp2", "resharded"),  # saved by plain DeepSpeed: metadata read off its own files
    (4, "stock:pp2u", "2/pp2", "stock"),  # `ucp convert --format deepspeed`, loaded by DeepSpeed's load_universal
    (2, "pp1z0", "2/pp2z0", "resharded"),  # ZeRO-0 fp32 (a torch optimizer on whole tensors), PP2 -> PP1 DP2
    (2, "pp1", "2/pp2z0", "resharded"),  # ZeRO-0 -> ZeRO-1
    (4, "pp1z0", "2/pp2", "resharded"),  # ZeRO-1 -> ZeRO-0, DP1 -> DP4
    (4, "stock:pp2u", "2/pp2z0", "stock"),  # ZeRO-0 exported to DeepSpeed's format, loaded by its ZeRO-1
    # megatron-core column/row-parallel layers inside LayerSpecs (TP x PP x DP)
    (2, "tp2pp1", "4/tp2pp2", "resharded"),  # 2x2x1 -> 2x1x1
    (2, "tp1pp2", "4/tp2pp2", "resharded"),  # 2x2x1 -> 1x2x1, another split
    (4, "tp2pp2", "2/tp1pp2", "resharded"),  # 1x2x1 -> 2x2x1
    (4, "tp2pp2", "2/tp2pp1", "resharded"),  # 2x1x1 -> 2x2x1
    (2, "seq", "2/pp2", "resharded"),  # PipelineModule -> the same layers as a plain module (`rename`)
    (4, "pp2u", "2/seq", "resharded"),  # and back
    # Megatron-DeepSpeed: `ucp convert --format deepspeed` (no rules) loaded by DeepSpeed's load_universal, which is
    # what its --universal-checkpoint runs; and the rank files read through ucp_deepspeed
    (2, "mdstp1pp2", "2/mdstp2pp1", "resharded"),  # TP2 -> PP2 x DP1
    (2, "stock:mdstp1pp1", "mds/mdstp2pp2", "stock"),  # TP2 x PP2 -> TP1 x DP2
    (2, "mdstp1pp2", "mds/mdstp2pp2", "resharded"),  # TP2 x PP2 -> PP2 x DP1
    (2, "stock:mdsllamatp1", "mds/mdsllamatp2", "stock"),  # SwiGLU, RMSNorm, untied: TP2 x DP2 -> TP1 x DP2
    (2, "stock:mdsbf16pp1", "mds/mdsbf16pp2", "stock"),  # bf16 PP2 x DP2 -> PP1 x DP2
]


# default cases whose claims another default case already makes, run under -m slow for the default run's budget
SLOW_AT_TWO = {("pp2", "2/pp2"), ("bf16pp2", "2/bf16pp2z0"), ("pp1", "2/pp2z0")}


def slow(case: tuple[int, str, str, str]) -> bool:
    """Whether a case is outside the default run: the default loads at 2 ranks what the 2-rank launch saved (PP2 ->
    PP1 DP2, another stage split, ZeRO-0 -> PP1, bf16, PipelineModule -> plain module, Megatron-DeepSpeed TP2 -> PP2),
    one launch each; the same-layout native load and the ZeRO-0 -> ZeRO-1 loads run under -m slow."""
    world, target, source, mode = case
    return world != 2 or not source.startswith("2/") or mode in ("stock", "imported") or (target, source) in SLOW_AT_TWO


class Pipes:
    """The saves (one launch per world size) and the loads (one launch per world size, slow cases apart), each run
    the first time a test needs it."""

    def __init__(self, root: Path):
        self.root = root
        self.saved: set[int] = set()
        self.loaded: dict[tuple[int, bool], dict[tuple[int, str, str], dict]] = {}

    def save(self, launch: int | str) -> Path:
        if launch not in self.saved:
            self.saved.add(launch)
            out = self.root / str(launch)
            variants = MDS_SAVES if launch == "mds" else SAVES[launch]
            torchrun(LAUNCHES[launch], "save", "--out", str(out), "--variant", *variants, worker=WORKER, timeout=600)
            if launch == 4:  # DeepSpeed's converter on the uneven split, and its folder with the layer files copied in
                tag = out / "pp2u" / "global_step3"
                theirs = ds_to_universal(tag, tag.with_name("global_step3_universal"), workers=1)
                shutil.copytree(theirs, self.root / "bare_universal")  # as DeepSpeed wrote it
                for layer_file in tag.glob("layer_*-model_states.pt"):
                    shutil.copy(layer_file, theirs)
                shutil.copy(out / "pp2u" / "reference.pt", theirs)  # where the worker looks for it
        return self.root / str(launch)

    def results(self, world: int, is_slow: bool) -> dict[tuple[int, str, str], dict]:
        if (world, is_slow) not in self.loaded:
            self.loaded[world, is_slow] = {}
            cases = [c for c in CASES if c[0] == world and slow(c) == is_slow]
            for launch in sorted({c[2].split("/")[0] for c in cases}):
                self.save(launch if launch == "mds" else int(launch))
            for exported in sorted({source for *_, source, mode in cases if mode == "stock"}):
                if not (self.root / exported / "latest_universal").is_file():
                    assert (
                        cli_main(["convert", "--format", "deepspeed", "--no-progress", str(self.root / exported)]) == 0
                    )
            targets: dict[str, list[str]] = {}
            for _, target, source, _ in cases:
                targets.setdefault(target, []).append(source)
            args = case_args(targets.items(), lambda source: self.root / source)
            results = self.root / f"loads{world}{'slow' if is_slow else ''}.json"
            torchrun(world, "load", "--results", str(results), *args, worker=WORKER, timeout=900)
            for r in load_results(results):
                self.loaded[world, is_slow][world, r["target"], str(Path(r["source"]).relative_to(self.root))] = r
        return self.loaded[world, is_slow]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> Pipes:
    return Pipes(tmp_path_factory.mktemp("pipeline"))


@pytest.mark.parametrize(
    "world,target,source,mode",
    [pytest.param(*c, id=f"{c[1]}-w{c[0]}<-{c[2]}", marks=[pytest.mark.slow] if slow(c) else []) for c in CASES],
)
def test_pipeline_reshard(pipes, world, target, source, mode):
    r = pipes.results(world, slow((world, target, source, mode)))[world, target, source]
    label = f"{r['saved']} -> {r['live']}"
    assert r["mode"] == mode, label
    assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"][:20])
    assert r["tensors"] >= (75 if mode == "stock" else 100), label  # 4 blocks x 12 tensors x (fp32, 2 states, weight)
    other_dp = mode == "stock" or r["saved"].split()[1] != r["live"].split()[1]
    rtol = LOSS_RTOL_BF16_OTHER_DP if "bf16" in target and other_dp else LOSS_RTOL
    assert r["max_rel_loss"] <= rtol, f"{label}: losses {r['losses']} vs {r['reference_losses']}"


@pytest.mark.slow
def test_tied_embedding_crosses_a_partition_on_one_stage_only(pipes):
    """The case DeepSpeed's converter breaks on: both stages hold the tied embedding, split differently over DP."""
    tag = pipes.save(4) / "pp2u" / "global_step3"
    crossing = []
    for stage in (0, 1):
        meta = read_meta(str(tag), stage)
        slot = next(s for s in meta.params if s.name.startswith("tied_modules.embed."))
        first, last = slot.offset // slot.partition, (slot.offset + slot.numel - 1) // slot.partition
        crossing.append(first != last)
    assert crossing == [False, True]


def test_layer_files_hold_buffers_and_frozen_parameters(pipes):
    """A PipelineModule's buffers and frozen weights live in per-layer files; the metadata says which."""
    tag = pipes.save(2) / "pp2" / "global_step3"
    extras = {e.name: e for stage in (0, 1) for e in read_meta(str(tag), stage).extras}
    assert extras["7.scale"].kind == "frozen" and extras["7.scale"].file == "layer_07-model_states.pt"
    assert extras["7.scale"].key == "scale"
    assert {n for n, e in extras.items() if e.kind == "buffer"} == {f"{i}.calls" for i in range(2, 6)}
    assert (tag / "layer_06-model_states.pt").is_file()  # the parameter-less layer's empty file


@pytest.mark.slow
def test_ds_to_universal_folder_without_layer_files_names_what_is_missing(pipes, tmp_path):
    """DeepSpeed's converter drops a PipelineModule's buffers (and frozen weights): say so, never reset them."""
    pipes.save(4)
    with pytest.raises(CheckpointError) as err:
        import_deepspeed(str(pipes.root / "bare_universal"), str(tmp_path / "out"))
    assert "layer_*-model_states.pt" in err.value.reason and "2.calls" in err.value.reason
    assert not (tmp_path / "out").exists(), "nothing is written before the folder is known to be complete"


@pytest.mark.slow
def test_deepspeed_launcher_job_resumes_at_another_layout(tmp_path):
    """A pipeline training job under the `deepspeed` launcher, restarted on twice the ranks with another stage split:
    it resumes from the newest checkpoint, resharded, and its losses follow the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    logs = []
    for ranks, variant, name in ((2, "pp2", "first"), (4, "pp2u", "second")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), str(WORKER), "train"]
        cmd += ["--variant", variant, "--ckpt-dir", str(ckpt), "--steps", "6", "--ckpt-every", "4"]
        proc = subprocess.run(
            [*cmd, "--results", str(tmp_path / f"{name}.json")],
            env=torch_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        logs.append(json.loads((tmp_path / f"{name}.json").read_text()))
    first, second = logs
    assert first["resumed"] is None and [e["step"] for e in first["log"]] == [1, 2, 3, 4, 5, 6]
    assert second["resumed"] == {
        "step": 4,
        "saved": "zero1 dp=1 pp=2 fp32",
        "live": "zero1 dp=2 pp=2 fp32",
        "mode": "resharded",
    }
    uninterrupted = {e["step"]: e["loss"] for e in first["log"]}
    assert [e["step"] for e in second["log"]] == [5, 6]
    for e in second["log"]:
        assert abs(e["loss"] - uninterrupted[e["step"]]) <= LOSS_RTOL * abs(uninterrupted[e["step"]]), e


def test_stages_with_different_param_group_counts_are_refused(pipes, tmp_path):
    """DeepSpeed drops a stage's empty param groups, so group numbers would not match across stages: refused."""
    ckpt = shutil.copytree(pipes.save(2) / "pp2", tmp_path / "pp2", ignore=shutil.ignore_patterns("*.universal"))
    meta_path = ckpt / "global_step3" / "ucp_meta_mp_rank_01.json"
    meta = json.loads(meta_path.read_text())
    meta["num_groups"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"have \[1, 2\] optimizer param groups"):
        NativeCheckpoint(str(ckpt))


# --- Megatron-DeepSpeed's saves (its GPTModelPipe, built in tests/workers/train_pipe.py) ---------------------------


def test_the_ucp_command_reads_a_megatron_deepspeed_save_with_no_rules(pipes, tmp_path, capsys):
    """inspect, verify, convert to the universal format and to DeepSpeed's: the layouts come from the record and the
    args; the fused projection is kept as [q; k; v] (DeepSpeed's loader takes its three sub-parameters apart again),
    the vocabulary's 7 padding rows, which training moved, are kept; the pickled args come back as a Namespace."""
    source = tmp_path / "mdstp2pp1"
    shutil.copytree(pipes.save(2) / "mdstp2pp1", source, ignore=shutil.ignore_patterns("*universal"))
    assert cli_main(["inspect", str(source)]) == 0
    out = capsys.readouterr().out
    assert "zero1 dp=1 tp=2 pp=1" in out and "rebuilt from DeepSpeed's files" in out
    assert cli_main(["verify", str(source)]) == 0
    assert cli_main(["convert", "--no-progress", str(source)]) == 0
    with UniversalCheckpoint(str(source / "global_step3.universal")) as ckpt:
        assert ckpt.params["tied_modules.embed.word_embeddings.weight"].shape == (128, 16)
        embedding = ckpt.read("tied_modules.embed.word_embeddings.weight", "fp32").view(128, 16)
        assert embedding[121:].abs().sum() > 0, "the padding rows were trained: they are kept"
        qkv = ckpt.read("2.self_attention.query_key_value.weight", "fp32").view(48, 16)
        args = ckpt.load_state()["client_state"]["args"]
        assert args.num_attention_heads == 2 and args.model_type["__class__"] == "megatron.core.enums.ModelType"
    shards = [
        torch.load(source / "global_step3" / f"layer_02-model_0{r}-model_states.pt", weights_only=False) for r in (0, 1)
    ]
    local = [s["self_attention.query_key_value.weight"] for s in shards]  # each rank: [q_r; k_r; v_r], 8 rows each
    expected = torch.cat([torch.cat([w[8 * i : 8 * (i + 1)] for w in local]) for i in range(3)])
    assert torch.equal(qkv.to(expected.dtype), expected), "q, k and v are each joined over the ranks"
    assert cli_main(["convert", "--format", "deepspeed", "--no-progress", str(source)]) == 0
    exported = torch.load(
        source / "global_step3_universal" / "zero" / "2.self_attention.query_key_value.weight" / "fp32.pt",
        weights_only=False,
    )
    assert exported["param_n_sub_params"] == 3 and torch.equal(exported["param"], qkv)
    record = torch.load(source / "global_step3_universal" / "mp_rank_00_model_states.pt", weights_only=False)
    assert isinstance(record["args"], argparse.Namespace) and record["args"].hidden_size == 16


def test_megatron_deepspeed_layouts_from_the_record_and_the_args():
    """The record's categories, the fused projection from the args' heads (GQA's unequal parts too) or in thirds,
    and the vocabulary kept with its padding."""
    from types import SimpleNamespace

    from ucp_deepspeed.geometry.layout import REPLICATED, Layout
    from ucp_deepspeed.sources.megatron_deepspeed import is_megatron_deepspeed_record, megatron_deepspeed_layouts

    info = {
        "universal_checkpoint_version": 0.4,
        "original_vocab_size": 121,
        "padded_vocab_size": 128,
        "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
        "tp_replicated_parameter_patterns": [r"\d+.input_layernorm.weight"],
        "parameter_with_row_parallelism_patterns": [r"\d+.self_attention.dense.weight"],
        "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight"],
    }
    local = {
        "tied_modules.embed.word_embeddings.weight": (64, 16),
        "2.input_layernorm.weight": (16,),
        "2.self_attention.query_key_value.weight": (12, 16),
        "2.self_attention.dense.weight": (16, 8),
        "2.mlp.dense_h_to_4h.weight": (24, 16),
    }
    gqa = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1, kv_channels=4)
    assert is_megatron_deepspeed_record(info, gqa) and not is_megatron_deepspeed_record(info, None)
    layouts = megatron_deepspeed_layouts(info, [local, local], gqa, "here")
    assert layouts["2.self_attention.query_key_value.weight"] == Layout("split", 0, parts=(16, 4, 4))
    assert layouts["tied_modules.embed.word_embeddings.weight"] == Layout("split", 0, vocab=128)
    assert layouts["2.input_layernorm.weight"] == REPLICATED
    assert layouts["2.self_attention.dense.weight"] == Layout("split", 1)
    assert layouts["2.mlp.dense_h_to_4h.weight"] == Layout("split", 0, parts=(24, 24))
    thirds = megatron_deepspeed_layouts(info, [local, local], SimpleNamespace(), "here")
    assert thirds["2.self_attention.query_key_value.weight"] == Layout("split", 0, parts=(8, 8, 8))
