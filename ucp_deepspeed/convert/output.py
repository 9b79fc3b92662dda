"""The output folder of a conversion: claimed under a lock, resumed from its journals, never inside a source.

Until the manifest exists, the folder holds `.ucp_source.json` (which source it belongs to) and one
journal per writing process with each finished file's CRCs. A rerun reuses a leftover file only if
it still matches its journal; the manifest, written last, marks the folder complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import FileRecord
from ucp_deepspeed.format.paths import INTENT, check_output
from ucp_deepspeed.format.universal import MANIFEST, CheckedFile, is_complete, read_manifest
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import NativeCheckpoint

JOURNAL = ".ucp_journal."
log = logging.getLogger("ucp_deepspeed")


def default_output(src: NativeCheckpoint) -> str:
    """Where a conversion goes when no output is given: beside the tag folder, never inside it."""
    return st.join(src.ckpt_dir, f"{src.tag}.universal")


def fingerprint(src: NativeCheckpoint) -> tuple[tuple[str | int, ...], ...]:
    """Identity of the source files (name, size, mtime) and its save id, so a stale conversion is never reused."""
    out: list[tuple[str | int, ...]] = []
    for path in sorted(src.source_files()):
        size, mtime = st.stat(path)
        out.append((st.basename(path), size, mtime))
    if src.meta.save_id:
        out.append(("save_id", src.meta.save_id))
    return tuple(out)


@contextlib.contextmanager
def claimed(out: str, sources: list[str]) -> Iterator[None]:
    """Check that `out` may be written (never inside a source, see `check_output`), then hold a lock on the
    folder itself while converting into it: a second converter waits, then finds the work done. An object store
    has no locks: there, the manifest written last is what makes the output complete."""
    check_output(out, sources)
    st.makedirs(out)
    with st.locked(out, holder="conversion"):
        yield


class Journal:
    """Records of finished output files, appended as each one is renamed into place.

    A rerun after a kill reuses a leftover file only if it still matches the CRCs recorded when it
    was written; anything else is deleted and written again. One journal file per process, so the
    ranks of a loading job never share one.
    """

    def __init__(self, out: str):
        self.path = st.join(out, f"{JOURNAL}{socket.gethostname()}.{os.getpid()}")
        self._lock = threading.Lock()

    def add(self, record: FileRecord) -> None:
        """Note a finished file (not fsynced: a lost line only costs rewriting that file). An object store cannot
        append: there an interrupted conversion is redone whole."""
        line = json.dumps({"path": record.path, **record.to_json()}) + "\n"
        with self._lock:
            st.append_line(self.path, line)

    @staticmethod
    def read(out: str) -> dict[str, FileRecord]:
        """Every record in the journals of `out`; a torn last line is ignored."""
        found: dict[str, FileRecord] = {}
        for name in st.listdir(out):
            if not name.startswith(JOURNAL):
                continue
            for line in st.read_text(st.join(out, name)).splitlines():
                try:
                    raw = json.loads(line)
                    found[raw["path"]] = FileRecord.from_json(raw["path"], raw, out)
                except (ValueError, KeyError, TypeError, CheckpointError):
                    continue
        return found

    @staticmethod
    def remove(out: str) -> None:
        """Delete the journals once the manifest holds the records."""
        for name in st.listdir(out):
            if name.startswith(JOURNAL):
                st.delete(st.join(out, name))


def _still_good(out: str, record: FileRecord) -> bool:
    try:
        with CheckedFile(out, record) as handle:
            handle.verify()
    except CheckpointError:
        return False
    return True


def prepare_output(src: NativeCheckpoint, out: str) -> dict[str, FileRecord] | None:
    """Get `out` ready; return finished files that can be reused (checked), or None if the conversion is complete."""
    want = fingerprint(src)
    intent_path = st.join(out, INTENT)
    if is_complete(out):
        if read_manifest(out).source.fingerprint == want:
            return None
        raise CheckpointError(
            out, "holds a finished conversion of a different checkpoint; remove it or pick another output"
        )
    if st.isdir(out) and st.listdir(out) and not st.isfile(intent_path):
        raise CheckpointError(out, "exists, is not empty and is not a ucp_deepspeed output; refusing to write into it")
    reusable: dict[str, FileRecord] = {}
    if st.isfile(intent_path):
        try:
            same_source = json.loads(st.read(intent_path)) == {
                "source": src.tag_dir,
                "fingerprint": [list(e) for e in want],
            }
        except (json.JSONDecodeError, UnicodeDecodeError):
            same_source = False
        journal = Journal.read(out) if same_source else {}
        for rel in st.find(out):
            fname = rel.rpartition("/")[2]
            if rel == INTENT or (fname.startswith(JOURNAL) and same_source):
                continue
            record = journal.get(rel)
            if record is not None and ".tmp." not in fname and _still_good(out, record):
                reusable[rel] = record
            else:
                st.delete(st.join(out, rel))
        if reusable:
            log.info(
                "ucp: %s: reusing %d files an interrupted conversion finished (their CRCs still match)",
                out,
                len(reusable),
            )
    st.makedirs(st.join(out, "params"))
    st.write(intent_path, json.dumps({"source": src.tag_dir, "fingerprint": [list(e) for e in want]}).encode())
    return reusable


def remove_output(out: str) -> None:
    """Delete a conversion folder (used when the user does not keep converted copies)."""
    if st.isfile(st.join(out, MANIFEST)) or st.isfile(st.join(out, INTENT)):
        st.delete(out)
