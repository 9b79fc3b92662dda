"""The two ways a resharding load reads. Direct (the default, which test_reshard.py, test_megatron.py and the other
matrices run): each rank reads what it needs straight from the saved rank files, and no universal copy is
written. Converted (`"direct": false`): the tag is converted to a universal copy first, which the restore reads.
Here the converted path runs the direct matrices' cells: every state must be torch.equal to the state before save,
and the next losses match the uninterrupted run."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest import GPT_WORKER, launch_jobs, load_results, nvme_unavailable, torchrun

TINY_CASES = {  # target -> sources, all loaded at dp=3 in one launch
    "z2": ("z1", "z3", "bf16z2"),
    "offz2": ("offz3",),
    "sgdz1": ("sgdz2",),
}
TINY_CASES_SLOW = {"z2": ("z2", "z0"), "offz2": ("offz2", "fusedz1")}


def copies(folders: Iterable[Path]) -> set[Path]:
    """Universal copies next to these checkpoints."""
    return {p for folder in folders for p in Path(folder).glob("*.universal")}


@pytest.mark.parametrize(
    "slow", [pytest.param(False, id="stages"), pytest.param(True, id="more", marks=pytest.mark.slow)]
)
def test_converted_reshard_of_zero_stages_offload_and_nvme(sources, tmp_path, slow):
    cases = dict(TINY_CASES_SLOW if slow else TINY_CASES)
    if not nvme_unavailable():
        cases["nvmez3"] = ("widez1",) if slow else ("nvmez3",)
    args = [a for target, names in cases.items() for a in ("--case", target, *(str(sources[n]) for n in names))]
    torchrun(3, "load", "--converted", *args, "--results", str(tmp_path / "r.json"))
    results = load_results(tmp_path / "r.json")
    assert len(results) == sum(len(v) for v in cases.values())
    for r in results:
        label = f"{r['source']} -> {r['target']} dp=3 converted"
        assert r["diffs"] == [], f"{label}:\n" + "\n".join(r["diffs"])
        assert r["mode"] == "resharded" and r["tensors"] >= 20, label
        rtol = 5e-3 if "bf16" in r["source"] else 1e-5
        assert r["max_rel_loss"] <= rtol, label
    for names in cases.values():  # the restore read a universal copy, kept next to each source
        assert all(copies([sources[n]]) for n in names), names


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


def test_direct_reshard_checks_every_byte_it_read(sources, tmp_path):
    """A flipped byte in a rank file that one of the 3 ranks reads: every rank reads its share, the reads are
    checked before anything is written, and every rank raises the CRC error with its engine as it was.

    The same launch checks the two other ways one rank can fail the others: a RuntimeError or a MemoryError on
    rank 1 halfway through staging its share is raised, named, on every rank, with every engine as it was; and rank
    0 taking longer over the tag's metadata (4 s) than the training group's timeout (1 s) does not fail the load,
    since the other ranks wait for it on the checkpointer's own group."""
    src = tmp_path / "z1"
    shutil.copytree(sources["z1"], src, ignore=shutil.ignore_patterns("*.universal"))
    optim = src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x01
    optim.write_bytes(bytes(data))
    healthy = str(sources["z1"])
    out = tmp_path / "errors.json"
    cases = [str(src), f"{healthy}!RuntimeError", f"{healthy}!MemoryError", f"{healthy}!slow"]
    torchrun(3, "load", "--expect-error", "--variant", "z2", "--results", str(out), "--source", *cases)
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
