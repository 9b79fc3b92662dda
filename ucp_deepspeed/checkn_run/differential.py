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


class DifferentialSaver:
    """Per-engine Check-N-Run state: row tracking, the current chain, and the policy's history."""

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
        tracked = policy not in (None, "full")
        if tracked:
            check_optimizer(engine.optimizer.optimizer)
        placed = live_params(engine)
        self.names = {module: placed[cast(torch.nn.Parameter, m.weight)].name for module, m in modules.items()}
        self.policy, self.method, self.bits, self.expected_restores = policy, method, bits, expected_restores
        self.tracker = RowTracker(modules) if tracked else None
        self.chain: list[str] = []
        self.chain_ids: list[str] = []
        self.since_baseline: dict[str, torch.Tensor] = {}
        self.history: list[float] = []
        self.restores = 0

    def _bits(self) -> int | None:
        if self.method is None:
            return None
        if self.bits is None:
            if self.expected_restores is None:
                raise ValueError("quantization needs `bits` or `expected_restores`")
            return choose_bits(self.expected_restores, self.restores)
        exceeded = self.expected_restores is not None and self.restores > self.expected_restores
        return 8 if exceeded else self.bits

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
        changed = self.tracker.take() if self.tracker is not None else {}
        for module, flags in changed.items():
            self.since_baseline[module] = self.since_baseline.get(module, torch.zeros_like(flags)) | flags
        kind, rows = self._plan(changed)
        bits = self._bits()
        tables = {self.names[m]: TableSave(rows.get(m), self.method, bits) for m in self.names}
        chain = (
            [tag]
            if kind == "baseline"
            else (self.chain + [tag] if self.policy == "incremental" else [self.chain[0], tag])
        )
        ids = (
            [save_id]
            if kind == "baseline"
            else (self.chain_ids + [save_id] if self.policy == "incremental" else [self.chain_ids[0], save_id])
        )
        out = st.join(save_dir, tag)

        def start() -> None:
            if st.isdir(out):
                st.delete(out)
            st.makedirs(out)
            st.write(st.join(out, MARKER), b"")

        on_rank0(start)  # a failure on rank 0 (a store that went down) fails the save on every rank
        extra = {
            "save_id": save_id,
            "differential": {
                "kind": kind,
                "policy": self.policy,
                "chain": chain,
                "chain_ids": ids,
                "restores": self.restores,
                "quantize": {"method": self.method, "bits": bits} if self.method else None,
                "changed_fraction": self._fraction(changed) if changed else None,
            },
        }
        _, nbytes = write_live(engine, out, client_state, tables, extra, data_loaders)
        if save_latest:
            on_rank0(lambda: st.write(st.join(save_dir, "latest"), tag.encode()))
        else:
            barrier()
        self.chain, self.chain_ids = chain, ids
        if kind == "baseline":
            self.since_baseline = {m: torch.zeros_like(f) for m, f in self.since_baseline.items()}
            self.history = []
        elif self.policy == "intermittent":
            self.history.append(self._fraction(self.since_baseline))
        return nbytes

    def _fraction(self, flags: dict[str, torch.Tensor]) -> float:
        total = sum(f.numel() for f in flags.values())
        return sum(int(f.sum()) for f in flags.values()) / max(total, 1)

    def _plan(self, changed: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """Baseline or delta, and the rows each table's delta holds."""
        if self.tracker is None or not self.chain:
            return "baseline", {}
        if self.policy == "incremental":
            return "delta", {m: rows_of(f) for m, f in changed.items()}
        if self.policy == "intermittent" and new_baseline_pays(self.history, self._fraction(self.since_baseline)):
            return "baseline", {}
        return "delta", {m: rows_of(f) for m, f in self.since_baseline.items()}

    def restored(self, manifest: Manifest | None) -> None:
        """After a restore from `manifest`: count a lossy restore, and make the next save a baseline."""
        section = (manifest.source.extra.get("differential") if manifest is not None else None) or {}
        self.restores = int(section.get("restores", 0)) + (1 if section.get("quantize") else 0)
        self.chain, self.chain_ids, self.since_baseline, self.history = [], [], {}, []
        if self.tracker is not None:
            for flags in self.tracker.flags.values():
                flags.zero_()
