"""torchrun elastic, end to end on localhost: two agents ("nodes") of 2 ranks each run launch/elastic.sh.

A node killed mid-run leaves the survivor to re-rendezvous at world 2; a node joining grows the job
to world 4. Either way the workers restart, resume from the newest complete checkpoint at the new
size with the state bit-exact, repeat at most one checkpoint interval, and finish the run.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import GPT_WORKER, ROOT, torch_env

ELASTIC = ROOT / "launch" / "elastic.sh"
STEPS, EVERY = 12, 2
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) world (\d+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One torchrun agent running launch/elastic.sh, its output in a log file."""

    def __init__(self, name: str, tmp: Path, port: int, is_host: bool, *train_args: str) -> None:
        self.log = tmp / f"{name}.log"
        env = dict(
            torch_env(),
            RDZV_ENDPOINT=f"127.0.0.1:{port}",
            IS_HOST=str(int(is_host)),
            RDZV_ID=f"test-{port}",
            TRAIN_SCRIPT=str(GPT_WORKER),  # launch/train_gpt.py's job with the tests' hooks (snapshots, results)
        )
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", str(ELASTIC), *train_args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the agent and every worker: torchrun puts workers in sessions of their own."""
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.log.name} did not finish in {timeout} s:\n{self.output()[-4000:]}")


def _wait_for_step(nodes: list[Node], step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(f"step {step} loss" in n.output() for n in nodes):
        if time.monotonic() > deadline or any(n.proc.poll() is not None for n in nodes):
            for n in nodes:
                n.kill() if n.proc.poll() is None else None
            pytest.fail(f"training never reached step {step}:\n" + "\n".join(n.output()[-3000:] for n in nodes))
        time.sleep(0.1)


def _step_lines(nodes: list[Node]) -> list[tuple[int, float, int]]:
    """Every (step, loss, world) line rank 0 printed, whichever node it ran on."""
    return [(int(s), float(loss), int(w)) for n in nodes for s, loss, w in STEP_LINE.findall(n.output())]


def _check_resume(ckpt: Path, results: Path, nodes: list[Node], world_before: int, world_after: int) -> None:
    report = json.loads(results.read_text())
    resumed = report["resumed"]
    assert resumed["saved"] == f"zero1 dp={world_before} fp32" and resumed["live"] == f"zero1 dp={world_after} fp32"
    assert resumed["mode"] == "resharded"
    assert report["final_step"] == STEPS
    assert any(
        f"resumed from step {resumed['step']}: resharded zero1 dp={world_before} fp32 -> "
        f"zero1 dp={world_after} fp32, read in place" in n.output()
        for n in nodes
    )
    before = {s: loss for s, loss, w in _step_lines(nodes) if w == world_before}
    after = {e["step"]: e["loss"] for e in report["log"]}
    assert sorted(after) == list(range(resumed["step"] + 1, STEPS + 1)), "the run finishes every planned step"
    assert all(e["world"] == world_after for e in report["log"])
    last = max(before)
    assert last - resumed["step"] <= EVERY, f"{last - resumed['step']} steps repeated, more than one interval"
    assert resumed["step"] in before and resumed["step"] >= EVERY, "resumed from a checkpoint the job had made"
    for step in range(resumed["step"] + 1, last + 1):  # repeated steps continue from the pre-failure losses
        assert abs(after[step] - before[step]) <= 1e-5 * abs(before[step]), (step, after[step], before[step])

    saved = torch.load(ckpt / f"saved_step{resumed['step']}.pt", weights_only=False)
    restored = torch.load(ckpt / f"resumed_step{resumed['step']}.pt", weights_only=False)
    for kind in ("fp32", "state"):
        assert sorted(saved[kind]) == sorted(restored[kind]) and len(saved[kind]) >= 20
        for name in saved[kind]:
            assert torch.equal(saved[kind][name], restored[kind][name]), f"{kind} {name}"
    assert all(torch.equal(saved["steps"][g], restored["steps"][g]) for g in saved["steps"])


def _train_args(ckpt: Path, results: Path, delay: float) -> list[str]:
    return [
        "--ckpt-dir",
        str(ckpt),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--keep",
        "2",
        "--snapshots",
        "--step-delay",
        str(delay),
        "--results",
        str(results),
    ]


def test_node_lost_job_shrinks_and_resumes(tmp_path):
    ckpt, results, port = tmp_path / "ckpt", tmp_path / "results.json", _free_port()
    args = _train_args(ckpt, results, delay=0.5)
    host = Node("host", tmp_path, port, True, *args)
    time.sleep(1)  # the host agent serves the rendezvous store; the other one connects to it
    other = Node("other", tmp_path, port, False, *args)
    _wait_for_step([host, other], 5)
    other.kill()
    assert host.wait(timeout=240) == 0, host.output()[-4000:]
    _check_resume(ckpt, results, [host, other], world_before=4, world_after=2)


@pytest.mark.slow
def test_node_joins_job_grows_and_resumes(tmp_path):
    ckpt, results, port = tmp_path / "ckpt", tmp_path / "results.json", _free_port()
    args = _train_args(ckpt, results, delay=0.3)
    first = Node("first", tmp_path, port, True, *args)
    _wait_for_step([first], 3)
    joiner = Node("joiner", tmp_path, port, False, *args)
    assert first.wait(timeout=240) == 0, first.output()[-4000:]
    assert joiner.wait(timeout=60) == 0, joiner.output()[-4000:]
    _check_resume(ckpt, results, [first, joiner], world_before=2, world_after=4)
