"""A progress bar on stderr for long analyses (only when stderr is a terminal, or when forced)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.t0 = time.monotonic()
        self._last = ""

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        filled = int(self.width * min(done, total) / total)
        line = f"\r{label:<12} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {time.monotonic() - self.t0:5.1f}s"
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self.enabled and self._last:
            self.stream.write("\n")
            self.stream.flush()
