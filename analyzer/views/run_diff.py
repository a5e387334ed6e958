"""What changed between two runs (`megascope diff RUN_A RUN_B`): step time and MFU, each phase (forward,
backward, optimizer, data wait, host gaps, the waits, each collective and pipeline transfer kind) per
pipeline stage and job-wide, the ranks whose own time moved most, and the findings that appeared or went
away; each change named the way a finding is ("backward on stage 3 +18 ms a step (+12%) from run A to
run B") when it clears the runs' own step-to-step noise.

Every measure is a per-step series in each run (seconds a step per rank of the scope: the mean over the
stage's ranks, or over all ranks); a change is the difference of the two runs' medians, named when it
exceeds NOISE_FACTOR x the runs' noise: the largest of each run's step-to-step spread (step_spread) and
its drift within the run (drift). Medians and first differences are robust: the warm-up step and a
checkpoint step move neither much.

Runs of different layouts compare what they share: job-wide phases always, stages when pp matches,
ranks and rank-keyed findings only when the topologies are the same; `not_compared` says what was left
out. Takes anything shaped like `Run` (RunLike: views do not import the facade that imports them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.findings import MIN_LATENESS_S, Finding, rank_list
from megascope.analyzer.views.mfu import MfuTimeline

NOISE_FACTOR = 3.0
"""A change is named when it exceeds this many times the runs' noise (Change.noise) and MIN_CHANGE_S.
Measured on real trainer runs (docs/diff.md, "The significance rule"): 15 pairs of clean `--pp 2` runs
differed by at most 2.41 x their noise, a 3x straggler's backward by at least 5.37 x (18 pairs)."""
MIN_CHANGE_S = MIN_LATENESS_S
"""Seconds a step: a smaller change is timer resolution, never named (a phase that takes 0 s in both
runs at every step has no spread at all)."""
WORK_PHASES = frozenset({"forward", "backward", "optimizer", "data wait", "host gaps"})
"""Phases of a rank's own work; the others (pipeline and collective waits, each op kind's spans) are
time spent with other ranks, which a slow peer stretches too."""
TOP_RANKS = 5
"""Ranks listed under "moved most"."""


class RunLike(Protocol):
    """What a diff reads of a run: `megascope.analyzer.Run` is one."""

    @property
    def store(self) -> Store: ...

    def rank_steps(self) -> pd.DataFrame: ...

    def mfu(self) -> MfuTimeline: ...

    def findings(self) -> list[Finding]: ...


@dataclass
class Change:
    """One measure's change from run A to run B: medians per step, and the noise it is judged against."""

    measure: str
    """"step time", "MFU", a phase ("backward", "dp grad_reduce_scatter"), "own time" (of a rank)"""
    scope: str
    """"job", "stage 3", "rank 5"""
    a: float
    """Run A's median per step (seconds a step per rank of the scope; MFU: 0..1)"""
    b: float
    spread_a: float
    """Run A's step-to-step spread of the measure (step_spread; NaN: under 3 steps)"""
    spread_b: float
    drift_a: float
    """How far run A's measure moved within the run (drift; NaN: under 4 steps)"""
    drift_b: float

    @property
    def delta(self) -> float:
        return self.b - self.a

    @property
    def relative(self) -> float:
        """delta / a (inf: the measure was 0 in run A)"""
        return self.delta / self.a if self.a else (math.inf if self.delta else 0.0)

    @property
    def noise(self) -> float:
        """The runs' own noise: the largest of their step-to-step spreads and drifts (NaN: a run too short)."""
        parts = (self.spread_a, self.spread_b, self.drift_a, self.drift_b)
        return math.nan if any(p != p for p in parts) else max(parts)

    @property
    def threshold(self) -> float:
        floor = 0.0 if self.measure == "MFU" else MIN_CHANGE_S
        return max(NOISE_FACTOR * self.noise, floor)

    @property
    def named(self) -> bool:
        """The change clears the runs' own noise (an unknown noise names nothing)."""
        return bool(self.threshold == self.threshold and abs(self.delta) > self.threshold)

    def sentence(self, a: str = "run A", b: str = "run B") -> str:
        """"backward on stage 3 +18 ms a step (+12%) from run A to run B" (a, b: how to call the runs)."""
        if self.measure == "MFU":
            return (f"MFU {100 * self.delta:+.2f} points ({100 * self.a:.2f}% -> {100 * self.b:.2f}%) "
                    f"from {a} to {b}")
        where = "" if self.scope == "job" else f" on {self.scope}"
        rel = "new" if math.isinf(self.relative) else f"{100 * self.relative:+.0f}%"
        return f"{self.measure}{where} {seconds_text(self.delta, signed=True)} a step ({rel}) from {a} to {b}"

    def to_dict(self) -> dict[str, Any]:
        return {"measure": self.measure, "scope": self.scope, "a": self.a, "b": self.b, "delta": self.delta,
                "relative": self.relative, "spread_a": self.spread_a, "spread_b": self.spread_b,
                "drift_a": self.drift_a, "drift_b": self.drift_b, "threshold": self.threshold,
                "named": self.named, "sentence": self.sentence()}


