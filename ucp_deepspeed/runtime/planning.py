"""What one load reads, and how: the `Source` a `UniversalCheckpointer.load` follows.

A load is given a folder and, maybe, a tag. The folder may be another tool's format (imported into a universal
folder first), a universal folder, or a checkpoint folder of tags. A tag may be an extension's (a Check-N-Run chain,
read in place or materialized once) or DeepSpeed's: DeepSpeed's own load reads it when the layout is unchanged, ours
otherwise, in place by byte range or through a converted copy. `LoadPlanner.folder` and `LoadPlanner.tag` answer
which, as a `Source` whose `mode` names the answer; `Source.open` gives the reader the restore consumes.

Both questions are collective: rank 0 reads what one rank reads for all (metadata, the manifest, imports) and
broadcasts it. They wait on the checkpointer's own gloo group whoever calls them, so no rank waits on another's
unbounded work in a collective of the training group (NCCL's 10-minute timeout).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from ucp_deepspeed import compat
from ucp_deepspeed.convert.core import build_manifest
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.convert.output import claimed
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import TagKind, kind_of
from ucp_deepspeed.format.metadata import SaveMeta
from ucp_deepspeed.format.swap import OFFLOADED
from ucp_deepspeed.format.universal import MANIFEST, TensorReader, UniversalCheckpoint
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.torch_file import TorchFile, check_save_id
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.capture import optimizer_order, optimizer_record, same_stage, topology
from ucp_deepspeed.runtime.collective import coordinated, everywhere, from_rank0, guarded, on_rank0, to_rank0
from ucp_deepspeed.runtime.config import UniversalConfig
from ucp_deepspeed.runtime.mpu import megatron_moe_layers
from ucp_deepspeed.runtime.plugins import ForeignFormat, foreign_formats
from ucp_deepspeed.runtime.restore import LoadFlags
from ucp_deepspeed.runtime.shared_convert import convert_across_ranks
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.native import named_by_sp_rank, refuse_fp8_state, tag_metas

log = logging.getLogger("ucp_deepspeed")


class LoadMode(str, enum.Enum):
    """What a load restored from, and so which reader ran (`LoadReport.mode`; compares equal to its value)."""

    NATIVE = "native"
    """A DeepSpeed tag at the live layout: DeepSpeed's own load."""
    RESHARDED = "resharded"
    """A DeepSpeed tag at another layout (or one DeepSpeed's own load cannot restore exactly), read by ours."""
    SAME_LAYOUT = "same-layout"
    """A DeepSpeed tag at the live layout on an object store, which DeepSpeed's own load cannot read: ours reads it."""
    UNIVERSAL = "universal"
    """A universal folder named directly."""
    IMPORTED = "imported"
    """Another tool's folder (DeepSpeed's universal layout, PyTorch DCP, megatron-core), imported first."""
    EXTENSION = "extension"
    """An extension's tag (`LoadReport.kind` names it: a Check-N-Run chain)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LoadReport:
    """What the last `load_checkpoint` did, kept on the engine as `engine.ucp_last_load`."""

    mode: LoadMode
    saved: str
    """The saved topology, in words."""
    live: str
    """The loading engine's topology, in words."""
    universal_dir: str | None = None
    """The universal folder read, when the load read one (converted, imported, materialized or named)."""
    kind: str | None = None
    """The registered tag kind (e.g. `checkn_run`) when the load restored one of an extension's tags."""
    in_place: bool = False
    """Whether ours read the saved files themselves, by byte range, instead of a universal copy."""
    refused: tuple[str, ...] = ()
    """Newer tags that failed to load (damaged) before this one, picked because no tag was named, loaded."""

    def how(self) -> str:
        """How the load ran, in words (for a job's log)."""
        if self.mode is LoadMode.SAME_LAYOUT:
            return f"same layout {self.live}, read in place by byte range (DeepSpeed's own load reads local files only)"
        if self.mode is LoadMode.EXTENSION:
            return f"{self.kind} tag, " + ("read in place" if self.in_place else "via a copy")
        if self.mode is not LoadMode.RESHARDED:
            return f"{self.mode} load"
        return f"resharded {self.saved} -> {self.live}, " + ("read in place" if self.in_place else "via a copy")


