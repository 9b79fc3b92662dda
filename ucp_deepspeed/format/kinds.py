"""Tag kinds that extensions add, so the core recognises their folders without importing them.

A DeepSpeed tag folder is marked by its `*model_states.pt` files. An extension whose saves are tag
folders of another shape (Check-N-Run's chains) registers a `TagKind`: the file that marks its
folders, how to check that one can be restored, which tags a restore reads, how to read one in place
as if it were an ordinary universal folder, and how to turn one into such a folder. `locate`, the
resume-tag choice, pruning, conversion and loading go through this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ucp_deepspeed.io import storage as st

if TYPE_CHECKING:  # universal.py imports this module
    from ucp_deepspeed.format.universal import TensorReader


@dataclass(frozen=True)
class TagKind:
    """One registered kind of tag folder.

    Args:
        name: the kind `locate` reports, e.g. `"checkn_run"`.
        marker: a file written first into every folder of this kind.
        needs: `(ckpt_dir, tag) -> tags` a restore of `tag` reads, itself included; raises `CheckpointError`
            when one is missing or damaged, so it doubles as the completeness check.
        materialize: `(ckpt_dir, tag, out) -> out`: write the tag as a full universal folder.
        verify: `(ckpt_dir, tag) -> problems`: every file checked, one line per bad file.
        open: `(ckpt_dir, tag, verify) -> reader`: the tag read in place as its full universal folder would be
            (a direct load; nothing is written), with `verify` every byte read checked.
    """

    name: str
    marker: str
    needs: Callable[[str, str], list[str]]
    materialize: Callable[[str, str, str], str]
    verify: Callable[[str, str], list[str]]
    open: Callable[[str, str, bool], TensorReader]


_KINDS: dict[str, TagKind] = {}


def register_tag_kind(kind: TagKind) -> None:
    """Add a kind of tag folder (called once, when its extension is imported)."""
    _KINDS[kind.name] = kind


def markers() -> tuple[str, ...]:
    """The marker files of every registered kind."""
    return tuple(k.marker for k in _KINDS.values())


def kind_of(tag_dir: str) -> TagKind | None:
    """The registered kind whose marker `tag_dir` holds, or None for a DeepSpeed tag or anything else."""
    for kind in _KINDS.values():
        if st.isfile(st.join(tag_dir, kind.marker)):
            return kind
    return None
