"""Readers of a run on object storage (analyze, export, dashboard, watch) open a local mirror of it.

`local_run_dir(RUN)` returns RUN itself for a local path; for a URL (s3://bucket/prefix) it syncs the
mirror under $MEGASCOPE_CACHE_DIR (default ~/.cache/megascope)/mirrors/<scheme>/<bucket>/<prefix> and
returns that folder, which the unchanged local code (DuckDB over Parquet globs) then reads. A sync is
incremental: segments never change once written, so it fetches only the objects it has not got (same
name and size: kept); the few small other files (run.json, health.json, incidents, in-flight records)
are fetched every time, run.json last so the mirror never holds a manifest newer than its data.
`follow(RUN)` keeps syncing on a thread for the live readers (dashboard, watch). A partial mirror holds
the segments of some ranks only (`sync(..., ranks=RankFilter(...))`): a Ray task's batch on its own
worker, and the driver of `analyze URL --engine ray` (`PartialMirror`: the ranks it reads itself).

Why a mirror rather than DuckDB's httpfs over the bucket: every query of an analysis (and every
dashboard refresh) would list and re-read the objects over the network; a mirror pays each byte once,
and the damaged-segment handling, the summary cache and the watcher's window work as they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path

from megascope.analyzer.data import attempts
from megascope.analyzer.data.store import RunOpenError, Store, prefix_batches
from megascope.tracer.run_dir import MANIFEST, table_dir
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


class RankFilter:
    """Which segments a partial mirror holds: those of `tables` (None: every table) in the rank
    folders matching one of `patterns`: exact names (`rank=00042`, a set lookup) or fnmatch patterns
    (a batch of the event pass, `rank=01???`)."""

    def __init__(self, patterns: Iterable[str], tables: Iterable[str] | None = None) -> None:
        self.patterns = tuple(patterns)
        self.tables = None if tables is None else frozenset(tables)
        self._exact = frozenset(p for p in self.patterns if not any(c in p for c in "*?["))
        self._wild = tuple(p for p in self.patterns if p not in self._exact)

    def keeps(self, name: str) -> bool:
        """`name`: a segment's path relative to the run (<table>/rank=NNNNN/seg-*.parquet)."""
        table, folder = name.split("/")[:2]
        if self.tables is not None and table not in self.tables:
            return False
        return folder in self._exact or any(fnmatchcase(folder, p) for p in self._wild)


def sync(url: str, folder: Path | None = None, require_run: bool = True, ranks: RankFilter | None = None) -> int:
    """Bring the mirror of `url` up to date; returns the number of objects fetched. Raises
    RunOpenError (one line) for an unreachable store, a missing bucket, or (require_run) no run.json.
    `ranks`: mirror only the segments that filter keeps (a Ray task's batch, the driver's few ranks);
    the small non-segment files (run.json, incidents, in-flight records) are fetched all the same."""
    return _sync(url, folder or mirror_folder(url), require_run, ranks)[0]


def _sync(url: str, folder: Path, require_run: bool, ranks: RankFilter | None) -> tuple[int, dict[str, int]]:
    """`sync`, also returning the listing of the whole run (relative name -> size; {} without a run)."""
    try:
        location = locate(url)
        remote = location.list_files()
        if MANIFEST not in remote:
            location.check_reachable()
            if require_run:
                raise RunOpenError(f"{location.display} is not a megascope run (no {MANIFEST} under it); pass the "
                                   "--run-dir of a `megascope train` or the OUT of `megascope simulate`/`import`")
            folder.mkdir(parents=True, exist_ok=True)
            return 0, {}
        manifest = location.read_bytes(MANIFEST)
        _forget_other_run(folder, manifest)
        fetch = [name for name, size in remote.items() if name != MANIFEST and not (
            _immutable(name) and _local_size(folder / name) == size)
            and (ranks is None or not _immutable(name) or ranks.keeps(name))]
        with ThreadPoolExecutor(max_workers=FETCH_THREADS) as pool:
            list(pool.map(lambda name: _fetch(location, name, folder), fetch))
        # read again after the data: a writer may have updated it meanwhile (clock offsets, restarts)
        _write_local(folder / MANIFEST, location.read_bytes(MANIFEST))
        return len(fetch) + 1, remote
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


class HeldStore(Store):
    """A Store over a mirror folder that other processes fill too (the Ray tasks of this host, a
    driver sharing the cache): it lists and reads only the segments `held` keeps (None: all of them),
    through explicit file lists. A glob would also read the ranks other processes fetch meanwhile,
    and a damaged one of those, not in this store's files, could not be dropped and retried."""

    def __init__(self, folder: str | Path, held: RankFilter | None, threads: int | None = None) -> None:
        self.held = held
        super().__init__(folder, threads=threads)

    def _list_segments(self, table: str) -> list[str]:
        files = super()._list_segments(table)
        if self.held is None:
            return files
        root = str(self.path)
        return [f for f in files if self.held.keeps(os.path.relpath(f, root).replace(os.sep, "/"))]

    def _make_view(self, table: str) -> None:
        if self.held is not None:
            self._excluded.add(table)
        super()._make_view(table)


