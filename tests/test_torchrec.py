"""TorchRec's DLRM under `DistributedModelParallel`, saved at 2 ranks through `TorchRecCheckpointer` (whole,
one-shot, incremental and intermittent Check-N-Run chains, and 8-bit quantized rows) and resumed at another plan and
world size.

Every table (table-wise, column-wise, data-parallel), fused-kernel state (row-wise Adagrad's per-row `momentum1`,
exact Adagrad's per-element one) and dense Adagrad state gathered right after the load is `torch.equal` to the one
gathered right after the save, except where a test says what it expects instead; the next losses are compared with the
uninterrupted run's. One load launch (1 rank) runs by default; the 2-rank one with the tables moved runs under
`-m slow`. TorchRec's own `dcp.save` of the same step comes in through `import_dcp`, and ours goes back out through
`export_dcp` for `dcp.load`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, torchrun
from safetensors import safe_open

from ucp_deepspeed.errors import CheckpointError

pytest.importorskip("torchrec", reason="TorchRec is not installed (the `torchrec` extra, then torchrec --no-deps)")
pytest.importorskip("fbgemm_gpu", reason="fbgemm's CPU kernels are not installed (the `torchrec` extra)")
from ucp_deepspeed.torchrec import TorchRecCheckpointer

JOB = ROOT / "tests" / "workers" / "torchrec_job.py"
T1, T2, T3 = (f"sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight" for t in ("t1", "t2", "t3"))
SOURCES = ("full", "one_shot", "incremental", "intermittent", "quantized")


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both optimizers' jobs, 8 steps at 2 ranks, saved at steps 2 and 4 by every source's checkpointer."""
    out = tmp_path_factory.mktemp("torchrec")
    torchrun(2, "save", "--out", str(out), worker=JOB)
    return out


def _load(saved: Path, world: int, cases: list[str], name: str) -> tuple[Path, dict]:
    out = saved / name
    torchrun(world, "load", "--out", str(out), "--case", *cases, worker=JOB)
    return out, json.loads((out / f"results_{world}.json").read_text())


def _same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    assert sorted(ref) == sorted(got)
    differ = [k for k in ref if k not in skip and not torch.equal(ref[k], got[k])]
    assert not differ, differ


def _losses(saved: Path, optimizer: str) -> dict[str, float]:
    return json.loads((saved / f"losses_{optimizer}.json").read_text())


def test_every_save_is_a_chain_element_and_deltas_hold_only_looked_up_rows(saved: Path):
    """The whole save's tables hold every row; step 4 of the one-shot chain only the rows looked up since step 2 (the
    ids TorchRec's `ModelDeltaTracker` recorded, merged over the ranks), and the quantized chain's fp32 rows are 8-bit
    codes."""
    for optimizer in ("rowwise", "adagrad"):
        full = json.loads((saved / f"{optimizer}-full" / "global_step4" / "manifest.json").read_text())
        delta = json.loads((saved / f"{optimizer}-one_shot" / "global_step4" / "manifest.json").read_text())
        assert full["differential"]["kind"] == "baseline" and delta["differential"]["kind"] == "delta"
        assert delta["differential"]["chain"] == ["global_step2", "global_step4"]
        for key in (T1, T2):
            whole, part = full["params"][key]["table"], delta["params"][key]["table"]
            assert whole["saved_rows"] == whole["rows"] and 0 < part["saved_rows"] < part["rows"], (whole, part)
        assert full["torchrec"]["tables"][T2]["sharding"] == "column_wise"
        assert full["torchrec"]["dense_tables"] == [T3]
        # the rows looked up since step 2 are those TorchRec's own ModelDeltaTracker saw on any rank
        tracked = json.loads((saved / f"delta_tracker_{optimizer}.json").read_text())
        for key in (T1, T2):
            with safe_open(
                str(saved / f"{optimizer}-one_shot" / "global_step4" / delta["params"][key]["file"]), "pt"
            ) as f:
                assert f.get_tensor("rows").tolist() == tracked[key.removesuffix(".weight")], key
    quant = json.loads((saved / "rowwise-quantized" / "global_step2" / "manifest.json").read_text())
    assert quant["params"][T1]["table"]["quantize"] == {"method": "symmetric", "bits": 8}
    assert quant["params"][T2]["table"]["widths"] == {"momentum1": [2]}  # one value per row and column shard


