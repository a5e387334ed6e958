"""Communication ops in flight, and the hang watchdog that reports the ones stuck too long.

Every traced collective/p2p op is registered when issued and removed when it completes (on GPU: when
its end event resolves, so a hung NCCL kernel stays registered even though the launch returned).
A daemon thread checks the oldest op; past `hang_timeout_s` it publishes an in-flight record (what this
rank waits on) in the job's control store (tracer/control_store.py), so no host reads another host's
files. It needs no GIL-holding help from the training thread, which is blocked inside the collective
(c10d releases the GIL there). MegaScale section 5.2: the ranks that write nothing, or wait on a
different op, are the suspects.

The analyzer reads the records offline from RUN/inflight/rank=NNNNN.json: `persist_inflight` copies the
store's records there through the run-directory helpers. Who calls it: the watchdog of rank 0 whenever
the store's record count changes (and once at close), and `megascope train`'s supervisor when it judges
a stall or a silent rank and when the job ends, so the records reach the run directory even when rank 0
is the one that froze. Without a store (no $MEGASCOPE_CONTROL_STORE and no process group yet), or
while the store fails, each rank writes its own record file directly: the file fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from megascope.tracer import control_store
from megascope.tracer.control_store import ControlStore
from megascope.tracer.run_dir import inflight_dir, write_json_atomic
from megascope.tracer.schema import SCHEMA_VERSION

log = logging.getLogger("megascope.tracer")
KIND = "inflight"
"""The record kind under the control store's prefix."""
RESOLVE_EVERY_S = 5.0
"""How often an "auto" watchdog looks again for a store it did not find (the process group may come later)."""


def persist_inflight(store: ControlStore, run_dir: str | Path) -> int:
    """Copy every in-flight record in the store to RUN/inflight/rank=NNNNN.json; returns how many (0
    when the store failed: logged and counted by the store)."""
    records = store.get_all(KIND) or {}
    for rank, record in records.items():
        write_json_atomic(inflight_dir(run_dir) / f"rank={rank:05d}.json", record)
    return len(records)


class CommOp:
    """One traced collective or p2p op (also the in-flight record)."""

    __slots__ = ("name", "kind", "group_name", "seq", "peer", "nbytes", "step", "microbatch", "chunk",
                 "issue_ns", "group", "members", "start", "done")

    def __init__(self, name: str, kind: str, group_name: str, seq: int, peer: int, nbytes: int,
                 step: int, microbatch: int, chunk: int, issue_ns: int, group: dist.ProcessGroup | None,
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
                 timeout_s: float, now_ns: Callable[[], int], ambient: Callable[[], dict[str, int]],
                 store: ControlStore | None | str = "auto") -> None:
        """store: the control store; "auto" = found by control_store.connect() when first needed (again
        every RESOLVE_EVERY_S while there is none); None = always files."""
        self.run_dir = run_dir
        self.path = inflight_dir(run_dir) / f"rank={rank:05d}.json" if run_dir is not None else None
        self._auto = store == "auto"
        self.store: ControlStore | None = None if self._auto else store  # type: ignore[assignment]
        self._resolved_at: float | None = None
        self._persisted_version: int | None = None
        self.persisted = 0
        """Records copied from the store into RUN/inflight/ by this (rank 0's) watchdog."""
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
                self.persist_if_changed()
            except Exception as exc:  # the watchdog must never take the process down
                log.warning("tracer: hang watchdog check failed: %r", exc)

    def _store(self) -> ControlStore | None:
        if self._auto and self.store is None:
            now = time.monotonic()
            if self._resolved_at is None or now - self._resolved_at >= RESOLVE_EVERY_S:
                self._resolved_at = now
                self.store = control_store.connect()
        return self.store

    def persist_if_changed(self) -> None:
        """Rank 0: copy the store's records into the run directory when any rank wrote a new one."""
        if self.rank != 0 or self.run_dir is None:
            return
        store = self._store()
        if store is None:
            return
        version = store.version(KIND)
        if version and version != self._persisted_version:
            self.persisted += persist_inflight(store, self.run_dir)
            self._persisted_version = version

    @property
    def store_failures(self) -> int:
        return self.store.failures if self.store is not None else 0

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
        store = self._store()
        if store is not None and store.put(KIND, self.rank, record):
            return
        if self.path is not None:  # no store, or it failed just now: the file fallback
            write_json_atomic(self.path, record)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.persist_if_changed()  # the last records (e.g. 'resolved') reach the run directory
        except Exception as exc:  # noqa: BLE001 - closing must not fail the job
            log.warning("tracer: persisting in-flight records failed: %r", exc)
