"""`megascope train` launched as srun launches it, across two hosts: each node is a network namespace with
its own address, hostname and /etc/hosts (tests/netns.py) and its driver gets no launch flag at all,
only the SLURM_* variables srun sets for a step of one task per node on a job whose node list is
`node[0-1]` (the hosts' names, resolvable in every host). No Slurm is needed: the variables are what
the scheduler hands the command, and everything after them is the real launch.

The job is a pipeline across the two hosts (pp=2, one rank per node): the launch values are the same
for any layout, and two ranks instead of four keep it inside a minute on the shared 2-core box
(pp=2: 52.6 s and 41.9 s in two runs at load average 10-22; dp=2 x pp=2 as in tests/test_multinode.py:
72.5 s in one run at load 7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.test_scheduler_env import srun_env

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_nodes_launched_by_slurm_variables_alone_train_to_the_end(tmp_path: Path) -> None:
    run = tmp_path / "exp7"
    # the test's own environment may come from a scheduler too: only the fake step's variables count
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "JOB_COMPLETION_INDEX"}
    argv = [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--pp", "2",
            "--steps", "4", "--run-dir", str(run)]  # the same command on every node: no --nnodes, --node-rank
    with netns.Cluster(2) as cluster:
        logs = [tmp_path / f"node{h.index}.log" for h in cluster.hosts]
        t0 = time.monotonic()
        procs = [h.popen(argv, env=h.env(base, **srun_env("node[0-1]", 2, h.index)), cwd=REPO,
                         stdout=log.open("w"), stderr=subprocess.STDOUT) for h, log in zip(cluster.hosts, logs)]
        deadline = time.monotonic() + 120
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        took = time.monotonic() - t0
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    for i, text in enumerate(texts):
        first = text.splitlines()[0]
        assert first == (f"[megascope] launch from Slurm: node rank {i} from SLURM_NODEID, 2 nodes from SLURM_NNODES, "
                         "endpoint node0:29400 from SLURM_JOB_NODELIST and the default port"), first
        start = next(line for line in text.splitlines() if line.startswith("[megascope] launching"))
        assert f"node {i} of 2 (node{i}), c10d rendezvous 'megascope-exp7' at node0:29400" in start, start

    manifest = json.loads((run / "run.json").read_text())
    assert [r["host"] for r in manifest["topology"]["ranks"]] == ["node0", "node1"]
    health = json.loads((run / "health.json").read_text())  # node 0 hosted the control store, node 1 reached it
    assert health["source"] == "control store node0:29401" and health["store_failures"] == 0
    assert sorted(b["status"] for b in health["ranks"].values()) == ["done"] * 2
    report = subprocess.run([sys.executable, "-m", "megascope.cli", "analyze", "--json", str(run)],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    assert json.loads(report.stdout)["run"]["steps"] == 4
    print(f"two Slurm-launched nodes, 4 steps of pp2: {took:.1f} s")
