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
    {"errors", "version", "protocols"},
    {"io"},
    {"compat"},
    {"geometry", "naming"},
    {"format", "sources"},
    {"convert"},
    {"runtime"},
    {"checkn_run", "hf", "interop"},
    {"torchrec"},  # Check-N-Run and universal checkpoints for TorchRec's models: built on the checkn_run extension
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
    """A test that cannot fail is a defect: an io module importing the runtime must be reported, and so must a module of
    the `compat` package importing a layer above it (any layer may import `compat`, not the reverse)."""
    fake = tmp_path / "ucp_deepspeed"
    (fake / "io").mkdir(parents=True)
    (fake / "io" / "bad.py").write_text("def f():\n    from ucp_deepspeed.runtime.engine import attach\n")
    (fake / "checkn_run").mkdir()
    (fake / "checkn_run" / "x.py").write_text("import ucp_deepspeed.hf.names\n")
    (fake / "compat").mkdir()
    (fake / "compat" / "zero.py").write_text("from ucp_deepspeed.naming.model import infos\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = _violations()
    assert any("compat/zero.py:1 imports ucp_deepspeed.naming.model" in v for v in found), found
    assert any("io/bad.py:2 imports ucp_deepspeed.runtime.engine" in v for v in found), found
    assert any("extension checkn_run imports extension hf" in v for v in found), found


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """The package's modules a file imports when it runs (inside functions too, not under `if TYPE_CHECKING:`),
    with the packages each import runs first (not the top one, which imports everything)."""
    known = {_module_of(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ucp_deepspeed"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(subs or {node.module})
            named.update(subs)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ucp_deepspeed"))
            named.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    named: set[str] = set()
    visit(ast.parse(path.read_text()))
    # a package imported by name (`from ucp_deepspeed import compat`) hands out its modules' names, which it may
    # import only at their first use (PEP 562): count them all
    lazy = {m for m in known for pkg in named & known if m.startswith(pkg + ".") and pkg.count(".") == 1}
    return {".".join(m.split(".")[:i]) for m in (found | lazy) & known for i in range(2, m.count(".") + 2)} & known


def _cycles_across_parts() -> list[list[str]]:
    """Each set of modules that import one another in a ring (a strongly connected component of the import graph)
    and span more than one part of the package."""
    graph = {_module_of(p): _runtime_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    rings: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            ring = []
            while True:
                member = stack.pop()
                ring.append(member)
                if member == node:
                    break
            if len({_part(m) for m in ring}) > 1:
                rings.append(sorted(ring))

    for node in graph:
        if node not in index:
            connect(node)
    return rings


def test_no_import_ring_crosses_parts():
    """Debt 12 of issue 65: `io.remote` reached `compat`, whose package imported `compat.torch`, which imports
    `io.storage`, which imports `io.remote`: the lowest layer imported itself back through the one above it."""
    assert _cycles_across_parts() == []


def test_the_ring_check_catches_a_ring(tmp_path, monkeypatch):
    """The ring of before: a `compat` package that imports its modules eagerly, one of which imports `io.storage`."""
    fake = tmp_path / "ucp_deepspeed"
    (fake / "io").mkdir(parents=True)
    (fake / "compat").mkdir()
    (fake / "io" / "storage.py").write_text("from ucp_deepspeed.io import remote\n")
    (fake / "io" / "remote.py").write_text("def f():\n    from ucp_deepspeed.compat.s3fs import s3_read_into\n")
    (fake / "compat" / "__init__.py").write_text("from ucp_deepspeed.compat.torch import x\n")
    (fake / "compat" / "torch.py").write_text("def x():\n    from ucp_deepspeed.io import storage\n")
    (fake / "compat" / "s3fs.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    ring = ["ucp_deepspeed.compat", "ucp_deepspeed.compat.torch", "ucp_deepspeed.io.remote", "ucp_deepspeed.io.storage"]
    assert _cycles_across_parts() == [ring]
    (fake / "compat" / "__init__.py").write_text("if TYPE_CHECKING:\n    from ucp_deepspeed.compat.torch import x\n")
    assert _cycles_across_parts() == []
    # a lazy package is still a ring when io names it and uses its names
    (fake / "io" / "remote.py").write_text("from ucp_deepspeed import compat\n")
    assert _cycles_across_parts() == [ring[1:]]


@pytest.mark.parametrize("module", ["ucp_deepspeed.tools.cli", "ucp_deepspeed"])
def test_the_ucp_command_imports_no_training_framework(module):
    """`ucp convert|inspect|verify` run where DeepSpeed, megatron-core and transformers cost seconds to import."""
    code = (
        f"import sys, {module}; heavy = [m for m in ('deepspeed', 'megatron', 'transformers', 'accelerate') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


FILESYSTEM = {
    "open",
    "os.open",
    "os.replace",
    "os.rename",
    "os.unlink",
    "os.remove",
    "os.listdir",
    "os.makedirs",
    "os.walk",
    "os.stat",
    "os.scandir",
    "os.pread",
    "os.preadv",
    "os.fsync",
    "os.symlink",
}
FILESYSTEM_MODULES = ("os.path.", "shutil.", "glob.")
LOCAL_FILES = {
    "compat/deepspeed.py": "DeepSpeed's recovery scripts, read from its own package",
    "runtime/config.py": "the ds_config file the user names",
    "naming/rules.py": "a layout-rules file the user names",
    "run.py": "the training script's folder, put on sys.path",
    "runtime/integrations.py": "the Trainer reads RNG files from a local folder: the one to restore is linked there",
    "hf/import_.py": "a Hugging Face model folder, read with safetensors' own reader",
    "hf/models.py": "a Hugging Face model folder's config.json",
    "runtime/write_worker.py": "its own threads, listed in /proc/self/task to bind each to the CPUs it is given",
}
"""The modules above `io` that may touch the local filesystem themselves, and why: none of them reads or writes a
checkpoint file; every checkpoint object goes through `io.storage`."""
STORE_SIDE = {"io/policy.py", "io/blob.py", "io/backend.py", "io/remote.py"}
"""The storage modules that serve every backend, or a store's alone, and so may not touch the local filesystem either:
of the storage layer only `io/local.py` and the facade `io/storage.py` (for local paths) may."""


def _filesystem_calls(path: pathlib.Path) -> list[tuple[int, str]]:
    def name(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return f"{name(node.value)}.{node.attr}"
        return ""

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            called = name(node.func)
            if called in FILESYSTEM or called.startswith(FILESYSTEM_MODULES):
                found.append((node.lineno, called))
    return found


def _storage_bypasses(package: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if (rel.startswith("io/") and rel not in STORE_SIDE) or rel in LOCAL_FILES:
            continue
        bad += [f"{rel}:{line}: {called}" for line, called in _filesystem_calls(path)]
    return bad


def test_checkpoint_files_are_reached_only_through_the_storage_layer():
    """The local filesystem and object stores are two implementations of `io.storage`: a module above it that calls
    `open`, `os.path` or `os.replace` itself would work on disk and break on a store."""
    assert _storage_bypasses(PACKAGE) == []


def test_the_storage_check_catches_a_bypass(tmp_path):
    fake = tmp_path / "ucp_deepspeed"
    (fake / "format").mkdir(parents=True)
    (fake / "format" / "bad.py").write_text("import os\ndef f(p):\n    return os.path.isfile(p) and open(p).read()\n")
    (fake / "io").mkdir()
    (fake / "io" / "remote.py").write_text("import os\ndef f(p):\n    return os.path.exists(p)\n")
    (fake / "io" / "local.py").write_text("import os\ndef f(p):\n    return os.path.exists(p)\n")
    assert _storage_bypasses(fake) == [
        "format/bad.py:3: os.path.isfile",
        "format/bad.py:3: open",
        "io/remote.py:3: os.path.exists",
    ]
