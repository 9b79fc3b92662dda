"""A Check-N-Run chain on disk: reading its elements and replaying them into a universal checkpoint.

Every Check-N-Run save (see `differential.py`) is a tag folder in the universal format, marked by
`.ucp_checkn_run` (written first) and completed by its manifest (written last). The manifest's
`differential` section says whether the folder is a baseline or a delta and lists, in `chain`, the
tags a restore needs, baseline first, and in `chain_ids` their save ids. A delta's tables hold only
some rows (`rows`), possibly with quantized fp32 values. `materialize` reads every file of the chain
through its block CRCs and writes the full tables, plus copies of the dense files, as an ordinary
universal checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading

import torch

from ucp_deepspeed.checkn_run.quantize import dequantize, from_tensors
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Manifest, ParamRecord
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.paths import INTENT
from ucp_deepspeed.format.universal import (
    BUFFERS,
    MANIFEST,
    STATE,
    Folder,
    FolderReader,
    atomic_write,
    copy_checked,
    param_file,
    read_manifest,
    write_manifest,
    write_tensors,
)
from ucp_deepspeed.io.checksum import crc32

MARKER = ".ucp_checkn_run"  # written first into a Check-N-Run tag folder, before any tensor file


def is_element(tag_dir: str) -> bool:
    """Whether a tag folder was written by a Check-N-Run save (complete or not)."""
    return os.path.isfile(os.path.join(tag_dir, MARKER))


def read_element(ckpt_dir: str, tag: str) -> Manifest:
    """One chain element's manifest, after checking that every file it lists is there at its size."""
    root = os.path.join(ckpt_dir, tag)
    manifest = read_manifest(root)
    path = os.path.join(root, MANIFEST)
    if not manifest.section("differential"):
        raise CheckpointError(path, "not a Check-N-Run checkpoint (no 'differential' section)")
    for relpath, want in Folder(root, manifest).records.items():
        file = os.path.join(root, relpath)
        if not os.path.isfile(file):
            raise CheckpointError(file, f"file of chain element {tag} is missing")
        if os.path.getsize(file) != want.nbytes:
            raise CheckpointError(
                file, f"size {os.path.getsize(file)} differs from manifest ({want.nbytes}): truncated or replaced"
            )
    return manifest


def chain(ckpt_dir: str, tag: str) -> list[tuple[str, Manifest]]:
    """The elements a restore of `tag` needs, baseline first, each checked for presence and size.

    Each element's manifest records its own save id and the ids of the elements before it, so an
    element replaced by one from another run (or an older save of the same tag) is refused.
    """
    target = read_element(ckpt_dir, tag)
    section = target.section("differential")
    tags = section.get("chain")
    ids = section.get("chain_ids")
    if not isinstance(tags, list) or not tags or tags[-1] != tag or (ids is not None and len(ids) != len(tags)):
        raise CheckpointError(os.path.join(ckpt_dir, tag, MANIFEST), "malformed chain in the 'differential' section")
    elements = [(t, read_element(ckpt_dir, t) if t != tag else target) for t in tags]
    for i, (t, manifest) in enumerate(elements):
        if ids is not None and manifest.extra.get("save_id") != ids[i]:
            raise CheckpointError(
                os.path.join(ckpt_dir, t, MANIFEST),
                f"is save {manifest.extra.get('save_id')}, but {tag} was written on top of save {ids[i]}: "
                "this element was replaced after the chain was written",
            )
    if elements[0][1].section("differential").get("kind") != "baseline":
        raise CheckpointError(os.path.join(ckpt_dir, tags[0]), "first element of the chain is not a baseline")
    return elements


def require_rows(path: str, rows: torch.Tensor, total: int) -> None:
    """A delta's row index must be sorted, unique and in range, or the file is corrupt."""
    if rows.numel() and (rows[0] < 0 or rows[-1] >= total or not bool((rows[1:] > rows[:-1]).all())):
        raise CheckpointError(path, f"row index is not sorted, unique and within [0, {total})")


def crc_problems(ckpt_dir: str, elements: list[tuple[str, Manifest]]) -> list[str]:
    """Files of the chain whose blocks do not match their element's manifest."""
    return [p for tag, manifest in elements for p in Folder(os.path.join(ckpt_dir, tag), manifest).verify()]


def _table_rows(folder: Folder, name: str, record: ParamRecord) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Row index (None: all rows) and fp32 (dequantized) and state values of one table in one element."""
    handle = folder.file(record.file)
    path = handle.path
    table = record.extra.get("table")
    if not isinstance(table, dict):
        raise CheckpointError(path, f"table {name} has no table record in its manifest")
    stored = {k: handle.full(k) for k in handle.keys()}
    rows = stored.pop("rows", None)
    if table["partial"] != (rows is not None):
        raise CheckpointError(path, "row index presence does not match the manifest")
    if rows is not None:
        require_rows(path, rows, table["rows"])
    count = table["saved_rows"]
    width = record.shape[1:]
    values = {}
    for key in record.keys:
        quant = table["quantize"]
        if key == FP32 and quant:
            q = from_tensors(
                quant["method"],
                quant["bits"],
                (count, math.prod(width)),
                {"codes": stored[f"{FP32}.codes"], "params": stored[f"{FP32}.params"]},
            )
            values[key] = dequantize(q).reshape(count, *width)
        elif key in stored:
            values[key] = stored[key]
        else:
            raise CheckpointError(path, f"table {name} lacks state {key!r}")
        if values[key].shape[0] != count:
            raise CheckpointError(
                path, f"table {name} state {key!r} has {values[key].shape[0]} rows, manifest says {count}"
            )
    return rows, values


def replay_table(folders: list[tuple[str, Folder, Manifest]], name: str) -> dict[str, torch.Tensor]:
    """Every state of one table as the chain's last element holds it: the baseline's rows, then each delta's."""
    full: dict[str, torch.Tensor] = {}
    for t, folder, manifest in folders:
        if name not in manifest.params:
            raise CheckpointError(os.path.join(folder.root, MANIFEST), f"chain element {t} lacks table {name}")
        rows, values = _table_rows(folder, name, manifest.params[name])
        if rows is None:
            full = {k: v.clone() for k, v in values.items()}
        else:
            for key, value in values.items():
                full[key][rows] = value
    return full