def test_resumes_at_one_rank_exactly_where_the_state_allows_and_refuses_by_name_elsewhere(saved: Path):
    """At 1 rank: the column split kept (t2 in two column shards on the one rank) loads every state exactly; a
    row-wise state merged into one table-wise shard is refused by name, the model as it was, and with
    `approximate_row_state` becomes the width-weighted mean of the saved shards; exact Adagrad's per-element state
    goes to any plan. TorchRec's own `dcp.save` of the job, which DCP cannot load at this plan, resumes through
    `import_dcp` exactly, and our tag exported with `export_dcp` loads through `dcp.load` exactly."""
    cases = [
        f"{saved}/rowwise-one_shot:rowwise:one_rank",
        f"{saved}/rowwise-incremental:rowwise:one_rank_tw",
        f"{saved}/rowwise-full:rowwise:one_rank_tw:approximate",
        f"{saved}/adagrad-incremental:adagrad:one_rank_tw",
        # TorchRec's own dcp.save of the same jobs at step 4: DCP's load, then ours through the import; our export
        f"{saved}/rowwise-dcp:rowwise:one_rank_tw:dcp_direct:lrs",
        f"{saved}/rowwise-dcp:rowwise:one_rank:import:lrs",
        f"{saved}/adagrad-dcp:adagrad:one_rank_tw:import:lrs",
        f"{saved}/rowwise-incremental:rowwise:one_rank:export:lrs",
    ]
    out, results = _load(saved, 1, cases, "one_rank")
    rowwise = torch.load(saved / "saved_rowwise.pt")
    _same(rowwise, torch.load(out / "loaded_rowwise-one_shot-one_rank.pt"))
    refused = results["rowwise-incremental-one_rank_tw"]
    assert "momentum1" in refused["error"] and "no exact conversion" in refused["error"] and T2 in refused["error"]
    assert refused["unchanged"], "a refused load changed the model or an optimizer"

    approx = torch.load(out / "loaded_rowwise-full-one_rank_tw-approximate.pt")
    state = f"{T2}/t2.momentum1"
    _same(rowwise, approx, skip=(state,))
    assert torch.equal(approx[state], rowwise[state].reshape(2, -1).mean(dim=0))  # two shards of 4 columns each

    _same(torch.load(saved / "saved_adagrad.pt"), torch.load(out / "loaded_adagrad-incremental-one_rank_tw.pt"))

    assert "Size mismatch" in results["rowwise-dcp-one_rank_tw-dcp_direct-lrs"]["error"]  # DCP alone: refused
    _same(rowwise, torch.load(out / "loaded_rowwise-dcp-one_rank-import-lrs.pt"))
    _same(rowwise, torch.load(out / "loaded_rowwise-incremental-one_rank-export-lrs.pt"))
    _same(torch.load(saved / "saved_adagrad.pt"), torch.load(out / "loaded_adagrad-dcp-one_rank_tw-import-lrs.pt"))

    for case, optimizer in (
        ("rowwise-one_shot-one_rank", "rowwise"),
        ("adagrad-incremental-one_rank_tw", "adagrad"),
        ("rowwise-dcp-one_rank-import-lrs", "rowwise"),
        ("adagrad-dcp-one_rank_tw-import-lrs", "adagrad"),
        ("rowwise-incremental-one_rank-export-lrs", "rowwise"),
    ):
        run, reference = results[case], _losses(saved, optimizer)
        assert run["step"] == 4 and run["client_state"] == {"epoch": 2}
        for step in ("5", "6", "7", "8"):  # the ranks' gradients are summed in another order: within rounding
            assert abs(run["losses"][step] - reference[step]) <= 1e-6 * abs(reference[step]), (case, step)


@pytest.mark.slow
def test_resumes_at_two_ranks_with_every_table_moved(saved: Path):
    """At 2 ranks with t1 on the other rank and t2's column shards swapped: every source loads every state exactly
    (the quantized one its fp32 rows within 8-bit error), and the next losses equal the uninterrupted run's."""
    cases = [f"{saved}/rowwise-{s}:rowwise:moved" for s in SOURCES] + [f"{saved}/adagrad-one_shot:adagrad:moved"]
    out, results = _load(saved, 2, cases, "moved")
    for source in SOURCES:
        ref, got = torch.load(saved / "saved_rowwise.pt"), torch.load(out / f"loaded_rowwise-{source}-moved.pt")
        tables = (T1, T2) if source == "quantized" else ()
        _same(ref, got, skip=tables)
        for key in tables:
            scale = ref[key].abs().amax(dim=1, keepdim=True) / 127
            assert ((ref[key] - got[key]).abs() <= scale * 0.5 + 1e-7).all(), key
        if source != "quantized":
            assert results[f"rowwise-{source}-moved"]["losses"] == {
                k: v for k, v in _losses(saved, "rowwise").items() if int(k) > 4
            }
    _same(torch.load(saved / "saved_adagrad.pt"), torch.load(out / "loaded_adagrad-one_shot-moved.pt"))
    assert results["adagrad-one_shot-moved"]["losses"] == {
        k: v for k, v in _losses(saved, "adagrad").items() if int(k) > 4
    }


