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

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterable

import torch

from ucp_deepspeed.checkn_run.quantize import Quantized, dequantize, row_window
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Manifest, ParamRecord
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.paths import INTENT
from ucp_deepspeed.format.universal import (
    BUFFERS,
    MANIFEST,
    STATE,
    CheckedFile,
    Folder,
    FolderReader,
    param_file,
    read_manifest,
)
from ucp_deepspeed.format.writer import UniversalWriter
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.checksum import crc32

MARKER = ".ucp_checkn_run"  # written first into a Check-N-Run tag folder, before any tensor file


def read_element(ckpt_dir: str, tag: str) -> Manifest:
    """One chain element's manifest, after checking that every file it lists is there at its size."""
    root = st.join(ckpt_dir, tag)
    manifest = read_manifest(root)
    path = st.join(root, MANIFEST)
    if not manifest.section("differential"):
        raise CheckpointError(path, "not a Check-N-Run checkpoint (no 'differential' section)")
    for relpath, want in Folder(root, manifest).records.items():
        file = st.join(root, relpath)
        if not st.isfile(file):
            raise CheckpointError(file, f"file of chain element {tag} is missing")
        size = st.stat(file)[0]
        if size != want.nbytes:
            raise CheckpointError(file, f"size {size} differs from manifest ({want.nbytes}): truncated or replaced")
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
        raise CheckpointError(st.join(ckpt_dir, tag, MANIFEST), "malformed chain in the 'differential' section")
    elements = [(t, read_element(ckpt_dir, t) if t != tag else target) for t in tags]
    for i, (t, manifest) in enumerate(elements):
        if ids is not None and manifest.extra.get("save_id") != ids[i]:
            raise CheckpointError(
                st.join(ckpt_dir, t, MANIFEST),
                f"is save {manifest.extra.get('save_id')}, but {tag} was written on top of save {ids[i]}: "
                "this element was replaced after the chain was written",
            )
    if elements[0][1].section("differential").get("kind") != "baseline":
        raise CheckpointError(st.join(ckpt_dir, tags[0]), "first element of the chain is not a baseline")
    return elements


def require_rows(path: str, rows: torch.Tensor, total: int) -> None:
    """A delta's row index must be sorted, unique and in range, or the file is corrupt."""
    if rows.numel() and (rows[0] < 0 or rows[-1] >= total or not bool((rows[1:] > rows[:-1]).all())):
        raise CheckpointError(path, f"row index is not sorted, unique and within [0, {total})")


def crc_problems(ckpt_dir: str, elements: list[tuple[str, Manifest]]) -> list[str]:
    """Files of the chain whose blocks do not match their element's manifest."""
    return [p for tag, manifest in elements for p in Folder(st.join(ckpt_dir, tag), manifest).verify()]


@dataclasses.dataclass(frozen=True)
class _Table:
    """One element's record of a table: its full row count, the rows it stores, and their quantization."""

    rows: int
    saved: int
    partial: bool
    method: str | None
    bits: int | None


def _table_record(path: str, name: str, record: ParamRecord) -> _Table:
    """The element's table record, checked against the parameter's shape: the reads below index by it."""
    raw = record.extra.get("table")
    try:
        if not isinstance(raw, dict):
            raise TypeError(raw)
        quant = raw["quantize"]
        table = _Table(
            int(raw["rows"]),
            int(raw["saved_rows"]),
            raw["partial"] is True,
            str(quant["method"]) if quant else None,
            int(quant["bits"]) if quant else None,
        )
        widths = raw.get("widths") or {}
        if not isinstance(widths, dict) or not all(
            isinstance(w, list) and all(type(n) is int and n > 0 for n in w) for w in widths.values()
        ):
            raise TypeError(widths)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(path, f"table {name} has no well-formed table record in its manifest") from None
    if (
        len(record.shape) < 2
        or table.rows != record.shape[0]
        or not 0 <= table.saved <= table.rows
        or (not table.partial and table.saved != table.rows)
        or (table.bits is not None and not 1 <= table.bits <= 8)
    ):
        raise CheckpointError(path, f"table {name}'s record {record.extra['table']} does not fit its shape")
    return table


def key_width(record: ParamRecord, key: str) -> tuple[int, ...]:
    """The shape of one row of a table's state: the table's own row, or the width its record gives a per-row state
    of another shape (TorchRec's row-wise Adagrad keeps one value per row and column shard)."""
    table = record.extra.get("table")
    widths = (table.get("widths") if isinstance(table, dict) else None) or {}
    return tuple(int(n) for n in widths[key]) if isinstance(widths, dict) and key in widths else tuple(record.shape[1:])


