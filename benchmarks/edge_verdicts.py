"""Verdicts from summaries at the edge vs from raw events, on the accuracy suites.

Each case of the project simulator suite (benchmarks/analyzer_accuracy.py, its `sim_suite` cases) and
of the held-out independent suite (benchmarks/accuracy_independent.py, its `cases`; tuned seeds 0-1
and held-out seeds 1000-1002) is analyzed twice: from its raw events, and from a copy of the run
summarized post hoc (tracer/edge_summary.py summarize_run: the rows each rank's tracer would have
written at close), which the analyzer reads instead of the events when they cover every rank-step.
Prints a table per suite: cases, cases read from the edge tables, identical findings (kind, ranks,
steps, severity rounded to 6 digits), the max |difference| over rank_step's columns and whether the
collective instances are equal; then every case that differs.

    nice -n 10 python benchmarks/edge_verdicts.py [--suite sim|independent|both] [--sim-seeds 3]
                                                  [--sim-steps 30] [--seed N]... [--case NAME]...
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_independent import HELD_OUT, TUNED, _quiet_import  # noqa: E402
from benchmarks.accuracy_independent import cases as independent_cases  # noqa: E402
from benchmarks.analyzer_accuracy import LAYOUT, sim_suite  # noqa: E402
from megascope.analyzer import Run  # noqa: E402
from megascope.analyzer.data import event_pass as ep  # noqa: E402
from megascope.samples.simulator import SimConfig, simulate  # noqa: E402
from megascope.tracer.edge_summary import summarize_run  # noqa: E402

Builder = Callable[[Path], Path]
"""Writes one case's run directory under the given folder; returns the run dir."""


@dataclass
class Outcome:
    label: str
    covered: bool                   # the edge copy was analyzed from its edge tables
    same_findings: bool
    findings: int                   # findings from the raw events
    rank_step_diff: float           # max |raw - edge| over rank_step's numeric columns (inf: rows differ)
    same_collectives: bool          # equal, but for the last arrival of instances whose last members tied
    tied: int                       # instances whose last_rank differs between two members that issued at once
    raw_s: float
    edge_s: float
    notes: list[str] = field(default_factory=list)


def _verdicts(run: Run) -> list[tuple]:
    return [(f.kind, tuple(int(r) for r in f.ranks), tuple(int(s) for s in f.steps), round(float(f.severity), 6))
            for f in run.findings()]


def _sorted(run: Run, table: str, keys: list[str]) -> pd.DataFrame:
    return run.store.query(f"SELECT * FROM {table}").sort_values(keys).reset_index(drop=True)


def _max_diff(a: pd.DataFrame, b: pd.DataFrame) -> float:
    if len(a) != len(b) or list(a.columns) != list(b.columns) or not a[["rank", "step"]].equals(b[["rank", "step"]]):
        return float("inf")
    worst = 0.0
    for col in a.columns:
        x, y = a[col], b[col]
        if pd.api.types.is_numeric_dtype(x) and pd.api.types.is_numeric_dtype(y):
            xv, yv = x.to_numpy(dtype=float), y.to_numpy(dtype=float)
            if not np.array_equal(np.isnan(xv), np.isnan(yv)):
                return float("inf")
            both = ~np.isnan(xv)
            if both.any():
                worst = max(worst, float(np.abs(xv[both] - yv[both]).max()))
        elif not x.equals(y):
            return float("inf")
    return worst


def _same_collectives(raw: Run, a: pd.DataFrame, b: pd.DataFrame) -> tuple[bool, int]:
    """(equal but for tied last arrivals, how many instances differ only in a tied last_rank)."""
    rest = [c for c in a.columns if c != "last_rank"]
    try:
        pd.testing.assert_frame_equal(a[rest], b[rest], check_exact=False, rtol=1e-12)
    except AssertionError:
        return False, 0
    moved = a.index[a.last_rank != b.last_rank]
    for i in moved:  # both "last" members issued the op at the same ns
        group, seq = str(a.at[i, "group"]), int(a.at[i, "seq"])
        r1, r2 = int(a.at[i, "last_rank"]), int(b.at[i, "last_rank"])
        issued = raw.store.query("SELECT rank, start_ns FROM events WHERE kind = 'collective' AND \"group\" = $g "
                                 "AND seq = $s AND rank IN ($r1, $r2)", {"g": group, "s": seq, "r1": r1, "r2": r2})
        if len(issued) != 2 or issued.start_ns.nunique() != 1:
            return False, 0
    return True, len(moved)


