"""The universal format without any launch: a manifest round-trips through its typed form, and a malformed
one is refused with a `CheckpointError` naming the file, never a `KeyError` inside a load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ucp_deepspeed import CheckpointError, UniversalCheckpoint
from ucp_deepspeed.format.manifest import BufferRecord, Counters, GroupRecord, Manifest, ParamRecord, SourceRecord
from ucp_deepspeed.format.metadata import SaveMeta
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.universal import (
    BUFFERS,
    MANIFEST,
    STATE,
    param_file,
    write_manifest,
    write_object,
    write_tensors,
)
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter

SPEC = ModelSpec(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=16,
    num_attention_heads=2,
    num_query_groups=1,
    kv_channels=4,
    vocab_size=10,
    max_sequence_length=32,
    normalization="RMSNorm",
    activation="silu",
    gated_linear_unit=True,
    rotary_base=5e5,
    unmapped={"qk_layernorm": True},
)


def _folder(root) -> Manifest:
    weight = torch.arange(12.0).reshape(3, 4)
    records = [
        write_tensors(str(root), param_file("w"), {"fp32": weight, "exp_avg": weight * 2}),
        write_tensors(str(root), BUFFERS, {"b": torch.ones(2)}),
        write_object(str(root), STATE, {"lr_scheduler": None, "client_state": {}, "optimizer_wrapper": {}}),
    ]
    manifest = Manifest(
        created_by={"test": "1"},
        source=SourceRecord("x", "global_step3", Topology(2, 1, "fp32"), {"deepspeed": "0.19.8"}, (("a.pt", 1, 2),)),
        counters=Counters(3, 6, 0),
        param_groups=(GroupRecord({"lr": 0.1}, {"step": 3}),),
        params={"w": ParamRecord((3, 4), "float32", 0, True, param_file("w"), ("fp32", "exp_avg"))},
        buffers={"b": BufferRecord((2,), "float32")},
        extra={"save_id": "abc-1", "model": SPEC.encode(), "hf_config": {"model_type": "llama"}},
    )
    write_manifest(str(root), manifest, records)
    return manifest


def test_manifest_round_trips_and_reads(tmp_path):
    written = _folder(tmp_path)
    raw = json.loads((tmp_path / MANIFEST).read_text())
    read = Manifest.decode(raw, "m")
    assert dataclasses.replace(read, files={}) == written
    assert sorted(read.files) == sorted(raw["files"]) == [BUFFERS, param_file("w"), STATE]
    ckpt = UniversalCheckpoint(str(tmp_path))
    assert torch.equal(ckpt.read("w", "exp_avg"), torch.arange(12.0) * 2)
    assert ckpt.manifest.extra["save_id"] == "abc-1"
    assert ckpt.manifest.model == SPEC and ckpt.manifest.hf_config == {"model_type": "llama"}


def test_save_metadata_carries_the_model():
    meta = SaveMeta(Topology(1, 1, "fp32"), (), (), model=SPEC, hf_config={"model_type": "llama"})
    assert SaveMeta.from_json(meta.to_json(), "m") == meta
    assert SaveMeta.from_json(SaveMeta(Topology(1, 1, "fp32"), (), ()).to_json(), "m").model is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda m: m.pop("params"), "lacks 'params'"),
        (lambda m: m["params"]["w"].update(shape=[3, "4"]), "params.w"),
        (lambda m: m["params"]["w"].update(shape=[3, -4]), "params.w"),
        (lambda m: m["params"]["w"].update(file="params/other.safetensors"), "not in the file table"),
        (lambda m: m["params"]["w"].update(keys=[]), "params.w"),
        (lambda m: m["params"]["w"].pop("group"), "lacks 'group'"),
        (lambda m: m["buffers"].update(b={"shape": [2]}), "buffers.b"),
        (lambda m: m.update(param_groups={"0": {}}), "param_groups"),
        (lambda m: m["source"].update(topology=[1]), "source"),
        (lambda m: m["source"]["topology"].update(dp=0), "topology.dp is 0"),
        (lambda m: m["source"]["topology"].update(zero_stage="1"), "topology.zero_stage is '1'"),
        (lambda m: m["source"]["topology"].update(cp=2), "unknown fields ['cp']"),
        (lambda m: m["source"].update(fingerprint=[["a.pt", 1.5]]), "source.fingerprint"),
        (lambda m: m["counters"].update(global_steps="3"), "counters"),
        (lambda m: m["counters"].update(surprise=1), "counters"),
        (lambda m: m["files"][BUFFERS].pop("crc32"), f"manifest entry of {BUFFERS} is malformed"),
        (lambda m: m["model"].update(num_layers="2"), "model.num_layers is '2'"),
        (lambda m: m["model"].update(num_layers=-2), "model.num_layers is -2"),
        (lambda m: m["model"].update(tied=1), "model.tied is 1"),
        (lambda m: m["model"].update(surprise=1), "unknown fields ['surprise']"),
        (lambda m: m["model"].pop("vocab_size"), "model lacks fields"),
        (lambda m: m.update(hf_config=[1]), "hf_config is not an object"),
    ],
)
def test_malformed_manifest_is_refused_naming_the_file(tmp_path, damage, reason):
    _folder(tmp_path)
    path = tmp_path / MANIFEST
    raw = json.loads(path.read_text())
    damage(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        UniversalCheckpoint(str(tmp_path))
    assert str(path) in str(info.value) and reason in str(info.value), str(info.value)


def test_topology_records_a_sequence_parallel_size_only_when_there_is_one():
    plain = Topology(dp=3, zero_stage=1, dtype="fp32")
    ulysses = Topology(dp=3, zero_stage=1, dtype="fp32", sp=3)
    assert "sp" not in plain.encode() and Topology.decode(plain.encode()) == plain
    assert Topology.decode(ulysses.encode()) == ulysses and ulysses.describe() == "zero1 dp=3 sp=3 fp32"
    assert not plain.same_layout(ulysses)  # DeepSpeed's own load does not read files named before its #8226


def _written(root, fail: bool = False) -> None:
    weight = torch.arange(12.0).reshape(3, 4)
    with UniversalWriter(root=str(root)) as writer:
        writer.add_param("w", {"fp32": weight, "exp_avg": weight * 2}, group=0)
        writer.add_frozen("f", torch.ones(2, dtype=torch.bfloat16))
        writer.add_buffers({"b": torch.zeros(3, dtype=torch.int64)})
        writer.set_state(TrainingState(client_state={"epoch": 3}))
        if fail:
            raise RuntimeError("injected")
        writer.finish(source=SourceRecord("x", None, Topology(1, 0, "fp32")), counters=Counters(3, 6, 0))
    with pytest.raises(RuntimeError, match="closed"):
        writer.add_buffers({})


def test_the_writer_records_what_it_wrote_and_commits_only_at_finish(tmp_path):
    _written(tmp_path / "ok")
    ckpt = UniversalCheckpoint(str(tmp_path / "ok"))
    assert ckpt.params["w"] == ParamRecord((3, 4), "float32", 0, True, param_file("w"), ("fp32", "exp_avg"))
    assert ckpt.params["f"] == ParamRecord((2,), "bfloat16", None, False, param_file("f"), ("value",))
    assert ckpt.buffers == {"b": BufferRecord((3,), "int64")} and ckpt.manifest.counters == Counters(3, 6, 0)
    assert torch.equal(ckpt.read("w", "exp_avg"), torch.arange(12.0) * 2)
    assert ckpt.load_state() == {"lr_scheduler": None, "client_state": {"epoch": 3}, "optimizer_wrapper": {}}
    ckpt.close()
    with pytest.raises(RuntimeError, match="injected"):
        _written(tmp_path / "failed", fail=True)
    assert (tmp_path / "failed" / BUFFERS).is_file() and not (tmp_path / "failed" / MANIFEST).exists()


def test_the_writer_refuses_a_manifest_naming_files_it_did_not_write(tmp_path):
    with UniversalWriter(root=str(tmp_path)) as writer:
        writer.add_param("w", {"fp32": torch.ones(2)}, group=0)
        with pytest.raises(RuntimeError, match="buffers and training state"):
            writer.finish(source=SourceRecord("x", None, Topology(1, 0, "fp32")), counters=Counters())
        writer.add_buffers({})
        manifest = _folder(tmp_path / "other")
        with pytest.raises(CheckpointError, match="not written"):
            writer.commit(manifest)
    assert not (tmp_path / MANIFEST).exists()