@dataclass(frozen=True)
class Source:
    """What one load reads and how it is reported.

    `open` gives the reader for every mode but `LoadMode.NATIVE`, which runs DeepSpeed's own load of `path`.
    """

    mode: LoadMode
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
    data_loaders: int | None = None
    """DeepSpeed's own load: how many ranks' data-loader records the tag holds (`SaveMeta.data_loaders`)."""
    discard: str | None = None
    """A converted copy to remove after the load (`keep: false`)."""


class LoadPlanner:
    """Which `Source` a load of one engine reads (see the module docstring); every method is collective."""

    def __init__(self, engine: Engine, options: UniversalConfig, group: Callable[[], Any]):
        """`group` gives the checkpointer's coordination group (`collective.coordination_group`)."""
        self.engine, self.options, self.group = engine, options, group

    def folder(self, load_dir: str) -> Source | None:
        """A foreign folder or a universal folder, if `load_dir` names one; None for a folder of tags."""
        with coordinated(self.group()):
            live = topology(self.engine).describe()
            for fmt in foreign_formats():
                folder = fmt.find(self.engine, load_dir)
                if folder is not None:
                    out = self._imported(fmt, folder)
                    report = LoadReport(mode=LoadMode.IMPORTED, saved=fmt.name, live=live, universal_dir=out)
                    return Source(mode=LoadMode.IMPORTED, path=folder, report=report, open=self._opener(out))
            if not st.isfile(st.join(load_dir, MANIFEST)):
                return None
            ckpt = guarded(lambda: UniversalCheckpoint(load_dir, verify=self.options.verify))
            saved = ckpt.manifest.source.topology.describe()
            report = LoadReport(mode=LoadMode.UNIVERSAL, saved=saved, live=live, universal_dir=load_dir)
            return Source(mode=LoadMode.UNIVERSAL, path=load_dir, report=report, open=lambda: ckpt)

    def tag(self, load_dir: str, tag: str, checked: bool, flags: LoadFlags) -> Source:
        """How to load `tag` of `load_dir`: an extension's tag, DeepSpeed's own load (same layout) or a reshard.
        `checked` when picking the tag has already opened and checked every file of it."""
        with coordinated(self.group()):
            kind = kind_of(st.join(load_dir, tag))
            if kind is not None:
                return self._extension(kind, load_dir, tag)
            return self._deepspeed(load_dir, tag, checked, flags)

    def _extension(self, kind: TagKind, load_dir: str, tag: str) -> Source:
        options, path = self.options, st.join(load_dir, tag)
        live = topology(self.engine).describe()
        if options.direct:
            # a rank that opened its reader closes it when another rank could not open its own
            reader = guarded(lambda: kind.open(load_dir, tag, options.verify), release=lambda opened: opened.close())
            report = LoadReport(mode=LoadMode.EXTENSION, saved=_saved(reader), live=live, kind=kind.name, in_place=True)
            return Source(mode=LoadMode.EXTENSION, path=path, report=report, open=lambda: reader)
        out = self._materialized(kind, load_dir, tag)
        ckpt = UniversalCheckpoint(out, verify=options.verify)
        report = LoadReport(mode=LoadMode.EXTENSION, saved=_saved(ckpt), live=live, universal_dir=out, kind=kind.name)
        return Source(mode=LoadMode.EXTENSION, path=path, report=report, open=lambda: ckpt)

    def _deepspeed(self, load_dir: str, tag: str, checked: bool, flags: LoadFlags) -> Source:
        engine, options = self.engine, self.options
        path, live = st.join(load_dir, tag), topology(engine)
        rank0 = tdist.get_rank() == 0

        # one rank reads the metadata of every model-parallel rank; a thousand ranks reading it would each do so
        # a plain ZeRO-0 save numbers its optimizer's parameters, which this engine's optimizer groups name; and how
        # the tag names a Ulysses job's files (DeepSpeed before #8226 named them by sequence-parallel rank)
        def read_metas() -> tuple[tuple[list[SaveMeta], bool], bool]:
            found = tag_metas(path, options.layout_rules, optimizer_order(engine))
            return found, named_by_sp_rank(path, found[0][0].topology)

        found, by_sp_rank = from_rank0(guarded(read_metas if rank0 else lambda: None))
        metas = found[0]
        meta = metas[0]
        saved = meta.topology
        node_local = not sees_what_rank0_sees(engine, path)
        if self._native_can_load(load_dir, path, saved, live, meta, metas, by_sp_rank):
            if node_local:  # rank 0 sees its node's files only: each rank checks the ones it reads
                guarded(lambda: _on_this_node(path, compat.native_load_files(engine, load_dir, tag), meta.save_id))
            elif not checked:  # opening checks it
                on_rank0(
                    lambda: NativeCheckpoint(
                        load_dir, tag, options.layout_rules, metas=found, by_sp_rank=by_sp_rank
                    ).close()
                )
            report = LoadReport(mode=LoadMode.NATIVE, saved=saved.describe(), live=live.describe())
            return Source(
                mode=LoadMode.NATIVE,
                path=path,
                report=report,
                client_keys=meta.client_state_keys,
                hf_config=meta.hf_config,
                expect_save_id=meta.save_id,
                data_loaders=meta.data_loaders,
            )
        if node_local:
            raise CheckpointError(
                path,
                f"saved at {saved.describe()} on each node's own disk (use_node_local_storage), which only "
                f"DeepSpeed's own load at that layout reads, and it cannot restore this job ({live.describe()}) "
                "exactly; copy every node's tag folder into one shared folder and resume from it with "
                "use_node_local_storage off",
            )
        log.info("ucp: resharding %s from %s to %s", tag, saved.describe(), live.describe())
        if flags.custom_load_fn is not None:
            log.warning(
                "ucp: custom_load_fn is not called when resharding; every tensor is restored from the universal "
                "checkpoint"
            )
        if not options.direct:
            on_rank0(lambda: refuse_fp8_state(load_dir, tag, options.layout_rules, found))
            out = convert_across_ranks(
                load_dir,
                tag,
                options.output and st.join(options.output, tag),
                options.layout_rules,
                options.verify,
                options.workers,
                options.progress,
            )
            report = LoadReport(
                mode=LoadMode.RESHARDED, saved=saved.describe(), live=live.describe(), universal_dir=out
            )
            return Source(
                mode=LoadMode.RESHARDED,
                path=path,
                report=report,
                open=self._opener(out),
                discard=None if options.keep else out,
            )
        # rank 0 checks every file against the metadata, unless picking the tag just did; the others open only the
        # files they read
        src = guarded(
            lambda: NativeCheckpoint(
                load_dir,
                tag,
                options.layout_rules,
                check=rank0 and not checked,
                verify=options.verify,
                metas=found,
                by_sp_rank=by_sp_rank,
            )
        )

        # the manifest (it opens the first rank files and stats every file of the tag) and where each optimizer file
        # holds its states are made once, on rank 0, which has opened every file to check it (and refuses FP8 state
        # the universal format cannot carry)
        def plan() -> tuple[Any, Any]:
            src.refuse_fp8_state()
            return build_manifest(src), src.file_index()

        try:
            manifest, index = from_rank0(guarded(plan if rank0 else lambda: None))
        except CheckpointError:
            src.close()  # a refused tag leaves no file open while the load falls back to an older one
            raise
        if not rank0:
            src.use_index(index)
        mode = LoadMode.SAME_LAYOUT if saved.same_layout(live) and st.is_url(load_dir) else LoadMode.RESHARDED
        report = LoadReport(mode=mode, saved=saved.describe(), live=live.describe(), in_place=True)
        return Source(
            mode=mode,
            path=path,
            report=report,
            open=lambda: DirectCheckpoint(src, manifest),
            check_reads=lambda: _check_direct_reads(src),
        )

    def _native_can_load(
        self, load_dir: str, path: str, saved: Any, live: Any, meta: Any, metas: Any, by_sp_rank: bool
    ) -> bool:
        """Whether DeepSpeed's own load restores this tag exactly into the live engine (collective: every rank
        answers the same)."""
        engine = self.engine
        if not compat.trains(engine):  # ours puts weights of any layout into an engine built without an optimizer
            return False
        rank0 = tdist.get_rank() == 0
        # DeepSpeed's own load looks for a Ulysses rank's files under the names it gives them now, not as before #8226
        if by_sp_rank or not saved.same_layout(live) or st.is_url(load_dir):  # DeepSpeed's reads local paths only
            return False
        # DeepSpeed's own load looks for the names it gave its FastPersist writer, which stored parts under others
        if from_rank0(guarded(lambda: st.in_parts(path) if rank0 else None)):
            return False
        # another optimizer class keeps its state differently (DeepSpeed's CPU Adam counts steps in ints): DeepSpeed's
        # own load would hand it over as is
        live_kernel = optimizer_record(engine)
        if meta.optimizer is not None and any(meta.optimizer.get(k) != live_kernel[k] for k in ("class", "algorithm")):
            return False
        # DeepSpeed's own load of a ZeRO-3 NVMe checkpoint leaves the swapped optimizer states and the sub-groups kept
        # in memory at their fresh values (measured: 13 of 16 tensors wrong); ours reads the swap files
        if compat.nvme_offload(engine) or st.isdir(st.join(path, OFFLOADED)):
            return False
        # DeepSpeed's data sampler keeps numpy values, which torch's weights-only unpickler can build only without
        # checking a dtype's state (`io/safe_pickle.py`), and DeepSpeed's load leaves out the sampler's generator
        if meta.data_sampler_rng is not None:
            return False
        # DeepSpeed's own load looks for experts only in its MoE layers; megatron-core's always go through ours. Every
        # rank answers (a stage may hold MoE layers or fail alone): the collective runs everywhere or nowhere
        return everywhere(guarded(lambda: not megatron_moe_layers(engine.module) and same_stage(engine, metas)))

    def _opener(self, out: str) -> Callable[[], TensorReader]:
        return lambda: UniversalCheckpoint(out, verify=self.options.verify)

    def _imported(self, fmt: ForeignFormat, folder: str) -> str:
        """Our copy of a foreign folder, made once by rank 0 and reused afterwards."""
        name = f"{st.basename(folder.rstrip('/'))}.ucp"
        out = st.join(self.options.output or st.dirname(folder), name)

        def work() -> None:
            with claimed(out, [folder]):
                if not st.isfile(st.join(out, MANIFEST)):
                    log.info("ucp: importing %s folder %s into %s", fmt.name, folder, out)
                    fmt.import_to(folder, out, self.options)

        on_rank0(work)  # every rank takes part: the check above runs on rank 0 only, so no rank skips the collective
        st.forget_listings()  # rank 0 wrote the copy: what any rank listed before is stale
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
        st.forget_listings()
        return out


