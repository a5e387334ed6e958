"""Per-rank heartbeats (MegaScale 4.2): host, pid, rank, step, status and the last traced event,
published every `interval_s` by a daemon thread.

Where: the job's control store (tracer/control_store.py: the TCPStore that `megascope train`'s node-0
driver hosts, named to the ranks by $MEGASCOPE_CONTROL_STORE), so the driver-side supervisor
(trainer/robust/supervisor.py) on any host reads every rank's beat without a shared filesystem. Without a
store (a rank started by hand, a unit test) the beat is a file, RUN/heartbeats/rank=NNNNN.json, written
atomically: the file fallback, which needs a directory every host sees. Each beat carries a sequence
number, so the reader judges silence by its own clock (no cross-host clock skew). The thread keeps
beating while the training thread is blocked in a collective or hung in Python (the stall detector
catches those); it stops when the process is frozen, killed or its host is gone. A failed store write
is logged and counted (`store_failures`); the next beat tries again.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from megascope.tracer import control_store
from megascope.tracer.control_store import ControlStore
from megascope.tracer.run_dir import write_json_atomic

STATUSES = ("starting", "self_check", "restoring", "training", "checkpointing", "done", "failed")
KIND = "heartbeat"
"""The record kind under the control store's prefix."""


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "heartbeats"


def heartbeat_path(run_dir: str | Path, rank: int) -> Path:
    return heartbeat_dir(run_dir) / f"rank={rank:05d}.json"


def read_heartbeats(run_dir: str | Path, store: ControlStore | None = None) -> dict[int, dict[str, Any]]:
    """The latest heartbeat of every rank: from `store` when given (empty if it failed), else the
    heartbeat files, else the driver's view in RUN/health.json (what it last read from the store: host,
    pid, step, status per rank), so a tool outside the job sees the ranks either way."""
    if store is not None:
        return store.get_all(KIND) or {}
    beats = read_heartbeat_files(run_dir)
    return beats if beats else _health_view(run_dir)


def _health_view(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    try:
        health = json.loads((Path(run_dir) / "health.json").read_text())
        return {int(r): {"rank": int(r), "restart": health.get("attempt", 0), **b}
                for r, b in health.get("ranks", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def read_heartbeat_files(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The file fallback: RUN/heartbeats/rank=*.json (unreadable files are skipped)."""
    out: dict[int, dict[str, Any]] = {}
    folder = heartbeat_dir(run_dir)
    if not folder.is_dir():
        return out
    for f in folder.glob("rank=*.json"):
        try:
            beat = json.loads(f.read_text())
            out[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError, TypeError):
            continue  # replaced between listing and reading, or foreign: the next poll sees it
    return out


def last_traced_event() -> dict[str, Any] | None:
    """What the tracer saw last: the oldest op still in flight, else the last completed one."""
    from megascope import tracer as tracing

    active = tracing.active()
    if active is None:
        return None
    inflight = active.registry.snapshot()
    if inflight:
        return {"state": "in_flight", **inflight[0].describe()}
    last = active.registry.last_completed
    return {"state": "completed", **last.describe()} if last is not None else None


class Heartbeat:
    """Start it as early as possible in the worker; update step/status from the training thread."""

    def __init__(self, run_dir: str | Path, rank: int, interval_s: float, restart: int = 0,
                 local_rank: int = 0, store: ControlStore | None | str = "auto") -> None:
        """store: the control store; "auto" = $MEGASCOPE_CONTROL_STORE (else files); None = files."""
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {interval_s}")
        self.store: ControlStore | None = control_store.from_env() if store == "auto" else store  # type: ignore
        self.path = heartbeat_path(run_dir, rank)
        self.interval_s = interval_s
        self.fields: dict[str, Any] = {
            "rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid(),
            # the process that started this rank (the driver: the elastic agent spawns its ranks), so a
            # driver started again on the same host tells the ranks of the previous one from its own
            "driver_pid": os.getppid(),
            "restart": restart, "step": -1, "status": "starting", "seq": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="megascope-heartbeat", daemon=True)
        self._thread.start()

    def update(self, step: int | None = None, status: str | None = None, beat_now: bool = False,
               restart: int | None = None) -> None:
        """restart: the attempt the ranks agreed on (worker.agreed_restart), once the group is formed."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"heartbeat status '{status}' unknown; use one of {STATUSES}")
        with self._lock:
            if restart is not None:
                self.fields["restart"] = restart
            if step is not None:
                self.fields["step"] = step
            if status is not None:
                self.fields["status"] = status
        if beat_now:
            self.beat()

    def beat(self) -> None:
        with self._lock:
            self.fields["seq"] += 1
            record = dict(self.fields, time=time.time())
        try:
            record["last_event"] = last_traced_event()
        except Exception:  # the tracer is optional and must not stop the heartbeat
            record["last_event"] = None
        if self.store is not None:
            self.store.put(KIND, record["rank"], record)  # a failure is logged and counted there
            return
        try:
            write_json_atomic(self.path, record)
        except OSError as exc:  # a full or flaky disk: report, keep beating
            print(f"[megascope] rank {record['rank']}: heartbeat write failed: {exc}", flush=True)

    @property
    def store_failures(self) -> int:
        return self.store.failures if self.store is not None else 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def close(self, status: str) -> None:
        """Final beat with the end status (done or failed); the thread stops."""
        self._stop.set()
        self._thread.join(self.interval_s + 5)
        self.update(status=status, beat_now=True)
