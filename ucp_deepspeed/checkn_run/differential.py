"""Check-N-Run differential checkpoints (Eisenman et al., NSDI'22) on the universal format.

Each save writes one tag folder in the universal format, straight from the live engine
(`live_save.write_live`). Dense parameters are whole. An embedding table holds either every row (a
baseline) or only the rows looked up since some earlier checkpoint (a delta), and its fp32 rows may
be quantized. Three policies decide what each save holds:

- `one_shot`: one baseline, then every checkpoint holds the rows changed since that baseline;
- `incremental`: every checkpoint holds the rows changed since the previous one; restoring replays
  the chain from the baseline;
- `full`: every checkpoint is a baseline (quantization alone, or a reference to measure against);
- `intermittent`: like one-shot, but a new baseline is taken when the delta about to be written is
  at least the average cost per checkpoint of the current cycle, (1 + f_1 + ... + f_{k-1}) / k in
  units of a full table. Past that point a longer cycle only raises the average, since deltas keep
  growing; the decision uses only the fractions observed so far.

Restoring replays the chain into an ordinary universal checkpoint (`chain.materialize`), which then
loads at any data-parallel size or ZeRO stage like any other. After a restore the next save is a
new baseline, so a chain never spans two runs of different layouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from ucp_deepspeed.checkn_run.chain import MARKER
from ucp_deepspeed.checkn_run.live_save import TableSave, check_supported, write_live
from ucp_deepspeed.checkn_run.quantize import choose_bits
from ucp_deepspeed.checkn_run.tracking import RowTracker, check_optimizer, find_tables, rows_of
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.runtime.capture import live_params
from ucp_deepspeed.runtime.collective import barrier, on_rank0


def new_baseline_pays(history: list[float], fraction: float) -> bool:
    """Intermittent policy: whether writing a delta of `fraction` costs at least the cycle's average so far.

    `history` holds the fractions of the deltas already written since the baseline (which cost 1).
    """
    return fraction >= (1 + sum(history)) / (len(history) + 1)


@dataclass(frozen=True)
class ChainStep:
    """What one save of a chain holds: a baseline or a delta, each table's rows (a delta's), the chain it ends,
    and the bit width of its quantized rows."""

    kind: str
    rows: dict[str, torch.Tensor]
    chain: list[str]
    chain_ids: list[str]
    bits: int | None
    section: dict[str, Any]
    """The manifest's `differential` section."""


