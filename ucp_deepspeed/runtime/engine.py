"""Wire universal checkpointing into a DeepSpeed engine's save_checkpoint / load_checkpoint.

`initialize` is `deepspeed.initialize` plus `attach`, which wraps the engine's two checkpoint
methods on the instance: save also writes our metadata; load takes DeepSpeed's native path when
the topology is unchanged and converts + reshards otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch.distributed as tdist
from deepspeed.pipe import PipelineModule

from ucp_deepspeed import compat
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.convert.output import claimed, remove_output
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import TagKind, kind_of
from ucp_deepspeed.format.metadata import Topology, write_meta
from ucp_deepspeed.format.paths import LATEST, latest_tag
from ucp_deepspeed.format.swap import OFFLOADED, SwapFile, SwapRecord, write_swap_record
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint
from ucp_deepspeed.io.swap_file import file_block_crcs
from ucp_deepspeed.runtime.async_save import AsyncCheckpointEngine
from ucp_deepspeed.runtime.capture import UNSUPPORTED, describe, optimizer_record, same_stage, supported, topology
from ucp_deepspeed.runtime.collective import all_ok, everywhere, guarded, on_rank0
from ucp_deepspeed.runtime.config import UniversalConfig, load_config, split_config
from ucp_deepspeed.runtime.gate import Gate
from ucp_deepspeed.runtime.mpu import MegatronMpu, megatron_initialized, megatron_moe_layers, megatron_moe_visible
from ucp_deepspeed.runtime.native_io import bind, unbound
from ucp_deepspeed.runtime.plugins import ForeignFormat, foreign_formats, make_saver
from ucp_deepspeed.runtime.restore import restore
from ucp_deepspeed.runtime.shared_convert import convert_across_ranks
from ucp_deepspeed.sources import NativeCheckpoint, list_tags, resolve_tag
from ucp_deepspeed.sources.native import tag_metas
from ucp_deepspeed.sources.tags import incomplete_reason, resume_tag

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


# `ucp_deepspeed.install` replaces deepspeed.initialize; ours must still reach DeepSpeed's own.
_deepspeed_initialize = deepspeed.initialize


def initialize(
    args: Any = None,
    *,
    config: Any = None,
    config_params: Any = None,
    default_universal: bool | dict[str, Any] = False,
    **kwargs: Any,
) -> tuple:
    """`deepspeed.initialize` with universal checkpointing switched on by `"checkpoint": {"universal": true}`.

    `default_universal` applies when the config has no `checkpoint.universal` entry. With
    megatron-core's parallel_state initialised (or passed as `mpu`), DeepSpeed gets an adapter for
    it, so tensor/pipeline/data-parallel groups come from megatron-core; a `PipelineModule` keeps its
    own grid (megatron-core layers inside it use parallel_state for their tensor-parallel groups).
    """
    raw = config if config is not None else config_params
    if raw is None and getattr(args, "deepspeed_config", None) is not None:
        raw, args.deepspeed_config = args.deepspeed_config, None  # DeepSpeed refuses a config given twice
    ds_config, options = split_config(load_config(raw), default_universal)
    mpu = kwargs.get("mpu")
    piped = isinstance(kwargs.get("model"), PipelineModule)  # its grid is its mpu; DeepSpeed wants none
    if not piped and (
        (mpu is None and megatron_initialized())
        or (mpu is not None and mpu is sys.modules.get("megatron.core.parallel_state"))
    ):
        kwargs["mpu"] = MegatronMpu()
    with (
        megatron_moe_visible(kwargs.get("model"))
        if "mpu" in kwargs and kwargs.get("model") is not None
        else contextlib.nullcontext()
    ):
        result = _deepspeed_initialize(args=args, config=ds_config, **kwargs)
    if options.enabled:
        attach(result[0], options)
    return result


def attach(engine: Any, options: UniversalConfig | None = None) -> Any:
    """Make an existing engine save ucp metadata and load checkpoints of any topology."""
    options = options or UniversalConfig(enabled=True)
    if getattr(engine, "_ucp_options", None) is not None:
        return engine
    if not supported(engine):
        raise NotImplementedError(UNSUPPORTED)  # refuse now rather than at the first save, mid-training
    engine._ucp_options = options
    native_save, native_load = engine.save_checkpoint, engine.load_checkpoint
    if options.async_save:
        engine.checkpoint_engine = AsyncCheckpointEngine(compat.engine_config(engine))
    files = bind(engine, options.verify)
    gate = Gate()  # closed by a load that failed after it began writing into the engine
    compat.before_model_step(engine, lambda: gate.check("step"))
    # every file of a save carries `<run id>-<save count>`: unique per save, with no collective per save
    box = [uuid.uuid4().hex[:16] if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    run_id, saves = box[0], itertools.count(1)
    saver = make_saver(engine, options)  # an extension's save in place of DeepSpeed's (Check-N-Run)
    engine.ucp_saver = saver

    def wait_for_checkpoint() -> None:
        """Block until a pending asynchronous or decoupled checkpoint is written on every rank and `latest` names it
        (collective)."""
        inner = unbound(engine)
        if isinstance(inner, AsyncCheckpointEngine):
            inner.wait()
        if inner.is_decoupled():
            compat.commit_decoupled_checkpoint(engine)

    @functools.wraps(native_save)
    def save_checkpoint(
        save_dir: str,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Any:
        wait_for_checkpoint()
        gate.check("save")
        client_state = client_state or {}
        tag = f"global_step{engine.global_steps}" if tag is None else tag
        save_id = f"{run_id}-{next(saves)}"
        if saver is not None:
            saver.save(engine, save_dir, str(tag), client_state, save_latest, save_id)
            return True
        files.save_id = save_id
        meta = dataclasses.replace(describe(engine, tuple(client_state)), save_id=save_id)
        if exclude_frozen_parameters:
            meta = dataclasses.replace(
                meta, extras=tuple(e for e in meta.extras if e.kind != "frozen"), frozen_excluded=True
            )
        if compat.data_parallel_rank(engine) == 0:
            write_meta(meta, os.path.join(save_dir, str(tag)), engine.checkpoint_mp_rank)
        try:
            saved = native_save(
                save_dir,
                tag=tag,
                client_state=client_state,
                save_latest=save_latest,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        finally:
            files.save_id = ""
        swap = compat.nvme_swap(engine, save_dir, str(tag))
        if swap is not None:
            record_swap_files(swap, os.path.join(save_dir, str(tag), OFFLOADED, swap.folder), save_id)
        return saved

    @functools.wraps(native_load)
    def load_checkpoint(
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple:
        result = load(
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )
        if saver is not None and result[0] is not None and engine.ucp_last_load.kind is None:
            saver.restored(None)  # the weights no longer match the saver's current chain
        return result

    def load(
        load_dir: str,
        tag: Any,
        load_module_strict: bool,
        load_optimizer_states: bool,
        load_lr_scheduler_states: bool,
        load_module_only: bool,
        custom_load_fn: Any,
    ) -> tuple:
        wait_for_checkpoint()
        native = functools.partial(
            native_load,
            load_dir,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        flags = (load_optimizer_states, load_lr_scheduler_states, load_module_only)
        for fmt in foreign_formats():
            folder = fmt.find(engine, load_dir)
            if folder is not None:
                ckpt = _imported(engine, fmt, folder)
                client = restore(engine, ckpt, *flags, gate=gate)
                engine.ucp_hf_config = ckpt.manifest.hf_config
                engine.ucp_last_load = LoadReport("imported", fmt.name, live_desc(), ckpt.root)
                return folder, client
        if os.path.isfile(os.path.join(load_dir, MANIFEST)):
            ckpt = UniversalCheckpoint(load_dir, verify=options.verify)
            client = restore(engine, ckpt, *flags, gate=gate)
            engine.ucp_hf_config = ckpt.manifest.hf_config
            engine.ucp_last_load = LoadReport(
                "universal", Topology(**ckpt.manifest.source["topology"]).describe(), live_desc(), load_dir
            )
            return load_dir, client
        if tag is None and not os.path.isfile(os.path.join(load_dir, LATEST)) and not list_tags(load_dir):
            return checked(native, tag=tag)  # DeepSpeed's own answer to a folder with nothing to load
        if tag is not None:
            return load_tag(load_dir, resolve_tag(load_dir, tag), False, native, flags, custom_load_fn)
        # a save killed part-way leaves a torn tag, possibly already named by `latest`; a tag that turns out
        # damaged while loading leaves the engine as it was, so an older complete tag is tried next
        refused: list[str] = []
        first: CheckpointError | None = None
        while True:
            box: list[Any] = [_pick_tag(load_dir, refused) if tdist.get_rank() == 0 else None]  # one rank opens
            tdist.broadcast_object_list(box, src=0)
            picked, failure = box[0]
            if failure:
                raise first or CheckpointError(*failure)
            try:
                result = load_tag(load_dir, resolve_tag(load_dir, picked), True, native, flags, custom_load_fn)
                if refused:
                    log.warning("ucp: resumed from %s instead of the newer %s", picked, ", ".join(refused))
                    engine.ucp_last_load = dataclasses.replace(engine.ucp_last_load, refused=tuple(refused))
                return result
            except CheckpointError as exc:
                first = first or exc
                refused.append(picked)
                log.warning("ucp: could not load %s (%s); trying the newest older complete tag", picked, exc)

    def load_tag(
        load_dir: str, tag: str, checked_tag: bool, native: Any, flags: tuple[bool, bool, bool], custom_load_fn: Any
    ) -> tuple:
        """Load one tag: `checked_tag` when resume_tag has already opened and checked every file of it."""
        kind = kind_of(os.path.join(load_dir, tag))
        if kind is not None:
            reader = (
                guarded(lambda: kind.open(load_dir, tag, options.verify))
                if options.direct
                else _materialized(engine, kind, load_dir, tag)
            )
            try:
                client = restore(engine, reader, *flags, gate=gate)
            finally:
                reader.close()
            if saver is not None:
                saver.restored(reader.manifest)
            engine.ucp_hf_config = reader.manifest.hf_config
            engine.ucp_last_load = LoadReport(
                kind.name,
                Topology(**reader.manifest.source["topology"]).describe(),
                live_desc(),
                None if options.direct else reader.root,
                kind.name,
                options.direct,
            )
            tdist.barrier()
            return os.path.join(load_dir, tag), client
        metas, _ = tag_metas(os.path.join(load_dir, tag), options.layout_rules)
        meta = metas[0]
        saved, live = meta.topology, topology(engine)
        # DeepSpeed's own load looks for experts only in its MoE layers; megatron-core's always go through ours
        # every rank answers (a stage may hold MoE layers or fail alone): the collective runs everywhere or nowhere
        # another optimizer class keeps its state differently (DeepSpeed's CPU Adam counts steps in ints):
        # DeepSpeed's own load would hand it over as is
        live_kernel = optimizer_record(engine)
        same_kernel = meta.optimizer is None or all(
            meta.optimizer.get(k) == live_kernel[k] for k in ("class", "algorithm")
        )
        # DeepSpeed's own load of a ZeRO-3 NVMe checkpoint leaves the swapped optimizer states and the sub-groups
        # kept in memory at their fresh values (measured: 13 of 16 tensors wrong); ours reads the swap files
        swapped = compat.nvme_offload(engine) or os.path.isdir(os.path.join(load_dir, tag, OFFLOADED))
        if (
            saved.same_layout(live)
            and same_kernel
            and not swapped
            and everywhere(guarded(lambda: not megatron_moe_layers(engine.module) and same_stage(engine, metas)))
        ):
            if not checked_tag:  # resume_tag has already opened and checked every file of the tag it picked
                on_rank0(lambda: NativeCheckpoint(load_dir, tag, options.layout_rules).close())
            engine.ucp_last_load = LoadReport("native", saved.describe(), live.describe(), None)
            files.expect(os.path.join(load_dir, tag), meta.save_id)
            with gate.writing(os.path.join(load_dir, tag)):  # DeepSpeed writes as it reads: it cannot be staged
                path, client = checked(native, tag=tag)
            engine.ucp_hf_config = meta.hf_config
            # DeepSpeed mixes its own bookkeeping into client_state; return only what the user saved
            return path, {k: v for k, v in (client or {}).items() if k in meta.client_state_keys}
        log.info("ucp: resharding %s from %s to %s", tag, saved.describe(), live.describe())
        if custom_load_fn is not None:
            log.warning(
                "ucp: custom_load_fn is not called when resharding; every tensor is restored from the "
                "universal checkpoint"
            )
        if options.direct:
            direct = _direct(engine, load_dir, tag)
            try:
                client = restore(engine, direct, *flags, check_reads=lambda: _check_direct_reads(direct.src), gate=gate)
            finally:
                direct.close()
            engine.ucp_hf_config = direct.manifest.hf_config
            engine.ucp_last_load = LoadReport("resharded", saved.describe(), live.describe(), None, direct=True)
            tdist.barrier()
            return os.path.join(load_dir, tag), client
        ckpt = _converted(engine, load_dir, tag)
        client = restore(engine, ckpt, *flags, gate=gate)
        engine.ucp_hf_config = ckpt.manifest.hf_config
        engine.ucp_last_load = LoadReport("resharded", saved.describe(), live.describe(), ckpt.root)
        tdist.barrier()
        if not options.keep and tdist.get_rank() == 0:
            remove_output(ckpt.root)
        return os.path.join(load_dir, tag), client

    def live_desc() -> str:
        return topology(engine).describe()

    def checked(native_load: Any, **kwargs: Any) -> Any:
        """DeepSpeed's own load, then on every rank the first damaged record any rank read, if one did."""
        result = native_load(**kwargs)
        problem = files.take_problem()
        all_ok((problem.path, problem.reason) if problem else None)
        return result

    engine.ucp_last_load = None
    engine.ucp_hf_config = None  # the Hugging Face config of the weights loaded last, carried into saves
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine.wait_for_checkpoint = wait_for_checkpoint
    return engine