@dataclass
class RunDiff:
    a: str
    """Run A's directory"""
    b: str
    layout_a: dict[str, int]
    """world, dp, pp, tp (and cp, vpp where the run has them)"""
    layout_b: dict[str, int]
    steps_a: int
    """Steps compared in run A (job-wide series length)"""
    steps_b: int
    step_time: Change
    mfu: Change | None
    """None: a run has no peak FLOP/s (an imported trace), so no MFU"""
    phases: list[Change]
    """Job-wide, each phase both runs have, largest change first"""
    stages: list[Change]
    """Per stage and phase (pp equal), largest change first"""
    ranks: list[Change]
    """The TOP_RANKS ranks whose own time (compute + data wait + host gaps) moved most (same topology)"""
    appeared: list[dict[str, Any]]
    """Findings of run B with no match in run A (Finding.to_dict)"""
    went_away: list[dict[str, Any]]
    """Findings of run A with no match in run B"""
    not_compared: list[str] = field(default_factory=list)
    """What the runs do not share, in words (layouts, phases only one run has, MFU)"""

    @property
    def named(self) -> list[Change]:
        """The changes that clear the noise, causes before effects: step time and MFU; the work per stage
        (job-wide where stages are not compared); the ranks' own time; then the waits and transfers,
        which move on every rank that waits for a slow one. Largest first in each part."""
        local = self.stages if self.stages else self.phases
        head = [self.step_time] + ([self.mfu] if self.mfu is not None else [])
        work = [c for c in local if c.measure in WORK_PHASES]
        waits = [c for c in local if c.measure not in WORK_PHASES]
        return [c for c in head + work + self.ranks + waits if c.named]

    def to_dict(self) -> dict[str, Any]:
        return {"run_a": self.a, "run_b": self.b, "layout_a": self.layout_a, "layout_b": self.layout_b,
                "steps_a": self.steps_a, "steps_b": self.steps_b, "noise_factor": NOISE_FACTOR,
                "step_time": self.step_time.to_dict(), "mfu": self.mfu.to_dict() if self.mfu else None,
                "named": [c.sentence() for c in self.named],
                "phases": [c.to_dict() for c in self.phases], "stages": [c.to_dict() for c in self.stages],
                "ranks": [c.to_dict() for c in self.ranks],
                "findings_appeared": self.appeared, "findings_went_away": self.went_away,
                "not_compared": self.not_compared}


def step_spread(values: Iterable[float]) -> float:
    """A run's step-to-step spread of a per-step series: 1.4826 x MAD of its first differences / sqrt(2)
    (the estimator of detect/peer_stats.noise_sigma: a level shift, a fault's onset, moves one
    difference only). NaN with under 3 steps."""
    v = np.asarray(list(values), dtype=float)
    if len(v) < 3:
        return math.nan
    d = np.diff(v)
    return float(1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2))


