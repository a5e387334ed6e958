"""What a culprit rank's time went to (issue 41 part 3, shared/DESIGN.md section 7 "Cause contract").

For each straggler / late_launch finding, every measure of the rank's step (sql/cause_evidence.sql: its
rank_step phases, the host evidence its tracer sampled, its GPU's throttling) is compared over the
finding's steps against the rank's own history before the onset (after the warm-up; none when the
finding starts too early for MIN_HISTORY steps) and against its stage peers at the same steps; a measure's growth is
the smaller of the two (ms per step, means). The cause is the measure that grew most:

- data_loading: its data_wait spans;
- garbage_collection: Python GC pauses (host_steps.gc_ns; an import's `gc` spans);
- cpu_quota / cpu_contention: the training thread's run delay (runnable, waiting for a CPU), a quota when
  the cgroup's throttled time grew with it (a throttled task stays queued: its wait is run delay too);
- paused: wall time neither on a CPU nor waiting for one nor in a data or peer wait (SIGSTOP, sleeps,
  blocking calls);
- gpu_throttled / slow_compute: its compute spans, with its CPU time (on a CPU: the work itself grew, GC
  left out) or, on a GPU, its clock-slowdown reasons set during the stretch and not before.

The winner must explain at least MIN_SHARE of the rank's own-time growth; else, or with none of these
measures (an import without host_steps whose host gaps grew), the cause is `host_time`. The finding's
evidence gets `explained_by`, `explained_ms`, `grew` (the phases that grew, ms per step) and `measured`
(every measure's growth); its summary names the cause with its number in place of the list of guesses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.detect.peer_stats import warmup_from_medians
from megascope.analyzer.findings import CULPRIT_KINDS, Finding, rank_list

MIN_SHARE = 0.4
"""The share of the rank's own-time growth the winning measure must explain to be named. Measured on
the real runs of tests/test_cause_real.py (2 gloo ranks, this shared 2-core box): the true cause's
growth was 0.7-1.1 of the own-time growth in every case, the runner-up's at most 0.3."""
MIN_HISTORY = 3
"""Steps of the rank's own before the stretch needed for a comparison with its history."""
MAX_PEERS = 64
"""Stage peers read per finding: their per-step median is the reference (64 hold it well; a 1,536-rank
stage would read 1.5 M rank-steps per finding for nothing)."""
GPU_SLOWDOWN = 0.5
"""A stretch is GPU-throttled when at least this share more of its NVML samples have a slowdown reason
set than before the onset."""
PHASES = {"forward": "forward_ms", "backward": "backward_ms", "optimizer": "optimizer_ms", "data_wait": "data_ms",
          "host_gap": "gap_ms"}
"""The step's phases `grew` reports (rank_step's columns)."""
_GUESSES = re.compile(r"[;:] (?:look for|check that) [^.;]*\.")
"""The detectors' list of guesses closing their sentence, which the measured cause replaces in place
(to the sentence's end only: a later sentence, trace_back's naming the victims, stays)."""


@dataclass
class Verdict:
    cause: str
    explained_ms: float
    grew: dict[str, float]
    measured: dict[str, float]
    excess_ms: float


def explain_causes(store: Store, findings: list[Finding], warmup_factor: float) -> None:
    """Give every culprit finding its cause (evidence and summary), in place."""
    for f in findings:
        if f.kind not in CULPRIT_KINDS or not f.ranks:
            continue
        verdict = cause_of(store, f.ranks, f.steps, warmup_factor)
        if verdict is None:  # no rows to compare: the detector's own excess is all that is known
            f.evidence.update(explained_by="host_time", explained_ms=f.evidence.get("excess_ms", 0.0), grew={})
            continue
        f.evidence.update(explained_by=verdict.cause, explained_ms=round(verdict.explained_ms, 2),
                          grew=verdict.grew, measured=verdict.measured)
        f.summary = with_cause(f.summary, f.ranks, verdict)


def cause_of(store: Store, ranks: list[int], steps: tuple[int, int], warmup_factor: float) -> Verdict | None:
    """The cause of the slowdown of `ranks` over `steps` (first, last); None without rows to judge."""
    frame, peers = _evidence(store, [int(r) for r in ranks])
    return decide(frame, [int(r) for r in ranks], peers, steps, warmup_factor) if frame is not None else None


