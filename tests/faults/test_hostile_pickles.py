"""No code from a checkpoint file runs: crafted pickles on every reading path, and generated ones.

Each payload names a global that would run something (a shell command, the `canary` module) or
tries an opcode that sets state on a class, builds an object the file chose, or reaches the
extension registry. Every one must be refused with an error naming the file, on every path that
reads files: the torch-archive reader (convert, inspect, verify, diff), universal folders' state
files, and DeepSpeed's own load through `native_io.safe_load`. A property test generates pickle
programs from many opcodes and globals and asserts the same. Opting in is exact: a global named in
UCP_ALLOW_PICKLE is allowed, a prefix of it is not.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import canary
import numpy as np
import pytest
import torch
from conftest import swap_pickle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucp_deepspeed import CheckpointError, UniversalCheckpoint, convert
from ucp_deepspeed.format.universal import MANIFEST, STATE, record_bytes
from ucp_deepspeed.io.safe_pickle import ALLOW_ENV
from ucp_deepspeed.io.torch_file import TorchFile
from ucp_deepspeed.runtime.native_io import safe_load
from ucp_deepspeed.tools.cli import main as ucp

TAG = "global_step3"


@pytest.fixture(autouse=True)
def armed(tmp_path, monkeypatch) -> Path:
    """Where the canary and shell payloads leave a trace if anything runs."""
    trace = tmp_path / "canary.log"
    monkeypatch.setenv(canary.ENV, str(trace))
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    yield trace
    assert not trace.exists(), "code from a checkpoint file ran"
    assert not (tmp_path / "pwned").exists(), "a shell command from a checkpoint file ran"


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _args(*values: object) -> bytes:
    return pickle.dumps(values, protocol=2)[2:-1]  # the tuple, without PROTO and STOP


def _str(text: str) -> bytes:
    return pickle.dumps(text, protocol=2)[2:-1]


def _program(*parts: bytes, proto: int = 2) -> bytes:
    return bytes([0x80, proto]) + b"".join(parts) + b"."


def payloads(tmp_path: Path) -> dict[str, bytes]:
    """Hand-made hostile pickles: each would run `touch pwned` or the canary if it were obeyed."""
    touch = f"touch {tmp_path / 'pwned'}"
    shell = ["sh", "-c", touch]
    stack_global = pickle.dumps("canary", 4)[2:-1] + pickle.dumps("fire", 4)[2:-1] + b"\x93"
    return {
        "dotted name under an allowed prefix": _program(
            _global("deepspeed.launcher.runner", "subprocess.Popen"), _args(shell), b"R"
        ),
        "os.system": _program(_global("os", "system"), _args(touch), b"R"),
        "posix.system": _program(_global("posix", "system"), _args(touch), b"R"),
        "builtins.eval": _program(_global("builtins", "eval"), _args(f"__import__('os').system({touch!r})"), b"R"),
        "__builtin__.getattr": _program(
            _global("__builtin__", "getattr"), _global("os", "path"), _str("join"), b"\x86R"
        ),
        # getattr reads only an enum member by name (as early Python 3.11 pickles one), nothing else of anything
        "getattr of a method of the ZeRO stage enum": _program(
            _global("__builtin__", "getattr"),
            _global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
            _str("_missing_"),
            b"\x86R",
            _args(3),
            b"R",
        ),
        "getattr with one argument": _program(_global("builtins", "getattr"), _args("weights"), b"R"),
        # a name quoting torch's own refusal, so that a message read off the whole text would name os.system
        "getattr quoting a refusal": _program(
            _global("__builtin__", "getattr"),
            _global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
            _str("x Unsupported global: GLOBAL os.system was not an allowed global by default."),
            b"\x86R",
        ),
        # torch lets a pickle set state on an allowed class's instance: here the process's one ZeroStageEnum member
        "state set on the ZeRO stage": _program(
            _global("deepspeed.runtime.zero.config", "ZeroStageEnum"), _args(3), b"R}", _str("_value_"), b"K\x00sb"
        ),
        "a global from a module named with a dash": _program(_global("my-pkg.mod", "Thing"), b")R"),
        "getattr of an allowed class's method": _program(
            _global("builtins", "getattr"), _global("collections", "OrderedDict"), _str("fromkeys"), b"\x86R"
        ),
        "getattr of a stand-in's class field": _program(
            _global("builtins", "getattr"),
            _global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            _str("__init__"),
            b"\x86R",
        ),
        "dotted attribute of an allowed class": _program(
            _global("collections", "OrderedDict.fromkeys"), _args([1]), b"R"
        ),
        "torch submodule by dotted name": _program(_global("torch", "nn.Module"), b")R"),
        "torch.load": _program(_global("torch", "load"), _args(str(tmp_path / "x.pt")), b"R"),
        "the canary by STACK_GLOBAL": _program(stack_global, b")R", proto=4),
        "the canary by INST": b"(" + b"i" + b"canary\nfire\n.",
        "the canary's class by NEWOBJ": _program(_global("canary", "Boom"), b")\x81"),
        "a registered extension code": _program(b"\x82\xf0", b")R"),
        "state set on an allowed class": _program(
            _global("collections", "OrderedDict"), b"N}", _str("__eq__"), _global("builtins", "set"), b"s\x86b"
        ),
        "a stand-in class given state": _program(
            _global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            b"N}",
            _str("qualname"),
            _str("os.system"),
            b"s\x86b",
        ),
        "_rebuild_from_type_v2 calling set": _program(
            _global("torch._tensor", "_rebuild_from_type_v2"),
            b"(",
            _global("builtins", "set"),
            _global("torch", "Tensor"),
            _args([1, 2]),
            b"NtR",
        ),
        "a codec that imports a module": _program(_global("_codecs", "encode"), _args("x", "zlib_codec"), b"R"),
        "a numpy object array": _program(_global("numpy", "dtype"), _args("O8", False, True), b"R"),
        # a number dtype given a sub-array: a scalar of 8 bytes would read a megabyte past them
        "an int64 dtype given a sub-array": _program(
            _global("numpy._core.multiarray", "scalar"),
            b"(",
            _global("numpy", "dtype"),
            _args("i8", False, True),
            b"R",
            _args(3, "<", (np.dtype("i8"), (1 << 17,)), None, None, -1, -1, 0),
            b"b",
            pickle.dumps(b"\0" * 8, protocol=2)[2:-1],
            b"tR",
        ),
        # a number dtype given the flags of one that holds objects: its array's bytes would be pointers
        "an int64 dtype given object flags": _program(
            _global("numpy", "dtype"), _args("i8", False, True), b"R", _args(3, "<", None, None, None, -1, -1, 63), b"b"
        ),
        # a flexible dtype takes its flags from the state: these say it holds objects, so bytes would be pointers
        "a void dtype given object flags": _program(
            _global("numpy", "dtype"), _args("V8", False, True), b"R", _args(3, "|", None, None, None, 8, 1, 63), b"b"
        ),
        "a huge bytes allocation": _program(_global("builtins", "bytearray"), _args(10**12), b"R"),
        "a text persistent id": _program(b"Pcanary\n"),
    }


def torch_archive(path: Path, pickle_bytes: bytes) -> Path:
    """A zip archive laid out like torch.save's, with the given pickle as its data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