def drift(values: Iterable[float]) -> float:
    """How far a per-step series moved within its run: |median of its first half - median of its second
    half|. Clean runs of the real trainer drift by about as much as they differ from each other (a
    rank's own time 25 -> 17 ms from one half to the other, on a shared box), which the step-to-step
    spread does not see. NaN with under 4 steps."""
    v = np.asarray(list(values), dtype=float)
    if len(v) < 4:
        return math.nan
    return float(abs(np.median(v[: len(v) // 2]) - np.median(v[len(v) // 2:])))


def compare(measure: str, scope: str, a: pd.Series, b: pd.Series) -> Change:
    """The Change of one measure from its per-step series (indexed by step) in run A and run B."""
    a, b = a.dropna().sort_index(), b.dropna().sort_index()
    return Change(measure, scope, float(a.median()), float(b.median()), step_spread(a), step_spread(b),
                  drift(a), drift(b))


def diff(run_a: RunLike, run_b: RunLike) -> RunDiff:
    """What changed from run A to run B (the same run twice compares it with itself)."""
    own_a, own_b = _own_times(run_a), _own_times(run_b)
    layout_a, layout_b = layout_of(run_a.store), layout_of(run_b.store)
    notes: list[str] = []
    per_a, per_b = run_a.mfu().per_step.set_index("step"), run_b.mfu().per_step.set_index("step")
    phases_a, phases_b = phase_steps(run_a.store), phase_steps(run_b.store)
    same_pp = layout_a["pp"] == layout_b["pp"]
    same_ranks = same_topology(run_a.store, run_b.store)
    if layout_a != layout_b:
        notes.append(f"layouts differ ({layout_text(layout_a)} vs {layout_text(layout_b)}): phases compared "
                     "as seconds a step per rank" + ("" if same_pp else ", stages not compared (pp differs)")
                     + ("" if same_ranks else ", ranks not compared"))
    notes += _phase_notes(phases_a, phases_b)
    return RunDiff(
        a=str(run_a.store.path), b=str(run_b.store.path), layout_a=layout_a, layout_b=layout_b,
        steps_a=len(per_a), steps_b=len(per_b),
        step_time=compare("step time", "job", per_a.step_time_s, per_b.step_time_s),
        mfu=_mfu_change(per_a, per_b, notes),
        phases=_largest_first(job_changes(phases_a, phases_b)),
        stages=_largest_first(stage_changes(phases_a, phases_b)) if same_pp else [],
        ranks=_largest_first(rank_changes(own_a, own_b))[:TOP_RANKS] if same_ranks else [],
        **_finding_changes(run_a.findings(), run_b.findings(), same_ranks, notes), not_compared=notes)


class DiffInputError(ValueError):
    """The runs cannot be compared; the message says why."""


def _own_times(run: RunLike) -> pd.DataFrame:
    """rank, step, own_s of every complete rank-step; a run without one cannot be compared."""
    rows = run.rank_steps()
    if rows.empty:
        raise DiffInputError(f"{run.store.path} has no complete step: nothing to compare")
    return rows[["rank", "step", "own_s"]]


def layout_of(store: Store) -> dict[str, int]:
    topo = store.manifest.get("topology", {})
    out = {"world": int(topo.get("world") or len(store.topology))}
    out.update({k: int(topo.get(k, 1)) for k in ("dp", "pp", "tp")})
    out.update({k: int(topo[k]) for k in ("cp", "vpp") if int(topo.get(k, 1) or 1) > 1})
    return out


def layout_text(layout: dict[str, int]) -> str:
    return " x ".join(f"{k} {layout[k]}" for k in ("dp", "pp", "tp", "cp") if k in layout)


def same_topology(a: Store, b: Store) -> bool:
    """The same ranks at the same (pp, dp, tp) coordinates: rank numbers mean the same in both runs."""
    cols = ["rank", "pp", "dp", "tp"]
    ta, tb = a.topology[cols].sort_values("rank"), b.topology[cols].sort_values("rank")
    return len(ta) == len(tb) and bool((ta.to_numpy() == tb.to_numpy()).all())


def phase_steps(store: Store) -> pd.DataFrame:
    """pp, step, phase, seconds (summed over the stage's ranks), ranks (diff_phase_steps.sql)."""
    return store.query(load_sql("diff_phase_steps"))


def _per_step(rows: pd.DataFrame, by_stage: bool) -> pd.DataFrame:
    """Seconds a step per rank, one column per phase, indexed by (pp, step) or step: a phase a stage has
    at some step counts 0 at its steps without it (a phase the stage never has stays NaN)."""
    keys = ["pp", "step"] if by_stage else ["step"]
    sums = rows.pivot_table(index=keys, columns="phase", values="seconds", aggfunc="sum")
    ranks = rows.groupby(["pp", "step"]).ranks.first()
    if not by_stage:
        return sums.fillna(0.0).div(ranks.groupby("step").sum(), axis=0)
    has = sums.notna().groupby(level="pp").transform("any")
    return sums.fillna(0.0).where(has).div(ranks, axis=0)


def job_changes(a: pd.DataFrame, b: pd.DataFrame) -> list[Change]:
    """Each phase both runs have, job-wide (seconds a step per rank over all ranks)."""
    pa_, pb = _per_step(a, False), _per_step(b, False)
    return [compare(p, "job", pa_[p], pb[p]) for p in sorted(set(pa_.columns) & set(pb.columns))]


def stage_changes(a: pd.DataFrame, b: pd.DataFrame) -> list[Change]:
    """Each (stage, phase) both runs have (pp equal), seconds a step per rank of the stage."""
    pa_, pb = _per_step(a, True), _per_step(b, True)
    out = []
    for stage in sorted(set(pa_.index.get_level_values("pp")) & set(pb.index.get_level_values("pp"))):
        xa, xb = pa_.xs(stage, level="pp").dropna(axis=1, how="all"), pb.xs(stage, level="pp").dropna(axis=1, how="all")
        out += [compare(p, f"stage {stage}", xa[p], xb[p]) for p in sorted(set(xa.columns) & set(xb.columns))]
    return out


def rank_changes(a: pd.DataFrame, b: pd.DataFrame) -> list[Change]:
    """Per rank, its own time (compute + data wait + host gaps: what the rank itself took, not what it
    waited for; waits move on every rank that waits for a slow one). Same topology only."""
    own_a, own_b = a.pivot(index="step", columns="rank", values="own_s"), b.pivot(index="step", columns="rank",
                                                                                    values="own_s")
    return [compare("own time", f"rank {r}", own_a[r].dropna(), own_b[r].dropna())
            for r in sorted(set(own_a.columns) & set(own_b.columns))]


def _largest_first(changes: list[Change]) -> list[Change]:
    return sorted(changes, key=lambda c: -abs(c.delta))


def _mfu_change(per_a: pd.DataFrame, per_b: pd.DataFrame, notes: list[str]) -> Change | None:
    if per_a.mfu.isna().all() or per_b.mfu.isna().all():
        notes.append("MFU not compared: a run has no peak FLOP/s in run.json (an imported trace)")
        return None
    return compare("MFU", "job", per_a.mfu, per_b.mfu)


def _phase_notes(a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    only_a, only_b = sorted(set(a.phase) - set(b.phase)), sorted(set(b.phase) - set(a.phase))
    return ([f"only in run A: {', '.join(only_a)}"] if only_a else []) + \
        ([f"only in run B: {', '.join(only_b)}"] if only_b else [])


def _finding_key(f: Finding, by_rank: bool) -> tuple:
    return (f.kind, tuple(sorted(f.ranks))) if by_rank else (f.kind,)


def _finding_changes(a: list[Finding], b: list[Finding], by_rank: bool, notes: list[str]) -> dict[str, Any]:
    """Findings of one run with no finding of the same kind on the same ranks in the other (of the same
    kind only, where rank numbers mean different things in the two layouts)."""
    if not by_rank:
        notes.append("findings matched by kind only (rank numbers differ in meaning between the layouts)")
    keys_a, keys_b = {_finding_key(f, by_rank) for f in a}, {_finding_key(f, by_rank) for f in b}
    return {"appeared": [f.to_dict() for f in b if _finding_key(f, by_rank) not in keys_a],
            "went_away": [f.to_dict() for f in a if _finding_key(f, by_rank) not in keys_b]}


def finding_text(f: dict[str, Any]) -> str:
    """'straggler on rank 3, steps 2-11: <summary>'"""
    return f"{f['kind']} on rank {rank_list(f['ranks'])}, steps {f['steps'][0]}-{f['steps'][1]}: {f['summary']}"


def seconds_text(value: float, signed: bool = False) -> str:
    """'+18 ms', '-450 us', '1.23 s'."""
    sign = ("+" if value >= 0 else "-") if signed else ("-" if value < 0 else "")
    v = abs(value)
    if v >= 1:
        return f"{sign}{v:.3g} s"
    if v >= 1e-3:
        return f"{sign}{v * 1e3:.3g} ms"
    return f"{sign}{v * 1e6:.3g} us"
