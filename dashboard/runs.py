"""The fixed set of run directories a dashboard serves, opened through the analyzer and cached.

Security: the browser only ever sends an index into the list given on the command line; nothing it
sends becomes a file path or SQL. Live runs: a run is reopened only when its directory changed
(segment files are renamed into `<table>/rank=NNNNN/`, which bumps that directory's mtime), so a
refresh every few seconds costs a few stat calls when nothing is new.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascope.analyzer import INCIDENTS_FILE, MANIFEST, SELF_CHECK_DIR, Run

CATALOG_KEY = "MEGASCOPE_RUN_CATALOG"
"""Where the catalog lives in the Flask config of the app serving it."""

_WATCHED = ("steps", "events", "gpu", "inflight")
_WATCHED_FILES = (MANIFEST, INCIDENTS_FILE, SELF_CHECK_DIR)  # appended / added to by the driver
_SIGNATURE_TTL_S = 1.0  # stat the directories at most once a second per run
_MEMO_SIZE = 128


def directory_signature(run_dir: Path) -> tuple[float, int]:
    """(newest mtime, number of entries) over run.json, the incident log, the self-check folder and
    every per-rank table directory."""
    newest, count = 0.0, 0
    for name in _WATCHED_FILES:
        if (run_dir / name).exists():
            newest = max(newest, (run_dir / name).stat().st_mtime)
            count += 1
    for table in _WATCHED:
        table_dir = run_dir / table
        if not table_dir.is_dir():
            continue
        with os.scandir(table_dir) as entries:
            for entry in entries:
                newest = max(newest, entry.stat().st_mtime)
                count += 1
    return newest, count


@dataclass
class _OpenRun:
    run: Run
    signature: tuple[float, int]
    checked_at: float
    lock: threading.RLock = field(default_factory=threading.RLock)


class RunCatalog:
    """The run directories given at start-up, addressed by index; opens and reopens them lazily."""

    def __init__(self, paths: list[str | Path], recheck_s: float = _SIGNATURE_TTL_S):
        if not paths:
            raise ValueError("give at least one run directory: megascope dashboard RUN [RUN...]")
        self.paths = [Path(p).resolve() for p in paths]
        self.names = _unique_names(self.paths)
        self._open: dict[int, _OpenRun] = {}
        self._memo: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._recheck_s = recheck_s

    def __len__(self) -> int:
        return len(self.paths)

    def options(self) -> list[dict[str, Any]]:
        """Dropdown options: label is the run's name, value its index."""
        return [{"label": name, "value": i} for i, name in enumerate(self.names)]

    def index(self, value: Any) -> int:
        """Validate a run selector from the browser; anything but a known index falls back to 0."""
        try:
            index = int(value)
        except (TypeError, ValueError):
            return 0
        return index if 0 <= index < len(self.paths) else 0

    @contextmanager
    def using(self, value: Any) -> Iterator[Run]:
        """The (re)opened Run for a selector, held under its lock (one query at a time per run)."""
        entry = self._entry(self.index(value))
        with entry.lock:
            yield entry.run

    def cached(self, value: Any, key: tuple, compute: Callable[[Run], Any]) -> Any:
        """compute(run), memoized until the run directory changes (live refreshes are cheap)."""
        index = self.index(value)
        entry = self._entry(index)
        memo_key = (index, entry.signature, key)
        with self._lock:
            if memo_key in self._memo:
                self._memo.move_to_end(memo_key)
                return self._memo[memo_key]
        with entry.lock:
            result = compute(entry.run)
        with self._lock:
            self._memo[memo_key] = result
            while len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        return result

    def _entry(self, index: int) -> _OpenRun:
        path = self.paths[index]
        now = time.monotonic()
        with self._lock:
            entry = self._open.get(index)
            if entry is not None and now - entry.checked_at < self._recheck_s:
                return entry
        signature = directory_signature(path)
        with self._lock:
            entry = self._open.get(index)
            if entry is not None and entry.signature == signature:
                entry.checked_at = now
                return entry
        fresh = _OpenRun(Run.open(path), signature, now)  # raises a clear error for a foreign dir
        with self._lock:
            self._open[index] = fresh
        return fresh


def _unique_names(paths: list[Path]) -> list[str]:
    """Directory names, with the parent added where two runs share a name."""
    names = [p.name or str(p) for p in paths]
    for i, name in enumerate(names):
        if names.count(name) > 1:
            names[i] = f"{paths[i].parent.name}/{name}"
    return [f"{n} ({i})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def current_catalog() -> RunCatalog:
    """The catalog of the Dash app handling this request (set by create_app)."""
    import dash

    return dash.get_app().server.config[CATALOG_KEY]