def _evidence(store: Store, mine: list[int]) -> tuple[pd.DataFrame | None, list[int]]:
    """cause_evidence's rows of the ranks `mine` and of up to MAX_PEERS of their stage peers."""
    topo = store.topology
    stages = topo.loc[topo["rank"].isin(mine), "pp"].unique()
    others = topo[topo.pp.isin(stages) & ~topo["rank"].isin(mine)]
    if others.empty:
        others = topo[~topo["rank"].isin(mine)]
    peers = sorted(int(r) for r in others["rank"])[:MAX_PEERS]
    ranks = sorted(mine) + peers
    sampled = store.query("SELECT count(*) AS n FROM host_steps WHERE list_contains($ranks, rank)",
                          {"ranks": ranks}).n.iloc[0]
    store.execute(load_sql("cause_evidence"))
    frame = store.query("SELECT * FROM cause_evidence($ranks, $span_gc)", {"ranks": ranks, "span_gc": not sampled})
    return (None if frame.empty else frame), peers


def decide(frame: pd.DataFrame, mine: list[int], peers: list[int], steps: tuple[int, int],
           warmup_factor: float) -> Verdict | None:
    """The cause of the slowdown of ranks `mine` over `steps` (first, last) in cause_evidence's rows."""
    columns = [c for c in frame.columns if c.endswith("_ms") or c in ("gpu_slowdown", "sm_clock_mhz")]
    frame = frame.assign(paused_ms=frame.wall_ms - frame.cpu_ms - frame.delay_ms - frame.data_ms - frame.wait_ms)
    columns.append("paused_ms")
    warm = warmup_from_medians(frame.groupby("step").step_ms.median().to_numpy(),
                               np.sort(frame.step.unique()), warmup_factor)
    frame = frame[~frame.step.isin(warm)]
    own = frame[frame["rank"].isin(mine)].groupby("step")[columns].mean()
    if own.empty:
        return None
    during = own.index.to_series().between(*steps)
    history = own.index < steps[0]  # (not the steps after: a fault held to the end is there too)
    ref = frame[frame["rank"].isin(peers)].groupby("step")[columns].median()
    ref = ref[ref.index.to_series().between(*steps)]

    def growth(column: str) -> float | None:
        now = own.loc[during, column].mean()
        if not np.isfinite(now):
            return None
        vs = [now - own.loc[history, column].mean() if history.sum() >= MIN_HISTORY else math.nan,
              now - ref[column].mean() if len(ref) else math.nan]
        vs = [v for v in vs if np.isfinite(v)]
        return min(vs) if vs else None

    def ratio_growth(num: str, den: str) -> tuple[float, float] | None:
        """(num/den over the stretch, its growth: the smaller against history and peers), of means."""
        now = own.loc[during, num].mean() / own.loc[during, den].mean()
        if not np.isfinite(now):
            return None
        refs = [own.loc[history, num].mean() / own.loc[history, den].mean() if history.sum() >= MIN_HISTORY
                else math.nan, ref[num].mean() / ref[den].mean() if len(ref) else math.nan]
        refs = [r for r in refs if np.isfinite(r)]
        return (float(now), float(now - max(refs))) if refs else None

    if not during.any():
        return None
    excess = float(growth("own_ms") or 0.0)
    measured = candidates(growth, own.loc[during], own.loc[history] if history.sum() >= MIN_HISTORY else None,
                          ratio_growth("delay_ms", "cpu_ms"))
    grew = {name: round(float(g), 2) for name, col in PHASES.items()
            if (g := growth(col)) is not None and g >= max(0.5, 0.1 * excess)}
    grew = dict(sorted(grew.items(), key=lambda kv: -kv[1]))
    if measured:
        cause, ms = max(measured.items(), key=lambda kv: kv[1])
        if ms >= MIN_SHARE * excess and ms > 0:
            return Verdict(cause, float(ms), grew, {k: round(float(v), 2) for k, v in measured.items()}, excess)
    return Verdict("host_time", float(excess), grew, {k: round(float(v), 2) for k, v in measured.items()}, excess)


