"""Losing a node of a two-node `megascope train` job, and getting it back: how long each part takes.

Two hosts as network namespaces (tests/netns.py: own address, hostname, /etc/hosts), the README's
per-node command (tiny preset, dp=2 x pp=2 across the hosts, a checkpoint every 10 steps). Once node
0 has logged step KILL_AT, every process of node 1 is SIGKILLed; --replace-after seconds later node 1
is started again with the same command. Times from the kill, read by polling node 0's log:

    detect    the survivor's supervisor reports its ranks' failure (dead_rank: they died in a collective)
    resumed   node 0's ranks completed their first step of the new attempt ("resumed from checkpoint")
    first     node 0 logged its first step line after the restart (training again)

Without a replacement (--replace-after -1) the survivor's one line comes after --rdzv-timeout; its time
is printed instead. Needs root and `ip netns`.

    python benchmarks/node_loss.py --trials 3
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import netns  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 30


def command(host: netns.Host, run: Path, steps: int, timeout_s: int) -> list[str]:
    return [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
            "--steps", str(steps), "--checkpoint-every", "10", "--nnodes", "2", "--node-rank", str(host.index),
            "--rdzv-endpoint", "node0:29400", "--rdzv-timeout", str(timeout_s), "--run-dir", str(run)]


def wait_for(log: Path, pattern: str, start: int, timeout_s: float) -> tuple[float, int] | None:
    """(monotonic time, end offset) of the first match of `pattern` after `start` in the log, polled every 50 ms."""
    deadline = time.monotonic() + timeout_s
    rx = re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        m = rx.search(log.read_text(errors="replace"), start)
        if m:
            return time.monotonic(), m.end()
        time.sleep(0.05)
    return None


def trial(folder: Path, replace_after: float, steps: int, timeout_s: int) -> dict[str, float | None]:
    run = folder / "run"
    with netns.Cluster(2) as cluster:
        logs = [folder / f"node{h.index}.log" for h in cluster.hosts]
        procs = [h.popen(command(h, run, steps, timeout_s), env=h.env(), cwd=REPO, stdout=log.open("w"),
                         stderr=subprocess.STDOUT) for h, log in zip(cluster.hosts, logs)]
        started = wait_for(logs[0], rf"^step\s+{KILL_AT} ", 0, 300)
        if started is None:
            raise SystemExit(f"node 0 never reached step {KILL_AT}; see {logs[0]}")
        offset = started[1]
        cluster.hosts[1].kill_all()
        killed = time.monotonic()
        out: dict[str, float | None] = {}
        detect = wait_for(logs[0], r"^\[megascope\] dead_rank", offset, 120)
        out["detect"] = detect[0] - killed if detect else None
        if replace_after >= 0:
            time.sleep(max(0.0, replace_after - (time.monotonic() - killed)))
            node1 = cluster.hosts[1]
            procs[1] = node1.popen(command(node1, run, steps, timeout_s), env=node1.env(), cwd=REPO,
                                   stdout=(folder / "node1-again.log").open("w"), stderr=subprocess.STDOUT)
            resumed = wait_for(logs[0], r"resumed from checkpoint step", offset, 300)
            out["resumed"] = resumed[0] - killed if resumed else None
            first = wait_for(logs[0], r"^step\s+\d+ ", resumed[1], 120) if resumed else None
            out["first"] = first[0] - killed if first else None
        else:
            line = wait_for(logs[0], r"^megascope train: .* lost", offset, timeout_s + 300)
            out["one line"] = line[0] - killed if line else None
        for p in procs:
            p.wait(timeout=600)
        out["exit codes"] = float(sum(abs(p.returncode) for p in procs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--replace-after", type=float, default=3.0, help="seconds after the kill; -1: no replacement")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rdzv-timeout", type=int, default=60)
    args = ap.parse_args()
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"node_loss: {reason}")
    rows = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="megascope-node-loss-") as tmp:
            rows.append(trial(Path(tmp), args.replace_after, args.steps, args.rdzv_timeout))
        print(f"trial {i}: " + ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in rows[-1].items()),
              flush=True)
    keys = list(rows[0])
    print("\n| trial | " + " | ".join(f"{k} (s after the kill)" if k != "exit codes" else k for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for i, row in enumerate(rows):
        print(f"| {i} | " + " | ".join("-" if row[k] is None else f"{row[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
