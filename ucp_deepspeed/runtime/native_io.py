"""DeepSpeed's own checkpoint file IO, made safe: every file a save writes is bound to the save, and
every file a load reads is unpickled without running code and checked byte for byte.

DeepSpeed writes and reads each checkpoint file through its engine's `checkpoint_engine`
(`create`, `save(state_dict, path)` per file, `commit` once the save is whole, `load(path,
map_location)`), for model states, optimizer partitions, expert and pipeline-layer files alike, and
whichever engine the config picks: torch's, the python writer, a decoupled writer that writes in
another process after `save` returns, or our asynchronous one. `bind` puts one `BoundEngine` in front
of it:

- save: a file the engine writes at once, whole (torch's engine, DeepSpeed's python and fast writers), is written
  under a temporary name of this rank's (FastPersist's data-parallel writers add `-<rank>.<writers>` to it, which the
  rename drops, so the tag holds DeepSpeed's names), by a `torch.save` without its CRC pass whose CRCs are filled in
  after (`torch_file.fill_crcs`: the same archive, in half a save's time), gets the current save id
  (`torch_file.stamp`), which our metadata for the tag also records, and is renamed into place: DeepSpeed's python
  writer has every data-parallel writer write the same replicated model-states file, and no rank may read or stamp a
  file another is still writing. A file an engine writes later or elsewhere (a decoupled writer's process) is
  remembered with the save id and stamped at `commit`, once every rank's engine has finished its files, by one rank
  per file (a FastPersist part by its own rank, which renames it to DeepSpeed's name; an engine that `stamps_itself`,
  ours, stamps each file before it appears);
- load: `torch.load(weights_only=True)` with only DeepSpeed's own checkpoint classes allowed
  (and those the user names in `UCP_ALLOW_PICKLE`), reading through `VerifyingReader` so every
  record torch reads is checked against its CRC-32, and refusing a file whose save id differs from
  the one the tag's metadata records.

A record that fails its CRC is noted, not raised, while DeepSpeed's load runs: each rank reads
its own files, and one rank raising in the middle of a load that the others finish would leave
them waiting in a collective. The caller raises the noted problem on every rank afterwards
(`Guard.take_problem`).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from typing import IO, Any, cast

import torch
import torch.distributed as tdist

from ucp_deepspeed import compat
from ucp_deepspeed.compat import deepspeed_safe_globals, user_safe_globals
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.commit import CommitRecord, write_commit
from ucp_deepspeed.format.paths import LATEST
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.atomic import atomic_path, written_back
from ucp_deepspeed.io.safe_pickle import UnsafePickle, hint
from ucp_deepspeed.io.torch_file import VerifyingReader, check_save_id, fill_crcs, stamp
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.collective import all_ok, coordinated, every_rank, failure_of, on_rank0, to_rank0
from ucp_deepspeed.runtime.write_worker import upload_file

# torch's weights-only refusals of a global, as its unpickler words them before they are wrapped in advice
_NOT_ALLOWED = re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global by default\.")
_BLOCKED = re.compile(r"Trying to load unsupported GLOBAL (\S+) whose module (\S+) is blocked\.")


def _refusal(exc: pickle.UnpicklingError) -> str:
    """One line for what torch's weights-only unpickler refused, read from the error it raised inside (the one it
    raises wraps that in advice to load the file unsafely, and may quote text the file chose)."""
    inner = exc.__context__ if isinstance(exc.__context__, Exception) else exc
    if isinstance(inner, UnsafePickle):  # a checked global of ours (`member_by_name`) said why
        return str(inner)
    text = str(inner)
    if found := _NOT_ALLOWED.match(text):
        module, _, name = found.group(1).rpartition(".")
        return hint(module or "builtins", name)  # torch names a builtin without its module (`GLOBAL eval`)
    if found := _BLOCKED.match(text):
        return f"refusing to unpickle global '{found.group(1)}': torch never loads from module {found.group(2)}"
    first = text.strip().splitlines()[0] if text.strip() else type(inner).__name__
    return f"cannot unpickle ({first[:300]})"


def safe_load(
    path: str, map_location: Any = None, save_id: str = "", verify: bool = True, on_damage: Any = None
) -> Any:
    """`torch.load` that runs no code from the file, checks every record it reads, and (given one) the save id.

    A damaged record raises, or is passed to `on_damage(error)` if given (the load then completes).
    """
    with VerifyingReader(path, verify) as reader:
        check_save_id(path, reader.save_id, save_id)
        try:
            with torch.serialization.safe_globals(deepspeed_safe_globals() + user_safe_globals()):
                obj = torch.load(cast(IO[bytes], reader), map_location=map_location, weights_only=True)
        except CheckpointError:  # the reader's own, naming the file and the record
            raise
        except pickle.UnpicklingError as exc:
            raise CheckpointError(path, _refusal(exc)) from None
        except (RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(path, f"truncated or corrupt torch file ({str(exc)[:300]})") from None
        except Exception as exc:  # an allowed callable given what it does not take (a TypeError, say)
            raise CheckpointError(path, f"cannot unpickle ({type(exc).__name__}: {str(exc)[:300]})") from None
        if verify:
            try:
                reader.check()
            except CheckpointError as exc:
                if on_damage is None:
                    raise
                on_damage(exc)
        return obj


class Guard:
    """What the bound checkpoint engine needs to know: the save in progress, each tag's save id, and the group its
    commit waits for the other ranks on (the checkpointer's own, `collective.coordination_group`)."""

    def __init__(self, verify: bool):
        self.verify = verify
        self.group: Callable[[], Any] = lambda: None
        self.save_id = ""
        self.expected: dict[str, str] = {}  # tag folder -> save id its metadata records
        self.problem: CheckpointError | None = None  # the first damaged record a load read
        # a save to an object store: (location, size) of each object this rank sent and the store acknowledged, the
        # first upload that failed (raised on every rank at the commit, not mid-save, where the others would wait),
        # and per tag folder the save id and whether `latest` should name it once committed
        self.uploads: list[tuple[str, int]] = []
        self.upload_failure: CheckpointError | None = None
        self.pending: dict[str, tuple[str, bool]] = {}
        # the `latest` DeepSpeed writes (in place, unsynced) after a commit this rank made, until it is made durable
        self.latest_written: str | None = None

    def sync_latest(self) -> None:
        """Make the `latest` DeepSpeed wrote after the last commit durable (its bytes and its name): DeepSpeed writes
        it with a plain `open`, and a crash could take back the commit it records."""
        path, self.latest_written = self.latest_written, None
        if path is not None and st.isfile(path):
            st.make_durable(path)

    def damaged(self, exc: CheckpointError) -> None:
        """Note a damaged record read during a load; the first one is kept."""
        self.problem = self.problem or exc

    def take_problem(self) -> CheckpointError | None:
        """The damage noted since the last call, if any."""
        problem, self.problem = self.problem, None
        return problem

    def expect(self, tag_dir: str, save_id: str) -> None:
        """Files read from `tag_dir` must carry `save_id` (empty: the save recorded none)."""
        self.expected[st.realpath(tag_dir)] = save_id

    def uploaded(self, path: str, size: int) -> None:
        """Note an object of the save in progress that the store acknowledged."""
        self.uploads.append((path, size))

    def upload_failed(self, path: str, exc: BaseException) -> None:
        """Note a failed upload; the save goes on, and fails on every rank at its commit."""
        reason = exc.reason if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        self.upload_failure = self.upload_failure or CheckpointError(path, f"upload failed: {reason}")


class BoundEngine:
    """Any of DeepSpeed's checkpoint engines, with saves bound by a save id and loads checked (see the module
    docstring). Everything else DeepSpeed asks of it (`create`, `is_decoupled`, `get_commit_info`, `makedirs`,
    `is_data_parallel_writer`, `cleanup`, ...) is the wrapped engine's own."""

    def __init__(self, inner: Any, guard: Guard, suffix: str = ""):
        self.inner, self.ucp_guard = inner, guard
        self.suffix = suffix  # what the engine adds to each name (FastPersist's parts); the save drops it
        self._written: list[tuple[str, str]] = []  # (path, save id) of files saved but not yet committed
        if getattr(inner, "stamps_itself", False):
            inner.ucp_guard = guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def makedirs(self, path: str, exist_ok: bool = False) -> Any:
        """The wrapped engine's `makedirs`; a store has no folders to make."""
        return None if st.is_url(path) else self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Write one file through the wrapped engine; it is stamped at commit, once it is surely on disk. A file for
        an object store is spooled locally, stamped and sent whole (an asynchronous engine does that itself)."""
        guard = self.ucp_guard
        if st.is_url(path) and not getattr(self.inner, "stamps_itself", False):
            try:
                size = upload_file(path, state_dict, guard.save_id)
            except Exception as exc:  # noted, raised on every rank at the commit
                guard.upload_failed(path, exc)
            else:
                guard.uploaded(path, size)
            return
        if getattr(self.inner, "stamps_itself", False):
            self.inner.save(state_dict, path)
            return
        writes = compat.checkpoint_writes(self.inner)
        if writes is compat.Writes.WHOLE:
            with atomic_path(path) as tmp:  # this rank's own file, whole and stamped before it takes the name
                try:
                    # torch's CRC pass is most of a save's time; ours fills the same CRCs in at memory speed
                    with compat.crcs_left_to_us() as crcs_later, written_back(tmp + self.suffix):
                        self.inner.save(state_dict, tmp)
                    if self.suffix:
                        st.rename_local(tmp + self.suffix, tmp)
                finally:
                    if self.suffix and st.exists(tmp + self.suffix):
                        st.delete(tmp + self.suffix)
                if crcs_later:
                    fill_crcs(tmp)
                if guard.save_id:
                    stamp(tmp, guard.save_id)
            return
        self.inner.save(state_dict, path)
        if guard.save_id and writes is compat.Writes.LATER:
            self._written.append((path, guard.save_id))

    def commit(self, info: Any) -> Any:
        """The wrapped engine's commit (a decoupled writer finishes its files here), then each file written later
        gets its id; on an object store, the tag's commit object and `latest` (collective)."""
        with coordinated(self.ucp_guard.group()):
            uploaded = getattr(self.inner, "uploaded", None)
            finished = uploaded() if callable(uploaded) else []
            result = self.inner.commit(info)
            written, self._written = self._written, []
            _stamp_once(written, self.suffix)
            if st.is_url(str(info.save_dir)):
                self._commit_to_store(info, finished)
            elif info.save_latest and tdist.get_rank() == 0:  # DeepSpeed writes it once this returns
                self.ucp_guard.latest_written = st.join(str(info.save_dir), LATEST)
        return result

    def _commit_to_store(self, info: Any, finished: list[tuple[str, int]]) -> None:
        guard = self.ucp_guard
        uploads, guard.uploads = guard.uploads + finished, []
        failure, guard.upload_failure = guard.upload_failure, None
        tag_dir = st.join(str(info.save_dir), str(info.tag))
        save_id, latest = guard.pending.pop(tag_dir, ("", False))
        try:
            commit_to_store(tag_dir, save_id, uploads, failure, latest)
        finally:
            st.unplace(tag_dir)  # a load learns the placement from the keys object

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file without running code from it, every record checked."""
        guard = self.ucp_guard
        expected = guard.expected.get(st.realpath(st.dirname(path)), "")
        return safe_load(path, map_location, expected, guard.verify, guard.damaged)


def _stamp_once(written: list[tuple[str, str]], suffix: str) -> None:
    """Give each file written later (by a decoupled writer's process) its save id, once every rank's engine has
    committed, so every file of the save is whole: a file several ranks wrote (the replicated model states) by the
    first of them alone. A file the writer named with a `suffix` (FastPersist's `-<rank>.<writers>`, this rank's
    own) is stamped by this rank and takes the name DeepSpeed asked for. A failure on any rank fails the commit on
    every rank (collective)."""
    everyone = every_rank(written)
    first: dict[str, int] = {}
    for rank, files in enumerate(everyone):
        for path, _ in files:
            first.setdefault(path, rank)
    failure = None
    try:
        for path, save_id in written:
            if suffix:
                stamp(path + suffix, save_id)
                st.rename_local(path + suffix, path)
            elif first[path] == tdist.get_rank():
                stamp(path, save_id)
    except Exception as exc:
        failure = failure_of(exc)
    all_ok(failure)


def commit_to_store(
    tag_dir: str, save_id: str, uploads: list[tuple[str, int]], failure: CheckpointError | None, latest: bool
) -> None:
    """Finish a save to an object store once every rank's objects are acknowledged: rank 0 writes the tag's commit
    object, listing every object, and then, if asked, `latest`. A failed upload on any rank fails the save on every
    rank before anything is committed (collective)."""
    all_ok((failure.path, failure.reason) if failure is not None else None)
    prefix = tag_dir.rstrip("/") + "/"
    gathered = to_rank0([(path[len(prefix) :], size) for path, size in uploads if path.startswith(prefix)])

    def commit() -> None:
        objects = tuple(sorted({entry for rank in gathered or [] for entry in rank}))
        write_commit(tag_dir, CommitRecord(save_id, objects))
        if latest:
            st.write(st.join(st.dirname(tag_dir), LATEST), st.basename(tag_dir))

    on_rank0(commit)


def bind(engine: Engine, verify: bool = True) -> Guard:
    """Put a `BoundEngine` in front of the engine's checkpoint engine (once); returns its guard."""
    ce = engine.checkpoint_engine
    if isinstance(ce, BoundEngine):
        return ce.ucp_guard
    if ce is None:  # DeepSpeed builds none for ZeRO-3 without an optimizer, which it cannot save
        return Guard(verify)
    if getattr(ce, "zipfile_serialization", True) is False:
        raise NotImplementedError(
            "universal checkpointing reads torch's zip archives; remove "
            '"checkpoint_serialization": false from the DeepSpeed config'
        )
    guard = Guard(verify)
    engine.checkpoint_engine = BoundEngine(ce, guard, compat.written_suffix(engine))
    return guard


def unbound(engine: Engine) -> Any:
    """The checkpoint engine DeepSpeed built (or that replaced it), without our binding."""
    ce = engine.checkpoint_engine
    return ce.inner if isinstance(ce, BoundEngine) else ce


def rebind(engine: Engine, inner: Any) -> None:
    """Swap the checkpoint engine behind the binding (an asynchronous one for a synchronous one)."""
    ce = engine.checkpoint_engine
    engine.checkpoint_engine = BoundEngine(inner, ce.ucp_guard) if isinstance(ce, BoundEngine) else inner