def _stored_rows(
    handle: CheckedFile, name: str, key: str, table: _Table, width: tuple[int, ...], a: int, b: int
) -> torch.Tensor:
    """Entries [a, b) of the rows one element stores for `key` (decoded if quantized), shaped (b - a, *width)."""
    header, dim = handle.header(), math.prod(width)
    if key == FP32 and table.method is not None and table.bits is not None:
        codes, params = f"{FP32}.codes", f"{FP32}.params"
        if codes not in header or params not in header:
            raise CheckpointError(handle.path, f"table {name} lacks its quantized {FP32} rows")
        first, last, lo, hi = row_window(a, b, table.saved, dim, table.bits)
        pshape = header[params][1]
        if (
            len(pshape) != 2
            or pshape[0] != table.saved
            or math.prod(header[codes][1]) != row_window(0, table.saved, table.saved, dim, table.bits)[3]
        ):
            raise CheckpointError(handle.path, f"table {name}: quantized rows do not fit {table.saved} x {dim}")
        q = Quantized(
            table.method,
            table.bits,
            (last - first, dim),
            handle.tensor(codes, lo, hi - lo),
            handle.tensor(params, first * pshape[1], (last - first) * pshape[1]).reshape(-1, pshape[1]),
        )
        try:
            values = dequantize(q)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise CheckpointError(handle.path, f"table {name}: quantized rows do not decode ({exc})") from None
        return values[a - first : b - first].reshape(b - a, *width)
    if key not in header:
        raise CheckpointError(handle.path, f"table {name} lacks state {key!r}")
    if tuple(header[key][1]) != (table.saved, *width):
        raise CheckpointError(
            handle.path, f"table {name} state {key!r} is {list(header[key][1])}, manifest says {[table.saved, *width]}"
        )
    return handle.tensor(key, a * dim, (b - a) * dim).reshape(b - a, *width)


def replay_rows(folders: list[tuple[str, Folder, Manifest]], name: str, key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of one state of a table as the chain's last element holds it: the baseline's, then each
    delta's rows that fall in the window. Only those rows are read (and the deltas' row indexes)."""
    out: torch.Tensor | None = None
    for t, folder, manifest in folders:
        record = manifest.params.get(name)
        if record is None:
            raise CheckpointError(st.join(folder.root, MANIFEST), f"chain element {t} lacks table {name}")
        if key not in record.keys:
            raise CheckpointError(st.join(folder.root, MANIFEST), f"table {name} has no state {key!r}")
        handle = folder.file(record.file)
        table = _table_record(handle.path, name, record)
        width = key_width(record, key)
        if table.partial != ("rows" in handle.header()):
            raise CheckpointError(handle.path, "row index presence does not match the manifest")
        if not table.partial:
            out = _stored_rows(handle, name, key, table, width, lo, hi)
            continue
        if out is None:
            raise CheckpointError(handle.path, f"table {name} holds only some rows, but nothing comes before it")
        rows = handle.full("rows")
        if rows.dtype != torch.int64 or tuple(rows.shape) != (table.saved,):
            raise CheckpointError(handle.path, f"row index of table {name} is not {table.saved} int64 entries")
        require_rows(handle.path, rows, table.rows)
        a, b = (int(i) for i in torch.searchsorted(rows, torch.tensor([lo, hi])))
        if b > a:
            out[rows[a:b] - lo] = _stored_rows(handle, name, key, table, width, a, b)
    if out is None:
        raise CheckpointError(st.join(folders[0][1].root, MANIFEST), f"no element holds table {name}")
    return out


def _fingerprint(ckpt_dir: str, elements: list[tuple[str, Manifest]]) -> list[list[str]]:
    """Each element's tag and save id: what a full copy of the chain was made from."""
    return [[t, manifest.extra.get("save_id") or _manifest_crc(st.join(ckpt_dir, t))] for t, manifest in elements]


def _full_manifest(target: Manifest, fingerprint: list[list[str]], params: dict[str, ParamRecord]) -> Manifest:
    """The manifest of the chain's full copy: the last element's, with whole tables and the chain in its source."""
    return dataclasses.replace(
        target,
        params=params,
        source=dataclasses.replace(
            target.source,
            extra=dict(target.source.extra, chain=fingerprint, differential=target.section("differential")),
        ),
        extra={k: v for k, v in target.extra.items() if k != "differential"},
        files={},
    )


def _whole_table(name: str, record: ParamRecord) -> ParamRecord:
    """A table's record in the full copy: its own file, no row record."""
    extra = {k: v for k, v in record.extra.items() if k != "table"}
    return dataclasses.replace(record, file=param_file(name), extra=extra)


def _open(ckpt_dir: str, elements: list[tuple[str, Manifest]], verify: bool) -> list[tuple[str, Folder, Manifest]]:
    return [(t, Folder(st.join(ckpt_dir, t), manifest, verify), manifest) for t, manifest in elements]


