"""Before a multi-node launch: every node's driver says it is here on the job's control store, and
waits for the others, so a missing node is named in one line instead of a silent rendezvous.

torch's rendezvous waits without a word and ends, after its timeout, in a traceback that names
nobody. Our drivers know more: each knows its --node-rank and the job's rendezvous id, and node 0
hosts the control store (trainer/robust/supervisor.py, ControlPlaneHost) at a known address. So each
driver writes one record (kind "node", key = its node rank: host, pid, rendezvous id) and polls until
every node rank 0..nnodes-1 has one with the same id. A node started again with the same command (a
replacement) overwrites its record and finds the others at once.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

from megascope.tracer.control_store import ControlStore

KIND = "node"
"""The record kind under the control store's prefix: one record per node rank."""


def rendezvous_id(given: str, run_dir: str) -> str:
    """--rdzv-id, else one every node derives alike from the run directory as given (its last part:
    /shared/runs/exp7 and s3://bucket/runs/exp7 both give megascope-exp7)."""
    if given:
        return given
    name = run_dir.rstrip("/").rsplit("/", 1)[-1]
    return f"megascope-{name}"


@dataclass
class RollCall:
    store: ControlStore
    nnodes: int
    node_rank: int
    rdzv_id: str
    timeout_s: float
    poll_s: float = 0.5
    say_every_s: float = 30.0

    def run(self, say: Callable[[str], None]) -> str | None:
        """Announce this node, wait for the rest; None when all are here, else one line saying which
        nodes did not arrive (or came with another rendezvous id) and what to do."""
        me = {"node_rank": self.node_rank, "host": socket.gethostname(), "pid": os.getpid(),
              "rdzv_id": self.rdzv_id, "time": time.time()}
        start = time.monotonic()
        said = start
        announced = False
        nodes: dict[int, dict] = {}
        while True:
            announced = announced or (self._listening() and self.store.put(KIND, self.node_rank, me))
            nodes = (self.store.get_all(KIND) or {}) if announced else {}
            foreign = {r: n for r, n in nodes.items() if n.get("rdzv_id") != self.rdzv_id}
            if foreign:
                rank, node = min(foreign.items())
                return (f"node {rank} ({node.get('host')}) joined with rendezvous id '{node.get('rdzv_id')}', "
                        f"this node has '{self.rdzv_id}': pass the same --run-dir (or the same --rdzv-id) "
                        "on every node")
            missing = [r for r in range(self.nnodes) if r not in nodes]
            if not missing:
                return None
            now = time.monotonic()
            if now - start >= self.timeout_s:
                return self.timed_out(announced, nodes, missing)
            if now - said >= self.say_every_s:
                said = now
                say(f"[megascope] waiting for node(s) {_ranks(missing)} of {self.nnodes} at the control store "
                    f"{self.store.address} ({now - start:.0f} s of --rdzv-timeout {self.timeout_s:g} s)")
            time.sleep(self.poll_s)

    def _listening(self) -> bool:
        """Whether the store's port accepts a connection; asked with a plain socket first, because a
        TCPStore client that cannot connect prints a C++ stack trace on every try while node 0 starts."""
        try:
            with socket.create_connection((self.store.host, self.store.port), timeout=1):
                return True
        except OSError:
            return False

    def timed_out(self, announced: bool, nodes: dict[int, dict], missing: list[int]) -> str:
        if not announced:
            return (f"rendezvous timed out after {self.timeout_s:g} s: node 0 did not arrive (no control store "
                    f"answers at {self.store.address}, which node 0 hosts); start node 0 "
                    f"(--node-rank 0 on the --rdzv-endpoint host), or raise --rdzv-timeout")
        here = ", ".join(f"{r} ({n.get('host')})" for r, n in sorted(nodes.items()))
        return (f"rendezvous timed out after {self.timeout_s:g} s: node(s) {_ranks(missing)} of {self.nnodes} did "
                f"not arrive (here: {here}); start the same command there with --node-rank "
                f"{missing[0]}, or raise --rdzv-timeout")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
