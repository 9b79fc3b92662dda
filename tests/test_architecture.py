"""The package's layers import only downward, extensions only the core, and the `ucp` command stays light.

Layers, lowest first (docs/architecture.md): a module may import its own layer and those below it.
`compat` is the one seam to DeepSpeed, megatron-core and transformers internals; any layer may use it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ucp_deepspeed"
LAYERS = [
    {"errors", "version"},
    {"io"},
    {"compat"},
    {"geometry", "naming"},
    {"format", "sources"},
    {"convert"},
    {"runtime"},
    {"checkn_run", "hf", "interop"},
    {"tools", "run", "__init__", "mpu", "checkpoints"},  # the last two: deprecated aliases of old import paths
]
EXTENSIONS = {"checkn_run", "hf", "interop"}
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _part(module: str) -> str:
    """The top-level part of `ucp_deepspeed.<part>...`, or of a file's path inside the package."""
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every `ucp_deepspeed...` module imported anywhere in the file, lazily inside functions included."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ucp_deepspeed"):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "ucp_deepspeed" else [node.module]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("ucp_deepspeed")]
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[0].removesuffix(".py")
        if own not in RANK:
            bad.append(f"{rel}: part {own!r} has no layer in LAYERS")
            continue
        for line, target in _imports(path):
            other = _part(target)
            if other == own or other == "compat" or other not in RANK:
                continue
            if RANK[other] > RANK[own]:
                bad.append(f"{rel}:{line} imports {target} (layer {RANK[other]}) from layer {RANK[own]}")
            elif own in EXTENSIONS and other in EXTENSIONS:
                bad.append(f"{rel}:{line}: extension {own} imports extension {other}")
    return bad


def test_every_import_goes_down_the_layers():
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """A test that cannot fail is a defect: an io module importing the runtime must be reported."""
    fake = tmp_path / "ucp_deepspeed"
    (fake / "io").mkdir(parents=True)
    (fake / "io" / "bad.py").write_text("def f():\n    from ucp_deepspeed.runtime.engine import attach\n")
    (fake / "checkn_run").mkdir()
    (fake / "checkn_run" / "x.py").write_text("import ucp_deepspeed.hf.names\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = _violations()
    assert any("io/bad.py:2 imports ucp_deepspeed.runtime.engine" in v for v in found), found
    assert any("extension checkn_run imports extension hf" in v for v in found), found


@pytest.mark.parametrize("module", ["ucp_deepspeed.tools.cli", "ucp_deepspeed"])
def test_the_ucp_command_imports_no_training_framework(module):
    """`ucp convert|inspect|verify` run where DeepSpeed, megatron-core and transformers cost seconds to import."""
    code = (
        f"import sys, {module}; heavy = [m for m in ('deepspeed', 'megatron', 'transformers', 'accelerate') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