class ChainPolicy:
    """A job's Check-N-Run chain: the policy that picks a baseline or a delta at each save, the rows changed since
    the baseline, the chain written so far, and the restores counted for the bit width. The saver of each training
    stack (a DeepSpeed engine here, a TorchRec model in `ucp_deepspeed.torchrec`) tracks rows and writes folders;
    this decides what they hold."""

    def __init__(self, policy: str | None, method: str | None, bits: int | None, expected_restores: int | None):
        self.policy, self.method, self.bits, self.expected_restores = policy, method, bits, expected_restores
        self.chain: list[str] = []
        self.chain_ids: list[str] = []
        self.since_baseline: dict[str, torch.Tensor] = {}
        self.history: list[float] = []
        self.restores = 0

    @property
    def tracked(self) -> bool:
        """Whether saves hold deltas, so looked-up rows must be tracked."""
        return self.policy not in (None, "full")

    def _bits(self) -> int | None:
        if self.method is None:
            return None
        if self.bits is None:
            if self.expected_restores is None:
                raise ValueError("quantization needs `bits` or `expected_restores`")
            return choose_bits(self.expected_restores, self.restores)
        exceeded = self.expected_restores is not None and self.restores > self.expected_restores
        return 8 if exceeded else self.bits

    def step(self, changed: dict[str, torch.Tensor], tag: str, save_id: str) -> ChainStep:
        """What save `tag` holds, given each table's rows looked up (on any rank) since the previous save."""
        for table, flags in changed.items():
            self.since_baseline[table] = self.since_baseline.get(table, torch.zeros_like(flags)) | flags
        # a tag of the chain saved again would replace an element the chain still needs: start a new one
        kind, rows = self._plan(changed) if tag not in self.chain else ("baseline", {})
        bits = self._bits()
        if kind == "baseline":
            chain, ids = [tag], [save_id]
        elif self.policy == "incremental":
            chain, ids = self.chain + [tag], self.chain_ids + [save_id]
        else:
            chain, ids = [self.chain[0], tag], [self.chain_ids[0], save_id]
        section = {
            "kind": kind,
            "policy": self.policy,
            "chain": chain,
            "chain_ids": ids,
            "restores": self.restores,
            "quantize": {"method": self.method, "bits": bits} if self.method else None,
            "changed_fraction": _fraction(changed) if changed else None,
        }
        return ChainStep(kind=kind, rows=rows, chain=chain, chain_ids=ids, bits=bits, section=section)

    @contextlib.contextmanager
    def saving(self, changed: dict[str, torch.Tensor], tag: str, save_id: str) -> Iterator[ChainStep]:
        """What save `tag` holds (`step`), for the block that writes it: a block that finishes ends the chain there
        (`saved`), one that raises makes the next save a baseline (`abandoned`)."""
        step = self.step(changed, tag, save_id)
        try:
            yield step
        except BaseException:
            self.abandoned()
            raise
        self.saved(step)

    def saved(self, step: ChainStep) -> None:
        """After `step` was written on every rank: it ends the chain the next save builds on."""
        self.chain, self.chain_ids = step.chain, step.chain_ids
        if step.kind == "baseline":
            self.since_baseline = {m: torch.zeros_like(f) for m, f in self.since_baseline.items()}
            self.history = []
        elif self.policy == "intermittent":
            self.history.append(_fraction(self.since_baseline))

    def _plan(self, changed: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """Baseline or delta, and the rows each table's delta holds."""
        if not self.tracked or not self.chain:
            return "baseline", {}
        if self.policy == "incremental":
            return "delta", {m: rows_of(f) for m, f in changed.items()}
        if self.policy == "intermittent" and new_baseline_pays(self.history, _fraction(self.since_baseline)):
            return "baseline", {}
        return "delta", {m: rows_of(f) for m, f in self.since_baseline.items()}

    def restored(self, manifest: Manifest | None) -> None:
        """After a restore from `manifest`: count a lossy restore, and make the next save a baseline."""
        section = (manifest.source.extra.get("differential") if manifest is not None else None) or {}
        self.restores = int(section.get("restores", 0)) + (1 if section.get("quantize") else 0)
        self.abandoned()

    def abandoned(self) -> None:
        """After a save that failed: the rows it took from the tracker are in no element, so the next save is a
        baseline (an incremental delta on top of the last element would lose them)."""
        self.chain, self.chain_ids, self.since_baseline, self.history = [], [], {}, []


def _fraction(flags: dict[str, torch.Tensor]) -> float:
    total = sum(f.numel() for f in flags.values())
    return sum(int(f.sum()) for f in flags.values()) / max(total, 1)


def start_tag(save_dir: str, tag: str) -> str:
    """Make a chain element's folder, marked before any tensor file is written (collective); returns it. A failure
    on rank 0 (a store that went down) fails the save on every rank."""
    out = st.join(save_dir, tag)

    def start() -> None:
        if st.isdir(out):
            st.delete(out)
        st.makedirs(out)
        st.write(st.join(out, MARKER), b"")

    on_rank0(start)
    return out


def end_tag(save_dir: str, tag: str, save_latest: bool) -> None:
    """After every rank wrote its part of `tag`: name it the latest (collective)."""
    if save_latest:
        on_rank0(lambda: st.write(st.join(save_dir, "latest"), tag.encode()))
    else:
        barrier()


class DifferentialSaver:
    """Per-engine Check-N-Run state: row tracking and the chain's policy."""

    def __init__(
        self,
        engine: Engine,
        policy: str | None,
        tables: list[str] | None,
        method: str | None,
        bits: int | None,
        expected_restores: int | None,
    ) -> None:
        check_supported(engine)
        modules = find_tables(engine.module, tables)
        if not modules:
            raise ValueError(
                "Check-N-Run checkpoints found no nn.Embedding / nn.EmbeddingBag to track"
                + (f" matching {tables}" if tables else "")
            )
        self.policy = ChainPolicy(policy, method, bits, expected_restores)
        if self.policy.tracked:
            check_optimizer(engine.optimizer.optimizer)
        placed = live_params(engine)
        self.names = {module: placed[cast(torch.nn.Parameter, m.weight)].name for module, m in modules.items()}
        self.tracker = RowTracker(modules) if self.policy.tracked else None

    def save(
        self,
        engine: Engine,
        save_dir: str,
        tag: str,
        client_state: dict[str, Any],
        save_latest: bool,
        save_id: str,
        *,
        data_loaders: list[dict[str, Any]] | None = None,
    ) -> int:
        """Write checkpoint `tag` under the policy (collective); returns the bytes written (rank 0)."""
        with self.policy.saving(self.tracker.take() if self.tracker is not None else {}, tag, save_id) as step:
            tables = {self.names[m]: TableSave(step.rows.get(m), self.policy.method, step.bits) for m in self.names}
            out = start_tag(save_dir, tag)
            extra = {"save_id": save_id, "differential": step.section}
            _, nbytes = write_live(engine, out, client_state, tables, extra, data_loaders)
            end_tag(save_dir, tag, save_latest)
        return nbytes

    def restored(self, manifest: Manifest | None) -> None:
        """After a restore from `manifest`: count a lossy restore, and make the next save a baseline."""
        self.policy.restored(manifest)
        if self.tracker is not None:
            for flags in self.tracker.flags.values():
                flags.zero_()
