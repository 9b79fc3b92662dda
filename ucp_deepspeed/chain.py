"""A Check-N-Run chain on disk: reading its elements and replaying them into a universal checkpoint.

Every Check-N-Run save (see `differential.py`) is a tag folder in the universal format, marked by
`.ucp_checkn_run` (written first) and completed by its manifest (written last). The manifest's
`differential` section says whether the folder is a baseline or a delta and lists, in `chain`, the
tags a restore needs, baseline first. A delta's tables hold only some rows (`rows`), possibly with
quantized fp32 values. `materialize` checks every file of the chain (presence, size, crc32) and
writes the full tables, plus copies of the dense files, as an ordinary universal checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch
from safetensors import safe_open

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.meta import CHECKN_RUN_MARKER as MARKER, FP32
from ucp_deepspeed.quantize import dequantize, from_tensors
from ucp_deepspeed.universal import BUFFERS, MANIFEST, STATE, file_record, param_file, write_manifest, write_tensors


def is_element(tag_dir: str) -> bool:
    """Whether a tag folder was written by a Check-N-Run save (complete or not)."""
    return os.path.isfile(os.path.join(tag_dir, MARKER))


def read_element(ckpt_dir: str, tag: str) -> dict[str, Any]:
    """One chain element's manifest, after checking that every file it lists is there at its size."""
    root = os.path.join(ckpt_dir, tag)
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(path, "manifest missing: the checkpoint was not written completely")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(path, f"manifest is not valid JSON ({exc})") from None
    if "differential" not in manifest:
        raise CheckpointError(path, "not a Check-N-Run checkpoint (no 'differential' section)")
    for relpath, want in manifest["files"].items():
        file = os.path.join(root, relpath)
        if not os.path.isfile(file):
            raise CheckpointError(file, f"file of chain element {tag} is missing")
        if os.path.getsize(file) != want["bytes"]:
            raise CheckpointError(file, f"size {os.path.getsize(file)} differs from manifest ({want['bytes']}): "
                                  "truncated or replaced")
    return manifest


def chain(ckpt_dir: str, tag: str) -> list[tuple[str, dict[str, Any]]]:
    """The elements a restore of `tag` needs, baseline first, each checked for presence and size."""
    target = read_element(ckpt_dir, tag)
    tags = target["differential"]["chain"]
    elements = [(t, read_element(ckpt_dir, t) if t != tag else target) for t in tags]
    if elements[0][1]["differential"]["kind"] != "baseline":
        raise CheckpointError(os.path.join(ckpt_dir, tags[0]), "first element of the chain is not a baseline")
    return elements


def require_rows(path: str, rows: torch.Tensor, total: int) -> None:
    """A delta's row index must be sorted, unique and in range, or the file is corrupt."""
    if rows.numel() and (rows[0] < 0 or rows[-1] >= total or not bool((rows[1:] > rows[:-1]).all())):
        raise CheckpointError(path, f"row index is not sorted, unique and within [0, {total})")


def crc_problems(ckpt_dir: str, elements: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Files of the chain whose crc32 differs from their element's manifest."""
    problems = []
    for tag, manifest in elements:
        root = os.path.join(ckpt_dir, tag)
        for relpath, want in manifest["files"].items():
            if file_record(root, relpath).crc32 != want["crc32"]:
                problems.append(f"{os.path.join(root, relpath)}: crc32 does not match the manifest")
    return problems


def _verify(ckpt_dir: str, elements: list[tuple[str, dict[str, Any]]]) -> None:
    problems = crc_problems(ckpt_dir, elements)
    if problems:
        raise CheckpointError(os.path.join(ckpt_dir, elements[-1][0]), "corrupt chain element: " + "; ".join(problems))


def _table_rows(root: str, name: str, record: dict[str, Any]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Row index (None: all rows) and fp32 (dequantized) and state values of one table in one element."""
    path = os.path.join(root, record["file"])
    table = record["table"]
    with safe_open(path, framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    rows = stored.pop("rows", None)
    if table["partial"] != (rows is not None):
        raise CheckpointError(path, "row index presence does not match the manifest")
    if rows is not None:
        require_rows(path, rows, table["rows"])
    count = table["saved_rows"]
    width = record["shape"][1:]
    values = {}
    for key in record["keys"]:
        quant = table["quantize"]
        if key == FP32 and quant:
            q = from_tensors(quant["method"], quant["bits"], (count, math.prod(width)),
                             {"codes": stored[f"{FP32}.codes"], "params": stored[f"{FP32}.params"]})
            values[key] = dequantize(q).reshape(count, *width)
        elif key in stored:
            values[key] = stored[key]
        else:
            raise CheckpointError(path, f"table {name} lacks state {key!r}")
        if values[key].shape[0] != count:
            raise CheckpointError(path, f"table {name} state {key!r} has {values[key].shape[0]} rows, "
                                  f"manifest says {count}")
    return rows, values


def materialize(ckpt_dir: str, tag: str, out: str) -> str:
    """Replay the chain of `tag` into a plain universal checkpoint at `out` (reused if already made)."""
    elements = chain(ckpt_dir, tag)
    fingerprint = [[t, file_record(os.path.join(ckpt_dir, t), MANIFEST).crc32] for t, _ in elements]
    done = os.path.join(out, MANIFEST)
    if os.path.isfile(done):
        with open(done) as f:
            if json.load(f).get("source", {}).get("chain") == fingerprint:
                return out
        shutil.rmtree(out)
    _verify(ckpt_dir, elements)
    target = elements[-1][1]
    root = os.path.join(ckpt_dir, tag)
    os.makedirs(out, exist_ok=True)
    records, params = [], {}
    for name, record in target["params"].items():
        record = dict(record)
        if "table" in record:
            full: dict[str, torch.Tensor] = {}
            for t, manifest in elements:
                rows, values = _table_rows(os.path.join(ckpt_dir, t), name, manifest["params"][name])
                if rows is None:
                    full = values
                else:
                    for key, value in values.items():
                        full[key][rows] = value
            record.pop("table")
            record["file"] = param_file(name)
            records.append(write_tensors(out, record["file"], full))
        else:
            os.makedirs(os.path.dirname(os.path.join(out, record["file"])), exist_ok=True)
            shutil.copyfile(os.path.join(root, record["file"]), os.path.join(out, record["file"]))
            records.append(file_record(out, record["file"]))
        params[name] = record
    for relpath in (BUFFERS, STATE):
        shutil.copyfile(os.path.join(root, relpath), os.path.join(out, relpath))
        records.append(file_record(out, relpath))
    body = {k: v for k, v in target.items() if k not in ("differential", "files", "format", "version")}
    body["params"] = params
    body["source"] = dict(body["source"], chain=fingerprint, differential=target["differential"])
    write_manifest(out, body, records)
    return out
