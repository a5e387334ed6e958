"""The Parquet store: round trip, live reads, kill -9, write errors, schema versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megascope import tracer
from megascope.tracer import run_dir as rundir
from megascope.tracer.config import TraceConfig
from megascope.tracer.schema import EVENTS, SCHEMA_VERSION, STEPS, SchemaVersionError

duckdb = pytest.importorskip("duckdb")


@pytest.fixture(autouse=True)
def _no_active_tracer():
    yield
    tracer.deactivate()


def run_steps(t: tracer.Tracer, steps: range, spans: int = 3) -> None:
    tracer.activate(t)
    for step in steps:
        tracer.set_step(step)
        for mb in range(spans):
            tracer.set_microbatch(mb)
            with tracer.span("forward"):
                pass
        tracer.record_step(tokens=64, loss=1.5)


def test_round_trip_through_parquet_duckdb_and_pyarrow(tmp_path: Path):
    t = tracer.Tracer(tmp_path, 2, TraceConfig(nvml=False), "cpu")
    run_steps(t, range(4))
    t.close()
    files = sorted((tmp_path / "events" / "rank=00002").iterdir())
    assert [f.name for f in files] == ["seg-000000.parquet"]
    assert pq.read_schema(files[0]) == EVENTS
    con = duckdb.connect()
    ev = con.execute(f"select step, microbatch, name, rank from read_parquet('{tmp_path}/events/*/*.parquet', "
                 "hive_partitioning=false) order by step, microbatch").fetchall()
    assert ev == [(s, m, "forward", 2) for s in range(4) for m in range(3)]
    steps = pq.read_table(tmp_path / "steps", partitioning=None)  # pyarrow dataset over the folder
    assert steps.schema == STEPS
    assert steps.column("step").to_pylist() == [0, 1, 2, 3]
    assert steps.column("tokens").to_pylist() == [64] * 4


def test_segments_are_readable_while_the_tracer_writes(tmp_path: Path):
    t = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False, flush_interval_s=3600), "cpu")
    con = duckdb.connect()
    query = f"select count(*) from read_parquet('{tmp_path}/events/*/*.parquet', hive_partitioning=false)"
    for chunk in range(3):
        run_steps(t, range(chunk * 2, chunk * 2 + 2))
        t.flush()  # what the flusher thread does every flush_interval_s
        assert con.execute(query).fetchall()[0][0] == (chunk + 1) * 2 * 3
    assert len(list((tmp_path / "events" / "rank=00000").glob("seg-*.parquet"))) == 3
    t.close()


def test_a_restarted_rank_appends_segments(tmp_path: Path):
    for attempt in range(2):
        t = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False), "cpu")
        run_steps(t, range(attempt * 10, attempt * 10 + 1))
        t.close()
    names = sorted(p.name for p in (tmp_path / "events" / "rank=00000").iterdir())
    assert names == ["seg-000000.parquet", "seg-000001.parquet"]


WRITER = textwrap.dedent("""
    import sys, time
    from megascope import tracer
    from megascope.tracer.config import TraceConfig
    t = tracer.Tracer(sys.argv[1], 0, TraceConfig(nvml=False, flush_interval_s=0.005, flush_events=5000), "cpu")
    tracer.activate(t)
    step = 0
    while True:
        tracer.set_step(step)
        for _ in range(500):
            with tracer.span("forward"):
                pass
        tracer.record_step(tokens=1)
        step += 1
""")


def test_kill_9_leaves_only_complete_segments(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    events = tmp_path / "events" / "rank=00000"
    try:
        # a generous wait, not a timing check: in CI at load the writer's start (importing torch) took
        # most of a 60 s wait, and it wrote 3 segments in the rest (~3,800 steps)
        deadline = time.monotonic() + 300
        while (len(list(events.glob("seg-*.parquet"))) < 5 and time.monotonic() < deadline
               and proc.poll() is None):
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the writer exited by itself ({proc.returncode})"
    segments = sorted(events.glob("*.parquet"))
    assert len(segments) >= 5
    for seg in segments:  # every visible file is a whole Parquet file
        assert pq.read_metadata(seg).num_rows > 0
    leftovers = [p.name for p in events.iterdir() if not p.name.endswith(".parquet")]
    assert all(name.startswith(".") and name.endswith(".tmp") for name in leftovers)
    con = duckdb.connect()
    total = con.execute(f"select count(*) from read_parquet('{tmp_path}/events/*/*.parquet', "
                    "hive_partitioning=false)").fetchall()[0][0]
    assert total == sum(pq.read_metadata(s).num_rows for s in segments)


def test_unwritable_run_directory_does_not_stop_the_loop(tmp_path: Path):
    (tmp_path / "events").write_text("not a directory")  # mkdir events/rank=... fails, even as root
    t = tracer.Tracer(tmp_path, 0, TraceConfig(nvml=False, max_buffered_events=50), "cpu")
    run_steps(t, range(30))
    for _ in range(3):
        t.flush()
    t.close()
    assert t.write_errors >= 3
    assert t.dropped_events >= 30 * 3 - 50
    steps = pq.read_table(tmp_path / "steps" / "rank=00000")  # other tables still written
    assert steps.column("step").to_pylist() == list(range(30))
    assert steps.column("dropped_events").to_pylist()[-1] > 0


def test_manifest_version_mismatch_says_what_to_do(tmp_path: Path):
    rundir.write_manifest(tmp_path, {"run_id": "x"})
    assert rundir.read_manifest(tmp_path)["schema_version"] == SCHEMA_VERSION
    data = json.loads((tmp_path / "run.json").read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "run.json").write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="upgrade megascope"):
        rundir.read_manifest(tmp_path)
