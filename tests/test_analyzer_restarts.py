"""Steps re-run after an elastic restart (analyzer/data/attempts.py): the analyzer's views keep only the
latest attempt of each (rank, step). A simulated run turned into a restarted one must analyze exactly
like the same run without the crashed attempt's re-run steps (with or without a restart incident, and
when the persisted summary was built before the restart); a real `megascope train` with an injected
crash has one row per rank and step, the re-run steps from the second attempt, and no bogus findings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data import event_pass

STEPS, RESUME, CRASH = 12, 6, 9
"""Attempt 0 ran steps 0..CRASH-1 and part of CRASH; attempt 1 restored the checkpoint at RESUME."""
TIMES = {"events": ("issue_ns", "start_ns", "end_ns"), "steps": ("start_ns", "end_ns")}


def _write(folder: Path, name: str, rows: pd.DataFrame, schema: pa.Schema) -> None:
    pq.write_table(pa.Table.from_pandas(rows, schema=schema, preserve_index=False), folder / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, simulated_run) -> dict[str, Path]:
    """'sim': the simulated run; 'attempt0': what the crashed attempt left (steps < CRASH, plus the
    first half of step CRASH's events and no steps row for it); 'restarted': attempt0 plus attempt 1's
    appended segments (steps >= RESUME, shifted); 'reference': attempt 0's steps < RESUME and attempt 1,
    once each. `restart_ns`: when the restart happened."""
    base = tmp_path_factory.mktemp("restarts")
    sim = base / "sim"
    simulated_run(sim, dp=2, tp=1, pp=2, steps=STEPS, inject=["straggler:rank=1,slowdown=1.4,from=2"])
    out = {name: base / name for name in ("attempt0", "restarted", "reference")}
    for path in out.values():
        shutil.copytree(sim, path)
    steps = duckdb.sql(f"SELECT start_ns, end_ns FROM read_parquet('{sim}/steps/*/*.parquet')").df()
    shift = int(steps.end_ns.max() - steps.start_ns.min()) + 60_000_000_000  # attempt 1 starts a minute later
    crash_end = 0
    for table, columns in TIMES.items():
        for folder in sorted((sim / table).iterdir()):
            seg = folder / "seg-000000.parquet"
            schema = pq.read_schema(seg)
            rows = pq.read_table(seg).to_pandas().sort_values(["step", "start_ns"], kind="stable")
            partial = rows[rows.step == CRASH]
            partial = partial.iloc[: len(partial) // 2] if table == "events" else partial.iloc[:0]
            first = pd.concat([rows[rows.step < CRASH], partial])
            crash_end = max(crash_end, int(first.end_ns.max()))
            second = rows[rows.step >= RESUME].copy()
            for col in columns:
                second[col] = second[col] + shift
            for name, older, newer in (("attempt0", first, None), ("restarted", first, second),
                                       ("reference", first[first.step < RESUME], second)):
                _write(out[name] / table / folder.name, "seg-000000.parquet", older, schema)
                if newer is not None:
                    _write(out[name] / table / folder.name, "seg-000001.parquet", newer, schema)
    out["sim"] = sim
    out["restart_ns"] = crash_end + 30_000_000_000  # type: ignore[assignment]
    return out


def _incident(run: Path, restart_ns: int) -> None:
    with open(run / "incidents.jsonl", "a") as f:
        f.write(json.dumps({"time": restart_ns / 1e9, "kind": "restart", "attempt": 1,
                            "detail": "the elastic agent started attempt 1 of the worker group"}) + "\n")


def _clone(src: Path, dst: Path, restart_ns: int | None) -> Path:
    shutil.copytree(src, dst)
    if restart_ns is not None:
        _incident(dst, restart_ns)
    return dst


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns)).reset_index(drop=True)


@pytest.mark.parametrize("incident", [True, False], ids=["restart-incident", "steps-only"])
def test_restarted_run_analyzes_like_the_run_without_the_replayed_steps(runs, tmp_path, incident):
    restarted = Run.open(_clone(runs["restarted"], tmp_path / "r", runs["restart_ns"] if incident else None))
    reference = Run.open(runs["reference"])
    raw = duckdb.sql(f"SELECT count(*) FROM read_parquet('{restarted.path}/steps/*/*.parquet') "
                     "GROUP BY rank, step HAVING count(*) > 1").fetchall()
    assert raw, "the restarted run must hold re-run steps twice"
    assert restarted.store.attempt_bounds == 4 and reference.store.attempt_bounds == 0
    pd.testing.assert_frame_equal(restarted.steps(), reference.steps())
    everything = "SELECT * FROM events"
    pd.testing.assert_frame_equal(_sorted(restarted.store.query(everything)),
                                  _sorted(reference.store.query(everything)))
    one = restarted.store.table_source("events", [1])  # per-rank sources are filtered too
    assert restarted.store.query(f"SELECT count(*) AS n FROM {one}").n.iloc[0] == \
        reference.store.query(f"SELECT count(*) AS n FROM {reference.store.table_source('events', [1])}").n.iloc[0]
    pd.testing.assert_frame_equal(restarted.rank_steps(), reference.rank_steps())
    assert restarted.rank_steps().groupby(["rank", "step"]).size().max() == 1
    assert [(f.kind, f.ranks, f.steps) for f in restarted.findings()] == \
        [(f.kind, f.ranks, f.steps) for f in reference.findings()]
    assert any(f.kind == "straggler" and f.ranks == [1] for f in restarted.findings())


def test_batched_sort_free_event_pass_reads_the_latest_attempt_too(runs, tmp_path, monkeypatch):
    """Big runs' event pass: batches of ranks read through batch_source, without the timeline."""
    monkeypatch.setattr(event_pass, "BATCH_RANKS", 2)
    monkeypatch.setattr(event_pass, "TIMELINE_ALWAYS_RANKS", 0)
    restarted = Run.open(_clone(runs["restarted"], tmp_path / "r", runs["restart_ns"]))
    assert restarted.store.rank_prefix_batches(2) is not None
    assert not event_pass.needs_timeline(restarted.store, event_pass.run_start_ns(restarted.store))
    pd.testing.assert_frame_equal(restarted.rank_steps(), Run.open(runs["reference"]).rank_steps())


def test_summary_built_before_the_restart_is_extended_with_the_latest_attempt(runs, tmp_path):
    live = _clone(runs["attempt0"], tmp_path / "live", None)
    Run.open(live).heatmap("compute")  # the summary of what attempt 0 had written
    for table in TIMES:  # the restarted ranks append their segments, the driver its incident
        for folder in (runs["restarted"] / table).iterdir():
            shutil.copy(folder / "seg-000001.parquet", live / table / folder.name / "seg-000001.parquet")
    _incident(live, runs["restart_ns"])
    run = Run.open(live)
    run.heatmap("compute")
    assert run.summary.how == "extended" and run.summary.rebuilt_from_step == RESUME
    got = run.store.query("SELECT * FROM rank_step_summary ORDER BY step, rank")
    fresh = Run.open(runs["reference"])
    fresh.heatmap("compute")
    want = fresh.store.query("SELECT * FROM rank_step_summary ORDER BY step, rank")
    pd.testing.assert_frame_equal(got, want)


def test_runs_without_restarts_get_no_bounds_and_unchanged_views(runs):
    store = Run.open(runs["sim"]).store
    assert store.attempt_bounds == 0
    assert "_attempt_bounds" not in store.table_source("events", [0])


# ---- a real restarted run --------------------------------------------------------------------------
TRAIN = [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
         "--steps", "16", "--checkpoint-every", "4", "--max-restarts", "1", "--inject", "crash:rank=1,at=10",
         "--set", "trace.flush_interval_s=0.05"]  # ranks blocked in step 10 flush steps 8-9 before the kill


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    result = subprocess.run(TRAIN + ["--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from checkpoint step 8" in result.stdout
    return run


@pytest.mark.slow
def test_real_restart_keeps_the_second_attempt_of_the_rerun_steps(trained):
    restart_s = next(json.loads(line)["time"] for line in (trained / "incidents.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == "restart")
    raw = duckdb.sql(f"SELECT rank, step FROM read_parquet('{trained}/steps/*/*.parquet', hive_partitioning=false) "
                     "GROUP BY ALL HAVING count(*) > 1").df()
    assert len(raw), "expected a rank that flushed steps 8-9 before the crash (the ranks stopped by SIGTERM)"
    run = Run.open(trained)
    assert run.store.attempt_bounds > 0
    steps = run.rank_steps()
    assert steps.groupby(["rank", "step"]).size().max() == 1
    rerun = steps[steps.step.isin([8, 9])]
    assert len(rerun) == 8 and (rerun.start_ns > restart_s * 1e9).all()
    assert rerun.step_time_s.max() < 5  # the restart's downtime is not inside a step
    stale = run.store.query(f"SELECT count(*) AS n FROM events WHERE step >= 8 AND start_ns < {int(restart_s * 1e9)}")
    assert stale.n.iloc[0] == 0
    bogus = [f for f in run.findings() if f.kind in ("late_launch", "straggler")
             and f.steps[0] <= 10 and f.steps[1] >= 8]
    assert not bogus, bogus
