"""The commit object of a tag saved to an object store: written last, it alone makes the tag complete.

A store has no rename, so a rank file is visible as soon as its upload ends, whole or not part of a save that
finished. Rank 0 therefore writes `<tag>/ucp_commit.json` only after every rank reported each object it wrote as
acknowledged by the store; `latest` moves after it. A tag on a store without its commit object is a torn save
(a killed rank, a failed upload) and is never loaded as complete. The object lists every object of the save with its
size, so a file deleted or replaced behind the save's back is caught before anything is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import storage as st

COMMIT = "ucp_commit.json"
COMMIT_FORMAT = "ucp_deepspeed/commit"
_MAX = 64 << 20


@dataclass(frozen=True)
class CommitRecord:
    """What one save wrote: its id, and every object (path inside the tag folder -> size in bytes)."""

    save_id: str
    objects: tuple[tuple[str, int], ...]

    def to_json(self) -> str:
        """The record as the JSON text of the commit object."""
        return json.dumps(
            {"format": COMMIT_FORMAT, "version": 1, "save_id": self.save_id, "objects": dict(self.objects)}, indent=1
        )

    @classmethod
    def from_json(cls, text: str, path: str) -> CommitRecord:
        """Parse and validate a commit object; anything malformed is a `CheckpointError` naming it."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(path, f"commit object is not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != COMMIT_FORMAT or raw.get("version") != 1:
            raise CheckpointError(path, "not a ucp_deepspeed commit object (format or version)")
        objects = raw.get("objects")
        if (
            not isinstance(raw.get("save_id"), str)
            or not isinstance(objects, dict)
            or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in objects.items())
            or any(k.startswith("/") or ".." in k.split("/") for k in objects)
        ):
            raise CheckpointError(path, "commit object is malformed (save_id, objects)")
        return cls(raw["save_id"], tuple(sorted(objects.items())))


def write_commit(tag_dir: str, record: CommitRecord) -> str:
    """Write a tag's commit object (the last object of its save)."""
    path = st.join(tag_dir, COMMIT)
    st.storage_of(path).commit(path, record.to_json().encode())
    return path


def read_commit(tag_dir: str) -> CommitRecord | None:
    """A tag's commit object, or None when it has none."""
    path = st.join(tag_dir, COMMIT)
    if not st.isfile(path):
        return None
    return CommitRecord.from_json(st.read(path, limit=_MAX).decode("utf-8", "replace"), path)


def uncommitted_reason(tag_dir: str) -> str | None:
    """Why a tag on a store is not a finished save (no commit object, or an object it lists missing or resized),
    or None. One listing per folder the commit names."""
    record = read_commit(tag_dir)
    if record is None:
        return f"no {COMMIT}: the save did not finish (a killed rank or a failed upload)"
    sizes: dict[str, dict[str, int]] = {}
    for rel, size in record.objects:
        folder, _, name = rel.rpartition("/")
        if folder not in sizes:
            sizes[folder] = st.storage_of(tag_dir).sizes(st.join(tag_dir, folder) if folder else tag_dir)
        found = sizes[folder].get(name)
        if found is None:
            return f"{rel}, written by the save, is missing"
        if found != size:
            return f"{rel} is {found} bytes, the save wrote {size}: truncated or replaced"
    return None
