"""Faults during conversion, run through the `ucp` command as a user would: a flipped byte in a source
file, a SIGKILL mid-way, a full disk, two converters at once, a read-only output folder. Each ends in a
clear message (or a clean wait), the source is unchanged, and no half-written output looks finished."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import torch_env

from ucp_deepspeed import UniversalCheckpoint, convert
from ucp_deepspeed.format.universal import MANIFEST
from ucp_deepspeed.tools.cli import main as cli_main
from ucp_deepspeed.tools.compare import diff

SHIM = Path(__file__).with_name("shim.py")
TAG = "global_step3"
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def ucp(
    *args: str, fault: tuple[str, float | Path] | None = None, prefix: tuple[str, ...] = (), wait: bool = True
) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [
        *prefix,
        sys.executable,
        *([str(SHIM), fault[0], str(fault[1])] if fault else ["-m", "ucp_deepspeed.tools.cli"]),
        *args,
    ]
    if not wait:
        return subprocess.Popen(cmd, env=torch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def source(sources, tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(sources["z1"], dst, ignore=shutil.ignore_patterns("*.universal", "*.lock"))
    return dst


def _unfinished(out: Path) -> None:
    assert not (out / MANIFEST).exists(), "a half-written conversion must not look finished"
    assert not [p for p in out.rglob("*") if ".tmp." in p.name], "temporary files are cleaned up"


def test_flipped_byte_in_a_source_file_is_found(source, tmp_path, capsys):
    """`ucp verify` and `ucp convert` in this process (the command's own entry point), and `convert --procs 2`,
    whose child processes read the damaged bytes, as a command of its own."""
    path = source / TAG / OPTIM
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the flat fp32 partition
    path.write_bytes(bytes(data))
    before = digest(source)
    assert cli_main(["verify", str(source)]) == 1
    checked = capsys.readouterr().out
    assert f"{OPTIM}: record" in checked and "crc32" in checked
    # every byte read is checked: in this process, in child processes (--procs), and by a rerun that would reuse
    # the files the first run made from the damaged bytes before its check failed
    for out, split in (("out", []), ("split", ["--procs", "2"]), ("out", [])):
        command = ["convert", str(source), "--output", str(tmp_path / out), *split]
        if split:
            refused = ucp(*command)
            code, err = refused.returncode, refused.stderr
        else:
            code, err = cli_main(command), capsys.readouterr().err
        assert code == 2 and "fails its crc32 check" in err and OPTIM in err
        assert not (tmp_path / out / MANIFEST).exists() and digest(source) == before


def test_conversion_killed_midway_is_never_used_and_a_rerun_finishes(source, tmp_path):
    out = tmp_path / "out"
    before = digest(source)
    proc = ucp("convert", str(source), "--output", str(out), "--workers", "1", fault=("slow", 0.5), wait=False)
    deadline = time.monotonic() + 120
    while not ((out / "params").is_dir() and any((out / "params").glob("*.safetensors"))):
        assert time.monotonic() < deadline and proc.poll() is None, "conversion never wrote its first file"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _unfinished(out)
    with pytest.raises(Exception, match="manifest missing"):
        UniversalCheckpoint(str(out))
    rerun = ucp("convert", str(source), "--output", str(out))
    assert rerun.returncode == 0, rerun.stderr
    assert UniversalCheckpoint(str(out)).verify() == []
    assert diff(str(source), str(out)).identical
    assert digest(source) == before


def test_disk_full_during_conversion(source, tmp_path):
    out = tmp_path / "out"
    before = digest(source)
    full = ucp("convert", str(source), "--output", str(out), "--workers", "1", fault=("enospc", 20000))
    assert full.returncode == 2, full.stderr
    assert "No space left on device" in full.stderr and str(out) in full.stderr
    assert "Traceback" not in full.stderr
    _unfinished(out)
    assert digest(source) == before
    rerun = ucp("convert", str(source), "--output", str(out))  # space freed: the same command finishes
    assert rerun.returncode == 0 and UniversalCheckpoint(str(out)).verify() == []


def test_two_converters_at_once_take_turns(source, tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    # the first converter holds the folder until the second has said it waits: no race on a slow host
    first = ucp("convert", str(source), "--output", str(out), "--workers", "1", fault=("hold", go), wait=False)
    deadline = time.monotonic() + 120
    while not (out / ".ucp_source.json").exists():
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    second = ucp("convert", str(source), "--output", str(out), wait=False)
    said = []
    for line in second.stderr:
        said.append(line)
        if "being written by another conversion; waiting" in line:
            break
    go.touch()
    _, first_err = first.communicate(timeout=300)
    _, second_err = second.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert second.returncode == 0, "".join(said) + second_err
    assert "being written by another conversion; waiting" in "".join(said)
    assert UniversalCheckpoint(str(out)).verify() == [] and diff(str(source), str(out)).identical


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root needs setpriv to drop DAC override")
def test_read_only_output_folder(source, tmp_path):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    before = digest(source)
    prefix = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search") if os.geteuid() == 0 else ()
    try:
        refused = ucp("convert", str(source), "--output", str(parent / "out"), prefix=prefix)
    finally:
        parent.chmod(0o755)
    assert refused.returncode == 2 and "Permission denied" in refused.stderr and str(parent) in refused.stderr
    assert "Traceback" not in refused.stderr
    assert list(parent.iterdir()) == [] and digest(source) == before
    assert Path(convert(str(source), output=str(parent / "out"), progress=False)).joinpath(MANIFEST).exists()
