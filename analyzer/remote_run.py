"""Readers of a run on object storage (analyze, export, dashboard, watch) open a local mirror of it.

`local_run_dir(RUN)` returns RUN itself for a local path; for a URL (s3://bucket/prefix) it syncs the
mirror under $MEGASCOPE_CACHE_DIR (default ~/.cache/megascope)/mirrors/<scheme>/<bucket>/<prefix> and
returns that folder, which the unchanged local code (DuckDB over Parquet globs) then reads. A sync is
incremental: segments never change once written, so it fetches only the objects it has not got (same
name and size: kept); the few small other files (run.json, health.json, incidents, in-flight records)
are fetched every time, run.json last so the mirror never holds a manifest newer than its data.
`follow(RUN)` keeps syncing on a thread for the live readers (dashboard, watch).

Why a mirror rather than DuckDB's httpfs over the bucket: every query of an analysis (and every
dashboard refresh) would list and re-read the objects over the network; a mirror pays each byte once,
and the damaged-segment handling, the summary cache and the watcher's window work as they are.
"""

from __future__ import annotations

import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megascope.analyzer.store import RunOpenError
from megascope.tracer.run_dir import MANIFEST
from megascope.tracer.schema import TABLES
from megascope.tracer.sink import SEGMENT_RE
from megascope.tracer.storage import Location, StorageError, is_url, local_folder_for, locate

log = logging.getLogger("megascope.analyzer")
FETCH_THREADS = 8


def mirror_folder(url: str) -> Path:
    return local_folder_for(url, "mirrors")


def _immutable(name: str) -> bool:
    """A Parquet segment (RUN/<table>/rank=N/seg-*.parquet): never rewritten once it exists."""
    parts = name.split("/")
    return len(parts) == 3 and parts[0] in TABLES and bool(SEGMENT_RE.match(parts[2]))


def sync(url: str, folder: Path | None = None, require_run: bool = True) -> int:
    """Bring the mirror of `url` up to date; returns the number of objects fetched. Raises
    RunOpenError (one line) for an unreachable store, a missing bucket, or (require_run) no run.json."""
    folder = folder or mirror_folder(url)
    try:
        location = locate(url)
        remote = location.list_files()
        if MANIFEST not in remote:
            location.check_reachable()
            if require_run:
                raise RunOpenError(f"{location.display} is not a megascope run (no {MANIFEST} under it); pass the "
                                   "--run-dir of a `megascope train` or the OUT of `megascope simulate`/`import`")
            folder.mkdir(parents=True, exist_ok=True)
            return 0
        manifest = location.read_bytes(MANIFEST)
        _forget_other_run(folder, manifest)
        fetch = [name for name, size in remote.items() if name != MANIFEST and not (
            _immutable(name) and _local_size(folder / name) == size)]
        with ThreadPoolExecutor(max_workers=FETCH_THREADS) as pool:
            list(pool.map(lambda name: _fetch(location, name, folder), fetch))
        # read again after the data: a writer may have updated it meanwhile (clock offsets, restarts)
        _write_local(folder / MANIFEST, location.read_bytes(MANIFEST))
        return len(fetch) + 1
    except StorageError as exc:
        raise RunOpenError(str(exc)) from None
    except FileNotFoundError as exc:  # an object listed a moment ago is gone: the run was deleted
        raise RunOpenError(f"{url}: {exc}; the run changed while it was copied, try again") from None


def _local_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _forget_other_run(folder: Path, manifest: bytes) -> None:
    """A different run now at the same URL (another run_id): the old mirror is dropped, not mixed in."""
    import json

    try:
        old = json.loads((folder / MANIFEST).read_text()).get("run_id")
        new = json.loads(manifest).get("run_id")
    except (OSError, ValueError, AttributeError):
        return
    if old != new:
        shutil.rmtree(folder, ignore_errors=True)


def _fetch(location: Location, name: str, folder: Path) -> None:
    _write_local(folder / name, location.read_bytes(name))


def _write_local(path: Path, data: bytes) -> None:
    """Temporary name + rename: a reader of the mirror (DuckDB's glob skips dot files) never sees half."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def local_run_dir(run: str | Path, require_run: bool = True) -> Path:
    """The local folder to read for `run`: itself when local, else its mirror synced now (RunOpenError)."""
    if not is_url(run):
        return Path(run)
    folder = mirror_folder(str(run))
    sync(str(run), folder, require_run=require_run)
    return folder


class Follower:
    """Keeps a mirror in sync every `interval_s` seconds on a daemon thread. A failing sync is logged
    (first time, then every 100th) and retried: a live view must outlive a network blip."""

    def __init__(self, url: str, folder: Path, interval_s: float) -> None:
        self.url, self.folder, self.interval_s = url, folder, max(0.2, interval_s)
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megascope-mirror", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                sync(self.url, self.folder, require_run=False)
            except Exception as exc:  # noqa: BLE001 - any failure: retried at the next tick
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("mirror of %s: sync failed (%s); retrying", self.url, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def follow(run: str | Path, interval_s: float, require_run: bool = True) -> tuple[Path, Follower | None]:
    """`local_run_dir`, and for a URL a started Follower that keeps the mirror current (None when local)."""
    folder = local_run_dir(run, require_run=require_run)
    if not is_url(run):
        return folder, None
    return folder, Follower(str(run), folder, interval_s).start()


def follow_all(runs: list[str], interval_s: float) -> tuple[list[str], list[Follower]]:
    """`follow` for each of several runs (the dashboard): local paths in the same order, and the
    followers to stop at the end. A failure stops the followers already started and raises."""
    paths: list[str] = []
    followers: list[Follower] = []
    try:
        for run in runs:
            folder, follower = follow(run, interval_s)
            paths.append(str(folder))
            followers += [follower] if follower is not None else []
    except BaseException:
        for follower in followers:
            follower.stop()
        raise
    return paths, followers
