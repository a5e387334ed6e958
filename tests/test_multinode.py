"""`megascope train` on several hosts, for real: each node is a network namespace with its own address,
hostname and /etc/hosts (tests/netns.py), and runs the command docs/several-hosts.md
gives, with only --node-rank differing; the run directory is the shared storage.

  - two nodes meet under the default rendezvous id (derived from --run-dir) and finish; the control
    store (on node 0) is reached from node 1; run.json and the heartbeats name each rank's real host;
    `analyze` and `watch` read the result;
  - a node that never comes is named in one line when --rdzv-timeout runs out;
  - three nodes, static rendezvous, a pipeline across all three;
  - a node lost mid-run (every process of its namespace SIGKILLed): without a replacement the
    survivor ends with one line naming it; a survivor stopped by SIGTERM while it waits exits within
    seconds, leaving no process behind.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

REPO = Path(__file__).resolve().parents[1]
PORT = 29400
"""The rendezvous port on node 0's address (and PORT + 1 for the control store): a namespace's own ports,
free in every fresh namespace."""


def train_argv(host: netns.Host, nnodes: int, run_dir: Path, *extra: str) -> list[str]:
    """The README's per-node command (plus the test's small job)."""
    return [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--nnodes", str(nnodes),
            "--node-rank", str(host.index), "--rdzv-endpoint", f"node0:{PORT}", "--run-dir", str(run_dir), *extra]


def start(host: netns.Host, argv: list[str], log: Path) -> subprocess.Popen:
    return host.popen(argv, env=host.env(), cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]


def megascope(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def driver_lines(log: Path) -> list[str]:
    """The driver's own lines (megascope's), not torch's logging or the ranks' step lines."""
    return [line for line in log.read_text().splitlines() if line.startswith(("megascope train:", "[megascope]"))]


def test_two_nodes_meet_by_default_and_finish(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    with netns.Cluster(2) as cluster:
        logs = [tmp_path / f"node{h.index}.log" for h in cluster.hosts]
        procs = [start(h, train_argv(h, 2, run, "--dp", "2", "--pp", "2", "--steps", "6"), log)
                 for h, log in zip(cluster.hosts, logs)]
        codes = wait_all(procs, 240)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    starts = [next(line for line in driver_lines(log) if "launching" in line) for log in logs]
    assert all("c10d rendezvous 'megascope-exp'" in line for line in starts), starts

    manifest = json.loads((run / "run.json").read_text())
    assert [r["host"] for r in manifest["topology"]["ranks"]] == ["node0", "node0", "node1", "node1"]
    health = json.loads((run / "health.json").read_text())  # node 0's driver: what it read from its store
    assert health["source"] == f"control store node0:{PORT + 1}" and health["store_failures"] == 0
    assert {r: b["host"] for r, b in health["ranks"].items()} == {"0": "node0", "1": "node0", "2": "node1",
                                                                 "3": "node1"}
    assert all(b["status"] == "done" for b in health["ranks"].values())
    assert not (run / "heartbeats").exists()  # node 1's ranks beat into node 0's store, not into files

    report = megascope("analyze", "--json", str(run))
    assert report.returncode == 0, report.stderr[-2000:]
    summary = json.loads(report.stdout)
    assert summary["run"]["world"] == 4 and summary["run"]["steps"] == 6
    watched = megascope("watch", str(run), "--idle-exit", "30")
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert "megascope watch: run finished at step 5" in watched.stderr, watched.stderr[-2000:]


def test_a_node_that_never_comes_is_named(tmp_path: Path) -> None:
    with netns.Cluster(2) as cluster:
        node0 = cluster.hosts[0]
        log = tmp_path / "node0.log"
        t0 = time.monotonic()
        code = start(node0, train_argv(node0, 2, tmp_path / "exp", "--dp", "2", "--pp", "2", "--steps", "4",
                                       "--rdzv-timeout", "5"), log).wait(timeout=120)
        took = time.monotonic() - t0
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "Traceback" not in text
    last = driver_lines(log)[-1]
    assert re.fullmatch(r"megascope train: rendezvous timed out after 5 s: node\(s\) 1 of 2 did not arrive "
                        r"\(here: 0 \(node0\)\); start the same command there with --node-rank 1, or raise "
                        r"--rdzv-timeout", last), last
    assert took < 120


@pytest.mark.slow
def test_three_nodes_static_rendezvous_pipeline_across_hosts(tmp_path: Path) -> None:
    run = tmp_path / "three"
    with netns.Cluster(3) as cluster:
        logs = [tmp_path / f"node{h.index}.log" for h in cluster.hosts]
        procs = [start(h, train_argv(h, 3, run, "--pp", "3", "--layers", "6", "--steps", "4",
                                     "--rdzv-backend", "static"), log) for h, log in zip(cluster.hosts, logs)]
        codes = wait_all(procs, 300)
    assert codes == [0, 0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    manifest = json.loads((run / "run.json").read_text())
    assert [(r["host"], r["pp"]) for r in manifest["topology"]["ranks"]] == [("node0", 0), ("node1", 1),
                                                                             ("node2", 2)]
    report = megascope("analyze", "--json", str(run))
    assert report.returncode == 0 and json.loads(report.stdout)["run"]["steps"] == 4, report.stderr[-2000:]


def left_behind(host: netns.Host, wait_s: float = 10) -> list[str]:
    """The processes still in the host after its driver exited (waiting up to wait_s for them to go)."""
    deadline = time.monotonic() + wait_s
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    out = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            pass
    return out


def _lose_node1(tmp_path: Path, cluster: netns.Cluster, *extra: str) -> tuple[subprocess.Popen, Path, float]:
    """Start a two-node job, SIGKILL every process of node 1 once node 0 has logged step 20; returns node
    0's driver, its log and when node 1 was killed (monotonic)."""
    run = tmp_path / "lost"
    argv = ["--dp", "2", "--pp", "2", "--steps", "2000", "--checkpoint-every", "10", *extra]  # later flags win
    logs = [tmp_path / f"node{h.index}.log" for h in cluster.hosts]
    procs = [start(h, train_argv(h, 2, run, *argv), log) for h, log in zip(cluster.hosts, logs)]
    deadline = time.monotonic() + 240
    while not re.search(r"^step\s+20 ", logs[0].read_text(), re.M):
        assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.2)
    cluster.hosts[1].kill_all()
    procs[1].wait(timeout=10)
    return procs[0], logs[0], time.monotonic()