def _fingerprint(ckpt_dir: str, elements: list[tuple[str, Manifest]]) -> list[list[str]]:
    """Each element's tag and save id: what a full copy of the chain was made from."""
    return [[t, manifest.extra.get("save_id") or _manifest_crc(os.path.join(ckpt_dir, t))] for t, manifest in elements]


def _full_manifest(target: Manifest, fingerprint: list[list[str]], params: dict[str, ParamRecord]) -> Manifest:
    """The manifest of the chain's full copy: the last element's, with whole tables and the chain in its source."""
    return dataclasses.replace(
        target,
        params=params,
        source=dict(target.source, chain=fingerprint, differential=target.section("differential")),
        extra={k: v for k, v in target.extra.items() if k != "differential"},
        files={},
    )


def _whole_table(name: str, record: ParamRecord) -> ParamRecord:
    """A table's record in the full copy: its own file, no row record."""
    extra = {k: v for k, v in record.extra.items() if k != "table"}
    return dataclasses.replace(record, file=param_file(name), extra=extra)


def _open(ckpt_dir: str, elements: list[tuple[str, Manifest]], verify: bool) -> list[tuple[str, Folder, Manifest]]:
    return [(t, Folder(os.path.join(ckpt_dir, t), manifest, verify), manifest) for t, manifest in elements]


def materialize(ckpt_dir: str, tag: str, out: str) -> str:
    """Replay the chain of `tag` into a plain universal checkpoint at `out` (reused if already made).

    Every file of the chain is read through its manifest's block CRCs as it is replayed.
    """
    elements = chain(ckpt_dir, tag)
    fingerprint = _fingerprint(ckpt_dir, elements)
    if os.path.isfile(os.path.join(out, MANIFEST)):
        if read_manifest(out).source.get("chain") == fingerprint:
            return out
        shutil.rmtree(out)
    folders = _open(ckpt_dir, elements, True)
    target = elements[-1][1]
    here = folders[-1][1]
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, INTENT)):
        raise CheckpointError(out, "exists, is not empty and is not a ucp_deepspeed output; refusing to write into it")
    os.makedirs(out, exist_ok=True)
    atomic_write(
        os.path.join(out, INTENT), json.dumps({"source": os.path.join(ckpt_dir, tag), "chain": fingerprint}).encode()
    )
    records, params = [], {}
    try:
        for name, record in target.params.items():
            if "table" in record.extra:
                record = _whole_table(name, record)
                records.append(write_tensors(out, record.file, replay_table(folders, name)))
            else:
                records.append(copy_checked(here, record.file, out))
            params[name] = record
        for relpath in (BUFFERS, STATE):
            records.append(copy_checked(here, relpath, out))
    finally:
        for _, folder, _ in folders:
            folder.close()
    write_manifest(out, _full_manifest(target, fingerprint, params), records)
    os.unlink(os.path.join(out, INTENT))
    return out


class ChainCheckpoint(FolderReader):
    """A chain's last tag read as its full copy (`materialize`) would be, with nothing written.

    Dense parameters, buffers and the training state are read by checked byte range from the tag's own files,
    which hold them whole. A table is replayed from every element of the chain when first read and kept until
    another table is read: a restore reads one parameter's states after another, so one table is held at a time.

    Example:
        >>> ckpt = ChainCheckpoint("checkpoints", "global_step8")
        >>> rows = ckpt.read("tables.0.weight", "fp32", start=0, numel=64)
    """

    def __init__(self, ckpt_dir: str, tag: str, verify: bool = True):
        elements = chain(ckpt_dir, tag)
        self._folders = _open(ckpt_dir, elements, verify)
        target = elements[-1][1]
        self._tables = {name for name, record in target.params.items() if "table" in record.extra}
        params = {n: _whole_table(n, r) if n in self._tables else r for n, r in target.params.items()}
        root = os.path.abspath(os.path.join(ckpt_dir, tag))
        super().__init__(root, _full_manifest(target, _fingerprint(ckpt_dir, elements), params), self._folders[-1][1])
        self._lock = threading.Lock()
        self._replayed: tuple[str, dict[str, torch.Tensor]] | None = None

    def _table(self, name: str, key: str) -> torch.Tensor:
        with self._lock:  # readers on other threads wait for a table being replayed instead of replaying it again
            if self._replayed is None or self._replayed[0] != name:
                self._replayed = (name, replay_table(self._folders, name))
            values = self._replayed[1]
        if key not in values:
            raise CheckpointError(os.path.join(self.root, MANIFEST), f"table {name} has no state {key!r}")
        return values[key]

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state of a full tensor, flattened."""
        if name not in self._tables:
            return super().read(name, key, start, numel)
        flat = self._table(name, key).reshape(-1)
        return flat[start : flat.numel() if numel is None else start + numel]

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a state of a full tensor."""
        if name not in self._tables:
            return super().read_slice(name, key, dim, start, length)
        return self._table(name, key).narrow(dim, start, length)

    def close(self) -> None:
        """Release every element's files and the replayed table."""
        for _, folder, _ in self._folders:
            folder.close()
        self._replayed = None


def _manifest_crc(root: str) -> str:
    with open(os.path.join(root, MANIFEST), "rb") as f:
        return f"{crc32(f.read()):08x}"
