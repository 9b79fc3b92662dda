"""The documented public API (docs/reference/api.md) imports, is the whole of `__all__`, and old paths still work."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

import ucp_deepspeed

API = Path(__file__).resolve().parents[1] / "docs" / "reference" / "api.md"


def _documented() -> list[str]:
    first_table = API.read_text().split("## Old import paths")[0]
    return re.findall(r"^\| `ucp_deepspeed\.(\w+)` \|", first_table, flags=re.MULTILINE)


def test_every_documented_name_imports_and_is_all_of_the_surface():
    names = _documented()
    assert len(names) >= 10
    for name in names:
        assert getattr(ucp_deepspeed, name) is not None, name
    assert sorted(names) == sorted(ucp_deepspeed.__all__)


@pytest.mark.parametrize(
    "old,name",
    [
        ("ucp_deepspeed.mpu", "register_megatron_experts"),
        ("ucp_deepspeed.mpu", "MegatronMpu"),
        ("ucp_deepspeed.checkpoints", "resume_tag"),
        ("ucp_deepspeed.checkpoints", "prune"),
    ],
)
def test_an_old_import_path_warns_and_gives_the_same_object(old, name):
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(ucp_deepspeed, name)
    assert any(issubclass(w.category, DeprecationWarning) and f"ucp_deepspeed.{name}" in str(w.message) for w in caught)
    assert f"{old}.{name}" in API.read_text()
