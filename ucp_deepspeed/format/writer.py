"""The one writer of universal folders: every importer, conversion and save builds its folder here.

A universal folder is complete only once its manifest exists, and the manifest must list exactly the files that were
written, with their CRCs, beside a record of each parameter that names its file. Assembling that by hand in every
module (write a file, keep its `FileRecord`, build a `ParamRecord` naming the same path, pickle the training state
with the right keys, write the manifest last) repeated the format's rules seven times. `UniversalFiles` writes the
files and returns their records, for writers split over threads, processes or ranks; `UniversalWriter` also keeps
the parameter and buffer tables and writes the manifest last, as the commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import (
    BufferRecord,
    Counters,
    FileRecord,
    GroupRecord,
    Manifest,
    ParamRecord,
    SourceRecord,
    dtype_name,
    written_by,
)
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.universal import (
    BUFFERS,
    STATE,
    Folder,
    copy_checked,
    param_file,
    stream_tensors,
    write_manifest,
    write_object,
    write_tensors,
)


@dataclass(frozen=True)
class TrainingState:
    """The non-tensor training state a universal folder's `state.pt` holds and a restore hands back."""

    lr_scheduler: Any = None
    """The LR scheduler's `state_dict`; None when the source had none."""
    client_state: Any = field(default_factory=dict)
    """Model-parallel rank 0's client state (everything a save kept beside the engine's own state)."""
    optimizer_wrapper: dict[str, Any] = field(default_factory=dict)
    """The ZeRO or mixed-precision wrapper's own state (loss scaler, overflow counters)."""
    client_states: Sequence[Any] | None = None
    """Each model-parallel rank's client state, by model-states file index, where the source kept one per rank."""
    data_sampler: Any = None
    """DeepSpeed's data sampler state (`engine.deepspeed_io` with data efficiency's curriculum learning): where the
    data stands, one global position that every data-parallel size continues from; None when the source had none."""
    data_sampler_rng: Any = None
    """That sampler's own numpy generator state (`SaveMeta.data_sampler_rng`)."""
    data_loaders: Sequence[dict[str, Any]] | None = None
    """Each saving rank's data-loader record (`format.data_position.LoaderRecord.encode`), by rank; None when the
    save was given no data loader."""

    def encode(self) -> dict[str, Any]:
        """The object `state.pt` pickles (its keys in the order every reader has seen them)."""
        body = {"lr_scheduler": self.lr_scheduler, "client_state": self.client_state}
        if self.client_states is not None:
            body["client_states"] = list(self.client_states)
        body["optimizer_wrapper"] = self.optimizer_wrapper
        if self.data_sampler is not None:
            body["data_sampler"] = self.data_sampler
            body["data_sampler_rng"] = self.data_sampler_rng
        if self.data_loaders is not None:
            body["data_loaders"] = list(self.data_loaders)
        return body


@dataclass(frozen=True)
class UniversalFiles:
    """The files of one universal folder, each written atomically and returned as the record its manifest lists.

    It holds nothing but the folder, so the threads and processes of a conversion share one and rank 0 hands every
    record they return to `UniversalWriter.add_files`.
    """

    root: str

    def param(self, name: str, tensors: Mapping[str, torch.Tensor], *, file: str | None = None) -> FileRecord:
        """Write a trainable parameter's fp32 master and optimizer states, so a restore reads any range of them.

        Args:
            name: the parameter's global name.
            tensors: state name (`fp32`, `exp_avg`, ...) -> full tensor; an extension may store other tensors.
            file: the relative path, when an extension stores the parameter elsewhere (Check-N-Run's tables).
        Returns:
            The file's record.
        """
        return write_tensors(self.root, file or param_file(name), dict(tensors))

    def stream_param(
        self, name: str, *, shape: tuple[int, ...], keys: Sequence[str], produce: Callable[[str], torch.Tensor]
    ) -> FileRecord:
        """Write a trainable parameter's fp32 states one at a time, so a conversion holds one tensor, not all.

        Args:
            name: the parameter's global name.
            shape: the full shape every state has.
            keys: the states, in file order (`fp32` first).
            produce: called once per key, in order, for its fp32 tensor.
        Returns:
            The file's record.
        """
        entries = [(key, torch.float32, shape) for key in keys]
        return stream_tensors(self.root, param_file(name), entries, produce)

    def frozen(self, name: str, value: torch.Tensor) -> FileRecord:
        """Write a frozen parameter's value in its own dtype, where a restore finds it by name.

        Args:
            name: the parameter's global name.
            value: the full tensor.
        Returns:
            The file's record.
        """
        return write_tensors(self.root, param_file(name), {VALUE: value})

    def buffers(self, buffers: Mapping[str, torch.Tensor]) -> FileRecord:
        """Write the persistent module buffers (every folder has the file, empty when the model has none).

        Args:
            buffers: global name -> full tensor, in its own dtype.
        Returns:
            The file's record.
        """
        return write_tensors(self.root, BUFFERS, dict(buffers))

    def state(self, state: TrainingState) -> FileRecord:
        """Write the non-tensor training state (every folder has it, so a restore never guesses a default).

        Args:
            state: the scheduler, client and wrapper state.
        Returns:
            The file's record.
        """
        return write_object(self.root, STATE, state.encode())


