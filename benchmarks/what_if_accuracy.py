"""What-if accuracy against ground truth: the same job run with and without its fault (same seed,
so the same noise), the what-if's estimated fault-free step time against the fault-free twin's
measured one.

    python benchmarks/what_if_accuracy.py [--only NAME ...] [--train] [--train-steps 40] [--keep DIR]

Traces from three sources:
- sim-*: the project's simulator (`megascope simulate` with and without `--inject`; its draws do not
  depend on the faults, so the twin's noise is identical step by step);
- gen-*: the independent generator (samples/independent_gen.py, not the project's timing model:
  rendezvous p2p, tp groups that wait for their slowest inside each op, heavy-tailed noise, GC
  pauses, partial traces), imported through `megascope import ndtimeline`; the twin is the same
  spec without the judged fault (every draw shared; another fault stays);
- train-* (with --train): real `megascope train --preset tiny` runs on this machine with and
  without `--inject straggler:...`, same seed. Real noise is not shared between the twins (+-10% per
  step on a loaded 2-core box), so those rows compare medians over the finding's steps: estimated =
  the faulty run's median step x (1 - throughput_lost), true = the twin's median on those steps.

The step time is the what-if's: from the end of the step before (its last rank) to the end of this
one, what throughput sees (pipeline stages overlap consecutive steps, so a step's span from its
first rank's start is longer). For sim-* and gen-* the comparison is on the steps the what-if
sampled: estimated = what_if_step_time_s (their mean observed step time minus the saving), true =
the twin's mean step time on the same steps. error = estimated / true - 1.
The finding judged is the one of the injected kind whose ranks hold the faulty rank (for generated
traces, any rank of its tp group: their spans end together, the trace cannot tell them apart).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd


@dataclass
class Case:
    name: str
    make: Callable[[Path], tuple[Path, Path]]
    """tmp dir -> (faulty run, fault-free twin)."""
    kind: str
    rank: int
    """The finding judged: this kind, holding this rank (or one of `also`)."""
    what: str
    medians: bool = False
    also: tuple[int, ...] = ()
    """Ranks the trace cannot tell from `rank`: a generated tp group's spans all end together."""


def _sim(name: str, kind: str, rank: int, inject: list[str], what: str, twin: tuple[str, ...] = (),
         **layout) -> Case:
    """`twin`: the faults the fixed job still has (none: the fault-free job)."""
    def make(tmp: Path) -> tuple[Path, Path]:
        from megascope.samples.simulator import SimConfig, simulate
        cfg = dict({"steps": 30, "seed": 11}, **layout)
        return (simulate(tmp / "faulty", SimConfig(inject=inject, **cfg)),
                simulate(tmp / "twin", SimConfig(inject=list(twin), **cfg)))
    return Case(name, make, kind, rank, what)


def _gen(name: str, kind: str, spec_fn: Callable[[], object], what: str) -> Case:
    """The first fault is judged; the twin is the spec without it (any other fault stays)."""
    def make(tmp: Path) -> tuple[Path, Path]:
        from dataclasses import replace

        from megascope.samples.independent_gen import import_run
        spec = spec_fn()
        with contextlib.redirect_stdout(sys.stderr):  # the importer's "imported ..." lines: not the table
            return (import_run(spec, tmp / "faulty"),
                    import_run(replace(spec, faults=spec.faults[1:]), tmp / "twin"))
    spec = spec_fn()
    f = spec.faults[0]
    group = tuple(spec.rank(f.dp, f.stage, t, c) for t in range(spec.tp) for c in range(spec.cp))
    return Case(name, make, kind, spec.rank(f.dp, f.stage, f.tp, f.cp), what, also=group)


def _gen_spec(**kw):
    from megascope.samples.independent_gen import GenSpec, Noise, SlowRank
    faults = kw.pop("faults")
    noise = Noise(**kw.pop("noise", {}))
    return GenSpec(noise=noise, faults=[SlowRank(**f) for f in faults], **kw)


def _train(name: str, layout: list[str], inject: str, rank: int, steps: int, what: str) -> Case:
    def make(tmp: Path) -> tuple[Path, Path]:
        runs = []
        for label, extra in (("faulty", ["--inject", inject]), ("twin", [])):
            out = tmp / label
            cmd = [sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--steps", str(steps),
                   "--seed", "7", "--run-dir", str(out), *layout, *extra]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
            runs.append(out)
        return runs[0], runs[1]
    return Case(name, make, "straggler", rank, what, medians=True)


