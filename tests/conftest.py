"""Shared fixtures: torchrun launches on gloo/CPU and one set of saved source checkpoints per session."""

from __future__ import annotations

import contextlib
import enum
import functools
import glob
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from launching import ROOT, each, env, torchrun_command

WORKER = ROOT / "tests" / "workers" / "train_tiny.py"
GPT_WORKER = ROOT / "tests" / "workers" / "gpt.py"
SOURCE_DP = 2
SOURCE_VARIANTS = ("z1", "z2", "z3", "bf16z1", "bf16z2", "sgdz2", "z2nofrozen", "z1b", "z0", "offz2", "offz3")
SOURCE_VARIANTS += ("fusedz1", "adagradz0", "offadagradz2", "offlionz2", "bf16z1pad")
NVME_VARIANTS = ("nvmez3", "widez1")  # ZeRO-3 NVMe offload, and a model as wide in plain ZeRO-1


@functools.cache
def nvme_unavailable() -> str | None:
    """Why DeepSpeed's NVMe offload cannot run here (its `async_io` op needs libaio, which `.ci/install` installs
    where it can), or None."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return "DeepSpeed's async_io op cannot build here (libaio-dev missing): NVMe offload is not tested"


def _probe_once() -> None:
    """DeepSpeed's CPU probe (about 1.2 s a call, at every op load), run once per session: answered from memory
    in this process, and in every launch through tests/site/sitecustomize.py."""
    import cpuinfo

    probe = functools.cache(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = lambda: dict(probe())


_probe_once()


@functools.cache
def _cpu_info() -> str:
    """The CPU probe's answer, for tests/site/sitecustomize.py in every launch."""
    import cpuinfo

    return json.dumps(cpuinfo.get_cpu_info())


def torch_env(*paths: Path) -> dict[str, str]:
    """Environment for every launch (`launching.env`, `paths` first on PYTHONPATH), with the CPU probe measured once."""
    out = env(*paths, ROOT / "tests" / "site")
    out["UCP_TEST_CPU_INFO"] = _cpu_info()
    return out