def materialize(ckpt_dir: str, tag: str, out: str) -> str:
    """Replay the chain of `tag` into a plain universal checkpoint at `out` (reused if already made).

    Every file of the chain is read through its manifest's block CRCs as it is replayed.
    """
    elements = chain(ckpt_dir, tag)
    fingerprint = _fingerprint(ckpt_dir, elements)
    if st.isfile(st.join(out, MANIFEST)):
        if read_manifest(out).source.extra.get("chain") == fingerprint:
            return out
        st.delete(out)
    target = elements[-1][1]
    params = {}
    with contextlib.ExitStack() as opened:  # every folder of the chain is closed however this ends
        folders = [(t, opened.enter_context(folder), m) for t, folder, m in _open(ckpt_dir, elements, True)]
        here = folders[-1][1]
        if st.isdir(out) and st.listdir(out) and not st.isfile(st.join(out, INTENT)):
            raise CheckpointError(
                out, "exists, is not empty and is not a ucp_deepspeed output; refusing to write into it"
            )
        st.makedirs(out)
        st.write(st.join(out, INTENT), json.dumps({"source": st.join(ckpt_dir, tag), "chain": fingerprint}).encode())
        with UniversalWriter(root=out) as writer:
            for name, record in target.params.items():
                if "table" in record.extra:
                    record = _whole_table(name, record)
                    full = {k: replay_rows(folders, name, k, 0, record.shape[0]) for k in record.keys}
                    writer.add_files([writer.files.param(name, full)])
                else:
                    writer.copy(here, record.file)
                params[name] = record
            for relpath in (BUFFERS, STATE):
                writer.copy(here, relpath)
            writer.commit(_full_manifest(target, fingerprint, params))
    st.delete(st.join(out, INTENT))
    return out


class ChainCheckpoint(FolderReader):
    """A chain's last tag read as its full copy (`materialize`) would be, with nothing written.

    Dense parameters, buffers and the training state are read by checked byte range from the tag's own files,
    which hold them whole. A range of a table is replayed from the chain: the baseline's rows that cover it, then
    the rows of each delta that fall in it, so a rank reads about what it owns, never a whole table.

    Example:
        >>> ckpt = ChainCheckpoint("checkpoints", "global_step8")
        >>> rows = ckpt.read("tables.0.weight", "fp32", start=0, numel=64)
    """

    def __init__(self, ckpt_dir: str, tag: str, verify: bool = True):
        elements = chain(ckpt_dir, tag)
        self._ckpt_dir, self._elements = ckpt_dir, elements
        self._folders = _open(ckpt_dir, elements, verify)
        target = elements[-1][1]
        self._tables = {name for name, record in target.params.items() if "table" in record.extra}
        self._records = target.params
        params = {n: _whole_table(n, r) if n in self._tables else r for n, r in target.params.items()}
        root = st.normalize(st.join(ckpt_dir, tag))
        super().__init__(root, _full_manifest(target, _fingerprint(ckpt_dir, elements), params), self._folders[-1][1])

    def row_width(self, name: str, key: str) -> tuple[int, ...]:
        """The shape of one row of a table's state as the chain's last element stores it (`key_width`)."""
        return key_width(self._records[name], key)

    def _rows(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        if not 0 <= lo <= hi <= self.params[name].shape[0]:
            raise CheckpointError(self.root, f"{name}:{key}: rows [{lo}, {hi}) outside {self.params[name].shape[0]}")
        return replay_rows(self._folders, name, key, lo, hi)

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state of a full tensor, flattened."""
        if name not in self._tables:
            return super().read(name, key, start, numel)
        shape = self.params[name].shape
        width = math.prod(key_width(self._records[name], key))
        numel = shape[0] * width - start if numel is None else numel
        if start < 0 or numel < 0:
            raise CheckpointError(self.root, f"{name}:{key}: elements [{start}, {start + numel}) outside the table")
        lo = start // width
        rows = self._rows(name, key, lo, -(-(start + numel) // width))
        return rows.reshape(-1)[start - lo * width : start - lo * width + numel]

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a state of a full tensor."""
        if name not in self._tables:
            return super().read_slice(name, key, dim, start, length)
        if dim == 0:
            return self._rows(name, key, start, start + length)
        return self._rows(name, key, 0, self.params[name].shape[0]).narrow(dim, start, length)

    def verify(self, relpaths: Iterable[str] | None = None) -> list[str]:
        """Check every block of every element's files (the given files of the tag itself, if named)."""
        if relpaths is not None:
            return super().verify(relpaths)
        return crc_problems(self._ckpt_dir, self._elements)

    def close(self) -> None:
        """Release every element's files."""
        for _, folder, _ in self._folders:
            folder.close()


def _manifest_crc(root: str) -> str:
    return f"{crc32(st.read(st.join(root, MANIFEST))):08x}"