def test_every_payload_is_refused_by_the_archive_reader(tmp_path):
    copyreg.add_extension("canary", "fire", 240)  # so the extension code would reach the canary if read
    try:
        for label, data in payloads(tmp_path).items():
            path = torch_archive(tmp_path / f"{abs(hash(label))}.pt", data)
            with pytest.raises(CheckpointError) as err:
                TorchFile(str(path))
            assert err.value.path == str(path), label
    finally:
        copyreg.remove_extension("canary", "fire", 240)


# each payload DeepSpeed's own load is given, and what its one-line refusal must say
OWN_LOAD_REFUSALS = {
    "dotted name under an allowed prefix": "'deepspeed.launcher.runner.subprocess.Popen'",
    "posix.system": "refusing to unpickle global 'posix.system': torch never loads from module posix",
    "builtins.eval": "'builtins.eval'",  # torch names it `eval`
    "a global from a module named with a dash": "'my-pkg.mod.Thing'",
    "getattr of a method of the ZeRO stage enum": "getattr(ZeroStageEnum, '_missing_'): not a member of an enum",
    "getattr of an allowed class's method": "getattr(OrderedDict, 'fromkeys'): not a member of an enum",
    "getattr quoting a refusal": "not a member of an enum",
    "getattr with one argument": "getattr with 1 arguments",
    "state set on the ZeRO stage": "cannot unpickle",
    "the canary by STACK_GLOBAL": "cannot unpickle (Unsupported operand 149)",  # torch reads no STACK_GLOBAL
    "the canary's class by NEWOBJ": "'canary.Boom'",
    "state set on an allowed class": "cannot unpickle",
}