def record_swap_files(swap: compat.NvmeSwap, folder: str, save_id: str) -> None:
    """Record the swap files DeepSpeed copied into `folder` for this rank's save: sizes, CRCs, the save id."""
    files = {}
    for name in sorted(os.listdir(folder)):
        swap_id = name.removesuffix(".tensor.swp").rpartition("-")[2]  # `<ds_id>` or `<state>-<ds_id>`
        if name.endswith(".tensor.swp") and swap_id in swap.swapped:
            path = os.path.join(folder, name)
            files[name] = SwapFile(swap.swapped[swap_id], os.path.getsize(path), file_block_crcs(path))
    dtype = str(swap.dtype).removeprefix("torch.")
    write_swap_record(SwapRecord(swap.optim_file, save_id, dtype, files), folder)


def _pick_tag(load_dir: str, refused: list[str]) -> tuple[str | None, tuple[str, str] | None]:
    """The tag to resume from, skipping the `refused` ones, or why there is none (the newest tag's problem)."""
    tag = resume_tag(load_dir, refused)
    if tag is not None:
        return tag, None
    if refused:
        return None, (load_dir, f"holds no complete checkpoint older than {refused[-1]} to fall back to")
    newest = latest_tag(load_dir) or next(reversed(list_tags(load_dir)), None)
    if newest is None:
        return None, (os.path.join(load_dir, LATEST), "'latest' is empty and there are no tag folders")
    reason = incomplete_reason(load_dir, newest) or "unreadable"
    return None, (load_dir, f"holds no complete checkpoint to resume from; the newest, {newest}, is not: {reason}")


