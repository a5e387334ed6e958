"""Faults made from outside a running job's code, for the fault lab (benchmarks/fault_lab.py).

Each fault acts on a process by its pid, through the operating system only, never through the
trainer: the job does not know. Each is a context manager that undoes what it made on exit, also
after an exception (a stopped process is continued, a cgroup is emptied and removed, a hog killed):

    with StopDutyCycle(pid, stop_ms=30, period_ms=100):   # SIGSTOP for 30 ms of every 100 ms
        ...
    with CpuQuota(pid, share=0.25):                        # cgroup v1 cpu controller: 25% of one CPU
        ...
    with CpuHog(pid, cpu=1):                               # pid and a busy loop pinned to CPU 1
        ...

`unavailable(kind)` says why this machine cannot make a fault (None when it can).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
"""The cgroup v1 cpu controller's root (the machine's; a v2-only machine has no cpu.cfs_quota_us here)."""
PERIOD_US = 100_000
"""The CFS period of the quota cgroup: 100 ms, the kernel's default."""


def unavailable(kind: str) -> str | None:
    """None when `kind` (stop | quota | hog) can be made here; else one line saying why not."""
    if kind == "quota":
        if os.geteuid() != 0:
            return "a cgroup cpu quota needs root"
        if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
            return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    if kind == "hog" and (os.cpu_count() or 1) < 2:
        return "a CPU hog beside a rank needs 2 CPUs"
    return None


def threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank: a child of the agent process, found through /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours
        if ppid == agent and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` may run on `cpus` only (threads it starts later inherit it)."""
    for tid in threads_of(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread exited


class StopDutyCycle:
    """Stop `pid` with SIGSTOP for stop_ms of every period_ms (a host pause, a preempted VM) from a
    thread, until exit; the process is always continued at exit."""

    def __init__(self, pid: int, stop_ms: float, period_ms: float) -> None:
        self.pid, self.stop_s, self.period_s = pid, stop_ms / 1e3, period_ms / 1e3
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._quit.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            self._quit.wait(self.period_s - self.stop_s)

    def __enter__(self) -> "StopDutyCycle":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._quit.set()
        self._thread.join(timeout=5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class CpuQuota:
    """Move every thread of `pid` into a new cgroup whose CFS quota is `share` of one CPU (the nearest
    analogue of a GPU held at capped clocks); at exit move them back to the root cgroup and remove it."""

    def __init__(self, pid: int, share: float) -> None:
        self.pid, self.share = pid, share
        self.path = CGROUP_CPU / f"megascope-lab-{os.getpid()}-{pid}"

    def __enter__(self) -> "CpuQuota":
        self.path.mkdir()
        try:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(self.share * PERIOD_US)))
            (self.path / "cgroup.procs").write_text(str(self.pid))  # v1: moves every thread of the process
        except BaseException:
            self._remove()
            raise
        return self

    def _remove(self) -> None:
        procs = self.path / "cgroup.procs"
        for _ in range(50):  # threads can be born inside it while we move the others out
            left = procs.read_text().split() if procs.exists() else []
            for tid in left:
                try:
                    (CGROUP_CPU / "cgroup.procs").write_text(tid)
                except OSError:
                    pass  # it exited
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        print(f"outside_faults: could not remove {self.path}", file=sys.stderr)

    def __exit__(self, *exc: object) -> None:
        self._remove()


class CpuHog:
    """Pin `pid` (all its threads) to `cpu` and start a busy loop pinned to the same CPU, so the two
    share it; at exit the hog is killed and the process may run on every CPU again."""

    def __init__(self, pid: int, cpu: int) -> None:
        self.pid, self.cpu = pid, cpu
        self._hog: subprocess.Popen | None = None

    def __enter__(self) -> "CpuHog":
        pin(self.pid, {self.cpu})
        self._hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=lambda: os.sched_setaffinity(0, {self.cpu}))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hog is not None:
            self._hog.kill()
            self._hog.wait()
        pin(self.pid, set(range(os.cpu_count() or 1)))