@pytest.mark.slow
def test_lost_node_without_replacement_ends_with_one_line(tmp_path: Path) -> None:
    with netns.Cluster(2) as cluster:
        survivor, log, killed_at = _lose_node1(tmp_path, cluster, "--rdzv-timeout", "15")
        code = survivor.wait(timeout=180)
        took = time.monotonic() - killed_at
        left = left_behind(cluster.hosts[0])
    assert code == 1 and left == [], log.read_text()[-3000:]
    assert any("once all 2 nodes are back in the rendezvous (waiting up to --rdzv-timeout 15 s;" in line
               for line in driver_lines(log)), driver_lines(log)  # said at once, not after the timeout
    last = driver_lines(log)[-1]
    assert re.fullmatch(r"megascope train: node 1 \(node1\) lost: ranks 2, 3 ended without a final heartbeat "
                        r"\(the last at [\d:]+, step \d+\), and not back within --rdzv-timeout 15 s; to continue, "
                        r"run the same command with --resume on every node from its checkpoint at step \d+",
                        last), last
    incident = [json.loads(x) for x in (tmp_path / "lost" / "incidents.jsonl").read_text().splitlines()][-1]
    assert incident["kind"] == "node_lost" and incident["ranks"] == [2, 3] and incident["hosts"] == ["node1"]
    print(f"node lost -> survivor's one line after {took:.1f} s (--rdzv-timeout 15)")
    assert took < 15 + 120  # bounded: the peers' failure, the rendezvous timeout, the stop


