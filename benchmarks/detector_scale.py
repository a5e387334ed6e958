"""The three default detectors alone at scale: the event pass's tables of a run are dumped once to Parquet
(--tables, reused while present), then loaded into a fresh process and each detector is timed (wall and
CPU seconds, peak RSS) and its findings written as JSON lines, so two versions of the detectors can be
compared on identical input, finding for finding.

    python benchmarks/detector_scale.py [--run /tmp/megascope-scale-edge/tiled] [--tables DIR]
                                        [--only StragglerDetector] [--findings OUT.jsonl] [--cprofile]

The default run is the 12,288-rank x 1,000-step edge case that `benchmarks/analyzer_scale.py --edge`
builds. Dumping runs its event pass (minutes there); the tables take ~1.3 GB.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import resource
import sys
import time
from pathlib import Path

from megascope.analyzer.run import Run

TABLES = ("rank_step", "_p2p_peer_step", "collective_instances", "late_arrivals", "rank_step_incomplete")
DETECTORS = ("StragglerDetector", "FlapDetector", "WorkloadImbalanceDetector")


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dump(run_dir: Path, out: Path) -> None:
    t = time.perf_counter()
    run = Run.open(run_dir)
    run.derived.late_arrivals()  # the event pass and late arrivals, as `analyze` builds them
    out.mkdir(parents=True, exist_ok=True)
    for name in TABLES:
        target = str(out / f"{name}.parquet").replace("'", "''")
        run.store.execute(f"COPY (FROM {name}) TO '{target}'")
    print(f"dumped {run_dir} -> {out} in {time.perf_counter() - t:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("/tmp/megascope-scale-edge/tiled"))
    ap.add_argument("--tables", type=Path, default=Path("/tmp/megascope-detector-tables"))
    ap.add_argument("--only", choices=DETECTORS, action="append")
    ap.add_argument("--findings", type=Path, help="write the findings here (JSON lines)")
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    if not (args.run / "run.json").exists():
        print(f"{args.run}: no run there; build it with benchmarks/analyzer_scale.py --edge", file=sys.stderr)
        return 2
    if not all((args.tables / f"{n}.parquet").exists() for n in TABLES):
        dump(args.run, args.tables)
    run = Run.open(args.run)
    t = time.perf_counter()
    for name in TABLES:
        source = str(args.tables / f"{name}.parquet").replace("'", "''")
        run.store.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS FROM read_parquet('{source}')")
    run.derived.timeline, run.derived.arrivals = True, True  # the tables are loaded, not derived again
    print(f"tables loaded in {time.perf_counter() - t:.1f} s, RSS {rss_mib():.0f} MiB", flush=True)
    lines = []
    for det in run.detectors:
        name = type(det).__name__
        if name not in DETECTORS or (args.only and name not in args.only):
            continue
        t, c = time.perf_counter(), time.process_time()
        prof = cProfile.Profile() if args.cprofile else None
        if prof:
            prof.enable()
        found = det.detect(run.context)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        print(f"{name}: {time.perf_counter() - t:.1f} s wall, {time.process_time() - c:.1f} s CPU, "
              f"{len(found)} finding(s), peak RSS {rss_mib():.0f} MiB", flush=True)
        lines += [json.dumps(dataclasses.asdict(f), sort_keys=True, default=repr) for f in found]
    if args.findings:
        args.findings.write_text("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
