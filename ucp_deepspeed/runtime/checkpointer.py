"""One object that owns a DeepSpeed engine's universal checkpoints: what it saves, and how it loads any of them.

DeepSpeed saves each rank's partition of the training state (flat ZeRO partitions, tensor- and pipeline-parallel
slices, experts), so a job can resume only at the layout it saved with. `UniversalCheckpointer` wraps an engine's
`save_checkpoint` and `load_checkpoint`: a save also writes our metadata and binds every file to the save; a load
resumes at any layout, all or nothing. It owns the options, the checkpoint-engine binding (`native_io`), the gate
that refuses steps and saves after a load failed part-way, an extension's saver (Check-N-Run), retention and the
last load's report.

A load is one pipeline, each step callable on its own:

1. `source`: what to read, and how: a foreign folder (imported), a universal folder, an extension's tag
   (a Check-N-Run chain, read in place or materialized), DeepSpeed's own load (same layout), or a reshard
   of a DeepSpeed tag (read in place, or converted first). With no tag named, the newest complete one,
   falling back to older ones when a tag turns out damaged;
2. `run`: open the reader, verify and restore (staged, then committed: `runtime.restore`), or run DeepSpeed's
   own load behind the gate;
3. the report (`last_load`, also `engine.ucp_last_load`) and the saver's notice.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from ucp_deepspeed import compat
from ucp_deepspeed.convert.core import build_manifest
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.convert.output import claimed, remove_output
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import TagKind, kind_of
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.format.metadata import write_meta
from ucp_deepspeed.format.paths import LATEST, latest_tag
from ucp_deepspeed.format.swap import OFFLOADED, SwapFile, SwapRecord, write_swap_record
from ucp_deepspeed.format.universal import MANIFEST, TensorReader, UniversalCheckpoint
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.swap_file import file_block_crcs
from ucp_deepspeed.runtime.async_save import AsyncCheckpointEngine
from ucp_deepspeed.runtime.capture import describe, optimizer_record, same_stage, topology
from ucp_deepspeed.runtime.collective import (
    all_ok,
    barrier,
    coordinated,
    coordination_group,
    everywhere,
    from_rank0,
    guarded,
    on_rank0,
    to_rank0,
)
from ucp_deepspeed.runtime.config import UniversalConfig
from ucp_deepspeed.runtime.gate import Gate
from ucp_deepspeed.runtime.mpu import megatron_moe_layers
from ucp_deepspeed.runtime.native_io import bind, unbound
from ucp_deepspeed.runtime.plugins import ForeignFormat, foreign_formats, make_saver
from ucp_deepspeed.runtime.restore import restore
from ucp_deepspeed.runtime.shared_convert import convert_across_ranks
from ucp_deepspeed.sources import NativeCheckpoint, list_tags, resolve_tag
from ucp_deepspeed.sources.native import named_by_sp_rank, tag_metas
from ucp_deepspeed.sources.tags import incomplete_reason, prune, resume_tag

log = logging.getLogger("ucp_deepspeed")


@dataclass(frozen=True)
class LoadReport:
    """What the last `load_checkpoint` did, kept on the engine as `engine.ucp_last_load`."""

    mode: str
    saved: str
    live: str
    universal_dir: str | None
    kind: str | None = None
    """The registered tag kind (e.g. `checkn_run`) when the load restored one of an extension's tags."""
    direct: bool = False
    """Whether a resharding load read the saved files in place instead of a universal copy."""
    refused: tuple[str, ...] = ()
    """Newer tags that failed to load (damaged) before this one, picked because no tag was named, loaded."""

    def how(self) -> str:
        """How the load ran, in words (for a job's log): DeepSpeed's own load, a reshard read in place, or one
        through a universal copy."""
        if self.mode == "direct":
            return f"same layout {self.live}, read in place by byte range (DeepSpeed's own load reads local files only)"
        if self.mode != "resharded":
            return f"{self.mode} load"
        return f"resharded {self.saved} -> {self.live}, " + ("read in place" if self.direct else "via a copy")


