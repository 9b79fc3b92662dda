"""What a path on disk holds, decided in one place, and where an output may go.

Kinds, by the files that mark them (nothing is unpickled to decide):

    native        a DeepSpeed checkpoint directory (`latest`, tag folders of `*model_states.pt`), or one tag folder
    <kind>        a tag folder of a kind an extension registered (`kinds.py`; Check-N-Run's is `checkn_run`)
    universal     a finished universal folder (`manifest.json`)
    unfinished    a conversion that was interrupted (`.ucp_source.json`, no manifest)
    ds_universal  DeepSpeed's own universal layout (`zero/optimizer_state.pt`, or `latest_universal`)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import kind_of, markers
from ucp_deepspeed.io import storage as st

MANIFEST = "manifest.json"
INTENT = ".ucp_source.json"
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
DS_OPTIMIZER_STATE = st.join("zero", "optimizer_state.pt")


def optim_prefix(dtype: str) -> str:
    """The prefix of DeepSpeed's optimizer files: every bf16 engine's are `bf16_zero_pp_rank_*`, whichever optimizer it
    steps (ZeRO-1/2/3 or BF16_Optimizer; engine.py's `_get_zero_ckpt_prefix`)."""
    return "bf16_" if dtype == "bf16" else ""


def is_tag_folder(path: str) -> bool:
    """A DeepSpeed tag folder (model-states files) or a tag folder of a registered kind (e.g. Check-N-Run)."""
    if not st.isdir(path):
        return False
    marks = markers()
    try:
        names = st.listdir(path)
    except st.PlacementError:
        return True  # our save spread over key prefixes, with a bad keys object: a tag, never complete
    return any(f.endswith("model_states.pt") or f in marks for f in names)


def tag_kind_name(tag_dir: str) -> str:
    """`native` for a DeepSpeed tag folder, else the name of the registered kind that marks it."""
    kind = kind_of(tag_dir)
    return "native" if kind is None else kind.name


def list_tags(ckpt_dir: str) -> list[str]:
    """Tag folders in a checkpoint directory: DeepSpeed model states, or a Check-N-Run save."""
    if not st.isdir(ckpt_dir):
        return []
    return sorted(d for d in st.listdir(ckpt_dir) if is_tag_folder(st.join(ckpt_dir, d)))


def is_checkpoint_dir(path: str) -> bool:
    """A directory DeepSpeed saves into: it has `latest` or tag folders."""
    return st.isfile(st.join(path, LATEST)) or bool(list_tags(path))


def is_ds_universal(path: str) -> bool:
    """A folder in DeepSpeed's universal layout."""
    return st.isfile(st.join(path, DS_OPTIMIZER_STATE))


@dataclass(frozen=True)
class Located:
    """A path resolved to one checkpoint: its kind, the checkpoint directory and tag (None for folders)."""

    kind: str
    root: str
    tag: str | None = None

    @property
    def path(self) -> str:
        """The folder that holds this checkpoint's files."""
        return st.join(self.root, self.tag) if self.tag else self.root


def latest_tag(ckpt_dir: str, name: str = LATEST) -> str | None:
    """The tag a pointer file (`latest`, or DeepSpeed's `latest_universal`) names, or None when it is absent or
    empty."""
    pointer = st.join(ckpt_dir, name)
    if not st.isfile(pointer):
        return None
    return st.read_text(pointer).strip() or None


def read_latest(ckpt_dir: str) -> str:
    """The tag `latest` names; a clear error when it is missing or empty."""
    tag = latest_tag(ckpt_dir)
    latest = st.join(ckpt_dir, LATEST)
    if tag is None and not st.isfile(latest):
        found = list_tags(ckpt_dir)
        hint = f"; tags present: {', '.join(found)} (pass one with --tag)" if found else ""
        raise CheckpointError(latest, f"no 'latest' file, so the tag to load is unknown{hint}")
    if tag is None:
        raise CheckpointError(latest, "'latest' is empty")
    return tag


def locate(path: str, tag: str | None = None) -> Located:
    """Decide what `path` (and `tag`) names; one clear error when it names nothing we can read."""
    path = st.normalize(path)
    if not st.exists(path):
        raise CheckpointError(path, "does not exist")
    if not st.isdir(path):
        raise CheckpointError(path, "is a file; give a checkpoint directory, a tag folder or a universal folder")
    if tag is None:
        if st.isfile(st.join(path, MANIFEST)) and kind_of(path) is None:
            return Located("universal", path)
        if st.isfile(st.join(path, INTENT)):
            raise CheckpointError(
                path,
                "is an unfinished conversion (no manifest.json): it was interrupted; run "
                "`ucp convert` again to finish it, or delete the folder",
            )
        if is_ds_universal(path):
            return Located("ds_universal", path)
        if is_tag_folder(path):
            root, name = st.dirname(path), st.basename(path)
            return Located(tag_kind_name(path), root, name)
        if not is_checkpoint_dir(path) and st.isfile(st.join(path, LATEST_UNIVERSAL)):
            return Located("ds_universal", path)
        if not is_checkpoint_dir(path):
            raise CheckpointError(path, "holds no checkpoint: no 'latest', no tag folders, no manifest.json")
        tag = read_latest(path)
    tag_dir = st.join(path, tag)
    if not st.isdir(tag_dir):
        raise CheckpointError(tag_dir, "checkpoint tag folder does not exist")
    return Located(tag_kind_name(tag_dir), path, tag)


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def check_output(out: str, sources: Iterable[str]) -> None:
    """Refuse an output that would write into a checkpoint: a source, a tag folder, a checkpoint directory
    itself, or any folder inside a tag or a universal folder. Outputs beside a tag are fine."""
    real = st.realpath(out)
    for source in sources:
        src = st.realpath(source)
        if _inside(real, src) or _inside(src, real):
            raise CheckpointError(
                out,
                f"{'is inside' if _inside(real, src) else 'contains'} the source {source}; "
                "a source is never written: pick an output outside it",
            )
    if st.isdir(real) and (is_tag_folder(real) or is_checkpoint_dir(real) or is_ds_universal(real)):
        raise CheckpointError(out, "is a checkpoint folder; writing into it would change what it holds")
    parent = st.dirname(real)
    while parent and parent != st.dirname(parent):
        if is_tag_folder(parent) or is_ds_universal(parent) or st.isfile(st.join(parent, MANIFEST)):
            raise CheckpointError(out, f"is inside the checkpoint folder {parent}; writing there would change it")
        parent = st.dirname(parent)
