"""Communication ops in flight, and the hang watchdog that reports the ones stuck too long.

Every traced collective/p2p op is registered when issued and removed when it completes (on GPU: when
its end event resolves, so a hung NCCL kernel stays registered even though the launch returned).
A daemon thread checks the oldest op; past `hang_timeout_s` it writes RUN/inflight/rank=NNNNN.json
with what this rank waits on. It needs no GIL-holding help from the training thread, which is
blocked inside the collective (c10d releases the GIL there). MegaScale section 5.2: the ranks that
write nothing, or wait on a different op, are the suspects.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from megascope.tracer.run_dir import inflight_dir, write_json_atomic
from megascope.tracer.schema import SCHEMA_VERSION

log = logging.getLogger("megascope.tracer")


class CommOp:
    """One traced collective or p2p op (also the in-flight record)."""

    __slots__ = ("name", "kind", "group_name", "seq", "peer", "nbytes", "step", "microbatch", "chunk",
                 "issue_ns", "group", "members", "start", "done")

    def __init__(self, name: str, kind: str, group_name: str, seq: int, peer: int, nbytes: int,
                 step: int, microbatch: int, chunk: int, issue_ns: int, group: object,
                 members: list[int] | None) -> None:
        self.name, self.kind, self.group_name, self.seq = name, kind, group_name, seq
        self.peer, self.nbytes = peer, nbytes
        self.step, self.microbatch, self.chunk = step, microbatch, chunk
        self.issue_ns, self.group, self.members = issue_ns, group, members
        self.start: Any = None  # CPU: aligned start ns; GPU: the start CUDA event; None: not recorded
        self.done = False

    def row_prefix(self) -> tuple:
        """events columns from step to bytes."""
        return (self.step, self.microbatch, self.chunk, self.name, self.kind, self.group_name,
                self.seq, self.peer, self.nbytes)

    def describe(self) -> dict[str, Any]:
        return {"op": self.name, "kind": self.kind, "group": self.group_name, "seq": self.seq,
                "peer": self.peer, "peers": self._peers(), "bytes": self.nbytes,
                "since_ns": self.issue_ns, "step": self.step, "microbatch": self.microbatch,
                "chunk": self.chunk}

    def _peers(self) -> list[int] | None:
        if self.members is not None:
            return list(self.members)
        if self.kind == "p2p" and self.peer >= 0:
            return [self.peer]
        try:
            return list(dist.get_process_group_ranks(self.group))
        except Exception:  # group destroyed or not a real group: say we do not know
            return None


class InflightRegistry:
    """Ops in flight by id(op). Single dict operations are atomic under the GIL, so the training thread
    adds (`ops[id(op)] = op`, in the tracer's hot path) and removes without a lock, and the watchdog
    copies the values in one C call."""

    def __init__(self) -> None:
        self.ops: dict[int, CommOp] = {}
        self.last_completed: CommOp | None = None

    def complete(self, op: CommOp) -> None:
        self.ops.pop(id(op), None)
        self.last_completed = op

    def snapshot(self) -> list[CommOp]:
        return sorted(list(self.ops.values()), key=lambda op: op.issue_ns)


class HangWatchdog:
    def __init__(self, run_dir: str | Path | None, rank: int, registry: InflightRegistry,
                 timeout_s: float, now_ns: Callable[[], int], ambient: Callable[[], dict[str, int]]) -> None:
        self.path = inflight_dir(run_dir) / f"rank={rank:05d}.json" if run_dir is not None else None
        self.rank = rank
        self.registry = registry
        self.timeout_ns = int(timeout_s * 1e9)
        self.now_ns = now_ns
        self.ambient = ambient
        self.reports = 0
        self._reported: tuple | None = None
        self._stop = threading.Event()
        period = min(1.0, max(0.02, timeout_s / 4))
        self._thread = threading.Thread(target=self._run, args=(period,), name="megascope-watchdog",
                                        daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.check()
            except Exception as exc:  # the watchdog must never take the process down
                log.warning("tracer: hang watchdog check failed: %r", exc)

    def check(self) -> None:
        now = self.now_ns()
        ops = self.registry.snapshot()
        hung = [op for op in ops if now - op.issue_ns > self.timeout_ns]
        key = tuple(id(op) for op in hung)
        if hung and key != self._reported:
            self._write("waiting", now, hung, ops)
            self._reported = key
        elif not hung and self._reported:
            self._write("resolved", now, [], ops)
            self._reported = None

    def _write(self, state: str, now: int, hung: list[CommOp], ops: list[CommOp]) -> None:
        last = self.registry.last_completed
        record = {
            "schema_version": SCHEMA_VERSION, "rank": self.rank, "state": state, "written_ns": now,
            "timeout_s": self.timeout_ns / 1e9,
            "waiting_on": hung[0].describe() if hung else None,
            "inflight": [op.describe() for op in ops],
            "last_completed": last.describe() if last is not None else None,
            **self.ambient(),
        }
        self.reports += 1
        if state == "waiting":
            op = hung[0]
            log.warning("tracer: rank %d waits on %s (group %s, seq %d) for %.1f s", self.rank, op.name,
                        op.group_name, op.seq, (now - op.issue_ns) / 1e9)
        if self.path is not None:
            write_json_atomic(self.path, record)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
