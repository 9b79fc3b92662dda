"""Which tag of a checkpoint directory to resume from: the newest one that was written completely.

A job killed while saving leaves a tag folder with missing or truncated rank files, and DeepSpeed
may already have pointed `latest` at it. A tag counts as complete when every model-parallel rank's
metadata is there and every rank file opens as a whole torch archive of this save (its zip
directory and pickle read and check out, it carries the save id, and it agrees with the metadata;
tensor bytes are checked against their CRCs when read).

A save into the tag `latest` names (a fixed tag saved again and again, as PyTorch Lightning's `"checkpoint"` is) would
destroy the only complete save while it writes: `set_aside` first moves that save to a tag of its own, which a save
killed part-way leaves for the resume to fall back to, and which is deleted once the new save is committed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.commit import COMMIT, uncommitted_reason
from ucp_deepspeed.format.kinds import kind_of
from ucp_deepspeed.format.paths import LATEST, latest_tag
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import NativeCheckpoint, list_tags
from ucp_deepspeed.sources.infer import GroupOrder, Placement
from ucp_deepspeed.sources.native import tag_metas

log = logging.getLogger("ucp_deepspeed")
_STEP = re.compile(r"(\d+)$")
SET_ASIDE = "ucp-replaced-"
"""The prefix of the tag the previous save of a tag is kept under while that tag is saved again (it keeps the tag's
trailing step number, so it sorts beside it)."""


def incomplete_reason(
    ckpt_dir: str, tag: str, *, layout_rules: Any = None, order: GroupOrder | Placement | None = None
) -> str | None:
    """Why a tag cannot be resumed from (a missing or unreadable file), or None when it is complete; `layout_rules`
    and `order` read one saved without ucp metadata (`tag_metas`)."""
    try:
        kind = kind_of(st.join(ckpt_dir, tag))
    except CheckpointError as exc:
        return str(exc)
    if kind is not None:
        try:
            kind.needs(ckpt_dir, tag)
        except CheckpointError as exc:
            return str(exc)
        return None
    if st.is_url(ckpt_dir):  # on a store, objects of a torn save look whole: only the commit object tells
        try:
            reason = uncommitted_reason(st.join(ckpt_dir, tag))
        except CheckpointError as exc:
            return str(exc)
        if reason is not None:
            return f"{st.join(ckpt_dir, tag)}: {reason}"
    try:
        NativeCheckpoint(
            ckpt_dir, tag, layout_rules, metas=tag_metas(st.join(ckpt_dir, tag), layout_rules, order)
        ).close()
    except CheckpointError as exc:
        return str(exc)
    return None


def _order(ckpt_dir: str, tag: str) -> tuple[int, float]:
    found = _STEP.search(tag)
    # a store's folder has no time of its own: its commit object's is when the save finished
    folder = st.join(ckpt_dir, tag)
    when = st.join(folder, COMMIT) if st.is_url(folder) else folder
    try:
        return (int(found.group(1)) if found else -1, st.mtime(when) if st.exists(when) else 0.0)
    except st.PlacementError:  # a spread tag whose keys object is bad: no time of its own, and never complete
        return (int(found.group(1)) if found else -1, 0.0)


def newest_complete(ckpt_dir: str, refused: Sequence[str] = (), **plain: Any) -> str | None:
    """The newest complete tag (by trailing step number, then folder time) older than every `refused` one; torn
    ones are logged and skipped (`plain`: as `incomplete_reason` takes them)."""
    tags = sorted(list_tags(ckpt_dir), key=lambda t: _order(ckpt_dir, t), reverse=True)
    if refused:
        oldest = min(_order(ckpt_dir, t) for t in refused)
        tags = [t for t in tags if _order(ckpt_dir, t) < oldest]
    for tag in tags:
        reason = incomplete_reason(ckpt_dir, tag, **plain)
        if reason is None:
            return tag
        log.warning("ucp: skipping incomplete checkpoint %s: %s", tag, reason)
    return None


def resume_tag(ckpt_dir: str, refused: Sequence[str] = (), **plain: Any) -> str | None:
    """The tag to resume from: the one `latest` names if it is complete, else the newest complete one; after
    `refused` tags (which failed to load), the newest complete one older than them (`plain`: as `incomplete_reason`
    takes them)."""
    if refused:
        return newest_complete(ckpt_dir, refused, **plain)
    latest = latest_tag(ckpt_dir)
    if latest is not None:
        reason = incomplete_reason(ckpt_dir, latest, **plain)
        if reason is None:
            return latest
        log.warning(
            "ucp: 'latest' names %s, which is incomplete (%s); looking for an older complete one", latest, reason
        )
    return newest_complete(ckpt_dir, **plain)


def fallback_tag(ckpt_dir: str, refused: Sequence[str], **plain: Any) -> str | None:
    """The tag to resume from after the `refused` ones failed to load (none, at first): `resume_tag`; None when
    every complete tag was refused (the caller reports why the first failed); with none refused and no complete tag,
    a `CheckpointError` saying what is wrong with the newest."""
    tag = resume_tag(ckpt_dir, refused, **plain)
    if tag is not None or refused:
        return tag
    newest = latest_tag(ckpt_dir) or next(reversed(list_tags(ckpt_dir)), None)
    if newest is None:
        raise CheckpointError(st.join(ckpt_dir, LATEST), "'latest' is empty and there are no tag folders")
    reason = incomplete_reason(ckpt_dir, newest, **plain) or "unreadable"
    raise CheckpointError(
        ckpt_dir, f"holds no complete checkpoint to resume from; the newest, {newest}, is not: {reason}"
    )


def _needs(ckpt_dir: str, tag: str) -> list[str]:
    kind = kind_of(st.join(ckpt_dir, tag))
    return [tag] if kind is None else kind.needs(ckpt_dir, tag)


def set_aside(ckpt_dir: str, tag: str) -> str | None:
    """Before a save into the tag `latest` names, move that tag's save to `ucp-replaced-<tag>` and return that name,
    so that a save killed part-way leaves a complete one behind; None when there is nothing to keep (no such tag, or
    an object store, whose save is committed by its commit object instead).

    When the folder aside is already there, an earlier save into the tag was killed: the tag is dropped if it is
    incomplete (the save aside is still the newest complete one), else the older save aside is."""
    if st.local_path(ckpt_dir) is None or latest_tag(ckpt_dir) != tag or not st.isdir(st.join(ckpt_dir, tag)):
        return None
    aside = SET_ASIDE + tag
    folder, kept = st.join(ckpt_dir, tag), st.join(ckpt_dir, aside)
    if st.isdir(kept):
        reason = incomplete_reason(ckpt_dir, tag)
        if reason is not None:
            log.warning("ucp: %s is incomplete (%s); %s stays the save to fall back to", folder, reason, aside)
            st.delete(folder)
            return aside
        st.delete(kept)
    st.rename_local(folder, kept)
    return aside


def drop_aside(ckpt_dir: str, aside: str) -> None:
    """Delete the save `set_aside` kept, once the save that replaced it is committed on every rank."""
    folder = st.join(ckpt_dir, aside)
    if st.isdir(folder):
        st.delete(folder)


def prune(ckpt_dir: str, keep: int) -> list[str]:
    """Keep the `keep` newest complete tags and the one `latest` names; delete older tags, torn ones among them, and
    their converted copies.

    A torn tag newer than the newest complete one is left alone: it may be a save still being written.
    Older tags that a kept tag needs (a Check-N-Run delta's chain) are kept too. Returns the deleted tags.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    tags = sorted(list_tags(ckpt_dir), key=lambda t: _order(ckpt_dir, t), reverse=True)
    complete = [t for t in tags if incomplete_reason(ckpt_dir, t) is None]
    if not complete:
        return []
    oldest_kept = _order(ckpt_dir, complete[min(keep, len(complete)) - 1])
    latest = latest_tag(ckpt_dir)  # what a restart would load first is never deleted, even if older
    kept = complete[:keep] + ([latest] if latest in complete[keep:] else [])
    needed = {t for k in kept for t in _needs(ckpt_dir, k)}
    doomed = [
        t for t in tags if t not in kept and t not in needed and t != latest and _order(ckpt_dir, t) < oldest_kept
    ]
    for tag in doomed:
        for path in (
            st.join(ckpt_dir, tag),
            st.join(ckpt_dir, f"{tag}.universal"),
            st.join(ckpt_dir, f"{tag}_universal"),
        ):
            if st.isdir(path):
                st.delete(path)
    return doomed
