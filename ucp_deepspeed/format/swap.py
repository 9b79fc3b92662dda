"""What a save records about the NVMe swap files DeepSpeed copies into its tag folder.

With `offload_optimizer: nvme`, ZeRO-3 keeps each large sub-group's fp32 partition and optimizer states in
raw files (`<ds_id>.tensor.swp`, `<state>-<ds_id>.tensor.swp`), which a save copies to
`offloaded_tensors/rank<NN>/`, where NN is the global rank (DeepSpeed's choice, not the data-parallel
rank that names the optimizer file). The files say nothing about themselves, so each saving rank writes
`ucp_swap_files.json` beside them: the optimizer file they belong to, the save id that binds them to it,
and each file's element count, byte size and one CRC-32 per MiB (so that a read checks only what it reads).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.checksum import BLOCK
from ucp_deepspeed.io.swap_file import file_block_crcs

if TYPE_CHECKING:  # the record's only use of it is the annotation
    from ucp_deepspeed import compat

OFFLOADED = "offloaded_tensors"
SWAP_RECORD = "ucp_swap_files.json"
_SWAP_NAME = re.compile(r"[A-Za-z0-9_.-]+\.tensor\.swp")
_MAX_RECORD = 64 << 20  # a 1 TB swap folder's record is about 15 MB
_OPTIM_NAME = re.compile(r"(bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]+_optim_states\.pt")


@dataclass(frozen=True)
class SwapFile:
    """One swap file: elements of the tensor (the rest is I/O alignment padding), bytes, a CRC-32 per MiB."""

    numel: int
    nbytes: int
    blocks: list[int]


@dataclass(frozen=True)
class SwapRecord:
    """The swap files one rank's save copied, by file name, and the optimizer file they complete."""

    optim_file: str
    save_id: str
    dtype: str
    files: dict[str, SwapFile]

    def to_json(self) -> str:
        """Serialise to the JSON written next to the swap files."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, path: str) -> SwapRecord:
        """Parse and validate a record, naming `path` in any error."""
        try:
            raw: dict[str, Any] = json.loads(text)
            record = cls(
                optim_file=str(raw["optim_file"]),
                save_id=str(raw["save_id"]),
                dtype=str(raw["dtype"]),
                files={str(k): SwapFile(**v) for k, v in dict(raw["files"]).items()},
            )
        except (KeyError, TypeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(path, f"swap record is malformed ({str(exc)[:200]})") from None
        if not _OPTIM_NAME.fullmatch(record.optim_file):
            raise CheckpointError(path, f"names {record.optim_file!r}, not an optimizer file of a tag folder")
        if record.dtype not in ("float32", "bfloat16", "float16"):
            raise CheckpointError(path, f"records swap files of dtype {record.dtype!r}")
        for name, entry in record.files.items():
            if not _SWAP_NAME.fullmatch(name):  # a bare file name: nothing outside the record's folder is read
                raise CheckpointError(path, f"names {name!r}, not a swap file of this folder")
            if not all(type(v) is int and v >= 0 for v in (entry.numel, entry.nbytes)):
                raise CheckpointError(path, f"{name}: sizes must be non-negative integers")
            crcs = entry.blocks
            if not isinstance(crcs, list) or not all(type(c) is int and 0 <= c < 1 << 32 for c in crcs):
                raise CheckpointError(path, f"{name}: block CRCs must be 32-bit integers")
            if len(entry.blocks) != -(-entry.nbytes // BLOCK):
                raise CheckpointError(path, f"{name}: {len(entry.blocks)} block CRCs for {entry.nbytes} bytes")
        return record


def write_swap_record(record: SwapRecord, folder: str) -> str:
    """Atomically write a rank's swap record into its `offloaded_tensors/rank<NN>` folder."""
    path = st.join(folder, SWAP_RECORD)
    st.write(path, record.to_json().encode())
    return path


def record_swap_files(swap: compat.NvmeSwap, folder: str, save_id: str) -> str:
    """Record the swap files DeepSpeed copied into `folder` for this rank's save (sizes, CRCs, the save id), so that
    a load can check what it reads of them."""
    files = {}
    for name in sorted(st.listdir(folder)):
        swap_id = name.removesuffix(".tensor.swp").rpartition("-")[2]  # `<ds_id>` or `<state>-<ds_id>`
        if name.endswith(".tensor.swp") and swap_id in swap.swapped:
            path = st.join(folder, name)
            files[name] = SwapFile(numel=swap.swapped[swap_id], nbytes=st.stat(path)[0], blocks=file_block_crcs(path))
    record = SwapRecord(optim_file=swap.optim_file, save_id=save_id, dtype=dtype_name(swap.dtype), files=files)
    return write_swap_record(record, folder)


def read_swap_records(tag_dir: str) -> dict[str, tuple[str, SwapRecord]]:
    """Every swap record of a tag folder: optimizer file name -> (its swap folder, the record)."""
    root = st.join(tag_dir, OFFLOADED)
    out: dict[str, tuple[str, SwapRecord]] = {}
    if not st.isdir(root):
        return out
    for entry in sorted(st.listdir(root)):
        path = st.join(root, entry, SWAP_RECORD)
        if not st.isfile(path):
            continue
        if st.islink(st.join(root, entry)) or st.islink(path):  # reads stay inside the tag folder
            raise CheckpointError(path, "a swap folder or record that is a symbolic link is not read")
        data = st.read(path, limit=_MAX_RECORD)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(path, "swap record is not UTF-8 text") from None
        record = SwapRecord.from_json(text, path)
        if record.optim_file in out:
            raise CheckpointError(path, f"a second swap record for {record.optim_file}")
        out[record.optim_file] = (st.join(root, entry), record)
    return out