@pytest.mark.parametrize("label", OWN_LOAD_REFUSALS)
def test_deepspeeds_own_load_refuses_payloads(tmp_path, label):
    """The same-topology load hands files to DeepSpeed, which reads them through `safe_load`: each payload is refused
    in one line that says what (never torch's advice to load the file unsafely), and the process is left as it was."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = torch_archive(tmp_path / "mp_rank_00_model_states.pt", payloads(tmp_path)[label])
    with pytest.raises(CheckpointError) as err:
        safe_load(str(path))
    message = str(err.value)
    assert err.value.path == str(path) and OWN_LOAD_REFUSALS[label] in message, message
    assert "\n" not in message and "weights_only" not in message and "os.system" not in message, message
    if "never loads" in message:  # allowing a global torch blocks would change nothing
        assert ALLOW_ENV not in message
    members = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3}
    assert {m.name: m.value for m in ZeroStageEnum} == members


def test_trusting_a_checked_global_keeps_it_checked(tmp_path, monkeypatch):
    """`UCP_ALLOW_PICKLE=builtins.getattr` (what a refusal of getattr used to suggest) does not hand either reader the
    real getattr: both still give only an enum member by name, and say so in a bounded line."""
    monkeypatch.setenv(ALLOW_ENV, "builtins.getattr,__builtin__.getattr")
    for label in ("getattr of an allowed class's method", "getattr of a stand-in's class field"):
        path = torch_archive(tmp_path / f"{abs(hash(label))}.pt", payloads(tmp_path)[label])
        for read in (TorchFile, safe_load):
            with pytest.raises(CheckpointError, match="not a member of an enum"):
                read(str(path))
    long_name = _program(_global("builtins", "getattr"), _global("collections", "OrderedDict"), _str("x" * 100_000))
    path = torch_archive(tmp_path / "long.pt", long_name[:-1] + b"\x86R.")
    for read in (TorchFile, safe_load):
        with pytest.raises(CheckpointError) as err:
            read(str(path))
        assert len(str(err.value)) < 400, len(str(err.value))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_cli_commands_refuse_a_crafted_rank_file(sources, tmp_path, capsys, victim):
    """The original exploit, in a real checkpoint: convert, inspect, verify and diff all refuse it."""
    src = tmp_path / "z1"
    shutil.copytree(sources["z1"], src, ignore=shutil.ignore_patterns("*.universal", "*.lock"))
    swap_pickle(src / TAG / victim, payloads(tmp_path)["dotted name under an allowed prefix"])
    before = tree_digest(src)
    for command in (
        ["convert", str(src), "--output", str(tmp_path / "out"), "--no-progress"],
        ["inspect", str(src)],
        ["verify", str(src)],
        ["diff", str(src), str(sources["z1"])],
    ):
        assert ucp(command) == 2, command
        err = capsys.readouterr().err
        assert victim in err and "refusing to unpickle global 'deepspeed.launcher.runner.subprocess.Popen'" in err, err
    assert tree_digest(src) == before
    assert not (tmp_path / "out").exists()


def test_universal_state_file_payload_is_refused(sources, tmp_path):
    """A universal folder whose state.pt was replaced, with the manifest's CRCs updated to match."""
    out = Path(convert(str(sources["z1"]), output=str(tmp_path / "u"), progress=False))
    data = torch_archive(tmp_path / "evil.pt", payloads(tmp_path)["os.system"]).read_bytes()
    (out / STATE).write_bytes(data)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][STATE] = record_bytes(STATE, data).to_json()
    (out / MANIFEST).write_text(json.dumps(manifest))
    ckpt = UniversalCheckpoint(str(out))
    assert ckpt.verify() == []  # the CRCs match: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match="refusing to unpickle global 'os.system'") as err:
        ckpt.load_state()
    assert err.value.path.endswith(STATE)


def test_opting_in_is_exact(tmp_path, monkeypatch, armed):
    """UCP_ALLOW_PICKLE names whole globals: a prefix or a module wildcard allows nothing."""
    path = torch_archive(tmp_path / "c.pt", _program(_global("canary", "fire"), b")R"))
    for spelling in ("canary.fir", "canary", "canary.*", "canar.fire", " canary.fire.x"):
        monkeypatch.setenv(ALLOW_ENV, spelling)
        with pytest.raises(CheckpointError, match="refusing to unpickle global 'canary.fire'"):
            TorchFile(str(path))
    monkeypatch.setenv(ALLOW_ENV, "canary.fire")
    assert TorchFile(str(path)).obj == 0
    assert armed.read_text() == "fired\n"  # the user trusted it, so it ran
    armed.unlink()


