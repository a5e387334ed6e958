"""A progress bar on stderr for long commands (analyze, import): drawn only when stderr is a terminal
(or when forced), so logs and pipes get no carriage-return noise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call it as `bar(label, done, total)`; `close()` ends the line. Each update rewrites one line."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.width = width
        self.t0 = time.monotonic()
        self._last = ""

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        filled = int(self.width * min(done, total) / total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{label:<12} [{bar}] {done}/{total} {time.monotonic() - self.t0:5.1f}s"
        if text == self._last:
            return
        # pad over what a longer previous line left on screen ("updating the rank-step summary" then "done")
        self.stream.write("\r" + text + " " * max(0, len(self._last) - len(text)))
        self.stream.flush()
        self._last = text

    def close(self) -> None:
        if self.enabled and self._last:
            self.stream.write("\n")
            self.stream.flush()
            self._last = ""


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or foreign stream: no bar
        return False