CASES = [
    _sim("sim-straggler-1.1x", "straggler", 5, ["straggler:rank=5,slowdown=1.1,from=10"],
         "dp4 tp2 pp4, one GPU 10% slow from step 10", dp=4, tp=2, pp=4),
    _sim("sim-straggler-2.4x-step0", "straggler", 0, ["straggler:rank=0,slowdown=2.4"],
         "dp4 pp4, stage-0 rank 2.4x from step 0", dp=4, tp=1, pp=4, micro_batches=8),
    _sim("sim-straggler-vpp", "straggler", 3, ["straggler:rank=3,slowdown=1.3,from=5"],
         "dp2 tp2 pp2 vpp2, 1.3x from step 5", dp=2, tp=2, pp=2, vpp=2, micro_batches=4),
    _sim("sim-late-launch", "late_launch", 6, ["late_launch:rank=6,ms=40,every=2,from=4"],
         "dp4 tp2 pp4, 40 ms before the dp collectives every 2nd step", dp=4, tp=2, pp=4),
    # fixing a partition imbalance puts the stage at the job's mean work per op (the What-if paper's fix:
    # a balanced split), not at the others' (no split removes work): the twin is stage 1 at (3 + 1.3) / 4
    _sim("sim-stage-imbalance", "stage_imbalance", 4, ["imbalance:stage=1,slowdown=1.3"],
         "dp2 tp2 pp4, stage 1 30% slower; twin: stage 1 at the stages' mean, 1.075x",
         twin=("imbalance:stage=1,slowdown=1.075",), dp=2, tp=2, pp=4),
    _sim("sim-slow-link", "slow_link", 3, ["slow_link:ranks=3-7,factor=4"],
         "dp2 tp2 pp4, p2p link 3-7 4x slower", dp=2, tp=2, pp=4),
    _gen("gen-issue-case6", "straggler", lambda: _gen_spec(
        dp=4, tp=2, pp=4, steps=30, micro=8, seed=3,
        faults=[{"dp": 1, "stage": 2, "tp": 1, "fwd": 1.1, "bwd": 1.1, "first": 10}]),
        "dp4 tp2 pp4, one GPU 10% slow from step 10 (the issue's case 6)"),
    _gen("gen-issue-case1", "straggler", lambda: _gen_spec(
        dp=4, tp=4, pp=4, steps=44, micro=8, seed=1, traced="tp0",
        faults=[{"dp": 0, "stage": 0, "fwd": 2.5, "bwd": 2.3}]),
        "dp4 tp4 pp4, tp rank 0 traced, stage-0 rank fwd 2.5x / bwd 2.3x from step 0 (case 1)"),
    _gen("gen-heavy-tail-gc", "straggler", lambda: _gen_spec(
        dp=4, tp=1, pp=4, steps=40, micro=8, seed=5,
        noise={"kind": "student_t", "sigma": 0.03, "gc_prob": 0.05, "gc_s": 0.02, "p2p_sigma": 0.1},
        faults=[{"dp": 2, "stage": 1, "fwd": 1.3, "bwd": 1.3, "first": 15}]),
        "dp4 pp4, Student-t noise, GC pauses, 1.3x from step 15"),
    _gen("gen-missing-workers", "straggler", lambda: _gen_spec(
        dp=4, tp=2, pp=2, steps=30, micro=4, seed=9, traced="tp0", missing=[(3, 1)],
        noise={"kind": "pareto", "sigma": 0.02, "step_sigma": 0.02},
        faults=[{"dp": 1, "stage": 1, "fwd": 1.5, "bwd": 1.5, "first": 0}]),
        "dp4 tp2 pp2, tp0 traced, worker (3, 1) missing, Pareto noise, 1.5x from step 0"),
    _gen("gen-two-faults", "straggler", lambda: _gen_spec(
        dp=4, tp=1, pp=4, steps=30, micro=8, seed=6,
        faults=[{"dp": 1, "stage": 1, "fwd": 1.3, "bwd": 1.3, "first": 5},
                {"dp": 3, "stage": 2, "fwd": 1.5, "bwd": 1.5, "first": 12}]),
        "dp4 pp4, 1.3x (judged) from step 5 and another rank 1.5x from step 12; twin keeps the second"),
    _gen("gen-seq-imbalance", "straggler", lambda: _gen_spec(
        dp=4, tp=1, pp=2, steps=30, micro=8, seed=8, noise={"seq_sigma": 0.1, "step_sigma": 0.03},
        faults=[{"dp": 2, "stage": 1, "fwd": 1.4, "bwd": 1.4, "first": 5}]),
        "dp4 pp2, sequence-length imbalance (10% per micro-batch), 3% per rank-step, 1.4x from step 5"),
    _gen("gen-1024-ranks", "straggler", lambda: _gen_spec(
        dp=16, tp=8, pp=8, steps=20, micro=4, seed=1, p2p_s=4e-3,
        faults=[{"dp": 5, "stage": 6, "tp": 3, "fwd": 1.1, "bwd": 1.1, "first": 8}]),
        "dp16 tp8 pp8 (1,024 ranks, replayed whole), one GPU 10% slow from step 8"),
]
TRAIN_CASES = [
    ("train-dp2pp2", ["--dp", "2", "--pp", "2"], "straggler:rank=3,slowdown=2,from=8", 3,
     "real tiny run dp2 pp2, rank 3 2x slower from step 8"),
    ("train-tp2pp2", ["--tp", "2", "--pp", "2"], "straggler:rank=1,slowdown=2,from=8", 1,
     "real tiny run tp2 pp2, rank 1 2x slower from step 8"),
]
"""Each --train case runs twice, interleaved (faulty, twin, faulty, twin): the box's load drifts."""