def candidates(growth, during: pd.DataFrame, history: pd.DataFrame | None,
               wait: tuple[float, float] | None = None) -> dict[str, float]:
    """Each cause's growth (ms per step) that the run's measures can tell; `wait`: the run delay per CPU ms
    over the stretch and its growth (ratio_growth), which splits the run delay's growth between contention
    and the rank's own extra work."""
    out: dict[str, float] = {}
    data, gc, compute = growth("data_ms"), growth("gc_ms"), growth("compute_ms")
    if data is not None:
        out["data_loading"] = data
    if gc is not None:
        out["garbage_collection"] = gc
    delay, throttled = growth("delay_ms"), growth("throttled_ms")
    # On a CPU other processes share, a rank's own extra work waits for the CPU too: its run delay grows with
    # its CPU time at the same wait per CPU ms. Contention is the wait per CPU ms grown (times its CPU time
    # now); the rest of the delay's growth is its work's. Measured on the lab's tuned ddp-compute-r1 (2 extra
    # forward passes on rank 1, load 11): its CPU time 17.8 -> 25.8 ms a step, run delay 35.5 -> 50.6 ms
    # (medians), the wait per CPU ms 2.0 before and 1.96 during (its peer's 2.05): the raw delay growth
    # (30.0 ms) named cpu_contention over the compute's own (8.7 ms of CPU).
    cpu_now = float(during.cpu_ms.mean()) if "cpu_ms" in during else math.nan
    if delay is not None and wait is not None and np.isfinite(cpu_now):
        delay = min(delay, wait[1] * cpu_now)
    if delay is not None:
        # a quota's throttling is counted per CPU of the cgroup; the thread's wait is its run delay
        quota = throttled is not None and throttled >= 0.5 * delay > 0
        out["cpu_quota" if quota else "cpu_contention"] = delay
    paused = growth("paused_ms")
    if paused is not None:
        out["paused"] = paused
    if compute is not None:
        slowdown = float(during.gpu_slowdown.mean())
        before = float(history.gpu_slowdown.mean()) if history is not None else 0.0
        if np.isfinite(slowdown) and slowdown - (before if np.isfinite(before) else 0.0) >= GPU_SLOWDOWN:
            out["gpu_throttled"] = compute
        elif np.isfinite(slowdown):  # a GPU: its compute spans time the device, not this thread's CPU
            out["slow_compute"] = compute
        else:  # its extra CPU time, with the wait for a CPU that much work has at the old wait per CPU ms
            cpu = growth("cpu_ms")
            queued = 1.0 + (wait[0] - wait[1]) if wait is not None else 1.0
            out["slow_compute"] = compute if cpu is None else min(compute, (cpu - (gc or 0.0)) * queued)
    return out


SENTENCES = {
    "data_loading": "{who} waits {ms} a step for its data loader",
    "garbage_collection": "{who} spends {ms} a step in Python garbage collection",
    "cpu_quota": "{who}'s cgroup throttled it {ms} a step (CPU quota)",
    "cpu_contention": "{who} waits {ms} a step for a CPU (other processes on its cores, no quota)",
    "paused": "{who} is stopped or blocked {ms} a step, neither running nor waiting for a CPU",
    "gpu_throttled": "{who}'s GPU runs clock-throttled: its compute takes {ms} a step longer",
    "slow_compute": "{who}'s compute itself takes {ms} a step longer on its own CPU or GPU",
    "host_time": "{who} spends {ms} a step more in host time no sampled measure explains",
}


def cause_text(cause: str, explained_ms: float, ranks: list[int]) -> str:
    """The cause in words with its number: 'rank 1 waits 24 ms a step for its data loader'."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"each of ranks {rank_list(ranks)}"
    ms = f"{explained_ms:.0f} ms" if explained_ms >= 10 else f"{explained_ms:.1f} ms"
    return SENTENCES[cause].format(who=who, ms=ms) if cause in SENTENCES else f"{who}: {cause} {ms} a step"


def with_cause(summary: str, ranks: list[int], verdict: Verdict) -> str:
    """The summary with its closing list of guesses replaced by the measured cause."""
    measured = f"; measured: {cause_text(verdict.cause, verdict.explained_ms, ranks)}."
    if _GUESSES.search(summary):
        return _GUESSES.sub(lambda _: measured, summary, count=1)
    return f"{summary.rstrip('. ')}{measured}"
