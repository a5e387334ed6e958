"""MFU timeline: per step job-wide (step time, tokens/s, MFU) and per rank."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from megascope.analyzer.store import Store, load_sql


@dataclass
class MfuTimeline:
    per_step: pd.DataFrame
    """step, step_time_s, tokens_per_s, mfu (0..1), ranks_reporting"""
    per_rank: pd.DataFrame
    """rank, step, step_time_s, mfu"""
    peak_flops: float
    """Peak FLOP/s per device used for MFU (from run.json)."""

    @property
    def mean(self) -> float:
        """Mean MFU over steps (0..1); NaN without steps."""
        return float(self.per_step.mfu.mean()) if len(self.per_step) else float("nan")


def peak_flops(manifest: dict) -> float:
    peak = (manifest.get("peak_flops") or {}).get("per_device")
    return float(peak) if peak else float("nan")


def mfu_timeline(store: Store) -> MfuTimeline:
    topo = store.manifest["topology"]
    world = int(topo.get("world") or len(store.topology))
    peak = peak_flops(store.manifest)
    params = {"world": world, "peak": peak if peak == peak else 1.0}
    per_step = store.query(load_sql("mfu"), dict(params, replica_size=int(topo.get("tp", 1)) * int(topo.get("pp", 1))))
    per_rank = store.query(load_sql("mfu_per_rank"), params)
    if peak != peak:  # unknown peak: MFU cannot be computed, keep the times
        per_step["mfu"] = float("nan")
        per_rank["mfu"] = float("nan")
    return MfuTimeline(per_step=per_step, per_rank=per_rank, peak_flops=peak)