def step_times(run) -> pd.Series:
    """Per step: the time from the end of the step before (its last rank's) to the end of this one,
    the what-if's step time; the first step: its span (last end - first start)."""
    steps = run.steps().groupby("step").agg(start=("start_ns", "min"), end=("end_ns", "max")).sort_index()
    follows = pd.Series(steps.index, index=steps.index).diff() == 1
    since = (steps.end - steps.end.shift(1)).where(follows, steps.end - steps.start)
    return since / 1e9


def evaluate(case: Case, tmp: Path) -> dict:
    from megascope.analyzer import Run
    faulty_dir, twin_dir = case.make(tmp)
    faulty, twin = Run.open(faulty_dir), Run.open(twin_dir)
    found = [f for f in faulty.findings() if f.kind == case.kind and {case.rank, *case.also} & set(f.ranks)]
    row = {"case": case.name, "what": case.what}
    if not found:
        return dict(row, note=f"no {case.kind} finding on rank {case.rank}")
    f = found[0]
    t = time.perf_counter()
    wi = faulty.what_if(f)
    row["what_if_s"] = time.perf_counter() - t
    if not wi.get("applicable"):
        return dict(row, note=wi.get("reason", "not applicable"))
    true_steps = step_times(twin)
    if case.medians:
        seen = step_times(faulty)
        steps = [s for s in range(f.steps[0], f.steps[1] + 1) if s in seen.index and s in true_steps.index]
        observed, true = float(np.median(seen[steps])), float(np.median(true_steps[steps]))
        est = observed * (1 - wi["throughput_lost"])
        noise = float(np.std(np.log(true_steps[steps] / np.median(true_steps[steps]))))
        row["note"] = (f"medians over steps {steps[0]}-{steps[-1]}; twin's per-step sigma {100 * noise:.0f}%; "
                       f"what-if throughput_lost {100 * wi['throughput_lost']:.1f}%, observed "
                       f"{100 * (1 - true / observed):.1f}%")
    else:
        steps = wi["steps_sampled"]
        observed, true, est = wi["step_time_s"], float(true_steps[steps].mean()), wi["what_if_step_time_s"]
        row["note"] = f"steps {steps}"
    return dict(row, finding=f"{f.kind} {f.ranks}", observed=observed, true=true, est=est,
                error=100 * (est / true - 1))


def table(rows: list[dict]) -> str:
    out = ["| case | layout and fault | observed step (s) | true fault-free (s) | what-if (s) | error | note |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['what']} | {r['observed']:.4f} | {r['true']:.4f} | {r['est']:.4f} | "
                       f"{r['error']:+.2f}% | {r['note']} |")
        else:
            out.append(f"| {r['case']} | {r['what']} | | | | | {r['note']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    ap.add_argument("--train", action="store_true", help="also the real `megascope train` twins (minutes)")
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--keep", type=Path, help="keep the runs under this directory")
    args = ap.parse_args(argv)
    cases = list(CASES)
    if args.train:
        cases += [_train(f"{n}-{rep}", lay, inj, r, args.train_steps, w)
                  for n, lay, inj, r, w in TRAIN_CASES for rep in "ab"]
    if args.only:
        cases = [c for c in cases if c.name in args.only or c.name.rsplit("-", 1)[0] in args.only]
    rows = []
    base = args.keep or Path(tempfile.mkdtemp(prefix="what-if-accuracy-"))
    try:
        for case in cases:
            tmp = base / case.name
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            rows.append(evaluate(case, tmp))
            r = rows[-1]
            print(f"{case.name}: " + (f"error {r['error']:+.2f}%" if "error" in r else r["note"]), file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(table(rows))
    judged = [abs(r["error"]) for r in rows if "error" in r]
    if judged:
        print(f"\n{len(judged)} of {len(rows)} cases judged; |error| median {np.median(judged):.2f}%, "
              f"max {max(judged):.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
