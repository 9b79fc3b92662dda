"""The two ways a resharding load reads. Direct (the default, which test_reshard.py, test_megatron.py and the other
matrices run): each rank reads what it needs straight from the saved rank files, and no universal copy is
written. Converted (`"direct": false`): the tag is converted to a universal copy first, which the restore reads.
Here the converted path runs the direct matrices' cells: every state must be torch.equal to the state before save,
and the next losses match the uninterrupted run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest import GPT_WORKER, case_args, launch_jobs, load_results, nvme_unavailable, torchrun

TINY_CASES_SLOW = {"z2": ("z2", "z0"), "offz2": ("offz2", "fusedz1")}  # the default cells: conftest.CONVERTED_CASES


def copies(folders: Iterable[Path]) -> set[Path]:
    """Universal copies next to these checkpoints."""
    return {p for folder in folders for p in Path(folder).glob("*.universal")}


def _check_converted(results: list[dict], cases: dict[str, tuple[str, ...]], sources) -> None:
    assert len(results) == sum(len(v) for v in cases.values())
    for r in results:
        label = f"{r['source']} -> {r['target']} dp=3 converted"
        assert r["diffs"] == [], f"{label}:\n" + "\n".join(r["diffs"])
        assert r["mode"] == "resharded" and r["tensors"] >= 20, label
        rtol = 5e-3 if "bf16" in r["source"] else 1e-5
        assert r["max_rel_loss"] <= rtol, label
    for names in cases.values():  # the restore read a universal copy, kept next to each source
        assert all(copies([sources[n]]) for n in names), names


def test_converted_reshard_of_zero_stages_offload_and_nvme(dp3_loads, sources):
    """The cells of conftest.CONVERTED_CASES, run in the session's shared dp=3 launch (`dp3_loads`)."""
    _check_converted(load_results(dp3_loads.out / "converted.json"), dp3_loads.converted_cases, sources)


@pytest.mark.slow
def test_converted_reshard_of_more_cells(sources, tmp_path):
    cases = dict(TINY_CASES_SLOW)
    if not nvme_unavailable():
        cases["nvmez3"] = ("widez1",)
    args = case_args(cases.items(), lambda n: sources[n])
    torchrun(3, "load", "--converted", *args, "--results", str(tmp_path / "r.json"))
    _check_converted(load_results(tmp_path / "r.json"), cases, sources)


@pytest.mark.slow
def test_converted_reshard_of_megatron_tp_pp_and_experts(megatron_sources, tmp_path):
    layouts = [
        (["--arch", "llama", "--zero", "1", "--tp", "1", "--pp", "2", "--first-stage-layers", "1"], "llama-z3-tp2"),
        (["--arch", "llama", "--zero", "1", "--tp", "2", "--pp", "1"], "llama-z1-dp2"),
        (["--arch", "gpt", "--zero", "2", "--tp", "1", "--pp", "1"], "gpt-z1-tp2"),
        (["--arch", "llama", "--zero", "1", "--moe", "--ep", "1"], "moe-z1-ep2"),
    ]
    runs = [
        ["load", "--converted", *layout, "--results", str(tmp_path / f"{i}.json"), "--source", str(megatron_sources[s])]
        for i, (layout, s) in enumerate(layouts)
    ]
    launch_jobs(2, runs, worker=GPT_WORKER)
    assert all(copies([megatron_sources[s]]) for _, s in layouts)
    for i, (_, name) in enumerate(layouts):
        (r,) = load_results(tmp_path / f"{i}.json")
        assert r["mode"] == "resharded" and r["diffs"] == [] and r["tensors"] >= 20, (name, r["diffs"][:5])
        assert r["max_rel_loss"] <= 1e-5, (name, r)


def test_direct_reshard_checks_every_byte_it_read(dp3_loads):
    """A flipped byte in a rank file that one of the 3 ranks reads: every rank reads its share, the reads are
    checked before anything is written, and every rank raises the CRC error with its engine as it was.

    The same launch checks the two other ways one rank can fail the others: a RuntimeError or a MemoryError on
    rank 1 halfway through staging its share is raised, named, on every rank, with every engine as it was; and rank
    0 taking longer over the tag's metadata (4 s) than the training group's timeout (1 s) does not fail the load,
    since the other ranks wait for it on the checkpointer's own group. (The session's shared dp=3 launch,
    `conftest.dp3_loads`.)"""
    src, optim = dp3_loads.damaged, dp3_loads.flipped
    out = dp3_loads.out / "errors.json"
    damaged, *injected, slow = load_results(out)
    errors = set(damaged["errors"])
    assert len(errors) == 1 and None not in errors, errors
    assert f"{optim}: record" in errors.pop()
    for outcome in (damaged, *injected):
        assert outcome["changed"] == [[], [], []] and outcome["step"] == [None, None, None], outcome
    for outcome, kind in zip(injected, ("RuntimeError", "MemoryError")):
        assert outcome["errors"] == [f"rank 1: {kind}: injected on rank 1"] * 3, outcome
    assert slow["errors"] == [None, None, None], slow
    assert not list(src.glob("*.universal"))