def torchrun(
    nproc: int,
    *args: str,
    timeout: int = 300,
    attempts: int = 1,
    worker: Path = WORKER,
    module: str | None = None,
    paths: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess:
    """Run a test worker (tests/workers/) under `torchrun --standalone` (through `-m module` if given, with `paths`
    first on PYTHONPATH); fail the test with the output tail on error."""
    cmd = torchrun_command(nproc, *(["-m", module] if module else []), worker, *args)
    for attempt in range(1, attempts + 1):
        proc = subprocess.run(cmd, env=torch_env(*paths), capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return proc
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        if attempt < attempts:
            print(f"torchrun {' '.join(args)} failed on attempt {attempt}, retrying:\n{tail}", file=sys.stderr)
    pytest.fail(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{tail}")


def launch_jobs(world: int, jobs: list[list[str]], worker: Path = GPT_WORKER, attempts: int = 1) -> None:
    """Several runs of a test worker that takes `--each` (gpt.py, train_dlrm.py), each given as its own
    arguments, in one launch of `world` ranks: start-up (imports of torch, DeepSpeed, megatron-core, process
    groups) is paid once, not once per run."""
    torchrun(world, *each(jobs), worker=worker, attempts=attempts, timeout=120 + 180 * len(jobs))


def ds_to_universal(tag_dir: Path, out: Path, workers: int | None = None) -> Path:
    """DeepSpeed's own converter, as a user runs it (`--inject_missing_state`, which pipeline checkpoints need);
    `workers` extract and merge processes instead of its defaults."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(out),
        "--inject_missing_state",
        *(["--num_extract_workers", str(workers), "--num_merge_workers", str(workers)] if workers else []),
    ]
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def swap_pickle(path: Path, data: bytes) -> None:
    """Replace a real torch file's pickle with `data`, keeping its tensor records (the zip CRCs match)."""
    with zipfile.ZipFile(path) as zf:
        entries = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, content in entries:
            zf.writestr(name, data if name.endswith("data.pkl") else content)


class EnumsByName(pickle.Pickler):
    """Pickles an enum member as early Python 3.11 releases do (3.11.2, Debian 12's python3): `getattr(Enum, NAME)`."""

    def reducer_override(self, obj: object) -> object:
        return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented


def pickled_by_name(obj: object) -> bytes:
    """`obj` pickled (protocol 2, as torch.save writes) with every enum member by name (`EnumsByName`)."""
    buf = io.BytesIO()
    EnumsByName(buf, protocol=2).dump(obj)
    return buf.getvalue()


def popen_payload(target: Path) -> bytes:
    """The exploit of issue 17: a global under an allowed prefix whose dotted name is `subprocess.Popen`,
    called to create `target`."""
    args = pickle.dumps((["sh", "-c", f"touch {target}"],), protocol=2)[2:-1]
    return b"\x80\x02cdeepspeed.launcher.runner\nsubprocess.Popen\n" + args + b"R."


def case_args(cells: Iterable[tuple[str, Iterable[str]]], folder: Callable[[str], Path]) -> list[str]:
    """A load launch's `--case TARGET SOURCE...` arguments: each target with the checkpoints it loads in turn."""
    return [a for target, names in cells for a in ("--case", target, *(str(folder(n)) for n in names))]


def load_results(path: Path) -> list[dict]:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session", autouse=True)
def shared_memory_left_by_killed_ranks() -> Iterator[None]:
    """Remove DeepSpeed's shared-memory buffers (69 MB each in /dev/shm) that ranks this session SIGKILLed left
    behind: the elastic and torn-save tests kill ranks, which never unlink theirs."""
    pattern = "/dev/shm/deepspeed_allreduce_buffer_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.fixture(scope="session")
def saved_at_dp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch at dp=2 saves every source variant after three training steps, and before them (so nothing of ucp
    has touched DeepSpeed in those processes) the plain DeepSpeed checkpoints, under `plain/`."""
    out = tmp_path_factory.mktemp("sources")
    variants = SOURCE_VARIANTS + (() if nvme_unavailable() else NVME_VARIANTS)
    plain = ["save", "--plain", "--out", str(out / "plain"), "--variant", *PLAIN_VARIANTS]
    ucp = ["save", "--out", str(out), "--variant", *variants]
    # every test depends on this launch; one retry keeps a transient launcher failure from failing them all
    torchrun(SOURCE_DP, *each([plain, ucp]), attempts=2, timeout=480)
    return out


@pytest.fixture(scope="session")
def sources(saved_at_dp2: Path) -> dict[str, Path]:
    """Checkpoints of every source variant, saved through ucp_deepspeed."""
    return {name: saved_at_dp2 / name for name in SOURCE_VARIANTS + (() if nvme_unavailable() else NVME_VARIANTS)}


@pytest.fixture(scope="session")
def plain_sources(saved_at_dp2: Path) -> Path:
    """TinyLM (tied embedding, frozen parameter, buffer, client state) saved by plain DeepSpeed at dp=2: `z1`, `z3`,
    and in bf16 (how most users train) at ZeRO-1 with BF16_Optimizer, ZeRO-2 and ZeRO-3 (`bf16z*pad`)."""
    return saved_at_dp2 / "plain"


# The tiny LM's loads at dp=3, in one launch (`dp3_loads`): test_reshard.py's default dp=3 cells, test_load_paths.py's
# converted cells (target -> sources) and test_cross_framework.py's plain DeepSpeed checkpoints (target -> plain/...).
CONVERTED_CASES = {"z2": ("z1", "z3", "bf16z2"), "offz2": ("offz3",), "sgdz1": ("sgdz2",)}
PLAIN_CASES = {
    "z1": ("z1", "z3"),
    "z3": ("z1",),
    "z2": ("z0",),  # a torch optimizer's numbered state, named by the loading engine's groups
    "z0": ("z0",),
    "bf16z2pad": ("bf16z1pad", "bf16z3pad"),
    "bf16z1pad": ("bf16z2pad",),
    "bf16z3pad": ("bf16z1pad",),
}
PLAIN_VARIANTS = ("z1", "z3", "z0", "bf16z1pad", "bf16z2pad", "bf16z3pad")


@dataclass(frozen=True)
class Dp3Loads:
    """Results of the shared dp=3 launch (`reshard.json`, `plain.json`, `converted.json`, `errors.json` in `out`),
    and the damaged copy of `z1` the error run loaded (a flipped byte in rank 1's optimizer file)."""

    out: Path
    damaged: Path
    flipped: Path
    converted_cases: dict[str, tuple[str, ...]]


@pytest.fixture(scope="session")
def dp3_loads(sources, plain_sources, tmp_path_factory: pytest.TempPathFactory) -> Dp3Loads:
    """One 3-rank launch for four runs: test_reshard.py's default dp=3 cells, the plain DeepSpeed checkpoints loaded
    directly (test_cross_framework.py), the converted path's cells (`--converted`), and the direct path's failures
    (`--expect-error`: a flipped byte in a rank file, a RuntimeError and a MemoryError injected on rank 1, a slow
    rank 0; test_load_paths.py)."""
    from test_reshard import cells as reshard_cells  # the matrix stays in its module; its launch is shared

    out = tmp_path_factory.mktemp("dp3_loads")
    cases = dict(CONVERTED_CASES)
    if not nvme_unavailable():
        cases["nvmez3"] = ("nvmez3",)
    damaged = out / "z1"
    shutil.copytree(sources["z1"], damaged, ignore=shutil.ignore_patterns("*.universal"))
    flipped = damaged / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    healthy = str(sources["z1"])

    plain = ["load", *case_args(PLAIN_CASES.items(), lambda n: plain_sources / n), "--results", str(out / "plain.json")]
    converted = [
        "load",
        "--converted",
        *case_args(cases.items(), lambda n: sources[n]),
        "--results",
        str(out / "converted.json"),
    ]
    errors = ["load", "--expect-error", "--variant", "z2", "--results", str(out / "errors.json"), "--source"]
    errors += [str(damaged), f"{healthy}!RuntimeError", f"{healthy}!MemoryError", f"{healthy}!slow"]
    reshard = ["load", *case_args(reshard_cells(3, False), sources.__getitem__), "--results", str(out / "reshard.json")]
    torchrun(3, *each([reshard, plain, converted, errors]), timeout=600)
    return Dp3Loads(out, damaged, flipped, cases)


# Every megatron-core source checkpoint of the suite: name -> (world size, layout arguments).
# Layouts are `--arch --zero --tp --pp` (DP is the rest of the world size); `moe-*` adds megatron-core MoE
# (4 experts, top-2, SequentialMLP) at an expert-parallel size.
MEGATRON_SOURCES: dict[str, tuple[int, list[str]]] = {
    "gpt-z1-tp2": (2, ["--arch", "gpt", "--zero", "1", "--tp", "2", "--pp", "1"]),
    "gpt-z1-pp2": (2, ["--arch", "gpt", "--zero", "1", "--tp", "1", "--pp", "2"]),
    # the layers as megatron-core's Transformer Engine spec names them (tests/workers/te_names.py)
    "gpt-te-z1-tp2": (2, ["--arch", "gpt", "--zero", "1", "--tp", "2", "--pp", "1", "--te-names"]),
    "gpt-z2-tp2dp2": (4, ["--arch", "gpt", "--zero", "2", "--tp", "2", "--pp", "1"]),
    "llama-z1-tp2pp2": (4, ["--arch", "llama", "--zero", "1", "--tp", "2", "--pp", "2"]),
    "llama-z1-dp4": (4, ["--arch", "llama", "--zero", "1", "--tp", "1", "--pp", "1"]),
    "llama-z1-dp2": (2, ["--arch", "llama", "--zero", "1", "--tp", "1", "--pp", "1"]),
    "llama-z3-tp2": (2, ["--arch", "llama", "--zero", "3", "--tp", "2", "--pp", "1"]),
    "moe-z1-ep2": (2, ["--arch", "llama", "--zero", "1", "--moe", "--ep", "2"]),
    "moe-z1-ep1": (1, ["--arch", "llama", "--zero", "1", "--moe", "--ep", "1"]),
    "moe-z2-ep2-w4": (4, ["--arch", "llama", "--zero", "2", "--moe", "--ep", "2"]),
}


class OnDemand(Mapping[str, Path]):
    """Checkpoints saved by shared launches, each launch run the first time a test asks for one of its checkpoints:
    a run of the default tests pays only for the launches they read (the `slow` ones read the rest). `group(name)`
    is the launch a checkpoint comes from, `launch(group)` runs it; a failed launch fails every later request for
    it with its output, without running again."""

    def __init__(self, out: Path, names: list[str], group: Callable[[str], Any], launch: Callable[[Any], None]):
        self.out, self.names, self.group, self.launch = out, names, group, launch
        self.done: dict[Any, str | None] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.names:
            raise KeyError(name)
        key = self.group(name)
        if key not in self.done:
            self.done[key] = f"the launch that saves {name} did not finish"
            try:
                self.launch(key)
            except BaseException as exc:
                self.done[key] = f"the launch that saves {name} failed:\n{exc}"[-6000:]
                raise
            self.done[key] = None
        failure = self.done[key]
        if failure is not None:
            pytest.fail(failure)
        return self.out / name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@pytest.fixture(scope="session")
def megatron_sources(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """Every megatron-core source, trained 3 steps and saved once per session: one launch per world size, run when a
    test first reads one of its sources."""
    out = tmp_path_factory.mktemp("megatron_sources")

    def launch(world: int) -> None:
        runs = [
            ["save", *layout, "--out", str(out / name)] for name, (w, layout) in MEGATRON_SOURCES.items() if w == world
        ]
        launch_jobs(world, runs, attempts=2)

    return OnDemand(out, list(MEGATRON_SOURCES), lambda name: MEGATRON_SOURCES[name][0], launch)
