"""PyTorch DCP both ways: an FSDP2 job's `dcp.save` resumes in DeepSpeed, a DeepSpeed checkpoint loads into FSDP2.

One launch of 2 ranks saves both sources (tests/workers/dcp_hub.py); the test process itself, as one rank (a launch of
3 with `-m slow`), loads every target: the
FSDP2 folder into DeepSpeed ZeRO-1 and ZeRO-3 engines directly (`load_checkpoint` imports it), and the DCP export
of the DeepSpeed checkpoint into an FSDP2 job with `dcp.load`. Every fp32 weight, Adam moment, step count, frozen
weight and buffer is compared with `torch.equal`, and the next losses with the saving job's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, torchrun

from ucp_deepspeed import UniversalCheckpoint
from ucp_deepspeed.format.universal import read_manifest
from ucp_deepspeed.interop import export_dcp, import_dcp
from ucp_deepspeed.sources.dcp import DcpCheckpoint
from ucp_deepspeed.tools.cli import main as ucp

WORKER = ROOT / "tests" / "workers" / "dcp_hub.py"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp_hub")
    torchrun(2, "save", "--out", str(out), worker=WORKER)
    return out


@pytest.fixture(scope="module")
def exported(hub) -> Path:
    assert ucp(["export-dcp", str(hub / "ds"), str(hub / "exported"), "--no-progress"]) == 0
    return hub / "exported"


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_and_deepspeed_move_both_ways_through_dcp(hub, exported, world):
    results = hub / f"results{world}.json"
    if world == 1:  # one rank needs no launch: the worker's load runs in this process, on its one-rank group
        import dcp_hub  # tests/workers/dcp_hub.py
        from inprocess import one_rank

        one_rank()
        dcp_hub.do_load(argparse.Namespace(out=str(hub), stage=[1, 3], results=str(results)))
    else:
        torchrun(world, "load", "--out", str(hub), "--stage", "1", "3", "--results", str(results), worker=WORKER)
    cases = json.loads(results.read_text())
    assert [c["case"] for c in cases] == ["fsdp->zero1", "fsdp->zero3", "zero1->fsdp"]
    for case in cases:
        assert case["diffs"] == [], case
        assert case["next"] == pytest.approx(case["ref"], abs=1e-5), case


def test_import_dcp_records_what_it_inferred(hub, tmp_path):
    out = import_dcp(str(hub / "fsdp"), str(tmp_path / "u"))
    manifest = read_manifest(out)
    assert manifest.source.extra["format"] == "dcp" and manifest.source.topology.dp == 2
    assert manifest.counters.global_steps == 3
    assert [g.hyperparams["lr"] for g in manifest.param_groups] == [2e-3, 1e-3]
    assert {g.scalars["step"]["value"] for g in manifest.param_groups} == {3.0}
    trainable = {n for n, r in manifest.params.items() if r.trainable}
    assert trainable == {"embed.weight", "up.weight", "up.bias", "norm.weight", "norm.bias", "down.weight", "down.bias"}
    # a tensor without optimizer state is a frozen weight, a buffer or a tied copy: listed as both
    assert {n for n, r in manifest.params.items() if not r.trainable} == {"scale", "calls", "head.weight"}
    assert set(manifest.buffers) == {"scale", "calls", "head.weight"}
    assert UniversalCheckpoint(out).load_state()["client_state"] == {"epoch": 7}
    assert ucp(["verify", out]) == 0


def test_export_then_import_is_the_identity(hub, tmp_path):
    first = import_dcp(str(hub / "fsdp"), str(tmp_path / "a"))
    export_dcp(first, str(tmp_path / "dcp"), progress=False)
    again = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "b"))
    assert ucp(["diff", first, again]) == 0
    source, exported = DcpCheckpoint(str(hub / "fsdp")), DcpCheckpoint(str(tmp_path / "dcp"))
    assert set(source.tensors) == set(exported.tensors) and set(source.objects) == set(exported.objects)
    for key in source.tensors:
        assert torch.equal(source.tensor(key), exported.tensor(key)), key


def test_ranged_reads_hold_one_layer_and_check_every_record_at_the_end(tmp_path):
    """Debt 10 of issue 65: the Megatron importer held each stacked key (every layer) and its states whole. A ranged
    read of one layer reads that layer's bytes alone; a bucket's range the same; and a damaged byte in a layer never
    read in the block still fails it when it ends, naming the file."""
    import torch.distributed.checkpoint as dcp

    from ucp_deepspeed.errors import CheckpointError
    from ucp_deepspeed.io import stats

    stacked, flat = torch.randn(8, 32, 16), torch.randn(1000)
    layer = stacked[0].nbytes
    dcp.save({"decoder.layers.w": stacked, "bucket": flat}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    with DcpCheckpoint(str(tmp_path / "ok")) as ckpt:
        with stats.counting() as counted, ckpt.ranged() as reads:
            for i in range(8):
                assert torch.equal(reads.at("decoder.layers.w", (i,)), stacked[i])
                assert counted.data_bytes == (i + 1) * layer
            assert torch.equal(reads.region("bucket", 100, 200), flat[100:300])
            assert torch.equal(reads.at("bucket", ()), flat)
        with pytest.raises(CheckpointError, match=r"has no entry \[8\]"), ckpt.ranged() as reads:
            reads.at("decoder.layers.w", (8,))

    (data,) = (tmp_path / "ok").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(stacked[5].numpy().tobytes())
    raw[at + 7] ^= 0xFF
    data.write_bytes(bytes(raw))
    with DcpCheckpoint(str(tmp_path / "ok")) as ckpt:
        with pytest.raises(CheckpointError, match=data.name), ckpt.ranged() as reads:
            assert torch.equal(reads.at("decoder.layers.w", (0,)), stacked[0])
        # a caller that fails on the damaged values it read (a layout check) hears of the damage instead
        with pytest.raises(CheckpointError, match=data.name), ckpt.ranged() as reads:
            assert not torch.equal(reads.at("decoder.layers.w", (5,)), stacked[5])
            raise ValueError("the values do not match the model's")
