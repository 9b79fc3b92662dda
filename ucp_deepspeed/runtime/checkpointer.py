"""One object that owns a DeepSpeed engine's universal checkpoints: what it saves, and how it loads any of them.

DeepSpeed saves each rank's partition of the training state (flat ZeRO partitions, tensor- and pipeline-parallel
slices, experts), so a job can resume only at the layout it saved with. `UniversalCheckpointer` wraps an engine's
`save_checkpoint` and `load_checkpoint`: a save also writes our metadata and binds every file to the save; a load
resumes at any layout, all or nothing. It owns the options, the checkpoint-engine binding (`native_io`), the gate
that refuses steps and saves after a load failed part-way, an extension's saver (Check-N-Run), retention and the
last load's report.

A load is one pipeline:

1. the location, checked and normalized once;
2. the source (`runtime.planning.LoadPlanner`): a folder to import or a universal folder, else the named tag, else
   the newest complete tag; its `LoadMode` says what it is and which reader runs;
3. open, stage, commit (`runtime.restore`), or DeepSpeed's own load behind the gate; a tag picked because none was
   named that turns out damaged leaves the engine as it was, and the next older one is planned instead;
4. one report (`last_load`, also `engine.ucp_last_load`) and one notice to the saver.

Every public method waits for other ranks' unbounded work (rank 0 picking, checking, importing) in object
collectives on the checkpointer's own gloo group (`_coordinated`), never on the training group.
"""

from __future__ import annotations

import contextlib
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
from ucp_deepspeed.convert.output import remove_output
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import LOADER_FILE, DataPositionRefused
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.metadata import write_meta
from ucp_deepspeed.format.paths import LATEST, latest_tag
from ucp_deepspeed.format.swap import OFFLOADED, record_swap_files
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.spread import KEYS, Spread
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.async_save import AsyncCheckpointEngine
from ucp_deepspeed.runtime.capture import describe, optimizer_order
from ucp_deepspeed.runtime.collective import (
    all_ok,
    barrier,
    coordinated,
    coordination_group,
    every_rank,
    failure_of,
    from_rank0,
    guarded,
    on_rank0,
    to_rank0,
)
from ucp_deepspeed.runtime.config import UniversalConfig
from ucp_deepspeed.runtime.data_position import capture, resume_plan
from ucp_deepspeed.runtime.gate import Gate
from ucp_deepspeed.runtime.native_io import bind, unbound
from ucp_deepspeed.runtime.planning import LoadMode, LoadPlanner, LoadReport, Source, sees_what_rank0_sees
from ucp_deepspeed.runtime.plugins import make_saver
from ucp_deepspeed.runtime.restore import LoadFlags, restore
from ucp_deepspeed.sources import list_tags, resolve_tag
from ucp_deepspeed.sources.data_loaders import read_loader_records
from ucp_deepspeed.sources.tags import drop_aside, fallback_tag, prune, set_aside

log = logging.getLogger("ucp_deepspeed")

__all__ = ["LoadMode", "LoadReport", "UniversalCheckpointer", "checkpointer_of"]


