"""Accuracy benchmark: a suite of simulated runs per fault kind plus clean runs, analyzed with the
default detectors. Prints precision/recall per fault kind, the onset error in steps and the false
findings on clean runs.

    python benchmarks/analyzer_accuracy.py [--seeds 3] [--steps 30]

A detection counts when a finding of the right kind names the injected rank(s) (for links: both
ends, or the collective group holding both; for imbalance: the stage; for hangs: the suspect).
Any other finding is a false positive.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from megascope.analyzer import Run
from megascope.samples.simulator import SimConfig, simulate

LAYOUT = dict(dp=4, tp=2, pp=4)  # 32 ranks; stage s = ranks 8s..8s+7, tp pairs (2k, 2k+1)


def suite(seed: int) -> list[tuple[str, str, int | None]]:
    """(expected kind, spec, onset) per case; rank/size vary with the seed so cases differ."""
    r = (7 * seed + 5) % 32
    r2 = (11 * seed + 20) % 32
    return [
        ("straggler", f"straggler:rank={r},slowdown=0.05,from={8 + seed}", 8 + seed),
        ("straggler", f"straggler:rank={r2},slowdown=0.10,from={12 + seed}", 12 + seed),
        ("straggler", f"straggler:rank={(r + 9) % 32},slowdown=0.3,from=3,to=15", 3),
        ("late_launch", f"late_launch:rank={r2},ms={10 + 5 * seed},every={1 + seed % 3},from=6", 6),
        ("stage_imbalance", f"imbalance:stage={seed % 4},slowdown=0.08", 0),
        ("network_flap", f"flap:ranks={r % 8}-{r % 8 + 8},down_ms=15,period_steps=7,len=2", 7),
        ("network_flap", f"flap:ranks=0-2,down_ms=150,period_steps=9,len=3", 9),
        ("slow_link", f"slow_link:ranks={8 + r % 8}-{16 + r % 8},factor=2.5", 0),
        ("hang", f"hang:rank={r2},at=15", 15),
        ("clean", "", None),
        ("clean", "", None),
    ]


def expected_ranks(kind: str, spec: str) -> set[int]:
    fields = dict(kv.split("=") for kv in spec.split(":", 1)[1].split(","))
    if kind == "stage_imbalance":
        s = int(fields["stage"])
        return set(range(8 * s, 8 * s + 8))
    key = "rank" if "rank" in fields else "ranks"
    a, _, b = fields[key].partition("-")
    return {int(a), int(b)} if b else {int(a)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    tp, fp, fn = defaultdict(int), defaultdict(int), defaultdict(int)
    onset_err: dict[str, list[int]] = defaultdict(list)
    clean_false = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for i, (kind, spec, onset) in enumerate(suite(seed)):
                out = simulate(Path(tmp) / f"s{seed}-{i}", SimConfig(**LAYOUT, steps=args.steps, seed=100 + seed * 17 + i,
                                                                  inject=[spec] if spec else []))
                found = Run.open(out).findings()
                if kind == "clean":
                    clean_false += len(found)
                    for f in found:
                        fp[f.kind] += 1
                    continue
                want = expected_ranks(kind, spec)
                # a flapping collective group is reported as the whole group: the link's ends are in it
                hit = [f for f in found if f.kind == kind and (set(f.ranks) == want or (
                    kind in ("network_flap", "slow_link") and want <= set(f.ranks)))]
                if hit:
                    tp[kind] += 1
                    onset_err[kind].append(abs(hit[0].steps[0] - onset))
                else:
                    fn[kind] += 1
                    print(f"missed: {spec} -> {[(f.kind, f.ranks[:4], f.steps) for f in found]}", file=sys.stderr)
                for f in found:
                    if f not in hit[:1]:
                        fp[f.kind] += 1
                        print(f"extra: {spec} -> {f.kind} {f.ranks[:4]} {f.steps}", file=sys.stderr)
    kinds = ["straggler", "late_launch", "stage_imbalance", "network_flap", "slow_link", "hang"]
    print(f"| fault kind | cases | precision | recall | onset error (steps, max) |\n|---|---|---|---|---|")
    for k in kinds:
        cases = tp[k] + fn[k]
        prec = tp[k] / (tp[k] + fp[k]) if tp[k] + fp[k] else float("nan")
        rec = tp[k] / cases if cases else float("nan")
        err = max(onset_err[k]) if onset_err[k] else float("nan")
        print(f"| {k} | {cases} | {prec:.2f} | {rec:.2f} | {err} |")
    print(f"| clean runs | {2 * args.seeds} | false findings: {clean_false} | | |")
    print(f"\n({args.seeds} seeds, {LAYOUT['dp']}x{LAYOUT['tp']}x{LAYOUT['pp']} layout, {args.steps} steps, "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