def compare(label: str, raw_dir: Path, work: Path) -> Outcome:
    """Analyze `raw_dir` from its events, and a summarized copy of it from its edge tables."""
    edge_dir = work / "edge"
    shutil.copytree(raw_dir, edge_dir, ignore=shutil.ignore_patterns("edge_*", "analysis"))
    summarize_run(edge_dir)
    t = time.perf_counter()
    raw = Run.open(raw_dir)
    raw_found = _verdicts(raw)
    raw_s = time.perf_counter() - t
    t = time.perf_counter()
    edge = Run.open(edge_dir)
    edge_found = _verdicts(edge)
    edge_s = time.perf_counter() - t
    covered = ep.edge_summaries_cover(edge.store)
    diff = _max_diff(_sorted(raw, "rank_step", ["rank", "step"]), _sorted(edge, "rank_step", ["rank", "step"]))
    keys = ["group", "instance", "seq"]
    ca, cb = _sorted(raw, "collective_instances", keys), _sorted(edge, "collective_instances", keys)
    same_coll, ties = _same_collectives(raw, ca, cb)
    out = Outcome(label, covered, raw_found == edge_found, len(raw_found), diff, same_coll, ties, raw_s, edge_s)
    if not covered:
        out.notes.append("the edge copy was not covered: analyzed from its raw events")
    if raw_found != edge_found:
        out.notes.append(f"findings raw {raw_found} vs edge {edge_found}")
    elif [f.to_dict() for f in raw.findings()] != [f.to_dict() for f in edge.findings()]:
        out.notes.append("same findings, but their summary or evidence differ: "
                         f"{[f.to_dict() for f in raw.findings()]} vs {[f.to_dict() for f in edge.findings()]}")
    if diff > 1e-9:
        timeline = ep.plan_pass(raw.store).timeline
        out.notes.append(f"rank_step max |diff| {diff:.3g} (raw pass: {'timeline' if timeline else 'flat'} variant)")
    if not same_coll:
        out.notes.append(f"collective_instances differ ({len(ca)} raw rows, {len(cb)} edge rows)")
    elif ties:
        again = Run.open(raw_dir)  # the same raw analysis once more: is its own choice stable?
        again.findings()
        rerun = int((_sorted(again, "collective_instances", keys).last_rank != ca.last_rank).sum())
        out.notes.append(f"last_rank of {ties} of {len(ca)} collective instances differs, each between members that "
                         f"issued at the same ns (a tie; the raw analysis run again differs from itself in {rerun})")
    return out


def sim_cases(seeds: int, steps: int) -> Iterator[tuple[str, Builder]]:
    """analyzer_accuracy's simulated suite, each run simulated as its run_sim does."""
    for seed in range(seeds):
        for i, case in enumerate(sim_suite(seed)):
            def build(tmp: Path, seed: int = seed, i: int = i, spec: str = case.spec) -> Path:
                return simulate(tmp / "raw", SimConfig(**LAYOUT, steps=steps, seed=100 + seed * 17 + i,
                                                       inject=[spec] if spec else []))
            yield f"seed {seed} #{i} {case.kind} {case.spec}".rstrip(), build


def independent(seeds: list[int], names: list[str] | None) -> Iterator[tuple[str, Builder]]:
    """accuracy_independent's cases, imported with `megascope import ndtimeline` as it does."""
    for seed in seeds:
        for name, (spec, _) in independent_cases(seed).items():
            if names and name not in names:
                continue

            def build(tmp: Path, spec=spec) -> Path:
                (tmp / "import").mkdir()
                return _quiet_import(spec, tmp / "import")
            yield f"seed {seed} {name}", build


def run_suite(title: str, cases: Iterator[tuple[str, Builder]]) -> list[Outcome]:
    outcomes = []
    for label, build in cases:
        with tempfile.TemporaryDirectory(prefix="edge-verdicts-") as tmp:
            t = time.perf_counter()
            out = compare(label, build(Path(tmp)), Path(tmp))
        outcomes.append(out)
        flag = "ok" if not out.notes else "DIFFERS"
        print(f"{title} {label}: {flag} ({time.perf_counter() - t:.1f} s)" + "".join(f"\n    {n}" for n in out.notes),
              file=sys.stderr, flush=True)
    return outcomes


def table(title: str, outcomes: list[Outcome]) -> str:
    diffs = [o.rank_step_diff for o in outcomes]
    lines = [f"\n{title}",
             "| cases | read from edge tables | identical findings (findings in all) | rank_step max abs diff "
             "| equal collective instances (+ equal but a tied last arrival) | analysis s (raw / edge) |",
             "|---|---|---|---|---|---|",
             f"| {len(outcomes)} | {sum(o.covered for o in outcomes)} | {sum(o.same_findings for o in outcomes)} "
             f"({sum(o.findings for o in outcomes)}) "
             f"| {max(diffs, default=0.0):.3g} | {sum(o.same_collectives and not o.tied for o in outcomes)} "
             f"(+{sum(o.same_collectives and o.tied > 0 for o in outcomes)} tied last_rank) "
             f"| {sum(o.raw_s for o in outcomes):.0f} / {sum(o.edge_s for o in outcomes):.0f} |"]
    differing = [o for o in outcomes if o.notes]
    lines.append("differences: none" if not differing else "differences:")
    lines += [f"- {o.label}: " + "; ".join(o.notes) for o in differing]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=["sim", "independent", "both"], default="both")
    ap.add_argument("--sim-seeds", type=int, default=3, help="analyzer_accuracy's --seeds")
    ap.add_argument("--sim-steps", type=int, default=30, help="analyzer_accuracy's --steps")
    ap.add_argument("--seed", action="append", type=int, help="independent suite: these seeds instead")
    ap.add_argument("--case", action="append", help="independent suite: only these cases (repeatable)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    report = []
    if args.suite in ("sim", "both"):
        title = (f"Simulator suite (analyzer_accuracy --suite sim: {args.sim_seeds} seeds, "
                 f"{LAYOUT['dp']}x{LAYOUT['tp']}x{LAYOUT['pp']}, {args.sim_steps} steps)")
        report.append(table(title, run_suite("sim", sim_cases(args.sim_seeds, args.sim_steps))))
    if args.suite in ("independent", "both"):
        seeds = args.seed or TUNED + HELD_OUT
        title = f"Independent suite (accuracy_independent, seeds {seeds})"
        report.append(table(title, run_suite("independent", independent(seeds, args.case))))
    print("\n".join(report))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