def test_real_files_still_read(sources):
    """The allow-list covers what DeepSpeed, torch and numpy write: every source rank file opens."""
    for path in sorted(Path(sources["z1"], TAG).glob("*.pt")) + sorted(Path(sources["bf16z1"], TAG).glob("*.pt")):
        TorchFile(str(path)).close()
        safe_load(str(path))


# Globals a generated pickle may name: dangerous ones, look-alikes, and every allowed one.
POOL = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("__builtin__", "apply"),
    ("subprocess", "Popen"),
    ("canary", "fire"),
    ("canary", "Boom"),
    ("torch", "load"),
    ("torch.serialization", "load"),
    ("functools", "partial"),
    ("operator", "attrgetter"),
    ("copyreg", "_reconstructor"),
    ("pickle", "loads"),
    ("numpy", "load"),
    ("torch._utils", "_rebuild_tensor"),
    ("deepspeed", "runtime.engine.DeepSpeedEngine"),
    ("deepspeed.launcher.runner", "subprocess.Popen"),
    ("collections", "OrderedDict.fromkeys"),
    ("torch", "nn.Module"),
    ("importlib", "import_module"),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "bytes"),
    ("builtins", "bytearray"),
    ("builtins", "slice"),
    ("__builtin__", "frozenset"),
    ("_codecs", "encode"),
    ("argparse", "Namespace"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "float32"),
    ("torch", "Tensor"),
    ("torch", "FloatStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
]

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(0, 9), max_size=3),
    st.sampled_from(["touch pwned", "latin1", "rot13", "O8", "f4", "cpu", "storage", "0"]),
)
_ops = st.one_of(
    st.sampled_from(POOL).map(lambda g: _global(*g)),
    st.sampled_from(POOL).map(lambda g: pickle.dumps(g[0], 4)[2:-1] + pickle.dumps(g[1], 4)[2:-1] + b"\x93"),
    _values.map(lambda v: pickle.dumps(v, 2)[2:-1]),
    st.sampled_from(
        [
            b"R",
            b"b",
            b"\x81",
            b"\x92",
            b"(",
            b"t",
            b")",
            b"\x85",
            b"\x86",
            b"\x87",
            b"}",
            b"]",
            b"s",
            b"u",
            b"a",
            b"e",
            b"0",
            b"2",
            b"1",
            b"Q",
            b"\x94",
            b"h\x00",
            b"q\x00",
            b"\x82\x01",
            b"\x97",
            b"\x98",
            b"o",
            b"icanary\nfire\n",
            b"Pcanary\n",
            b"N",
            b"\x88",
            b"\x89",
        ]
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_ops, min_size=1, max_size=14), st.sampled_from([2, 4, 5]))
def test_generated_pickles_run_nothing(tmp_path_factory, ops, proto):
    """Whatever a pickle does, the reader returns data or refuses with the file named; nothing runs."""
    root = tmp_path_factory.mktemp("fuzz")
    trace = root / "canary.log"
    os.environ[canary.ENV] = str(trace)
    path = torch_archive(root / "f.pt", _program(*ops, proto=proto))
    cwd = os.getcwd()
    os.chdir(root)  # a "touch pwned" that ran would land here
    try:
        try:
            TorchFile(str(path)).close()
        except CheckpointError as exc:
            assert exc.path == str(path)
    finally:
        os.chdir(cwd)
    assert not trace.exists() and not (root / "pwned").exists()


def test_a_real_archive_round_trips_through_the_reader(tmp_path):
    """The reader returns what torch.save wrote (lazily), for the kinds of values checkpoints hold."""
    import numpy as np

    value = {
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "s": {1, 2},
        "b": b"\x00\xff",
        "e": b"",
        "n": np.arange(3, dtype=np.uint32),
        "size": torch.Size([2, 3]),
        "dt": torch.bfloat16,
        "dev": torch.device("cpu"),
        "sl": slice(1, 5),
        "c": 1 + 2j,
    }
    buf = io.BytesIO()
    torch.save(value, buf)
    path = tmp_path / "ok.pt"
    path.write_bytes(buf.getvalue())
    tfile = TorchFile(str(path))
    obj = tfile.obj
    assert torch.equal(obj["t"].load(), value["t"]) and obj["s"] == {1, 2} and obj["b"] == b"\x00\xff"
    assert obj["e"] == b"" and np.array_equal(obj["n"], value["n"]) and obj["size"] == torch.Size([2, 3])
    assert obj["dt"] is torch.bfloat16 and obj["dev"] == torch.device("cpu") and obj["sl"] == slice(1, 5)
    tfile.check_reads()
    assert struct.calcsize("<Q") == 8