def _imported(engine: Any, fmt: ForeignFormat, folder: str) -> UniversalCheckpoint:
    """Our copy of a foreign folder (DeepSpeed's universal format), made once by rank 0 and reused afterwards."""
    options: UniversalConfig = engine._ucp_options
    name = f"{os.path.basename(os.path.normpath(folder))}.ucp"
    out = os.path.join(options.output, name) if options.output else os.path.join(os.path.dirname(folder), name)

    def work() -> None:
        with claimed(out, [folder]):
            if not os.path.isfile(os.path.join(out, MANIFEST)):
                log.info("ucp: importing %s folder %s into %s", fmt.name, folder, out)
                fmt.import_to(folder, out)

    on_rank0(work)  # every rank takes part: the check above runs on rank 0 only, so no rank skips the collective
    return UniversalCheckpoint(out, verify=options.verify)


def _materialized(engine: Any, kind: TagKind, load_dir: str, tag: str) -> UniversalCheckpoint:
    """The full universal copy of an extension's tag (a Check-N-Run chain), made once by rank 0; its blocks are
    checked as they are read, like any universal folder."""
    options: UniversalConfig = engine._ucp_options
    out = os.path.join(options.output, tag) if options.output else os.path.join(load_dir, f"{tag}.universal")

    def work() -> None:
        with claimed(out, [os.path.join(load_dir, tag)]):
            kind.materialize(load_dir, tag, out)

    on_rank0(work)
    return UniversalCheckpoint(out, verify=options.verify)


def _direct(engine: Any, load_dir: str, tag: str) -> DirectCheckpoint:
    """The tag's rank files, read as its universal conversion would be; rank 0 checks them against the metadata."""
    options: UniversalConfig = engine._ucp_options
    rank0 = tdist.get_rank() == 0
    src = guarded(lambda: NativeCheckpoint(load_dir, tag, options.layout_rules, check=rank0, verify=options.verify))
    return DirectCheckpoint(src)


def _check_direct_reads(src: NativeCheckpoint) -> None:
    """Every byte any rank read straight from the rank files, checked on rank 0 against their CRCs (collective)."""
    gathered: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, src.pieces())
    on_rank0(lambda: src.check_reads(gathered))


def _converted(engine: Any, load_dir: str, tag: str) -> UniversalCheckpoint:
    """Convert (or reuse a finished conversion of) a tag, sharing the work across all ranks of the job."""
    options: UniversalConfig = engine._ucp_options
    out = convert_across_ranks(
        load_dir,
        tag,
        options.output and os.path.join(options.output, tag),
        options.layout_rules,
        options.verify,
        options.workers,
        options.progress,
    )
    return UniversalCheckpoint(out, verify=options.verify)
