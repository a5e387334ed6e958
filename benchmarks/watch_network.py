"""Live on real faults: `megascope watch` beside the fault lab's jobs, its announcements against the
fault's wall-clock windows. For the two-host cases (node0 and node1 as network namespaces, a `tc tbf`
limit on node1's link in episodes): seconds from the first throttle to the first live network
finding between the hosts, how many live findings that took (one that stays open and counts its
episodes, or one per episode), the episodes the live findings counted against the throttle windows
and the offline analysis's; for a rank fault (SIGSTOP duty cycle) the same latency for its straggler.

    python benchmarks/watch_network.py [--cases tbf-pp,tbf-dp,stop-r1] [--steps 400] [--onset 0.1]

Root and `ip netns` are needed for the two-host cases (tests/netns.py). The watcher runs in the root
namespace on the shared run directory, as `megascope watch RUN` beside a job would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_lab  # noqa: E402

from megascope.analyzer import Run  # noqa: E402
from megascope.tracer.run_dir import FINDINGS_FILE  # noqa: E402

NETWORK = ("network_flap", "slow_link")


@dataclass
class Live:
    case: str
    windows: int
    first_latency_s: float | None
    """first live finding of the expected kind - the fault's first window start (s)"""
    live_findings: int
    """distinct findings of that kind announced live (start records)"""
    live_episodes: int
    """the most episodes one live record counted (network), or live starts (rank faults)"""
    offline_episodes: int | None
    onset_error_steps: int | None
    """live onset - the offline finding's onset (steps)"""


def _time(record: dict) -> float:
    return datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()


def _expected(case: fault_lab.Case, record: dict) -> bool:
    if case.fault in fault_lab.LINK_FAULTS:
        return record["kind"] in NETWORK and len(set(record.get("hosts", []))) == 2
    return record["kind"] in fault_lab.CULPRIT_KINDS and case.rank in record["ranks"]


def judge(case: fault_lab.Case, run_dir: Path, windows: list[tuple[float, float]]) -> Live:
    records = [json.loads(line) for line in (run_dir / FINDINGS_FILE).read_text().splitlines() if line.strip()]
    live = [r for r in records if r["event"] == "start" and _expected(case, r)]
    counted = [int(r.get("evidence", {}).get("episode_count") or 1) for r in records
               if r["event"] in ("start", "update", "end", "open_at_end") and _expected(case, r)]
    offline = [f for f in Run.open(run_dir).findings() if _expected(case, f.to_dict())]
    first = min((_time(r) for r in live), default=None)
    return Live(case.name, len(windows), round(first - windows[0][0], 1) if first and windows else None, len(live),
                max(counted, default=0),
                int(offline[0].evidence.get("episode_count") or len(offline)) if offline else None,
                int(min(r["steps"][0] for r in live) - offline[0].steps[0]) if live and offline else None)


def run(case: fault_lab.Case, work: Path, steps: int, onset: float) -> Live:
    run_dir = work / case.name / "run"
    run_dir.parent.mkdir(parents=True)
    log = open(run_dir.parent / "watch.log", "w+b")
    watcher = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(run_dir), "--idle-exit", "60"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        runner = fault_lab.run_two_hosts if case.nodes > 1 else fault_lab.run_one_host
        windows = runner(case, run_dir, steps, onset)
        watcher.wait(timeout=600)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
        log.close()
    return judge(case, run_dir, windows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--cases", default="tbf-pp,tbf-dp,stop-r1", help="comma-separated fault-lab case names")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per job")
    ap.add_argument("--onset", type=float, default=0.1, help="share of the run before the fault begins")
    ap.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    args = ap.parse_args()
    cases = fault_lab.select(args.cases)
    missing = [f"{c.name}: {why}" for c in cases if (why := fault_lab.unavailable(c))]
    if missing:
        print("watch_network: cannot run " + "; ".join(missing), file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="megascope-watch-network-") as tmp:
        work = args.keep or Path(tmp)
        for case in cases:
            rows.append(run(case, work, args.steps, args.onset))
            print(rows[-1], file=sys.stderr, flush=True)
    print("| case | fault windows | first live finding after the first window (s) | live findings | "
          "episodes counted live | offline | live onset - offline onset (steps) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.case} | {r.windows} | {r.first_latency_s} | {r.live_findings} | {r.live_episodes} | "
              f"{r.offline_episodes} | {r.onset_error_steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
