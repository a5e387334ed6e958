"""MFU timeline: per step job-wide (step time, tokens/s, MFU) and per rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from megascope.analyzer.data.store import Store, load_sql


@dataclass
class MfuTimeline:
    per_step: pd.DataFrame
    """step, step_time_s, tokens_per_s, mfu (0..1), ranks_reporting"""
    peak_flops: float
    """Peak FLOP/s per device used for MFU (from run.json)."""
    store: Store = field(repr=False)

    @property
    def mean(self) -> float:
        """Mean MFU over steps (0..1); NaN without steps."""
        return float(self.per_step.mfu.mean()) if len(self.per_step) else float("nan")

    @cached_property
    def per_rank(self) -> pd.DataFrame:
        """rank, step, step_time_s, mfu: fetched on first use (every rank-step: 12.3 M rows, 1.8 s, at
        12,288 ranks x 1,000 steps, which the report and the dashboard do not read)."""
        peak = self.peak_flops
        rows = self.store.query(load_sql("mfu_per_rank"), _params(self.store, peak))
        if peak != peak:  # unknown peak: MFU cannot be computed, keep the times
            rows["mfu"] = float("nan")
        return rows


def peak_flops(manifest: dict) -> float:
    peak = (manifest.get("peak_flops") or {}).get("per_device")
    return float(peak) if peak else float("nan")


def _params(store: Store, peak: float) -> dict[str, float]:
    topo = store.manifest["topology"]
    return {"world": int(topo.get("world") or len(store.topology)), "peak": peak if peak == peak else 1.0}


def mfu_timeline(store: Store) -> MfuTimeline:
    topo = store.manifest["topology"]
    peak = peak_flops(store.manifest)
    per_step = store.query(load_sql("mfu"), dict(_params(store, peak),
                                                replica_size=int(topo.get("tp", 1)) * int(topo.get("pp", 1))))
    if peak != peak:  # unknown peak: MFU cannot be computed, keep the times
        per_step["mfu"] = float("nan")
    return MfuTimeline(per_step=per_step, peak_flops=peak, store=store)