class UniversalWriter:
    """Writes one universal folder: its tensor files, its training state, and last its manifest, the commit.

    A folder is a universal checkpoint only once `manifest.json` exists, and that manifest must list every file with
    its CRCs and a record for every parameter naming its file. The writer keeps those tables as the files are
    written, so no caller builds a `FileRecord` or `ParamRecord` by hand, and it writes the manifest only in
    `finish` (or `commit`): an exception inside the `with` block, or leaving it without finishing, leaves no
    manifest, and the folder is not a universal folder. Files written elsewhere (a conversion's other ranks and
    processes, through `UniversalFiles`) join with `add_files` before rank 0 commits.

    Args:
        root: the folder to write (local path or store URL); the caller has claimed it (`check_output`, `claimed`).

    Example:
        >>> with UniversalWriter(root="out.universal") as writer:
        ...     writer.add_param("w", {"fp32": w, "exp_avg": m, "exp_avg_sq": v}, group=0)
        ...     writer.add_frozen("embed.weight", embed)
        ...     writer.add_buffers({"norm.running_mean": mean})
        ...     writer.set_state(TrainingState(client_state={"epoch": 3}))
        ...     source = SourceRecord("ckpt", None, Topology(dp=1, zero_stage=0, dtype="fp32"))
        ...     writer.finish(source=source, counters=Counters())
        'out.universal/manifest.json'
    """

    def __init__(self, *, root: str):
        self.files = UniversalFiles(root)
        self._records: list[FileRecord] = []
        self._params: dict[str, ParamRecord] = {}
        self._buffers: dict[str, BufferRecord] | None = None
        self._state = False
        self._open = True

    def __enter__(self) -> UniversalWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._open = False

    @property
    def root(self) -> str:
        """The folder written."""
        return self.files.root

    @property
    def params(self) -> Mapping[str, ParamRecord]:
        """The parameters added so far, by global name, in the order the manifest lists them."""
        return MappingProxyType(self._params)

    @property
    def nbytes(self) -> int:
        """The bytes of every file written or added so far."""
        return sum(r.nbytes for r in self._records)

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"{self.root}: the writer is closed; its folder takes no more files")

    def _keep(self, write: Callable[[], FileRecord]) -> FileRecord:
        """Write one file and keep its record; a closed writer refuses before anything is written."""
        self._check_open()
        record = write()
        self._records.append(record)
        return record

    def add_param(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        group: int,
        dtype: str = "float32",
        shape: tuple[int, ...] | None = None,
        keys: Sequence[str] | None = None,
        file: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ParamRecord:
        """Write a trainable parameter's states and record it.

        Args:
            name: the parameter's global name.
            tensors: state name -> full fp32 tensor, `fp32` (the master) among them unless `shape` and `keys` say
                what an extension stores instead.
            group: its optimizer param group.
            dtype: the dtype the model holds it in (`bfloat16` under mixed precision), as `dtype_name` names it.
            shape: its full shape; by default the master's.
            keys: its states in the manifest; by default `fp32`, then the other tensors' names sorted.
            file: the relative path, when an extension stores it elsewhere (Check-N-Run's `tables/`).
            extra: fields an extension adds to the record (Check-N-Run's `table`).
        Returns:
            The parameter's record.
        """
        self._keep(lambda: self.files.param(name, tensors, file=file))
        record = ParamRecord(
            shape=tuple(tensors[FP32].shape) if shape is None else shape,
            dtype=dtype,
            group=group,
            trainable=True,
            file=file or param_file(name),
            keys=(FP32, *sorted(k for k in tensors if k != FP32)) if keys is None else tuple(keys),
            extra=extra or {},
        )
        self._params[name] = record
        return record

    def add_written(self, name: str, file: FileRecord, record: ParamRecord) -> None:
        """Take a parameter whose file another rank or process wrote (`UniversalFiles.param`), with its record.

        Args:
            name: the parameter's global name.
            file: what the write returned.
            record: the parameter's record, naming that file.
        """
        self._check_open()
        if record.file != file.path:
            raise CheckpointError(self.root, f"{name}: its record names {record.file}, the file written is {file.path}")
        self._records.append(file)
        self._params[name] = record

    def add_frozen(self, name: str, value: torch.Tensor, *, dtype: str | None = None) -> ParamRecord:
        """Write a frozen parameter's value and record it (no param group, no optimizer state).

        Args:
            name: the parameter's global name.
            value: the full tensor, in the dtype it is stored in.
            dtype: the dtype to record, where the model holds it otherwise; by default the value's.
        Returns:
            The parameter's record.
        """
        self._keep(lambda: self.files.frozen(name, value))
        record = ParamRecord(
            shape=tuple(value.shape),
            dtype=dtype_name(value.dtype) if dtype is None else dtype,
            group=None,
            trainable=False,
            file=param_file(name),
            keys=(VALUE,),
        )
        self._params[name] = record
        return record

    def add_buffers(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Write every persistent buffer, in one file, and record them.

        Args:
            buffers: global name -> full tensor in its own dtype; empty when the model has none.
        """
        self._keep(lambda: self.files.buffers(buffers))
        self._buffers = {n: BufferRecord(tuple(b.shape), dtype_name(b.dtype)) for n, b in buffers.items()}

    def set_state(self, state: TrainingState) -> None:
        """Write the non-tensor training state.

        Args:
            state: the scheduler, client and wrapper state; `TrainingState()` when training starts afresh.
        """
        self._keep(lambda: self.files.state(state))
        self._state = True

    def add_files(self, records: Iterable[FileRecord]) -> None:
        """Take files written by other threads, processes or ranks (`UniversalFiles`) into the manifest's table.

        Args:
            records: what their writes returned.
        """
        self._check_open()
        self._records.extend(records)

    def copy(self, folder: Folder, relpath: str) -> FileRecord:
        """Copy one file of another folder unchanged, checking its blocks as they are read.

        Args:
            folder: the folder read.
            relpath: the file's path, the same in both folders.
        Returns:
            The copy's record.
        """
        return self._keep(lambda: copy_checked(folder, relpath, self.root))

    def finish(
        self,
        *,
        source: SourceRecord,
        counters: Counters,
        param_groups: Sequence[GroupRecord] = (),
        tied: Mapping[str, str] | None = None,
        frozen_excluded: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Write the manifest of what was added, last: from here on the folder is a universal checkpoint.

        Args:
            source: where the checkpoint came from.
            counters: the step counters at the save.
            param_groups: each optimizer param group's hyperparameters and scalar state, by group index.
            tied: parameters that are copies of another, by global name.
            frozen_excluded: whether the save left frozen parameters out.
            extra: the manifest's other sections (`model`, `notes`, an extension's).
        Returns:
            The manifest's path.
        """
        if self._buffers is None or not self._state:
            raise RuntimeError(f"{self.root}: buffers and training state must be written before the manifest")
        return self.commit(
            Manifest(
                created_by=written_by(),
                source=source,
                counters=counters,
                param_groups=tuple(param_groups),
                params=dict(self._params),
                buffers=self._buffers,
                tied=dict(tied or {}),
                frozen_excluded=frozen_excluded,
                extra=dict(extra or {}),
            )
        )

    def commit(self, manifest: Manifest) -> str:
        """Write a manifest built elsewhere (a conversion's, from its source; a chain's full copy), last.

        Args:
            manifest: the body; every file it names must have been written or added here.
        Returns:
            The manifest's path.
        """
        self._check_open()
        written = {r.path for r in self._records}
        missing = sorted(({r.file for r in manifest.params.values()} | {BUFFERS, STATE}) - written)
        if missing:
            raise CheckpointError(self.root, f"{len(missing)} files the manifest names were not written: {missing[:5]}")
        path = write_manifest(self.root, manifest, self._records)
        self._open = False
        return path
