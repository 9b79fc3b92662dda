"""Where the data stands: a job fed by DeepSpeed's own data sampler (`deepspeed_io`, curriculum learning), saved at 2
ranks mid-epoch and resumed at 1, 2 and 4, trains next on exactly the global batches the uninterrupted run trained
on, in the same order, with the same losses; the epoch covers every sample once.

One launch per world size: the 2-rank launch saves, runs on uninterrupted, and resumes at its own size; the 1- and
4-rank launches reshard, the 1-rank one also from `ucp convert`'s universal folder of the same checkpoint and into a
job whose cluster folder lacks the saved clusters (refused). torchdata's `StatefulDataLoader` runs in the same
launches. The 4-rank launch (M > N) runs with `-m slow`, for the suite's budget.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, torchrun

from ucp_deepspeed.tools.cli import main as cli_main

WORKER = ROOT / "tests" / "workers" / "data_sampler.py"
SAMPLES = 48
DRAWN = 3 * 8  # the map-style loader's samples drawn at its save: the worker's 3 steps of a global batch of 8
LOSS_RTOL = 1e-5  # the same batches; only the reduction over ranks differs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("data_sampler")
    torchrun(2, "save", "--out", str(out), "--each", f"loader-save --out {out}", worker=WORKER)
    universal = out / "universal"
    assert cli_main(["convert", str(out / "ckpt"), "--output", str(universal), "--no-progress"]) == 0
    converted = f"load --out {out} --source {universal} --name converted"
    (out / "empty").mkdir()
    refused = f"load --out {out} --clusters {out / 'empty'} --name refused"
    loaders = f"loader-load --out {out}"
    loader_universal = out / "loader-universal"
    to_universal = ["convert", str(out / "loader-ckpt"), "--tag", "map", "--output", str(loader_universal)]
    assert cli_main([*to_universal, "--no-progress"]) == 0
    torchrun(
        1,
        *("load", "--out", str(out), "--each", converted, "--each", refused),
        *("--each", f"{loaders} --source {loader_universal}"),
        worker=WORKER,
    )
    saved = json.loads((out / "saved.json").read_text())
    resumed = {
        label: json.loads((out / f"{name}{world}.json").read_text())["resumed"]
        for label, name, world in (("1", "resumed", 1), ("1, converted", "converted", 1))
    }
    found = {"out": out, "2": saved, **{label: {**saved, "resumed": r} for label, r in resumed.items()}}
    found["refused"] = json.loads((out / "refused1.json").read_text())
    found["loaders"] = {
        "saved": json.loads((out / "loader-saved.json").read_text()),
        "1": json.loads((out / "loader1.json").read_text()),
    }
    return found


@pytest.fixture(scope="module")
def runs4(runs: dict) -> dict[str, dict]:
    """`runs`, with the resumes at 4 ranks (one more launch)."""
    out = runs["out"]
    torchrun(4, "load", "--out", str(out), "--each", f"loader-load --out {out}", worker=WORKER)
    resumed = json.loads((out / "resumed4.json").read_text())["resumed"]
    return {
        **runs,
        "4": {**runs["2"], "resumed": resumed},
        "loaders": {**runs["loaders"], "4": json.loads((out / "loader4.json").read_text())},
    }


def _at(request: pytest.FixtureRequest, world: str) -> dict:
    """The runs a check at `world` ranks reads: the 4-rank launch only when a check asks for it."""
    return request.getfixturevalue("runs4" if world.startswith("4") else "runs")


WORLDS = ["1", "2", pytest.param("4", marks=pytest.mark.slow), "1, converted"]


@pytest.mark.parametrize("world", WORLDS)
def test_resumed_run_trains_on_the_batches_the_uninterrupted_run_did(request, world):
    run = _at(request, world)[world]
    after, resumed = run["after"], run["resumed"]
    assert [s["ids"] for s in resumed] == [s["ids"] for s in after], f"at {world} ranks"
    for mine, theirs in zip(resumed, after):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_RTOL * abs(theirs["loss"]), (world, mine, theirs)
    seen = [i for step in run["before"] + resumed for i in step["ids"]]
    assert sorted(seen) == list(range(SAMPLES)), f"the epoch at {world} ranks repeats or skips samples"


def test_missing_clusters_are_refused_before_anything_changes(runs):
    """The saved position names cluster files the resumed job's `data_cluster_path` lacks: one line naming the file,
    raised while reading, so the engine keeps its weights and step count."""
    found = runs["refused"]
    assert found["error"] and "cluster_seqlen" in found["error"] and "missing" in found["error"], found
    assert found["kept"], found


def _steps(run: list[dict]) -> list[list[int]]:
    """Each step's samples: a `DistributedSampler` interleaves its ranks, so the order within a step depends on the
    size; which samples a step trains on does not."""
    return [sorted(step["ids"]) for step in run]


@pytest.mark.parametrize("world", WORLDS)
def test_stateful_dataloader_continues_the_global_order(request, world):
    """torchdata's `StatefulDataLoader` over a `DistributedSampler`, saved at 2 ranks mid-epoch in its second epoch
    and resumed at 1, 2 and 4 with the same global batch (and at 1 from `ucp convert`'s folder of the tag): the next
    steps train on the samples the uninterrupted run did, with its losses, and the epoch covers every sample once (a
    sampler restarted at epoch 0, or at sample 0 of its share, fails this)."""
    runs = _at(request, world)
    saved = runs["loaders"]["saved"]["map"]
    resumed = {
        "2": saved["resumed"],
        "1, converted": runs["loaders"]["1"]["converted"],
    }.get(world) or runs["loaders"][world]["map"]
    assert _steps(resumed) == _steps(saved["after"]), f"at {world} ranks"
    for mine, theirs in zip(resumed, saved["after"]):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_RTOL * abs(theirs["loss"]), (world, mine, theirs)
    seen = [i for step in saved["before"] + resumed for i in step["ids"]]
    assert sorted(seen) == list(range(SAMPLES)), f"the epoch at {world} ranks repeats or skips samples"


@pytest.mark.parametrize("world", ["1", pytest.param("4", marks=pytest.mark.slow)])
def test_stateful_dataloader_at_another_global_batch(request, world):
    """Resumed with half the global batch: twice the steps, over exactly the samples the uninterrupted run had left,
    in the same global order."""
    runs = _at(request, world)
    saved = runs["loaders"]["saved"]["map"]
    half = runs["loaders"][world]["half"]
    pairs = [sorted(half[2 * k]["ids"] + half[2 * k + 1]["ids"]) for k in range(len(half) // 2)]
    assert pairs == _steps(saved["after"]), f"at {world} ranks"


@pytest.mark.parametrize("world", ["1", pytest.param("4", marks=pytest.mark.slow)])
def test_iterable_loader_resumes_at_its_size_and_is_refused_at_another(request, world):
    """An iterable dataset's position is its own state: at the saved size each rank continues exactly; at 1 and 4
    ranks the load is refused naming the loader, with the engine as it was."""
    runs = _at(request, world)
    saved = runs["loaders"]["saved"]["iterable"]
    assert [s["ids"] for s in saved["resumed"]] == [s["ids"] for s in saved["after"]]
    refused = runs["loaders"][world]["refused"]
    assert refused["error"] and "StatefulDataLoader over Stream, saved by 2 ranks" in refused["error"], refused
    assert "iterable dataset's position is its own" in refused["error"] and refused["kept"], refused


def test_inspect_shows_where_each_ranks_loader_stood(runs, capsys):
    """`ucp inspect` of the tag saved with both loaders' records: each rank's loader, and the global order the
    map-style one draws from (its epoch, the dataset's size, the samples drawn over the ranks)."""
    assert cli_main(["inspect", str(runs["out"] / "loader-ckpt"), "--tag", "map"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "data loaders:" in line)
    assert line.startswith("  data loaders: 2 ranks of StatefulDataLoader over") and f"of {SAMPLES} samples" in line
    assert f", {DRAWN} drawn" in line, line  # over both ranks, each counted once
    assert cli_main(["inspect", str(runs["out"] / "loader-ckpt"), "--tag", "map", "--json"]) == 0
    loaders = json.loads(capsys.readouterr().out)["data_loaders"]
    assert [(r["rank"], r["dp_size"]) for r in loaders] == [(0, 2), (1, 2)] and all(r["order"] for r in loaders)
    assert cli_main(["inspect", str(runs["out"] / "ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_loaders"] is None  # a save given no loader records none


def test_inspect_of_a_tag_whose_loader_file_is_damaged_still_summarises_it(runs, tmp_path, capsys):
    """The rest of the summary stands; the loader line says why its file cannot tell (ucp verify names it too)."""
    shutil.copytree(runs["out"] / "loader-ckpt" / "map", tmp_path / "map")
    loaders = tmp_path / "map" / "data_loader.pt"
    loaders.write_bytes(loaders.read_bytes()[:100])
    assert cli_main(["inspect", str(tmp_path / "map")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "data loaders:" in line)
    assert line.startswith("  data loaders: unreadable (") and "data_loader.pt" in line, line
