"""What extensions plug into the runtime, so the engine wiring imports none of them.

Call order, for one engine:

1. At import, an extension registers its config sections (`register_section`), a saver factory
   (`register_saver`) and any foreign format it can import (`register_foreign_format`).
2. `split_config` validates each registered section found beside `"universal"` into
   `UniversalConfig.extensions[name]`.
3. `attach` calls every saver factory with the engine and its options; the first that returns a
   saver writes every later `save_checkpoint` in place of DeepSpeed's, and hears of every load
   through `restored(manifest)` (None when the load was not one of its own tags).
4. `load_checkpoint` asks every foreign format whether the load directory is one of its folders
   (`find`) and imports it (`import_to`) into a universal folder before restoring.

This module imports nothing heavy, so registering costs an extension nothing at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.protocols import Engine


class Saver(Protocol):
    """Writes checkpoints in place of DeepSpeed's `save_checkpoint`."""

    def save(
        self,
        engine: Engine,
        save_dir: str,
        tag: str,
        client_state: dict[str, Any],
        save_latest: bool,
        save_id: str,
        *,
        data_loaders: list[dict[str, Any]] | None = None,
    ) -> Any:
        """Write checkpoint `tag` (collective); `data_loaders` (rank 0 only) are every rank's data-loader records,
        for the training state."""

    def restored(self, manifest: Manifest | None) -> None:
        """After a load: `manifest` of the restored tag when it was one of this saver's, else None."""


SaverFactory = Callable[[Any, Any], "Saver | None"]


@dataclass(frozen=True)
class ForeignFormat:
    """A checkpoint format another tool writes, which a load imports into a universal folder first.

    Args:
        name: how `ucp_last_load` and messages name it.
        find: `(engine, load_dir) -> folder | None`: the folder of this format that a load of `load_dir` means.
        import_to: `(folder, out, options) -> out`: write `folder` as a universal folder at `out`; `options` is
            the loading engine's `UniversalConfig` (its `vocab_size` says which rows are padding).
    """

    name: str
    find: Callable[[Any, str], str | None]
    import_to: Callable[[str, str, Any], str]


_SECTIONS: dict[str, Any] = {}
_SAVERS: list[SaverFactory] = []
_FORMATS: list[ForeignFormat] = []


def register_section(name: str, model: Any) -> None:
    """Accept `"checkpoint": {name: {...}}` beside `"universal"`, validated by the pydantic `model`."""
    _SECTIONS[name] = model


def sections() -> dict[str, Any]:
    """The registered config sections by name."""
    return dict(_SECTIONS)


def register_saver(factory: SaverFactory) -> None:
    """Add a factory `(engine, options) -> Saver | None`, asked once per engine at `attach`."""
    _SAVERS.append(factory)


def make_saver(engine: Engine, options: Any) -> Saver | None:
    """The first saver a registered factory makes for this engine, or None to keep DeepSpeed's save."""
    for factory in _SAVERS:
        saver = factory(engine, options)
        if saver is not None:
            return saver
    return None


def register_foreign_format(fmt: ForeignFormat) -> None:
    """Add a format that loads import (e.g. DeepSpeed's own universal folders)."""
    _FORMATS.append(fmt)


def foreign_formats() -> tuple[ForeignFormat, ...]:
    """The registered foreign formats, in registration order."""
    return tuple(_FORMATS)