@pytest.mark.slow
def test_dtensor_tables_save_and_resume(tmp_path: Path):
    """With TorchRec's `output_dtensor` (tables as DTensors over its LocalShardsWrapper) on both sides: saved at 2
    ranks, our one-shot chain, TorchRec's own `dcp.save` through `import_dcp`, and our export through `dcp.load`
    resume at 1 rank with every state exact and the next losses within rounding."""
    torchrun(2, "save", "--out", str(tmp_path), "--optimizers", "rowwise", "--dtensor", worker=JOB)
    cases = [
        f"{tmp_path}/rowwise-one_shot:rowwise:one_rank",
        f"{tmp_path}/rowwise-dcp:rowwise:one_rank:import:lrs",
        f"{tmp_path}/rowwise-incremental:rowwise:one_rank:export:lrs",
    ]
    out = tmp_path / "one_rank"
    torchrun(1, "load", "--out", str(out), "--dtensor", "--case", *cases, worker=JOB)
    results = json.loads((out / "results_1.json").read_text())
    reference = _losses(tmp_path, "rowwise")
    for case in (
        "rowwise-one_shot-one_rank",
        "rowwise-dcp-one_rank-import-lrs",
        "rowwise-incremental-one_rank-export-lrs",
    ):
        _same(torch.load(tmp_path / "saved_rowwise.pt"), torch.load(out / f"loaded_{case}.pt"))
        for step, loss in results[case]["losses"].items():
            assert abs(loss - reference[step]) <= 1e-6 * abs(reference[step]), (case, step)


@pytest.fixture(scope="module")
def job():
    """The worker's module, in this process, over a 1-rank gloo world."""
    import importlib.util

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    spec = importlib.util.spec_from_file_location("torchrec_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_save_makes_the_next_one_a_baseline(job, tmp_path: Path):
    """A save that fails (its directory cannot be made) consumed the rows looked up before it, so the incremental
    chain's next save must be a baseline, not a delta that leaves those rows as they were."""
    model, dense = job.build("rowwise", "one_rank")
    saver = TorchRecCheckpointer(model, dense, differential={"policy": "incremental"})
    job.train_step(model, dense, 1)
    saver.save(str(tmp_path / "ckpt"), step=1)
    job.train_step(model, dense, 2)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError):
        saver.save(str(tmp_path / "file"), step=2)
    job.train_step(model, dense, 3)
    saver.save(str(tmp_path / "ckpt"), step=3)
    manifest = json.loads((tmp_path / "ckpt" / "global_step3" / "manifest.json").read_text())
    assert manifest["differential"]["kind"] == "baseline"


def test_a_tag_saved_again_starts_a_new_chain(job, tmp_path: Path):
    """Saving a chain's tag again would delete an element the chain needs: it becomes a new baseline, and loads."""
    model, dense = job.build("rowwise", "one_rank")
    saver = TorchRecCheckpointer(model, dense, differential={"policy": "one_shot"})
    for step in (1, 2):
        job.train_step(model, dense, step)
        saver.save(str(tmp_path), "ckpt", step=step)
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["differential"]["kind"] == "baseline"
    assert TorchRecCheckpointer(*job.build("rowwise", "one_rank")).load(str(tmp_path)).step == 2


def _edit(manifest: Path, change) -> None:
    body = json.loads(manifest.read_text())
    change(body)
    manifest.write_text(json.dumps(body))


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda b: b["torchrec"]["tables"][T2].update(shards=[]), "does not fit"),
        (lambda b: b["torchrec"].update(dense_tables=3), "malformed 'torchrec' section"),
        (lambda b: b["torchrec"]["tables"][T2].update(rows=61), "does not fit"),
        (lambda b: b["params"][T2].update(group=None), "names no param group"),
        (lambda b: b["params"][T2].update(group=99), "names no param group"),
        (lambda b: b["param_groups"][b["params"][T2]["group"]]["hyperparams"].update(lr="fast"), "not a number"),
        (lambda b: b["params"][T2]["table"].update(widths={"momentum1": [3]}), "does not fit"),
        (lambda b: b["params"].pop(T2), "has no record among the parameters"),
        (lambda b: b["torchrec"].update(dense_optimizers=["Adam"]), "dense optimizers ['Adam']"),
    ],
    ids=[
        "no-shards",
        "dense-tables",
        "rows",
        "group-null",
        "group-range",
        "lr",
        "widths",
        "params",
        "dense-type",
    ],
)
def test_a_malformed_manifest_is_refused_naming_it(job, tmp_path: Path, change, reason):
    """Each field the load indexes by is checked: one clear line naming the manifest, and the model as it was."""
    model, dense = job.build("rowwise", "one_rank")
    job.train_step(model, dense, 1)
    TorchRecCheckpointer(model, dense).save(str(tmp_path), "ckpt", step=1)
    _edit(tmp_path / "ckpt" / "manifest.json", change)
    fresh, fresh_dense = job.build("rowwise", "one_rank_tw" if "approximate" in reason else "one_rank")
    before = job.snapshot(fresh, fresh_dense)
    with pytest.raises(CheckpointError, match=re.escape(reason)) as err:
        TorchRecCheckpointer(fresh, fresh_dense).load(str(tmp_path))
    assert err.value.path.endswith("manifest.json"), err.value
    _same(before, job.snapshot(fresh, fresh_dense))
