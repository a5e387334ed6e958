"""A stopped driver ends within seconds, whatever its main thread is blocked in.

SIGTERM or SIGINT reaches the driver of `megascope train` as a Python signal handler (the elastic
agent's, which stops the ranks and raises). A Python handler runs only when the main thread returns to
the interpreter; a main thread blocked in a C++ read (a TCPStore get, a rendezvous op waiting on a lost
node) never does, and then the driver lives on after the signal, holding its ports, its control store
thread and its children. The guard does not depend on the main thread: Python's C-level handler writes
the signal's number to a wakeup socket (signal.set_wakeup_fd) the moment the signal arrives, a daemon
thread reads it and gives the orderly stop `deadline_s`; when the process is still there after that, it
kills every descendant (ranks, watcher) and ends the process.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
DEADLINE_S = 10.0
"""The orderly stop took 3.7 s in a two-node job waiting in the rendezvous for a lost peer (the agent
stops its ranks, the supervisor and the control store close; namespaces on the 2-core box); 10 s leaves
room for load. SIGTERM while the agent was still stopping its group after the peer's loss once did not
end in 10 s, and the guard ended it at 10.1 s (tests/test_multinode.py)."""


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first), from /proc; empty without /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(children.get(child, []))
    return out


class StopGuard:
    """install() from the main thread before the job starts; close() when it has ended normally."""

    def __init__(self, deadline_s: float = DEADLINE_S, name: str = "megascope train") -> None:
        self.deadline_s = deadline_s
        self.name = name
        self.signum: int | None = None
        """The first stop signal received (None: none yet)."""
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._previous_fd = -1
        self._closed = threading.Event()

    def install(self) -> "StopGuard":
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:  # the wakeup byte is written only for signals with a Python handler
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _default_for(sig))
        threading.Thread(target=self._watch, name="megascope-stop-guard", daemon=True).start()
        return self

    def _watch(self) -> None:
        assert self._reader is not None
        while not self._closed.is_set():
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            stops = [b for b in data if b in STOP_SIGNALS]
            if stops:
                self.signum = stops[0]
                break
        if self._closed.wait(self.deadline_s) or self.signum is None:
            return
        self.force(self.signum)

    def force(self, signum: int) -> None:
        """The orderly stop did not end the process in time: kill what is below it, then end it."""
        killed = 0
        for pid in reversed(descendants(os.getpid())):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        try:
            sys.stdout.flush()
            os.write(2, (f"megascope train: stopped by signal {signum}; the orderly stop did not end within "
                         f"{self.deadline_s:g} s: ended now ({killed} child process(es) killed)\n").encode())
        finally:
            os._exit(128 + signum)

    def close(self) -> None:
        """The job ended: the guard stands down (a later signal gets Python's usual handling)."""
        self._closed.set()
        try:
            signal.set_wakeup_fd(self._previous_fd)
        except ValueError:  # not the main thread: leave the fd set, the closed flag disarms the guard
            pass
        for sock in (self._writer, self._reader):
            if sock is not None:
                sock.close()


def _default_for(sig: int):
    """A Python-level stand-in for the default action, so the signal reaches the wakeup socket too."""
    if sig == signal.SIGINT:
        return signal.default_int_handler

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return handler

