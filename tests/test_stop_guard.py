"""trainer/robust/stop_guard.py: a process whose main thread is blocked in a C++ read of a real TCPStore
(as the driver of a job whose peer node is lost can be) and that hosts a TCPStore server thread and a
child process still ends within seconds of SIGTERM, child included; without the guard it does not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKED = """
import signal, subprocess, sys
from datetime import timedelta
import torch.distributed as dist
from megascope.trainer.robust.stop_guard import StopGuard

server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
child = subprocess.Popen(["sleep", "300"])

def handler(signum, frame):  # Python-level, like the elastic agent's: it cannot run while the read blocks
    raise SystemExit(1)

signal.signal(signal.SIGTERM, handler)
if sys.argv[1] == "guarded":
    StopGuard(deadline_s=2).install()
print(child.pid, flush=True)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=600))
client.get("never-set")  # the main thread blocks here, in C++
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _blocked_process(mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, mode], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    time.sleep(1.0)  # into the blocking get
    return proc, child


@pytest.mark.slow
def test_sigterm_ends_a_process_blocked_in_a_store_read() -> None:
    proc, child = _blocked_process("guarded")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took = time.monotonic() - t0
    _, err = proc.communicate()
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal 15; the orderly stop did not end within 2 s" in err
    assert not _alive(child)
    assert took < 20, took  # 2 s deadline; the margin is for a loaded 2-core box


@pytest.mark.slow
def test_without_the_guard_the_same_process_lives_on() -> None:
    """The premise of the test above: SIGTERM alone does not end it."""
    proc, child = _blocked_process("unguarded")
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=6)
        assert _alive(child)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if _alive(child):
            os.kill(child, signal.SIGKILL)
