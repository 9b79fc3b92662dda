"""Read the data-loader records a save wrote beside DeepSpeed's files (`format.data_position`)."""

from __future__ import annotations

from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import LOADER_FILE, checked_records
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import TorchFile, check_save_id, plain


def read_loader_records(
    tag_dir: str, ranks: int | None, save_id: str, verify: bool = True
) -> list[dict[str, Any]] | None:
    """Every rank's data-loader record of a tag, checked and in rank order; None when its metadata records none
    (`ranks`: `SaveMeta.data_loaders`).

    The file must carry the tag's save id (when the save recorded one), like DeepSpeed's own files of the tag."""
    if ranks is None:
        return None
    path = st.join(tag_dir, LOADER_FILE)
    if not st.isfile(path):
        raise CheckpointError(path, f"the tag's metadata records the data loaders of {ranks} ranks, but not this file")
    with TorchFile(path, verify) as opened:
        check_save_id(path, opened.save_id, save_id)
        records = checked_records(plain(opened.obj), path)
    if len(records) != ranks:
        raise CheckpointError(path, f"holds the data loaders of {len(records)} ranks; the metadata records {ranks}")
    return [r.encode() for r in records]