def _coordinated(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with the checkpointer's own group for every wait on another rank (`collective.coordinated`)."""

    @functools.wraps(method)
    def run(self: UniversalCheckpointer, *args: Any, **kwargs: Any) -> Any:
        with coordinated(self.group()):
            return method(self, *args, **kwargs)

    return run


class UniversalCheckpointer:
    """Universal checkpoints for one DeepSpeed engine (see the module docstring); built by `attach`."""

    def __init__(self, engine: Engine, options: UniversalConfig):
        self.engine, self.options = engine, options
        self._native_save, self._native_load = engine.save_checkpoint, engine.load_checkpoint
        # an engine built without an optimizer (a reference model, an evaluation) has no training state: it saves as
        # DeepSpeed does, and each load puts weights from a checkpoint of any layout into its module
        self.trains = compat.trains(engine)
        self.group = coordination_group(options.wait_minutes)  # weak: released at exit
        if options.async_save and self.trains:
            # every rank starts its writer before any rank goes on: CPUs one node lacks fail the engine on all of them
            with coordinated(self.group()):
                engine.checkpoint_engine = guarded(
                    lambda: AsyncCheckpointEngine(
                        compat.engine_config(engine), module=engine.module, writer_cpus=options.async_writer_cpus
                    ),
                    release=lambda made: made.cleanup(),
                )
        self.files = bind(engine, options.verify)
        st.set_default_options(options.storage_options)
        compat.store_recovery_scripts(engine, st.is_url, st.write)
        self.gate = Gate()  # closed by a load that failed after it began writing into the engine
        compat.before_model_step(engine, self._before_step)
        self.files.group = self.group  # a decoupled save commits from the engine's step, outside our calls
        # every file of a save carries `<run id>-<save count>`: unique per save, with no collective per save
        with coordinated(self.group()):
            self._run_id = from_rank0(uuid.uuid4().hex[:16] if tdist.get_rank() == 0 else None)
        self._saves = itertools.count(1)
        self.planner = LoadPlanner(engine, options, self.group)
        # an extension's save in place of DeepSpeed's (Check-N-Run)
        self.saver = make_saver(engine, options) if self.trains else None
        self.last_load: LoadReport | None = None
        self.hf_config: dict[str, Any] | None = None  # the Hugging Face config of the weights loaded last
        self._prune_dir: str | None = None  # a decoupled save's folder, pruned once the save is committed
        self._aside: str | None = None  # the previous save of the tag being saved again, kept until this one commits

    def _before_step(self) -> None:
        """Before each optimizer step: a closed gate refuses it; an async save's copies into staging are finished; a
        decoupled save DeepSpeed committed just now (at this step's boundary) gets its `latest` made durable."""
        self.gate.check("step")
        inner = unbound(self.engine)
        if isinstance(inner, AsyncCheckpointEngine):
            inner.wait_staged()  # the step changes what an async save is still copying
        self.files.sync_latest()

    # --- saving -------------------------------------------------------------------------------------------------

    @_coordinated
    def wait(self) -> None:
        """Block until a pending asynchronous or decoupled checkpoint is written on every rank and `latest` names it
        (collective); then apply retention."""
        if not self.trains:  # it saves as DeepSpeed does, which waits for nothing of ours
            return
        inner = unbound(self.engine)
        if isinstance(inner, AsyncCheckpointEngine):
            inner.wait()
        if inner.is_decoupled():
            compat.commit_decoupled_checkpoint(self.engine)
            self.files.sync_latest()
        if self._prune_dir is not None:
            self._committed(self._prune_dir)
            self._prune_dir = None

    @_coordinated
    def save(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        data_loader: Any = None,
    ) -> bool:
        """DeepSpeed's save (or an extension's), with our metadata and every file bound to this save; with
        `data_loader` (each rank's own), where it stands too (`runtime.data_position`)."""
        engine = self.engine
        if not self.trains:  # nothing of ours to record: DeepSpeed's own save of the weights
            return self._native_save(
                save_dir,
                tag=tag,
                client_state=client_state or {},
                save_latest=save_latest,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
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
        records, loaders = self._loader_records(data_loader)
        if self.saver is not None:
            extra = {"data_loaders": records} if loaders is not None else {}
            self.saver.save(engine, save_dir, tag, client_state, save_latest, save_id, **extra)
            self._committed(save_dir)
            return True
        if not url:  # before any rank writes into the tag: a save into the one `latest` names keeps it until committed
            self._aside = from_rank0(guarded(lambda: set_aside(save_dir, tag) if tdist.get_rank() == 0 else None))
        self.files.save_id = save_id
        meta = dataclasses.replace(
            describe(engine, tuple(client_state), self.hf_config), save_id=save_id, data_loaders=loaders
        )
        if exclude_frozen_parameters:
            meta = dataclasses.replace(
                meta, extras=tuple(e for e in meta.extras if e.kind != "frozen"), frozen_excluded=True
            )
        tag_dir = st.join(save_dir, tag)
        if url:
            self._start_on_store(tag_dir, Spread(self.options.key_prefixes) if self.options.key_prefixes else None)
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
            if loaders is not None:  # rank 0, through the checkpoint engine: bound to the save, on a store or not

                def write() -> None:
                    engine.checkpoint_engine.makedirs(tag_dir, exist_ok=True)
                    engine.checkpoint_engine.save(records, st.join(tag_dir, LOADER_FILE))

                on_rank0(write)
            saved = self._native_save(
                save_dir,
                tag=tag,
                client_state=client_state,
                save_latest=save_latest and not url,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
            self.files.sync_latest()  # a synchronous save's, written by DeepSpeed once its commit returned
        finally:
            self.files.save_id = ""
        swap = compat.nvme_swap(engine, save_dir, tag)
        if swap is not None:
            record_swap_files(swap, st.join(save_dir, tag, OFFLOADED, swap.folder), save_id)
        if unbound(engine).is_decoupled():
            self._prune_dir = save_dir  # the save is complete only once committed
        else:
            self._committed(save_dir)
        return saved

    def _loader_records(self, data_loader: Any) -> tuple[list[dict[str, Any]] | None, int | None]:
        """Every rank's data-loader record on rank 0 (None elsewhere), and on every rank how many there are (None when
        no rank was given a loader); a rank that fails to say where its loader stands, or a loader given on some
        ranks only, fails the save on every rank (collective)."""
        mine: tuple[dict[str, Any] | None, tuple[str, str] | None]
        try:
            mine = (capture(self.engine, data_loader).encode() if data_loader is not None else None, None)
        except Exception as exc:
            mine = (None, failure_of(exc))
        gathered = to_rank0(mine)

        def count() -> tuple[int | None, tuple[str, str] | None]:
            assert gathered is not None  # rank 0
            failure = next((f for _, f in gathered if f is not None), None)
            given = [i for i, (r, _) in enumerate(gathered) if r is not None]
            if failure is None and given and len(given) != len(gathered):
                failure = ("data_loader", f"given on ranks {given[:8]} only: every rank passes its own loader, or none")
            return (len(gathered) if given else None), failure

        loaders, failure = from_rank0(count() if tdist.get_rank() == 0 else None)
        if failure is not None:
            raise CheckpointError(*failure)
        return ([r for r, _ in gathered] if gathered is not None and loaders is not None else None), loaders

    def _start_on_store(self, tag_dir: str, spread: Spread | None) -> None:
        """Where this save's objects go, until the commit: over the key prefixes, or into the tag folder (`io/spread`).
        First rank 0 deletes an earlier save of the same tag when either save is spread (overwritten, as on disk: its
        objects would not be where this one's are looked for), and writes the keys object that tells a load where
        they are; a failure there fails the save on every rank before anything else is written (collective)."""
        keys = st.join(tag_dir, KEYS)
        data = spread.to_json() if spread is not None else b""

        def start() -> None:
            if (spread is not None and st.isdir(tag_dir)) or st.isfile(keys):
                st.delete(tag_dir)
            if spread is not None:
                st.write(keys, data)

        on_rank0(start)
        st.place(tag_dir, spread)
        if spread is not None and tdist.get_rank() == 0:
            self.files.uploaded(keys, len(data))

    def _committed(self, save_dir: str) -> None:
        """Once a save is committed: delete the previous save of its tag, kept aside while it was written, then keep
        the `keep_last` newest complete tags (and what they need), never the one `latest` names (collective)."""
        aside, self._aside, keep = self._aside, None, self.options.keep_last
        if aside is None and keep is None:
            return
        barrier()  # every rank's files of the new tag are written before it counts as complete

        def tidy() -> None:
            if aside is not None:
                drop_aside(save_dir, aside)
            if keep is not None:
                prune(save_dir, keep)

        on_rank0(tidy)

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
        data_loader: Any = None,
    ) -> tuple:
        """Load a checkpoint of any layout into the engine, all or nothing; returns (path, client_state). With
        `data_loader` (each rank's own), it continues where the saved ranks' loaders stood, at any data-parallel
        size where that is exact, and is refused, with the engine as it was, where it is not."""
        self.wait()
        flags = LoadFlags(
            module_strict=load_module_strict,
            optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states,
            module_only=load_module_only or not self.trains,
            custom_load_fn=custom_load_fn,
            data_loader=None if load_module_only else data_loader,
        )
        with st.listed():  # a finished save does not change under its load: one listing per folder, not a HEAD each
            loaded = self._load(_location(load_dir), tag, flags)
        if loaded.report is not None:
            self.last_load = self.engine.ucp_last_load = loaded.report
        if loaded.path is not None and flags.data_loader is None and tdist.get_rank() == 0:
            _warn_if_steps_move(self.engine)
        if self.saver is not None and loaded.path is not None:
            # the weights now match the saver's chain only when the load restored one of its own tags
            self.saver.restored(loaded.manifest if loaded.report and loaded.report.kind is not None else None)
        return loaded.path, loaded.client

    def _load(self, load_dir: str, tag: Any, flags: LoadFlags) -> _Loaded:
        """The answers to: is `load_dir` a folder to import or a universal folder? was a tag named? is there any tag
        at all? Otherwise the newest tag that loads."""
        folder = self.planner.folder(load_dir)
        if folder is not None:
            return self._read(folder, flags)
        if tag is None and not sees_what_rank0_sees(self.engine, load_dir):
            # each node's disk holds its own ranks' files, so no rank can tell which tags are complete: the one
            # `latest` names, which DeepSpeed writes on rank 0's node
            tag = from_rank0(guarded(lambda: latest_tag(load_dir) if tdist.get_rank() == 0 else None))
            if tag is None:
                raise CheckpointError(
                    st.join(load_dir, LATEST),
                    "is not on rank 0's node, whose disk (use_node_local_storage) holds other tags than the other "
                    "nodes': name the tag to load",
                )
        if tag is not None:
            return self._read(self.planner.tag(load_dir, resolve_tag(load_dir, tag), checked=False, flags=flags), flags)
        if not st.isfile(st.join(load_dir, LATEST)) and not list_tags(load_dir):
            path, client = self._deepspeed_load(load_dir, None, flags)  # DeepSpeed's own answer to an empty folder
            return _Loaded(path=path, client=client)
        return self._newest_loadable(load_dir, flags)

    def _newest_loadable(self, load_dir: str, flags: LoadFlags) -> _Loaded:
        """The newest complete tag, loaded; a tag that turns out damaged while loading (a save killed part-way leaves
        a torn tag, possibly already named by `latest`) leaves the engine as it was, so the next older one is tried."""
        refused: list[str] = []
        failures: list[CheckpointError] = []
        rank0 = tdist.get_rank() == 0  # one rank opens the tags
        # what a tag saved without our metadata needs: layout rules, and this engine's optimizer groups for ZeRO-0
        plain = {"layout_rules": self.options.layout_rules, "order": optimizer_order(self.engine) if rank0 else None}
        while True:
            picked = from_rank0(guarded(lambda: fallback_tag(load_dir, refused, **plain) if rank0 else None))
            if picked is None:
                raise failures[0]  # what was wrong with the newest tag, not that no older one loaded
            try:
                source = self.planner.tag(load_dir, resolve_tag(load_dir, picked), checked=True, flags=flags)
                loaded = self._read(source, flags)
            except DataPositionRefused:
                raise  # the tag is healthy: the caller's loader cannot continue it
            except CheckpointError as exc:
                failures.append(exc)
                refused.append(picked)
                log.warning("ucp: could not load %s (%s); trying the newest older complete tag", picked, exc)
                continue
            if refused and loaded.report is not None:
                log.warning("ucp: resumed from %s instead of the newer %s", picked, ", ".join(refused))
                loaded = dataclasses.replace(loaded, report=dataclasses.replace(loaded.report, refused=tuple(refused)))
            return loaded

    def _read(self, source: Source, flags: LoadFlags) -> _Loaded:
        """Load `source` into the engine: DeepSpeed's own load behind the gate, or ours (open, stage, commit)."""
        if source.mode is LoadMode.NATIVE:
            self.files.expect(source.path, source.expect_save_id)
            place = self._data_plan(
                flags,
                lambda: read_loader_records(
                    source.path, source.data_loaders, source.expect_save_id, self.options.verify
                ),
                source.path,
            )
            with self.gate.writing(source.path):  # DeepSpeed writes as it reads: it cannot be staged
                path, client = self._deepspeed_load(st.dirname(source.path), st.basename(source.path), flags)
            self.hf_config = source.hf_config
            kept = {k: v for k, v in (client or {}).items() if k in source.client_keys}
            place()
            return _Loaded(path=path, client=kept, report=source.report)
        assert source.open is not None, source.mode  # every other mode has a reader
        opener = source.open
        with contextlib.ExitStack() as opened:
            # a reader one rank failed to open fails the load on every rank (and this rank's is closed)
            reader = guarded(lambda: opened.enter_context(opener()))
            place = self._data_plan(flags, lambda: reader.load_state().get("data_loaders"), source.path)
            client = restore(self.engine, reader, flags, check_reads=source.check_reads, gate=self.gate)
            place()
        self.hf_config = reader.manifest.hf_config
        barrier()
        if source.discard is not None and tdist.get_rank() == 0:
            remove_output(source.discard)
        return _Loaded(path=source.path, client=client, report=source.report, manifest=reader.manifest)

    def _data_plan(self, flags: LoadFlags, saved: Callable[[], Any], where: str) -> Callable[[], None]:
        """What the load does to the caller's data loader once the engine has loaded, decided before anything is
        loaded (collective). Records that fail to read fail the tag, as any damaged file does; a loader that cannot
        continue them refuses the load on every rank (`DataPositionRefused`: an older tag would do no better)."""
        loader = flags.data_loader
        given = every_rank(loader is not None)
        if not any(given):
            return lambda: None
        if not all(given):
            ranks = [r for r, g in enumerate(given) if g][:8]
            raise DataPositionRefused("data_loader", f"given on ranks {ranks} only: every rank passes its own, or none")
        records = from_rank0(guarded(saved if tdist.get_rank() == 0 else lambda: None))  # one read, not one per rank
        try:
            plan: Callable[[], None] = guarded(lambda: resume_plan(records, loader, self.engine, where))
        except CheckpointError as exc:
            raise DataPositionRefused(exc.path, exc.reason) from exc
        return plan

    def _deepspeed_load(self, load_dir: str, tag: str | None, flags: LoadFlags) -> Any:
        """DeepSpeed's own load, then on every rank the first damaged record any rank read, if one did."""
        result = self._native_load(load_dir, tag=tag, **flags.native())
        problem = self.files.take_problem()
        all_ok((problem.path, problem.reason) if problem else None)
        return result


@dataclass(frozen=True)
class _Loaded:
    """What one load gave back, and what to report of it."""

    path: str | None
    client: dict[str, Any] | None
    report: LoadReport | None = None
    manifest: Manifest | None = None
    """The restored manifest, for the saver (ours loaded it)."""


def _warn_if_steps_move(engine: Engine) -> None:
    """Name the samples a loader that skips whole steps (the Hugging Face Trainer, Accelerate's `skip_first_batches`)
    repeats or skips when the global batch changed: it starts at `steps * new batch` of the run's order, where the
    saved run had consumed `global_samples`. DeepSpeed's own data sampler and a `data_loader` keep the sample
    position instead."""
    steps, consumed, batch = int(engine.global_steps), int(engine.global_samples), int(engine.train_batch_size())
    # no samples counted (a PyTorch DCP import keeps only steps), or no one batch size (Megatron-LM's batch ramp-up)
    if steps <= 0 or consumed <= 0 or consumed % steps or consumed == steps * batch:
        return
    if compat.data_sampler(engine) is not None:
        return
    start = steps * batch
    lost = (
        f"samples {consumed}-{start - 1} are skipped"
        if start > consumed
        else f"samples {start}-{consumed - 1} are trained on again"
    )
    log.warning(
        "ucp: the checkpoint consumed %d samples in %d steps (a global batch of %d); this job's global batch is %d: a "
        "data loader that skips whole steps (the Hugging Face Trainer, Accelerate's skip_first_batches) starts at "
        "sample %d of the run's order, so %s; keep the global batch, or pass a StatefulDataLoader as data_loader",
        consumed,
        steps,
        consumed // steps,
        batch,
        start,
        lost,
    )


def checkpointer_of(engine: Engine) -> UniversalCheckpointer | None:
    """The engine's checkpointer, if `attach` gave it one."""
    found = getattr(engine, "ucp", None)
    return found if isinstance(found, UniversalCheckpointer) else None


def _location(location: Any) -> Any:
    """A checkpoint URL checked (a scheme no installed filesystem serves, or credentials in it, are refused);
    a local path as given."""
    return st.normalize(location) if isinstance(location, str) and st.is_url(location) else location