@dataclass(frozen=True)
class Source:
    """What one load reads and how it is reported: `open` gives the reader, or None for DeepSpeed's own load."""

    path: str
    """What `load_checkpoint` returns as the loaded path."""
    report: LoadReport
    open: Callable[[], TensorReader] | None = None
    check_reads: Callable[[], None] | None = None
    """A collective check of everything every rank read, before the commit (the direct reader's CRCs)."""
    client_keys: tuple[str, ...] = ()
    """DeepSpeed's own load: the user's client_state keys (DeepSpeed mixes its bookkeeping in)."""
    hf_config: dict[str, Any] | None = None
    expect_save_id: str = ""
    discard: str | None = None
    """A converted copy to remove after the load (`keep: false`)."""


def _coordinated(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with the checkpointer's own group for every wait on another rank (`collective.coordinated`)."""

    @functools.wraps(method)
    def run(self: UniversalCheckpointer, *args: Any, **kwargs: Any) -> Any:
        with coordinated(self.group()):
            return method(self, *args, **kwargs)

    return run


class UniversalCheckpointer:
    """Universal checkpoints for one DeepSpeed engine (see the module docstring); built by `attach`."""

    def __init__(self, engine: Any, options: UniversalConfig):
        self.engine, self.options = engine, options
        self._native_save, self._native_load = engine.save_checkpoint, engine.load_checkpoint
        if options.async_save:
            engine.checkpoint_engine = AsyncCheckpointEngine(compat.engine_config(engine))
        self.files = bind(engine, options.verify)
        st.set_default_options(options.storage_options)
        compat.store_recovery_scripts(engine, st.is_url, st.write)
        self.gate = Gate()  # closed by a load that failed after it began writing into the engine
        compat.before_model_step(engine, lambda: self.gate.check("step"))
        self.group = coordination_group(options.wait_minutes)  # weak: released at exit
        # every file of a save carries `<run id>-<save count>`: unique per save, with no collective per save
        with coordinated(self.group()):
            self._run_id = from_rank0(uuid.uuid4().hex[:16] if tdist.get_rank() == 0 else None)
        self._saves = itertools.count(1)
        self.saver = make_saver(engine, options)  # an extension's save in place of DeepSpeed's (Check-N-Run)
        self.last_load: LoadReport | None = None
        self.hf_config: dict[str, Any] | None = None  # the Hugging Face config of the weights loaded last
        self._prune_dir: str | None = None  # a decoupled save's folder, pruned once the save is committed

    # --- saving -------------------------------------------------------------------------------------------------

    @_coordinated
    def wait(self) -> None:
        """Block until a pending asynchronous or decoupled checkpoint is written on every rank and `latest` names it
        (collective); then apply retention."""
        inner = unbound(self.engine)
        if isinstance(inner, AsyncCheckpointEngine):
            inner.wait()
        if inner.is_decoupled():
            compat.commit_decoupled_checkpoint(self.engine)
        if self._prune_dir is not None:
            self._retain(self._prune_dir)
            self._prune_dir = None

    @_coordinated
    def save(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's save (or an extension's), with our metadata and every file bound to this save."""
        engine = self.engine
        self.wait()
        self.gate.check("save")
        save_dir = _location(save_dir)
        url = st.is_url(save_dir)
        if url and compat.nvme_offload(engine):
            raise CheckpointError(
                save_dir,
                "NVMe optimizer offload keeps part of the state in local swap files that DeepSpeed copies with "
                "shutil; save it to a local folder (or a filesystem mounted from the store)",
            )
        client_state = client_state or {}
        tag = str(f"global_step{engine.global_steps}" if tag is None else tag)
        save_id = f"{self._run_id}-{next(self._saves)}"
        if self.saver is not None:
            self.saver.save(engine, save_dir, tag, client_state, save_latest, save_id)
            self._retain(save_dir)
            return True
        self.files.save_id = save_id
        meta = dataclasses.replace(describe(engine, tuple(client_state), self.hf_config), save_id=save_id)
        if exclude_frozen_parameters:
            meta = dataclasses.replace(
                meta, extras=tuple(e for e in meta.extras if e.kind != "frozen"), frozen_excluded=True
            )
        tag_dir = st.join(save_dir, tag)
        if url:  # the commit object, then `latest`, are written once every rank's objects are acknowledged
            self.files.pending[tag_dir] = (save_id, save_latest)
        if compat.data_parallel_rank(engine) == 0:
            try:
                path = write_meta(meta, tag_dir, engine.checkpoint_mp_rank)
            except Exception as exc:
                if not url:
                    raise
                self.files.upload_failed(st.join(tag_dir, "ucp_meta"), exc)  # raised on every rank at the commit
            else:
                if url:
                    self.files.uploaded(path, st.size(path))
        try:
            saved = self._native_save(
                save_dir,
                tag=tag,
                client_state=client_state,
                save_latest=save_latest and not url,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        finally:
            self.files.save_id = ""
        swap = compat.nvme_swap(engine, save_dir, tag)
        if swap is not None:
            record_swap_files(swap, st.join(save_dir, tag, OFFLOADED, swap.folder), save_id)
        if unbound(engine).is_decoupled():
            self._prune_dir = save_dir  # the save is complete only once committed
        else:
            self._retain(save_dir)
        return saved

    def _retain(self, save_dir: str) -> None:
        """Keep the `keep_last` newest complete tags (and what they need), never the one `latest` names (collective)."""
        keep = self.options.keep_last
        if keep is None:
            return
        barrier()  # every rank's files of the new tag are written before it counts as complete
        on_rank0(lambda: prune(save_dir, keep))

    # --- loading ------------------------------------------------------------------------------------------------

    @_coordinated
    def load(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple:
        """Load a checkpoint of any layout into the engine, all or nothing; returns (path, client_state)."""
        self.wait()
        load_dir = _location(load_dir)
        native = {
            "load_module_strict": load_module_strict,
            "load_optimizer_states": load_optimizer_states,
            "load_lr_scheduler_states": load_lr_scheduler_states,
            "load_module_only": load_module_only,
            "custom_load_fn": custom_load_fn,
        }
        flags = (load_optimizer_states, load_lr_scheduler_states, load_module_only)
        result = self._load(load_dir, tag, native, flags)
        if self.saver is not None and result[0] is not None and self.last_load is not None:
            if self.last_load.kind is None:
                self.saver.restored(None)  # the weights no longer match the saver's current chain
        return result

    def _load(self, load_dir: str, tag: Any, native: dict[str, Any], flags: tuple[bool, bool, bool]) -> tuple:
        folder = self._folder_source(load_dir)
        if folder is not None:
            return self.run(folder, native, flags)
        if tag is None and not st.isfile(st.join(load_dir, LATEST)) and not list_tags(load_dir):
            return self._checked(load_dir, native, None)  # DeepSpeed's own answer to a folder with nothing to load
        if tag is not None:
            tag = resolve_tag(load_dir, tag)
            return self.run(self.source(load_dir, tag, checked=False, custom=native["custom_load_fn"]), native, flags)
        # a save killed part-way leaves a torn tag, possibly already named by `latest`; a tag that turns out damaged
        # while loading leaves the engine as it was, so an older complete tag is tried next
        refused: list[str] = []
        first: CheckpointError | None = None
        rank0 = tdist.get_rank() == 0  # one rank opens the tags
        while True:
            picked, failure = from_rank0(guarded(lambda: _pick_tag(load_dir, refused) if rank0 else None))
            if failure:
                raise first or CheckpointError(*failure)
            try:
                tag = resolve_tag(load_dir, picked)
                result = self.run(
                    self.source(load_dir, tag, checked=True, custom=native["custom_load_fn"]), native, flags
                )
            except CheckpointError as exc:
                first = first or exc
                refused.append(picked)
                log.warning("ucp: could not load %s (%s); trying the newest older complete tag", picked, exc)
                continue
            if refused and self.last_load is not None:
                log.warning("ucp: resumed from %s instead of the newer %s", picked, ", ".join(refused))
                self._report(dataclasses.replace(self.last_load, refused=tuple(refused)))
            return result

    def _folder_source(self, load_dir: str) -> Source | None:
        """A foreign folder (DeepSpeed's universal layout) or a universal folder named directly, if it is one."""
        live = topology(self.engine).describe()
        for fmt in foreign_formats():
            folder = fmt.find(self.engine, load_dir)
            if folder is not None:
                out = self._imported(fmt, folder)
                return Source(folder, LoadReport("imported", fmt.name, live, out), self._opener(out))
        if st.isfile(st.join(load_dir, MANIFEST)):
            ckpt = guarded(lambda: UniversalCheckpoint(load_dir, verify=self.options.verify))
            saved = ckpt.manifest.source.topology.describe()
            return Source(load_dir, LoadReport("universal", saved, live, load_dir), lambda: ckpt)
        return None

    def source(self, load_dir: str, tag: str, checked: bool, custom: Any = None) -> Source:
        """How to load `tag`: an extension's tag, DeepSpeed's own load (same layout) or a reshard. `checked` when
        resume_tag has already opened and checked every file of it."""
        engine, options = self.engine, self.options
        path, live = st.join(load_dir, tag), topology(engine)
        kind = kind_of(path)
        if kind is not None:
            if options.direct:
                reader = guarded(lambda: kind.open(load_dir, tag, options.verify))
                report = LoadReport(kind.name, _saved(reader), live.describe(), None, kind.name, True)
                return Source(path, report, lambda: reader)
            out = self._materialized(kind, load_dir, tag)
            ckpt = UniversalCheckpoint(out, verify=options.verify)
            return Source(path, LoadReport(kind.name, _saved(ckpt), live.describe(), out, kind.name), lambda: ckpt)
        rank0 = tdist.get_rank() == 0
        # one rank reads the metadata of every model-parallel rank; a thousand ranks reading it would each do so
        found = from_rank0(guarded(lambda: tag_metas(path, options.layout_rules) if rank0 else None))
        metas = found[0]
        meta = metas[0]
        saved = meta.topology
        # another optimizer class keeps its state differently (DeepSpeed's CPU Adam counts steps in ints): DeepSpeed's
        # own load would hand it over as is
        live_kernel = optimizer_record(engine)
        same_kernel = meta.optimizer is None or all(
            meta.optimizer.get(k) == live_kernel[k] for k in ("class", "algorithm")
        )
        # DeepSpeed's own load of a ZeRO-3 NVMe checkpoint leaves the swapped optimizer states and the sub-groups kept
        # in memory at their fresh values (measured: 13 of 16 tensors wrong); ours reads the swap files
        swapped = compat.nvme_offload(engine) or st.isdir(st.join(path, OFFLOADED))
        # DeepSpeed's own load looks for a Ulysses rank's files under the names it gives them now, not as before #8226
        renamed = saved.sp > 1 and from_rank0(guarded(lambda: named_by_sp_rank(path, saved) if rank0 else None))
        # DeepSpeed's own load looks for experts only in its MoE layers; megatron-core's always go through ours. Every
        # rank answers (a stage may hold MoE layers or fail alone): the collective runs everywhere or nowhere
        if (
            saved.same_layout(live)
            and not st.is_url(load_dir)  # DeepSpeed's own load reads local paths only; ours reads a store by range
            and same_kernel
            and not swapped
            and not renamed
            and everywhere(guarded(lambda: not megatron_moe_layers(engine.module) and same_stage(engine, metas)))
        ):
            if not checked:
                on_rank0(lambda: NativeCheckpoint(load_dir, tag, options.layout_rules).close())
            report = LoadReport("native", saved.describe(), live.describe(), None)
            return Source(
                path,
                report,
                None,
                client_keys=meta.client_state_keys,
                hf_config=meta.hf_config,
                expect_save_id=meta.save_id,
            )
        log.info("ucp: resharding %s from %s to %s", tag, saved.describe(), live.describe())
        if custom is not None:
            log.warning(
                "ucp: custom_load_fn is not called when resharding; every tensor is restored from the universal "
                "checkpoint"
            )
        if options.direct:
            # rank 0 checks every file against the metadata, unless picking the tag just did; the others open only
            # the files they read
            src = guarded(
                lambda: NativeCheckpoint(
                    load_dir, tag, options.layout_rules, check=rank0 and not checked, verify=options.verify, metas=found
                )
            )

            # the manifest (it opens the first rank files and stats every file of the tag) and where each optimizer
            # file holds its states are made once, on rank 0, which has opened every file to check it (and refuses
            # FP8 state the universal format cannot carry)
            def plan() -> tuple[Any, Any]:
                src.refuse_fp8_state()
                return build_manifest(src), src.file_index()

            manifest, index = from_rank0(guarded(plan if rank0 else lambda: None))
            if not rank0:
                src.use_index(index)
            mode = "direct" if saved.same_layout(live) and st.is_url(load_dir) else "resharded"
            report = LoadReport(mode, saved.describe(), live.describe(), None, direct=True)
            return Source(
                path, report, lambda: DirectCheckpoint(src, manifest), check_reads=lambda: _check_direct_reads(src)
            )
        on_rank0(lambda: _no_fp8_state(load_dir, tag, options.layout_rules, found))
        out = convert_across_ranks(
            load_dir,
            tag,
            options.output and st.join(options.output, tag),
            options.layout_rules,
            options.verify,
            options.workers,
            options.progress,
        )
        report = LoadReport("resharded", saved.describe(), live.describe(), out)
        return Source(path, report, self._opener(out), discard=None if options.keep else out)

    def run(self, source: Source, native: dict[str, Any], flags: tuple[bool, bool, bool]) -> tuple:
        """Load `source` into the engine: DeepSpeed's own load behind the gate, or ours (verify, stage, commit)."""
        make = source.open
        if make is None:
            self.files.expect(source.path, source.expect_save_id)
            self._report(source.report)
            with self.gate.writing(source.path):  # DeepSpeed writes as it reads: it cannot be staged
                path, client = self._checked(st.dirname(source.path), native, st.basename(source.path))
            self.hf_config = source.hf_config
            return path, {k: v for k, v in (client or {}).items() if k in source.client_keys}
        opened: list[TensorReader] = []

        def open_reader() -> TensorReader:
            opened.append(make())
            return opened[0]

        try:  # a reader one rank failed to open fails the load on every rank
            reader = guarded(open_reader)
        except CheckpointError:
            for each in opened:
                each.close()
            raise
        try:
            client = restore(self.engine, reader, *flags, check_reads=source.check_reads, gate=self.gate)
        finally:
            reader.close()
        if self.saver is not None and source.report.kind is not None:
            self.saver.restored(reader.manifest)
        self.hf_config = reader.manifest.hf_config
        self._report(source.report)
        barrier()
        if source.discard is not None and tdist.get_rank() == 0:
            remove_output(source.discard)
        return source.path, client

    def _report(self, report: LoadReport) -> None:
        self.last_load = self.engine.ucp_last_load = report

    def _checked(self, load_dir: str, native: dict[str, Any], tag: str | None) -> Any:
        """DeepSpeed's own load, then on every rank the first damaged record any rank read, if one did."""
        result = self._native_load(load_dir, tag=tag, **native)
        problem = self.files.take_problem()
        all_ok((problem.path, problem.reason) if problem else None)
        return result

    def _opener(self, out: str) -> Callable[[], TensorReader]:
        return lambda: UniversalCheckpoint(out, verify=self.options.verify)

    def _imported(self, fmt: ForeignFormat, folder: str) -> str:
        """Our copy of a foreign folder (DeepSpeed's universal format), made once by rank 0 and reused afterwards."""
        name = f"{st.basename(folder.rstrip('/'))}.ucp"
        out = st.join(self.options.output or st.dirname(folder), name)

        def work() -> None:
            with claimed(out, [folder]):
                if not st.isfile(st.join(out, MANIFEST)):
                    log.info("ucp: importing %s folder %s into %s", fmt.name, folder, out)
                    fmt.import_to(folder, out, self.options)

        on_rank0(work)  # every rank takes part: the check above runs on rank 0 only, so no rank skips the collective
        return out

    def _materialized(self, kind: TagKind, load_dir: str, tag: str) -> str:
        """The full universal copy of an extension's tag (a Check-N-Run chain), made once by rank 0; its blocks are
        checked as they are read, like any universal folder."""
        options = self.options
        out = st.join(options.output, tag) if options.output else st.join(load_dir, f"{tag}.universal")

        def work() -> None:
            with claimed(out, [st.join(load_dir, tag)]):
                kind.materialize(load_dir, tag, out)

        on_rank0(work)
        return out


def checkpointer_of(engine: Any) -> UniversalCheckpointer | None:
    """The engine's checkpointer, if `attach` gave it one."""
    found = getattr(engine, "ucp", None)
    return found if isinstance(found, UniversalCheckpointer) else None


def _saved(reader: TensorReader) -> str:
    return reader.manifest.source.topology.describe()


def record_swap_files(swap: compat.NvmeSwap, folder: str, save_id: str) -> None:
    """Record the swap files DeepSpeed copied into `folder` for this rank's save: sizes, CRCs, the save id."""
    files = {}
    for name in sorted(st.listdir(folder)):
        swap_id = name.removesuffix(".tensor.swp").rpartition("-")[2]  # `<ds_id>` or `<state>-<ds_id>`
        if name.endswith(".tensor.swp") and swap_id in swap.swapped:
            path = st.join(folder, name)
            files[name] = SwapFile(swap.swapped[swap_id], st.stat(path)[0], file_block_crcs(path))
    dtype = dtype_name(swap.dtype)
    write_swap_record(SwapRecord(swap.optim_file, save_id, dtype, files), folder)


def _location(location: Any) -> Any:
    """A checkpoint URL checked (a scheme no installed filesystem serves, or credentials in it, are refused);
    a local path as given."""
    return st.normalize(location) if isinstance(location, str) and st.is_url(location) else location


def _pick_tag(load_dir: str, refused: list[str]) -> tuple[str | None, tuple[str, str] | None]:
    """The tag to resume from, skipping the `refused` ones, or why there is none (the newest tag's problem)."""
    tag = resume_tag(load_dir, refused)
    if tag is not None:
        return tag, None
    if refused:
        return None, (load_dir, f"holds no complete checkpoint older than {refused[-1]} to fall back to")
    newest = latest_tag(load_dir) or next(reversed(list_tags(load_dir)), None)
    if newest is None:
        return None, (st.join(load_dir, LATEST), "'latest' is empty and there are no tag folders")
    reason = incomplete_reason(load_dir, newest) or "unreadable"
    return None, (load_dir, f"holds no complete checkpoint to resume from; the newest, {newest}, is not: {reason}")


def _no_fp8_state(load_dir: str, tag: str, rules: Any, metas: Any) -> None:
    src = NativeCheckpoint(load_dir, tag, rules, check=False, metas=metas)
    try:
        src.refuse_fp8_state()
    finally:
        src.close()


def _check_direct_reads(src: NativeCheckpoint) -> None:
    """Every byte any rank read straight from the rank files, checked on rank 0 against their CRCs (collective)."""
    gathered = to_rank0(src.pieces())
    on_rank0(lambda: src.check_reads(gathered or []))
