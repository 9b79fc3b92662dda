"""A job that keeps its checkpoints on each node's own disk (`"use_node_local_storage": true`): two nodes of one rank,
each launched in a mount namespace of its own where its disk is mounted at the checkpoint folder, so neither sees
the other's files, as on two machines. Needs `unshare` and `mount` (a root shell here); skipped without them."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, torch_env, torchrun

WORKER = ROOT / "tests" / "workers" / "node_local.py"


def _namespaces() -> str | None:
    """Why nodes cannot be given disks of their own here, or None if they can."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount --bind / /mnt"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare: {exc}"
    return None if probe.returncode == 0 else f"unshare/mount refused: {probe.stderr.strip()[:200]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _on_two_nodes(mode: str, disks: list[Path], ckpt: Path, out: Path) -> None:
    """Run the worker's `mode` as two nodes of one rank, node k with `disks[k]` mounted at `ckpt`."""
    port = _free_port()
    procs = []
    for node, disk in enumerate(disks):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}"]
        torchrun += ["--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
        torchrun += [str(WORKER), mode, str(ckpt), str(out)]
        script = f"mount --bind {shlex.quote(str(disk))} {shlex.quote(str(ckpt))} && exec {shlex.join(torchrun)}"
        procs.append(
            subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                env=torch_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for node, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} of {mode}:\n" + "\n".join(output.splitlines()[-60:])


def test_a_node_local_save_resumes_at_its_layout_and_another_is_refused_by_name(tmp_path):
    """Each node's disk holds its own ranks' files and `latest` only rank 0's. rank 0 used to check every rank's files
    on its own disk and refuse the tag ("rank files are missing") that DeepSpeed's own load restores: now each rank
    checks the files it reads, the load goes through DeepSpeed's, and every state and the next losses are the
    uninterrupted run's. A resume at another layout, which would read other nodes' files, is refused by name, the
    engine as it was; so is a tag one of whose files is gone from the node whose rank reads it, on every rank."""
    why = _namespaces()
    if why is not None:
        pytest.skip(why)
    disks, ckpt = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "ckpt"
    for folder in (*disks, ckpt):
        folder.mkdir()
    _on_two_nodes("save", disks, ckpt, tmp_path)
    assert (disks[0] / "latest").exists() and not (disks[1] / "latest").exists()
    assert not (disks[0] / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    _on_two_nodes("load", disks, ckpt, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert "use_node_local_storage" in result["refused"] and "copy every node's tag folder" in result["refused"]
        assert result["unchanged"]
        assert result["differ"] == [] and result["losses"] == result["expected"], result
    gone = disks[1] / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    _on_two_nodes("missing", disks, ckpt, tmp_path)
    for rank in (0, 1):
        refused = json.loads((tmp_path / f"missing-{rank}.json").read_text())
        assert refused is not None and gone.name in refused and "is not on this node's disk" in refused, refused


def test_a_node_local_job_on_one_node_reshards_as_any_other(tmp_path):
    """The flag alone changes nothing where every rank sees the same files (one node, or a shared folder): a resume
    at another stage reshards, every state exact (a first cut of the node-local load refused it)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torchrun(2, "save", str(ckpt), str(tmp_path), worker=WORKER)
    torchrun(2, "reshard", str(ckpt), str(tmp_path), worker=WORKER)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"reshard-{rank}.json").read_text())
        assert result["differ"] == [] and "resharded" in result["how"], result
