"""analyzer/data/partials_ahead.py: the edge pass's numpy partials computed ahead by worker processes
are the tables this process computes (Arrow-equal, every value); a batch whose files changed, workers
stopped early, a worker that fails or dies fall back to computing here; nothing is left in the folder;
an unguarded script is not run again by the workers; and the event pass's collective instances with
workers are exactly those without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data import event_pass as ep
from megascope.analyzer.data import partials_ahead
from megascope.analyzer.data.edge_partials import numpy_pays, partials_of_files
from megascope.analyzer.data.partials_ahead import PartialsAhead
from megascope.samples.edge_gen import EdgeGenConfig, generate

DP, TP = 2, 8
BASE = 0


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """16 ranks x 1,000 steps: 137 KB segments, big enough for the numpy path."""
    cfg = EdgeGenConfig(dp=DP, tp=TP, pp=1, steps=1000, faults=[])
    return generate(tmp_path_factory.mktemp("partials-ahead") / "run", cfg, batch_ranks=16)


def _batches(run: Path, size: int = 4) -> list[list[str]]:
    folders = [run / "edge_collectives" / f"rank={r:05d}" for r in range(DP * TP)]
    files = [str(f) for folder in folders for f in sorted(folder.glob("*.parquet"))]
    return [files[i:i + size] for i in range(0, len(files), size)]


LAYOUT = (BASE, DP, TP, 1, None)


def test_workers_give_the_tables_computed_here(job, tmp_path):
    jobs = _batches(job)
    assert len(jobs) == 4 and all(numpy_pays(files) for files in jobs)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path, workers=2)
    try:
        for files in jobs:
            got = ahead.partials(files)
            want = partials_of_files(files, *LAYOUT)
            assert got is not None and want is not None and got.num_rows > 0
            assert got.equals(want)
    finally:
        ahead.close()
    assert list(tmp_path.iterdir()) == []  # each file unlinked once mapped


def test_a_changed_batch_is_computed_here_and_its_job_let_go(job, tmp_path):
    """The second batch's files change (as after a damaged segment was dropped): computed here; the
    worker's table for the old files is removed when the pass moves on, the rest come from the workers."""
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path, workers=2)
    try:
        assert ahead.partials(jobs[0]).equals(partials_of_files(jobs[0], *LAYOUT))
        fewer = jobs[1][:-1]
        assert ahead.partials(fewer).equals(partials_of_files(fewer, *LAYOUT))
        for files in jobs[2:]:
            assert ahead.partials(files).equals(partials_of_files(files, *LAYOUT))
    finally:
        ahead.close()
    assert list(tmp_path.iterdir()) == []


def test_an_early_close_stops_the_workers_and_removes_their_files(job, tmp_path):
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path, workers=2)
    workers = [w.proc for w in ahead._workers]
    ahead.partials(jobs[0])
    ahead.close()  # batches still ahead
    assert all(proc.poll() is not None for proc in workers)
    assert list(tmp_path.iterdir()) == []
    assert ahead.partials(jobs[2]).equals(partials_of_files(jobs[2], *LAYOUT))  # computed here


def test_a_script_without_a_main_guard_runs_once(job, tmp_path):
    """The workers run this module, not the caller's main module again (multiprocessing's spawn would
    import an unguarded script in every worker, running it once more each)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from megascope.analyzer.data.partials_ahead import PartialsAhead\n"
        "jobs, layout = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "ahead = PartialsAhead(jobs, tuple(layout), Path(sys.argv[3]), 2)\n"
        "print('rows', sum(ahead.partials(files).num_rows for files in jobs))\n"
        "ahead.close()\n")
    jobs = _batches(job)
    folder = tmp_path / "out"
    folder.mkdir()
    out = subprocess.run([sys.executable, str(script), json.dumps(jobs), json.dumps(list(LAYOUT)), str(folder)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    want = sum(partials_of_files(files, *LAYOUT).num_rows for files in jobs)
    assert out.splitlines() == [f"rows {want}"]
    assert list(folder.iterdir()) == []


def test_a_worker_that_fails_costs_only_speed(job, tmp_path, caplog):
    """The workers cannot write their files (the folder is gone): each batch is computed here, and one
    warning says why."""
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path / "gone", workers=2)
    try:
        for files in jobs:
            assert ahead.partials(files).equals(partials_of_files(files, *LAYOUT))
    finally:
        ahead.close()
    warned = [r.getMessage() for r in caplog.records if r.name == "megascope.analyzer"]
    assert len(warned) == 1 and "FileNotFoundError" in warned[0], warned


def test_a_worker_that_dies_costs_only_speed(job, tmp_path):
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path, workers=2)
    try:
        ahead._workers[1].proc.kill()  # the one with the second batch
        for files in jobs:
            assert ahead.partials(files).equals(partials_of_files(files, *LAYOUT))
    finally:
        ahead.close()
    assert list(tmp_path.iterdir()) == []


def test_not_for_numpy_in_a_worker_is_not_for_numpy_here(job, tmp_path):
    """A segment pyarrow cannot read: the worker's partials_of_files says None, as it would here (the
    event pass then runs the macro, which finds the segment damaged)."""
    jobs = _batches(job)
    cut = tmp_path / "cut.parquet"
    data = Path(jobs[1][0]).read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    jobs[1] = [str(cut)] + jobs[1][1:]
    folder = tmp_path / "out"
    folder.mkdir()
    ahead = PartialsAhead(jobs, LAYOUT, folder, workers=2)
    try:
        assert ahead.partials(jobs[0]).equals(partials_of_files(jobs[0], *LAYOUT))
        assert ahead.partials(jobs[1]) is None and partials_of_files(jobs[1], *LAYOUT) is None
    finally:
        ahead.close()
    assert list(folder.iterdir()) == []


def test_the_event_pass_with_workers_equals_it_without(job, monkeypatch):
    """from_edge_summaries in 4 batches: with two DuckDB threads the numpy partials come from two worker
    processes, with one they are computed in this process; the collective instances are the same, exactly."""
    monkeypatch.setattr(ep, "BATCH_RANKS", 4)
    here: list[int] = []  # the batches computed in this process

    def counted(*args, **kwargs):
        here.append(1)
        return partials_of_files(*args, **kwargs)

    monkeypatch.setattr(ep, "partials_of_files", counted)
    monkeypatch.setattr(partials_ahead, "partials_of_files", counted)
    tables = []
    for threads, computed_here in ((1, 4), (2, 0)):
        here.clear()
        store = Run.open(job, threads=threads).store
        assert ep.from_edge_summaries(store, ep.run_start_ns(store))
        assert len(here) == computed_here
        tables.append(store.query("FROM collective_instances ORDER BY ALL"))
        assert list(store.temp_folder.glob("partials-*")) == []
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    assert len(tables[0]) == 1000 * (2 * 16 + 8 * 2)
