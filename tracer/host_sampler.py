"""What a rank's host time went to, per step: the evidence the analyzer's cause step reads (host_steps).

At each record_step the training thread takes one sample of cumulative counters and the tracer writes
the differences since the previous sample (the step's window) as one host_steps row:

- Python garbage collection: pause time and count, timed by a `gc.callbacks` hook (start/stop pairs;
  a collection on any thread holds the GIL, so it stops the training thread too);
- the training thread's CPU time and its run delay, the time it was runnable but waited for a CPU
  (/proc/self/task/<tid>/schedstat, 1st and 2nd fields): CPU contention, and a CFS quota's throttling (a
  throttled task stays queued, so its wait counts there too). Not time.thread_time_ns: in this VM a CPU
  clock is a system call, 2.7 us idle and 125 us a call at load 15 (cProfile), a pread ~1.8 us;
- the throttled time of the process's cgroup (cpu.stat: v1 `throttled_time` ns, v2 `throttled_usec`),
  which tells a quota from contention. The cgroup is looked up again when /proc/self/cgroup changes
  (a process moved into a quota's cgroup mid-run: that step's difference is left out).

A measure this machine lacks (no /proc, no cpu controller) is -1 in every row, never an error. Each read
is a pread on a file opened once (~1.3 us each on an idle 2-core box, against ~18 us to open and read).
Any failure is counted by the tracer (Tracer._failed) and the row is skipped.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

ABSENT = -1
"""The value of a measure this machine or this step does not have."""
CGROUP_CHECK_NS = 1_000_000_000
"""How often the sampler looks whether the process moved to another cgroup."""


def _read_fd(fd: int | None, size: int = 4096) -> bytes | None:
    if fd is None:
        return None
    try:
        return os.pread(fd, size, 0)
    except OSError:
        return None


def _open(path: str | Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class GcTimer:
    """Cumulative Python GC pause time (ns) and collections, from gc.callbacks (installed until close)."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.count = 0
        self._start = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        elif self._start:
            self.total_ns += time.perf_counter_ns() - self._start
            self.count += 1
            self._start = 0

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._callback)
        except ValueError:
            pass


def cpu_stat_path(cgroup_file: str, mountinfo: str) -> tuple[Path, str] | None:
    """The cpu.stat of the process's cpu cgroup and the key of its throttled time, from the text of
    /proc/self/cgroup and /proc/self/mountinfo: the cgroup v1 cpu controller's when it is mounted
    (`throttled_time`, ns), else the v2 unified hierarchy's (`throttled_usec`). None when neither."""
    v1, v2 = None, None
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        before, after = fields.split(), tail.split()
        if len(before) < 5 or len(after) < 3:
            continue
        root, mount, fstype, options = before[3], before[4], after[0], after[2]
        if fstype == "cgroup" and "cpu" in options.split(","):
            v1 = (root, mount)
        elif fstype == "cgroup2":
            v2 = (root, mount)
    for line in cgroup_file.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v1 is not None and "cpu" in controllers.split(","):
            return _under(v1, path), "throttled_time"
        if v2 is not None and hid == "0" and controllers == "":
            found = _under(v2, path)
            if v1 is None:
                return found, "throttled_usec"
    return None


def _under(mount: tuple[str, str], path: str) -> Path:
    """A cgroup path (as /proc/self/cgroup names it) under the mount of its hierarchy, whose root
    (mountinfo's 4th field) may itself be a cgroup (a container's namespace)."""
    root, point = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return Path(point) / path.lstrip("/") / "cpu.stat"


def throttled_ns(text: bytes, key: str) -> int:
    for line in text.split(b"\n"):
        name, _, value = line.partition(b" ")
        if name == key.encode():
            return int(value) * (1000 if key == "throttled_usec" else 1)
    return ABSENT


class HostSampler:
    """Cumulative counters of this process and its training thread; `delta(now_ns)` is the host_steps
    row of the window since the previous call (None on the first call, or after a cgroup change)."""

    def __init__(self) -> None:
        self.gc = GcTimer()
        self._cgroup_fd = _open("/proc/self/cgroup")
        self._cgroup_text: bytes | None = None
        self._cgroup_next = 0
        self._stat_fd: int | None = None
        self._stat_key = ""
        self._tid: int | None = None
        self._sched_fd: int | None = None
        self._prev: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def _cgroup_changed(self) -> bool:
        """Re-resolve the cpu.stat file when the process's cgroups changed (looked at every
        CGROUP_CHECK_NS: reading /proc/self/cgroup costs ~20 us on a loaded 2-core box, 3x the rest of a
        sample; until the next look, the old cgroup's counter does not grow); True when they did."""
        now = time.monotonic_ns()
        if now < self._cgroup_next:
            return False
        self._cgroup_next = now + CGROUP_CHECK_NS
        text = _read_fd(self._cgroup_fd)
        if text == self._cgroup_text:
            return False
        self._cgroup_text = text
        _close(self._stat_fd)
        self._stat_fd = None
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return True
        found = cpu_stat_path((text or b"").decode(errors="replace"), mountinfo)
        if found is not None:
            self._stat_fd, self._stat_key = _open(found[0]), found[1]
        return True

    def _schedstat(self) -> tuple[int, int, int]:
        """The calling thread's (CPU ns, run delay ns, its id) from its schedstat (ABSENT without one)."""
        tid = threading.get_ident()  # no system call, unlike get_native_id (~2 us here)
        if tid != self._tid:
            _close(self._sched_fd)
            self._tid, self._sched_fd = tid, _open(f"/proc/self/task/{threading.get_native_id()}/schedstat")
        text = _read_fd(self._sched_fd, 128)
        fields = text.split() if text else []
        if len(fields) < 2:
            return ABSENT, ABSENT, tid
        return int(fields[0]), int(fields[1]), tid

    def sample(self, now_ns: int) -> tuple[tuple[int, ...], bool]:
        """The counters now (now_ns, thread CPU, run delay, throttled, gc ns, gc count, thread id) and
        whether the cgroup changed since the previous sample."""
        changed = self._cgroup_changed()
        stat = _read_fd(self._stat_fd)
        cpu, delay, tid = self._schedstat()
        return ((now_ns, cpu, delay, throttled_ns(stat, self._stat_key) if stat else ABSENT, self.gc.total_ns,
                 self.gc.count, tid), changed)

    def delta(self, now_ns: int) -> tuple[int, ...] | None:
        """(start_ns, end_ns, cpu_ns, run_delay_ns, throttled_ns, gc_ns, gc_count): the window since the
        previous sample; None when there is none comparable (first sample, another thread, a cgroup
        change)."""
        with self._lock:
            now, changed = self.sample(now_ns)
            prev, self._prev = self._prev, now
        if prev is None or prev[6] != now[6]:
            return None
        diff = [b - a if a != ABSENT and b != ABSENT else ABSENT for a, b in zip(prev[1:6], now[1:6])]
        if changed:
            diff[2] = ABSENT  # throttled time of another cgroup: not comparable
        return (prev[0], now[0], *diff)

    def close(self) -> None:
        self.gc.close()
        for fd in (self._cgroup_fd, self._stat_fd, self._sched_fd):
            _close(fd)
        self._cgroup_fd = self._stat_fd = self._sched_fd = None
