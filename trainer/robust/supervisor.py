"""Driver-side monitor of `megascope train` (MegaScale 4.1-4.2), a thread next to elastic_launch.

It reads the ranks' heartbeats (trainer/robust/heartbeat.py) from the job's control store (the TCPStore the
node-0 driver hosts, tracer/control_store.py; RUN/heartbeats/ files only when it is given no store) and
detects
  dead_rank    a local worker of the current attempt exited without reporting `done` (the elastic
               agent sees the exit too and restarts the group or ends the job; we record why);
  silent_rank  a rank's heartbeat has not changed for heartbeat_timeout_s (frozen process, lost host);
  stall        no rank changed its step or status for stall_timeout_s (a hang), judged once every rank
               of the attempt has begun its first step: start-up (imports, groups, model, restore,
               self-check) is bounded by the rendezvous and process-group timeouts, not by this one;
               under CPU contention it took more than a 5 s stall timeout and was killed as a stall.
For silent ranks and stalls it stops the worker group by killing this node's workers of the attempt:
the elastic agent then restarts the group from the latest checkpoint, or ends the job when no
restarts are left. Every incident is a line in RUN/incidents.jsonl; RUN/health.json holds the
driver's latest view of every rank. Silence and stalls are timed by this process's monotonic clock.
When it judges a stall or a silent rank, and when it stops, it copies the in-flight (hang) records from
the store into RUN/inflight/ (tracer.watchdog.persist_inflight), where the hang analysis reads them.
A failed store read is logged and counted (`store_failures` in health.json); while the store fails no
rank is judged silent, and the clocks restart when it answers again: a store outage never stops training.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from megascope.tracer.control_store import ControlStore
from megascope.tracer.run_dir import INCIDENTS_FILE, SELF_CHECK_DIR, write_json_atomic
from megascope.tracer.watchdog import persist_inflight
from megascope.trainer.config import RobustConfig
from megascope.trainer.robust.heartbeat import KIND as HEARTBEAT
from megascope.trainer.robust.heartbeat import read_heartbeat_files
from megascope.trainer.robust.node_loss import lost_node_record, lost_ranks


def append_incident(run_dir: str | Path, record: dict[str, Any]) -> None:
    """One JSON line per incident. O_APPEND writes of one short line do not interleave."""
    line = json.dumps({"time": time.time(), **record}, default=str) + "\n"
    fd = os.open(Path(run_dir) / INCIDENTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """False for a gone process and for a zombie (exited, not yet reaped by the agent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:  # no /proc (not Linux): signal 0 only tells whether the pid exists
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class _Seen:
    seq: int
    changed_at: float


class Supervisor:
    def __init__(self, run_dir: str | Path, robust: RobustConfig, world: int, max_restarts: int,
                 poll_s: float = 0.02, read_every_s: float = 0.2, host: str | None = None,
                 kill: Callable[[int], None] | None = None, alive: Callable[[int], bool] = process_alive,
                 on_stop_job: Callable[[], None] | None = None, store: ControlStore | None = None,
                 leader: bool = True, restart_note: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.store = store
        """Where the beats are read (None: the heartbeat files of the run directory)."""
        self._store_down = False
        self.robust = robust
        self.world = world
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        """Process liveness is checked this often (cheap), so the rank that died first is seen alone
        before the agent stops the others (it looks every 0.2 s)."""
        self.read_every_s = read_every_s
        self._current: dict[int, dict] | None = None
        self._current_before: dict[int, dict] | None = None
        self.leader = leader
        self.restart_note = restart_note
        """Appended to a restart's action: on several nodes, that the restart waits for every node."""
        """Records the job's restarts (and nodes lost before them): node 0's supervisor on several nodes,
        so that the run directory they share gets each once."""
        self._read_at = 0.0
        self.host = host or socket.gethostname()
        self.driver_pid = os.getpid()
        self.kill = kill or (lambda pid: os.kill(pid, signal.SIGKILL))
        self.alive = alive
        # SIGTERM to the driver: the elastic agent stops every worker and raises, no restart
        self.on_stop_job = on_stop_job or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.incidents: list[dict[str, Any]] = []
        self._attempt = -1
        self._handled = False
        self._seen: dict[int, _Seen] = {}
        self._progress_key: tuple = ()
        self._progress_at = time.monotonic()
        self._health_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="megascope-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, persist: bool = True) -> None:
        """Stop the thread; with `persist`, copy the store's in-flight records to the run directory one
        last time (node 0 only on several nodes: its driver hosts the store, which is gone for the others
        once it has stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if persist:
            self.persist_inflight()

    def persist_inflight(self) -> int:
        """Copy the store's in-flight records into RUN/inflight/ (the hang analysis reads them there)."""
        if self.store is None:
            return 0
        try:
            return persist_inflight(self.store, self.run_dir)
        except OSError as exc:  # the run directory is unwritable: say so, keep supervising
            print(f"[megascope] supervisor: cannot write the in-flight records: {exc}", flush=True)
            return 0

    @property
    def store_failures(self) -> int:
        return self.store.failures if self.store is not None else 0

    @property
    def beats(self) -> dict[int, dict]:
        """The latest heartbeats of the current attempt's ranks, as last read (empty before the first)."""
        return dict(self._current or {})

    def _read_beats(self, now: float) -> dict[int, dict] | None:
        """The beats, or None while the store fails (then nothing is judged)."""
        if self.store is None:
            return read_heartbeat_files(self.run_dir)
        beats = self.store.get_all(HEARTBEAT)
        if beats is None:
            self._store_down = True
            return None
        if self._store_down:  # back: time silence and progress from now, not from the outage's start
            self._store_down = False
            for seen in self._seen.values():
                seen.changed_at = now
            self._progress_at = now
        return beats

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # the monitor must never take the driver down
                print(f"[megascope] supervisor: poll failed: {exc!r}", flush=True)

    # ------------------------------------------------------------------ one poll

    def poll(self, now: float | None = None) -> dict[str, Any] | None:
        """Check once; returns the incident recorded by this poll, if any."""
        now = time.monotonic() if now is None else now
        if self._current is None or now - self._read_at >= self.read_every_s:
            self._read_at = now
            beats = self._read_beats(now)
            if not beats:
                return None
            attempt = max(int(b.get("restart", 0)) for b in beats.values())
            self._current_before = self._current if attempt != self._attempt else None
            self._current = {r: b for r, b in beats.items() if int(b.get("restart", 0)) == attempt}
            if attempt != self._attempt:
                self._new_attempt(attempt, now)
            self._track(self._current, now)
            self._write_health(self._current, now)
        current = self._current
        if self._handled or all(b.get("status") == "done" for b in current.values()):
            return None
        verdict = self._self_check_verdict()
        if verdict is not None:
            self._handled = True
            self._record(verdict)
            self.on_stop_job()
            return verdict
        incident = self._detect(current, now)
        if incident is not None:
            self._handled = True
            if incident["kind"] != "dead_rank":
                # the hang records must reach the run directory before the group (and the records of a
                # store that a restart would overwrite) goes
                incident["inflight_records"] = self.persist_inflight()
            self._record(incident)
            if incident["kind"] != "dead_rank":  # the agent already handles exits itself
                self._stop_group(current)
        return incident

    def _new_attempt(self, attempt: int, now: float) -> None:
        if self._attempt >= 0 and self.leader:
            lost = lost_ranks(self._current_before or {}, self.host)
            if lost:
                self._record(lost_node_record(self._current_before or {}, lost, self._attempt))
            self._record({"kind": "restart", "attempt": attempt,
                          "detail": f"the elastic agent started attempt {attempt} of the worker group"})
        self._attempt, self._handled = attempt, False
        self._seen.clear()
        self._progress_key, self._progress_at = (), now

    def _track(self, current: dict[int, dict], now: float) -> None:
        for rank, beat in current.items():
            seen = self._seen.get(rank)
            if seen is None or seen.seq != beat.get("seq"):
                self._seen[rank] = _Seen(int(beat.get("seq", 0)), now)
        key = tuple(sorted((r, b.get("step"), b.get("status")) for r, b in current.items()))
        if key != self._progress_key:
            self._progress_key, self._progress_at = key, now

    def _local(self, beat: dict) -> bool:
        """A rank this driver started: on its host and, when the beat says so, a child of this process
        (the ranks of a driver that ran here before, killed with its node, are not)."""
        return beat.get("host") == self.host and int(beat.get("driver_pid", self.driver_pid)) == self.driver_pid

    def _detect(self, current: dict[int, dict], now: float) -> dict[str, Any] | None:
        local = {r: b for r, b in current.items() if self._local(b)}
        dead = sorted(r for r, b in local.items()
                      if b.get("status") != "done" and not self.alive(int(b["pid"])))
        if dead:
            return self._incident("dead_rank", dead, current,
                                  f"rank(s) {dead} exited without finishing (status "
                                  f"{[current[r].get('status') for r in dead]})")
        timeout = self.robust.heartbeat_timeout_s
        silent = sorted(r for r, s in self._seen.items()
                        if timeout > 0 and now - s.changed_at > timeout and current[r].get("status") != "done")
        if silent:
            return self._incident("silent_rank", silent, current,
                                  f"no heartbeat from rank(s) {silent} for more than {timeout:g} s")
        stall = self.robust.stall_timeout_s
        if stall > 0 and now - self._progress_at > stall and _all_training(current, self.world):
            suspects = stall_suspects(current)
            return self._incident("stall", suspects, current,
                                  f"no step progress on any rank for more than {stall:g} s; "
                                  f"ranks with nothing in flight while others wait: {suspects}")
        return None

    def _self_check_verdict(self) -> dict[str, Any] | None:
        """An enforced self-check decision to stop (or to drop this host) ends the job on this node:
        restarting on the same bad hardware would only fail again."""
        path = self.run_dir / SELF_CHECK_DIR / f"attempt-{self._attempt:02d}.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        decision = record.get("decision", {})
        if not record.get("enforced") or decision.get("action") == "continue":
            return None
        if decision.get("action") == "exclude" and self.host not in decision.get("exclude", []):
            return None  # another host leaves; this node's agent re-forms the group without it
        return {"kind": "self_check", "ranks": record.get("flagged_ranks", []), "attempt": self._attempt,
                "hosts": record.get("flagged_hosts", []), "detail": decision.get("reason", ""),
                "action": "stopping this node's agent (no restart on bad hardware)"}

    def _incident(self, kind: str, ranks: list[int], current: dict[int, dict], detail: str) -> dict[str, Any]:
        left = self.max_restarts - self._attempt
        action = ("the elastic agent restarts the worker group from the latest checkpoint" + self.restart_note
                  if left > 0 else "no restarts left: the job ends")
        if kind != "dead_rank":
            action = "stopping the worker group; " + action
        return {"kind": kind, "ranks": ranks, "attempt": self._attempt, "detail": detail, "action": action,
                "hosts": sorted({current[r].get("host", "?") for r in ranks if r in current}),
                "steps": {str(r): b.get("step") for r, b in sorted(current.items())},
                "last_events": {str(r): current[r].get("last_event") for r in ranks if r in current}}

    def _record(self, incident: dict[str, Any]) -> None:
        self.incidents.append(incident)
        append_incident(self.run_dir, incident)
        print(f"[megascope] {incident['kind']}: {incident['detail']}"
              + (f" -> {incident['action']}" if "action" in incident else ""), flush=True)

    def _stop_group(self, current: dict[int, dict]) -> None:
        """Kill this node's workers of the attempt; the agent sees the failure and acts on it."""
        for beat in current.values():
            if self._local(beat) and self.alive(int(beat["pid"])):
                try:
                    self.kill(int(beat["pid"]))
                except ProcessLookupError:
                    pass

    def _write_health(self, current: dict[int, dict], now: float) -> None:
        # as fresh as the beats (at most 1 s old): outside the job it is the view of the ranks
        if now - self._health_at < min(1.0, max(self.read_every_s, self.robust.heartbeat_interval_s)):
            return
        self._health_at = now
        write_json_atomic(self.run_dir / "health.json", {
            "attempt": self._attempt, "written_at": time.time(),
            "source": f"control store {self.store.address}" if self.store is not None else "heartbeat files",
            "store_failures": self.store_failures,
            "since_progress_s": round(now - self._progress_at, 3),
            "ranks": {str(r): {"host": b.get("host"), "pid": b.get("pid"), "step": b.get("step"),
                               "status": b.get("status"),
                               "heartbeat_age_s": round(now - self._seen[r].changed_at, 3) if r in self._seen else None,
                               "last_event": b.get("last_event")}
                      for r, b in sorted(current.items())}})


def _all_training(beats: dict[int, dict], world: int) -> bool:
    """Every rank of the world has a heartbeat of this attempt with a step (>= 0): training has begun."""
    steps = [b.get("step") for b in beats.values()]
    return len(steps) == world and all(isinstance(step, int) and step >= 0 for step in steps)


def stall_suspects(beats: dict[int, dict]) -> list[int]:
    """In a stall, the ranks that wait on nothing while others wait in a collective or p2p op: they
    stopped issuing work (MegaScale's in-flight reasoning, here from the heartbeats' last events)."""
    inflight = {r: (b.get("last_event") or {}) for r, b in beats.items()}
    inflight = {r: e for r, e in inflight.items() if e.get("state") == "in_flight"}
    # an async op left over from an earlier step (a prefetch never waited on) is not waiting on peers
    newest = max((int(e.get("step", -1)) for e in inflight.values()), default=-1)
    waiting = {r for r, e in inflight.items() if int(e.get("step", -1)) == newest}
    if not waiting:
        return sorted(beats)
    idle = sorted(r for r in beats if r not in waiting and beats[r].get("status") != "done")
    return idle or sorted(waiting)


class ControlPlaneHost:
    """The job's control store as `megascope train` runs it: node 0's driver hosts a TCPStore for the
    whole job (it outlives every worker restart, unlike a rank), every driver and rank is a client.
    The address reaches the ranks as $MEGASCOPE_CONTROL_STORE (the elastic agent passes the driver's
    environment on). One node: 127.0.0.1 and a free port. Several nodes: $MEGASCOPE_CONTROL_STORE if
    set on every node, else the rendezvous host with the rendezvous port + 1; --node-rank 0 (which must
    run on that host) hosts it."""

    def __init__(self, nnodes: int, node_rank: int, rdzv_endpoint: str) -> None:
        import torch.distributed as dist

        from megascope.tracer import control_store

        given = os.environ.get(control_store.ENV, "").strip()
        if given:
            host, port = control_store.parse_address(given)
        elif nnodes == 1:
            host, port = "127.0.0.1", 0
        else:
            rdzv_host, rdzv_port = control_store.parse_address(rdzv_endpoint)
            host, port = rdzv_host, rdzv_port + 1
        self.server = None
        self._sock: socket.socket | None = None
        self.client: ControlStore | None = None
        self._env_before = given
        if node_rank == 0:
            try:
                # c10d's TCPStore server on a socket we bound: on `host` only (127.0.0.1 on one node; left
                # to itself c10d listens on every interface); port 0: a free one
                self._sock = socket.create_server((host, port), backlog=1024)
                port = self._sock.getsockname()[1]
                self.server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=control_store.OP_TIMEOUT_S),
                                            master_listen_fd=self._sock.fileno())
            except Exception as exc:  # noqa: BLE001 - no store: the file fallback, said once
                print(f"[megascope] warning: cannot host the control store on {host}:{port} ({exc}); "
                      "heartbeats and hang records go to files in the run directory (single host only)",
                      flush=True)
                os.environ.pop(control_store.ENV, None)
                return
            port = int(self.server.port)
        self.address = f"{host}:{port}"
        os.environ[control_store.ENV] = self.address
        self.client = control_store.ControlStore(host, port)

    def close(self) -> None:
        from megascope.tracer import control_store

        if self.client is not None:
            self.client.close()
        self.server = None  # the server thread ends with the object
        if self._sock is not None:
            self._sock.detach()  # the TCPStore server owned the descriptor and has closed it
            self._sock = None
        if self._env_before:
            os.environ[control_store.ENV] = self._env_before
        else:
            os.environ.pop(control_store.ENV, None)