def _saved(reader: TensorReader) -> str:
    return reader.manifest.source.topology.describe()


def _check_direct_reads(src: NativeCheckpoint) -> None:
    """Every byte any rank read straight from the rank files, checked on rank 0 against their CRCs (collective)."""
    gathered = to_rank0(src.pieces())
    on_rank0(lambda: src.check_reads(gathered or []))


def sees_what_rank0_sees(engine: Engine, folder: str) -> bool:
    """Whether every rank lists the same files in `folder` as rank 0 (collective): not so only where the job keeps each
    node's files on its own disk (`use_node_local_storage`), which then decides from what each node holds."""
    if not engine.use_node_local_storage() or st.is_url(folder):
        return True
    listed = guarded(lambda: sorted(st.listdir(folder)) if st.isdir(folder) else [])
    views = to_rank0(listed)
    return bool(from_rank0(all(v == listed for v in views) if views is not None else None))


def _on_this_node(tag_dir: str, files: list[str] | None, save_id: str) -> None:
    """Refuse a node-local tag whose files this rank reads are not on its node's disk, damaged, or of another save:
    rank 0, which checks every file of a tag on one disk, sees only its own node's."""
    if files is None:
        raise CheckpointError(
            tag_dir,
            "is kept on each node's own disk (use_node_local_storage), and this job's load reads other ranks' files "
            "too (MoE experts' files, or an elastic ZeRO checkpoint): copy every node's tag folder into one shared "
            "folder and resume from it with use_node_local_storage off",
        )
    for path in files:
        if not st.isfile(path):
            raise CheckpointError(
                path, f"is not on this node's disk (rank {tdist.get_rank()}; the job keeps each node's files there)"
            )
        with TorchFile(path) as tfile:
            problems = tfile.verify()
            if problems:
                raise CheckpointError(path, "; ".join(problems))
            check_save_id(path, tfile.save_id, save_id)
