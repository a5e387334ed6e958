"""analyzer/data/partials_ahead.py: the edge pass's numpy partials computed ahead by worker processes
are the tables this process computes (Arrow-equal, every value); a batch whose files changed, a pool
closed early and a worker that fails fall back to computing here; nothing is left in the folder; and
the event pass's collective instances with workers are exactly those without."""

from __future__ import annotations

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


def test_a_changed_batch_and_an_early_close_are_computed_here(job, tmp_path):
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path, workers=2)
    fewer = jobs[0][:-1]  # as after a damaged segment was dropped: no worker computed these files
    assert ahead.partials(fewer).equals(partials_of_files(fewer, *LAYOUT))
    ahead.close()  # batches still ahead: their files are removed, the workers stopped
    assert list(tmp_path.iterdir()) == []
    assert ahead.partials(jobs[2]).equals(partials_of_files(jobs[2], *LAYOUT))


def test_a_worker_that_fails_costs_only_speed(job, tmp_path):
    """The workers cannot write their files (the folder is gone): each batch is computed here."""
    jobs = _batches(job)
    ahead = PartialsAhead(jobs, LAYOUT, tmp_path / "gone", workers=2)
    try:
        for files in jobs:
            assert ahead.partials(files).equals(partials_of_files(files, *LAYOUT))
    finally:
        ahead.close()


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