@pytest.mark.slow
def test_survivor_stopped_by_sigterm_exits_within_seconds(tmp_path: Path) -> None:
    with netns.Cluster(2) as cluster:
        survivor, log, _ = _lose_node1(tmp_path, cluster)  # default --rdzv-timeout: it would wait 300 s
        deadline = time.monotonic() + 60
        while not any("dead_rank" in line for line in driver_lines(log)):  # its ranks failed: it waits
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        t0 = time.monotonic()
        survivor.send_signal(signal.SIGTERM)
        code = survivor.wait(timeout=60)
        took = time.monotonic() - t0
        left = left_behind(cluster.hosts[0], wait_s=0)
    assert left == [], left  # its ranks, the control store and every thread went with it
    assert code != 0 and took < 30, (code, took)
    print(f"SIGTERM -> driver gone after {took:.1f} s")


@pytest.mark.slow
def test_replacement_node_continues_from_the_last_checkpoint(tmp_path: Path) -> None:
    """What a cluster manager does: the lost node is started again with the same command (its run
    directory already holds the job's data: the guard against mixing runs lets the same job back in)."""
    with netns.Cluster(2) as cluster:
        survivor, log, _ = _lose_node1(tmp_path, cluster, "--steps", "60")
        node1 = cluster.hosts[1]
        replacement_log = tmp_path / "node1-again.log"
        argv = train_argv(node1, 2, tmp_path / "lost", "--dp", "2", "--pp", "2", "--steps", "60",
                          "--checkpoint-every", "10")
        replacement = start(node1, argv, replacement_log)
        codes = wait_all([survivor, replacement], 300)
    assert codes == [0, 0], log.read_text()[-3000:] + replacement_log.read_text()[-3000:]
    resumed = re.findall(r"resumed from checkpoint step (\d+) \(attempt 1\)", log.read_text())
    assert len(resumed) == 1 and int(resumed[0]) >= 10, log.read_text()[-3000:]
    incidents = [json.loads(x) for x in (tmp_path / "lost" / "incidents.jsonl").read_text().splitlines()]
    lost = [i for i in incidents if i["kind"] == "node_lost"]
    assert len(lost) == 1 and lost[0]["ranks"] == [2, 3] and lost[0]["hosts"] == ["node1"], incidents
    assert [i["attempt"] for i in incidents if i["kind"] == "restart"] == [1]  # recorded once, by node 0
    steps = megascope("analyze", "--json", str(tmp_path / "lost"))
    assert steps.returncode == 0 and json.loads(steps.stdout)["run"]["steps"] == 60, steps.stderr[-2000:]
    text = megascope("analyze", str(tmp_path / "lost")).stdout
    assert "node_lost: node1 lost: ranks 2, 3 ended without a final heartbeat" in text, text[-3000:]


SYNC = """
import json, sys
import torch.distributed as dist
from megascope.tracer.clock import HostClock
from megascope.tracer.clock_sync import estimate_offsets

rank, world, skew_ns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="tcp://node0:29500", rank=rank, world_size=world)
result = estimate_offsets(HostClock(skew_ns=skew_ns), rounds=8)  # hosts told apart by their real names
print(json.dumps({"offsets": result.offsets_ns, "delays": result.delays_ns, "hosts": result.hosts}))
dist.destroy_process_group()
"""
SKEW_NS = {0: 0, 1: 3_000_000_000, 2: -7_000_000_000}


def test_clock_skew_between_hosts_is_recovered(tmp_path: Path) -> None:
    """Each host's timestamps are offset (namespaces share the kernel's clock, so the skew is added to
    one host's epoch reading, as a host with a wrong clock would read it); the two-level ping-pong over
    the hosts' links finds each offset within its own bound, half the winning round trip."""
    with netns.Cluster(3) as cluster:
        procs = [h.popen([sys.executable, "-c", SYNC, str(h.index), "3", str(SKEW_NS[h.index])], env=h.env(),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for h in cluster.hosts]
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    for out, _ in outs:
        result = json.loads(out)
        assert result["hosts"] == 3, result  # told apart by their hostnames: the exchanges cross the links
        for r, skew in SKEW_NS.items():
            bound = result["delays"][str(r)] / 2 + 1_000_000  # + 1 ms: each process's epoch reading
            assert abs(result["offsets"][str(r)] - skew) <= bound, (r, result)
    print("clock skew recovered within (ns):", [abs(json.loads(out)["offsets"][str(r)] - s)
                                               for out, _ in outs[:1] for r, s in SKEW_NS.items()])