class PartialMirror(HeldStore):
    """The driver's Store of a run on object storage whose event pass runs elsewhere (`analyze URL
    --engine ray`: each task mirrors its own batch where it runs). Its mirror starts with run.json and
    the small files only; the segments of a rank are fetched the first time something here reads that
    rank (table_source, batch_source: the first rank for the time origin and the wait-row check, the
    timeline check's sample, a what-if window, a damaged segment a task reported), all of them when a
    reader asks for every rank. The event pass's batches are planned from the bucket's listing."""

    def __init__(self, url: str, threads: int | None = None) -> None:
        self.url = url
        folder = mirror_folder(url)
        listing = _sync(url, folder, True, RankFilter(()))[1]
        self._remote_folders = {t: {n.split("/")[1] for n in listing if _immutable(n) and n.startswith(t + "/")}
                                for t in TABLES}
        self._held: set[str] | None = set()  # rank folders fetched by this process (None: all of them)
        super().__init__(folder, RankFilter(()), threads=threads)
        if any(name.startswith("inflight/") for name in listing):
            # a hang: its analysis reads the suspects' last events from the `events` view directly
            self.ensure_ranks(None)

    def ensure_ranks(self, folders: set[str] | None) -> None:
        """Mirror the segments of these rank folders (None: every rank) and add them to the views."""
        if self._held is None or (folders is not None and folders <= self._held):
            return
        missing = None if folders is None else folders - self._held
        sync(self.url, self.path, ranks=None if missing is None else RankFilter(sorted(missing)))
        self._held = None if missing is None else self._held | missing
        self.held = None if self._held is None else RankFilter(sorted(self._held))
        changed = []
        for table in TABLES:
            found = self._list_segments(table)
            if found != self._all_files[table]:
                dropped = {path for t, path in self.damaged if t == table}
                self._all_files[table] = found
                self.files[table] = [f for f in found if f not in dropped]
                changed.append(table)
        if "steps" in changed and self.files["steps"]:
            # new ranks' steps: the restart bounds (attempts.py) are found again, as Store.__init__ does
            self.attempt_bounds = 0
            changed = list(TABLES)
        for table in changed:
            self.run_with_retry(lambda: self._make_view(table))
        times = attempts.restart_times_ns(self.path, self.manifest, [])
        if "steps" in changed and self.files["steps"] and (
                times is not None or len(self.files["steps"]) <= attempts.SCAN_MAX_FILES):
            self._find_attempts(times)

    def rank_prefix_batches(self, batch_ranks: int, tables: tuple[str, ...] = ("events", "steps")
                            ) -> list[list[str]] | None:
        return prefix_batches(set().union(*(self._remote_folders[t] for t in tables)), batch_ranks)

    def table_source(self, table: str, ranks: list[int] | None) -> str:
        whole = ranks is None or len(ranks) > 4096  # Store.table_source reads the view then
        folders = None if whole else {table_dir(self.path, table, int(r)).name for r in ranks or []}
        self.ensure_ranks(folders)
        return super().table_source(table, ranks)

    def batch_source(self, table: str, patterns: list[str] | None) -> str:
        if patterns is None:
            self.ensure_ranks(None)
        else:
            self.ensure_ranks({f for f in self._remote_folders[table] if RankFilter(patterns).keeps(f"{table}/{f}/")})
        return super().batch_source(table, patterns)

    def adopt_damaged(self, damaged: list[tuple[str, str, str]]) -> None:
        """Their ranks are mirrored first: the incomplete-data bounds read the damaged segment's neighbours."""
        self.ensure_ranks({os.path.basename(os.path.dirname(path)) for _, path, _ in damaged})
        super().adopt_damaged(damaged)


class Follower:
    """Keeps a mirror in sync every `interval_s` seconds on a daemon thread, or less often when a sync
    itself is slow: each sync lists the whole run (10^5 objects on a 10^4-rank run take seconds of
    LIST calls), so the next one waits at least SLOW_FACTOR times as long as the last took and the
    follower never spends more than ~10% of its time listing. A failing sync is logged (first time,
    then every 100th) and retried: a live view must outlive a network blip."""

    SLOW_FACTOR = 10.0

    def __init__(self, url: str, folder: Path, interval_s: float) -> None:
        self.url, self.folder, self.interval_s = url, folder, max(0.2, interval_s)
        self.failures = 0
        self.last_sync_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megascope-mirror", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def next_wait_s(self) -> float:
        return max(self.interval_s, self.SLOW_FACTOR * self.last_sync_s)

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait_s()):
            started = time.monotonic()
            try:
                sync(self.url, self.folder, require_run=False)
            except Exception as exc:  # noqa: BLE001 - any failure: retried at the next tick
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("mirror of %s: sync failed (%s); retrying", self.url, exc)
            self.last_sync_s = time.monotonic() - started

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
