"""Host clocks: the monotonic clock mapped to Unix epoch ns, and the rank's alignment to rank 0.

Every timestamp the tracer writes is `time.monotonic_ns() + shift`, where shift maps this process's
monotonic clock to epoch time (measured once at start) minus this rank's estimated offset to rank 0
(see clock_sync.py). The monotonic clock never jumps, so durations stay right even if NTP steps the
wall clock while the job runs.
"""

from __future__ import annotations

import socket
import time


def _mono_to_epoch_ns(samples: int = 7) -> int:
    """epoch - monotonic, read as the tightest of a few back-to-back pairs (least scheduling noise)."""
    best_gap, best_shift = None, 0
    for _ in range(samples):
        a = time.monotonic_ns()
        wall = time.time_ns()
        b = time.monotonic_ns()
        if best_gap is None or b - a < best_gap:
            best_gap, best_shift = b - a, wall - (a + b) // 2
    return best_shift


class HostClock:
    """This process's view of epoch time, plus its alignment to rank 0.

    `skew_ns` is added to this host's epoch reading and `host` names the machine (default: its
    hostname): tests use them to simulate hosts whose clocks are off, and the clock sync must then
    find and remove the skew. Processes on one host share its clock, which the sync exploits.
    """

    def __init__(self, skew_ns: int = 0, host: str | None = None) -> None:
        self.host = host if host is not None else socket.gethostname()
        self.local_shift_ns = _mono_to_epoch_ns() + int(skew_ns)
        self.offset_to_rank0_ns = 0
        """local epoch - rank 0's epoch at the same instant (NTP-style estimate; 0 until synced)."""
        self.sync_delay_ns = -1
        """Round-trip delay of the ping-pong round the offset came from (its uncertainty is half)."""
        self.shift_ns = self.local_shift_ns
        """monotonic_ns() + shift_ns = time on the job's aligned clock (rank 0's epoch). A plain
        attribute, not a property: the span hot path reads it (a property costs ~5x an attribute);
        set_offset keeps it in step."""

    def local_ns(self) -> int:
        """This host's (unaligned) epoch time: what the clock sync exchanges."""
        return time.monotonic_ns() + self.local_shift_ns

    def now_ns(self) -> int:
        """Time on the job's aligned clock, Unix epoch ns."""
        return time.monotonic_ns() + self.shift_ns

    def to_aligned_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.shift_ns

    def set_offset(self, offset_ns: int, delay_ns: int) -> None:
        self.offset_to_rank0_ns = int(offset_ns)
        self.sync_delay_ns = int(delay_ns)
        self.shift_ns = self.local_shift_ns - self.offset_to_rank0_ns
