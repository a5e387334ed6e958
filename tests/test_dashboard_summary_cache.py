"""The per-rank-step summary persisted in RUN/analysis/rank_step (analyzer/data/summary_cache.py): reused
when the segments are unchanged, extended by a new part when a live run adds segments, rebuilt
otherwise; the same numbers as a full build either way."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data import event_pass, summary_cache

STEPS = 12


def _split(run: Path, first_of_second: int, spill_rows: int = 0) -> Path:
    """Move each rank's rows from step `first_of_second` on (and `spill_rows` rows before it, as a
    flush mid-step does) out of seg-000000 into a held-back folder; returns that folder."""
    held = run.parent / f"{run.name}-from-{first_of_second}"
    for table in ("events", "steps"):
        for folder in sorted((run / table).iterdir()):
            seg = folder / "seg-000000.parquet"
            rows = pq.read_table(seg).to_pandas()
            rows = rows.sort_values(["step", "start_ns"], kind="stable").reset_index(drop=True)
            cut = int((rows.step < first_of_second).sum()) - (spill_rows if table == "events" else 0)
            target = held / table / folder.name
            target.mkdir(parents=True, exist_ok=True)
            schema = pq.read_schema(seg)
            pq.write_table(pa.Table.from_pandas(rows.iloc[cut:], schema=schema, preserve_index=False),
                           target / "seg-000001.parquet")
            pq.write_table(pa.Table.from_pandas(rows.iloc[:cut], schema=schema, preserve_index=False), seg)
    return held


def _release(run: Path, held: Path) -> None:
    for table in ("events", "steps"):
        for folder in (held / table).iterdir():
            os.replace(folder / "seg-000001.parquet", run / table / folder.name / "seg-000001.parquet")


def _summary(run: Run) -> pd.DataFrame:
    run.heatmap("compute")
    return run.store.query("SELECT * FROM rank_step_summary ORDER BY step, rank")


@pytest.fixture()
def sim(tmp_path, simulated_run) -> Path:
    return simulated_run(tmp_path / "sim", dp=2, tp=1, pp=2, steps=STEPS,
                         inject=["straggler:rank=1,slowdown=1.4,from=4"])


def _fresh(run: Path, tmp_path: Path) -> pd.DataFrame:
    """The summary of a full build over a copy of the run (no file to reuse)."""
    copy = tmp_path / "full-copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("analysis"))
    r = Run.open(copy)
    frame = _summary(r)
    assert r.summary.how == "built"
    return frame


def test_built_once_then_reused(sim):
    first = Run.open(sim)
    a = _summary(first)
    assert first.summary.how == "built" and first.summary.parts == 1
    assert (sim / "analysis" / "rank_step" / "manifest.json").is_file()
    assert len(a) == 4 * STEPS and a.late_count.sum() > 0
    again = Run.open(sim)
    b = _summary(again)
    assert again.summary.how == "reused"
    pd.testing.assert_frame_equal(a, b)
    assert again.derived.timeline is None  # nothing scanned: the event pass did not run


@pytest.mark.parametrize("spill_rows, flat", [(0, False), (3, False), (3, True)])
def test_new_segments_extend_the_summary(sim, tmp_path, monkeypatch, spill_rows, flat):
    if flat:  # the sort-free pass big runs take (event_pass_flat.sql), for the build and the extension
        monkeypatch.setattr(event_pass, "TIMELINE_ALWAYS_RANKS", 0)
        monkeypatch.setattr(event_pass, "needs_timeline", lambda store, base, tolerance=0.01: False)
    held = _split(sim, 8, spill_rows)
    early = Run.open(sim)
    assert _summary(early).step.max() == 7
    _release(sim, held)
    live = Run.open(sim)
    extended = _summary(live)
    assert live.summary.how == "extended"
    assert live.summary.rebuilt_from_step == (7 if spill_rows else 8)
    # the old part is kept (or cut at the first rebuilt step), the new steps are a part of their own
    assert live.summary.parts == 2
    assert summary_cache.read_manifest(sim / "analysis" / "rank_step")["timeline"] is (not flat)
    pd.testing.assert_frame_equal(extended, _fresh(sim, tmp_path), check_dtype=False)
    again = Run.open(sim)
    assert again.heatmap("lateness").values.size and again.summary.how == "reused"
    assert len(extended) == 4 * STEPS


def test_many_extensions_are_merged_and_old_parts_collected(sim, tmp_path, monkeypatch):
    monkeypatch.setattr(summary_cache, "MAX_PARTS", 2)
    monkeypatch.setattr(summary_cache, "GC_AGE_S", 0.0)
    held_late = _split(sim, 9)                       # steps 9-11 come last
    held_mid = _split(sim, 5, spill_rows=0)          # steps 5-8 before them
    _summary(Run.open(sim))
    _release(sim, held_mid)
    mid = Run.open(sim)
    _summary(mid)
    assert (mid.summary.how, mid.summary.parts) == ("extended", 2)
    for table in ("events", "steps"):                # steps 9-11 arrive as a third segment per rank
        for folder in (held_late / table).iterdir():
            os.replace(folder / "seg-000001.parquet", sim / table / folder.name / "seg-000002.parquet")
    late = Run.open(sim)
    merged = _summary(late)
    assert (late.summary.how, late.summary.parts) == ("extended", 1)  # 3 parts > MAX_PARTS: merged
    folder = sim / "analysis" / "rank_step"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("part-")) == \
        [p["file"] for p in summary_cache.read_manifest(folder)["parts"]]  # unnamed parts collected
    pd.testing.assert_frame_equal(merged, _fresh(sim, tmp_path), check_dtype=False)


def test_removed_segment_forces_a_rebuild(sim):
    _summary(Run.open(sim))
    (sim / "events" / "rank=00000" / "seg-000000.parquet").unlink()
    run = Run.open(sim)
    summary = _summary(run)
    assert run.summary.how == "built"
    assert (summary[summary["rank"] == 0].n_events == 0).all()


def test_other_sql_forces_a_rebuild(sim, monkeypatch):
    _summary(Run.open(sim))
    monkeypatch.setattr(summary_cache, "_fingerprint", lambda store: "something else")
    run = Run.open(sim)
    _summary(run)
    assert run.summary.how == "built"


def test_unwritable_run_dir_keeps_the_summary_in_memory(sim, monkeypatch):
    def refuse(*_args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(summary_cache.os, "replace", refuse)
    run = Run.open(sim)
    summary = _summary(run)
    assert run.summary.how == "memory" and len(summary) == 4 * STEPS
    assert any("kept in memory" in w for w in run.warnings)
    assert not [p for p in (sim / "analysis" / "rank_step").iterdir()]  # no temporary file left behind


def test_findings_first_then_heatmap_writes_from_the_built_tables(sim):
    run = Run.open(sim)
    run.findings()
    _summary(run)
    assert run.summary.how == "built"
    again = Run.open(sim)
    again.heatmap("compute")
    assert again.summary.how == "reused"
    assert summary_cache.read_manifest(sim / "analysis" / "rank_step")["timeline"] is True


def test_a_run_whose_segments_hold_no_rows_yet_gives_an_empty_heatmap(simulated_run):
    # a live run right after start: segments exist, no step has finished
    run = simulated_run(dp=2, tp=1, pp=1, steps=2)
    for seg in list((run / "events").glob("*/*.parquet")) + list((run / "steps").glob("*/*.parquet")):
        pq.write_table(pq.read_schema(seg).empty_table(), seg)
    from megascope.analyzer.data.store import Store
    assert not summary_cache.is_current(Store(run))
    hm = Run.open(run).heatmap("compute")
    assert hm.values.shape == (0, 0) and hm.rows == []
    assert summary_cache.is_current(Store(run))
