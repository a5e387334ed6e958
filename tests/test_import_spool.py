"""The spool read back in order one window of start times at a time (spool.sorted_batches) gives what
one ORDER BY over the whole table gives, ties included; a Kineto import sorted in many small windows
writes the same run as one sorted whole; the writer's typed column buffers keep every value."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from megascope.tracer.importers import spool as sp
from megascope.tracer.importers.cli import import_run
from megascope.tracer.importers.writer import RunWriter
from megascope.tracer.layout import Layout

SCHEMA = {"t": pa.schema([("ord", pa.int64()), ("tid", pa.string()), ("start", pa.int64()), ("end", pa.int64())])}


def test_sorted_windows_give_the_order_of_one_sort(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rng = random.Random(7)
    spool = sp.Spool(SCHEMA, prefix="spool-", flush_rows=37)  # many parts, rows out of order across parts
    for i in range(1_000):
        start = rng.choice([5, 5, 5, 9, 9]) if i % 10 == 0 else rng.randrange(-50, 10_000)  # ties across cuts
        spool.append("t", (i, rng.choice(["1", "2"]), start, start + rng.randrange(100)))
    folder = spool.close()
    assert folder is not None
    con = sp.connect(folder)
    params = {"p": sp.parts(folder, "t"), "tid": "1"}
    whole = con.execute('SELECT ord, start, "end" FROM read_parquet($p) WHERE tid = $tid ORDER BY start, ord',
                        params).fetchall()
    batches = list(sp.sorted_batches(con, 'ord, start, "end"', "read_parquet($p)", "tid = $tid", "start, ord",
                                     params, batch_rows=10_000, window_rows=40))
    got = [row for b in batches for row in zip(*(c.to_pylist() for c in b.columns))]
    assert len(batches) >= 5, "several windows, each its own query"
    assert got == whole and len(whole) > 400
    con.close()
    sp.remove(folder)


def _trace(rank: int, steps: int = 40) -> dict[str, Any]:
    """A torch.profiler-shaped CPU trace: per step forward ops with a nested child, autograd backward
    functions, three c10d all-reduces (two at the same instant) executed by gloo on two other threads,
    an optimizer annotation; CPU ops written before their step's annotation, as Kineto writes them."""
    events: list[dict] = []
    t = 4_801_136_944_682.0

    def op(name: str, cat: str, ts: float, dur: float, tid: int, args: dict | None = None) -> None:
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": round(ts, 3),
                       "dur": dur, "args": args or {}})

    for step in range(steps):
        start = t
        for _ in range(3):
            op("aten::linear", "cpu_op", t, 30, 1)
            op("aten::addmm", "cpu_op", t + 5, 20, 1)
            t += 32
        for _ in range(2):
            op("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", t, 50, 1)
            t += 52
        for i in range(3):
            issue = t if i < 2 else t + 25
            dims = {"Input Dims": [[[1024 * (i + 1)]]], "Input type": ["TensorList"]}
            op("c10d::allreduce_", "cpu_op", issue, 20, 1, dims)
            op("gloo:all_reduce", "user_annotation", issue + 25, 300, 2 + i % 2,
               {"Input Dims": [[1024 * (i + 1)]], "Input type": ["float"]})
        t += 400
        op("Optimizer.step#SGD.step", "user_annotation", t, 400, 1)
        t += 410
        op(f"ProfilerStep#{step}", "user_annotation", start, t - start, 1)
        t += 5
    return {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
            "baseTimeNanoseconds": 1_790_857_026_000_000_000, "traceEvents": events}


def _rows(run: Path, table: str) -> list[dict]:
    """A table's rows, sorted, NaN as None (comparable)."""
    rows = duckdb.sql(f"SELECT * FROM read_parquet('{run}/{table}/rank=*/*.parquet', hive_partitioning=false) "
                      "ORDER BY ALL").to_arrow_table().to_pylist()
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in rows]


def _tables(run: Path) -> dict[str, list[dict]]:
    return {table: _rows(run, table) for table in ("events", "steps")}


def test_kineto_import_sorted_in_small_windows_writes_the_same_run(tmp_path: Path, monkeypatch):
    paths = []
    for rank in (0, 1):
        paths.append(tmp_path / f"trace_rank{rank}.json")
        paths[-1].write_text(json.dumps(_trace(rank)))
    import_run("kineto", paths, tmp_path / "whole")  # a few hundred rows: one window each
    queries: list[str] = []
    connect = sp.connect

    class Recording:
        def __init__(self, con: Any) -> None:
            self.con = con

        def sql(self, query: str, **kw: Any) -> Any:
            queries.append(query)
            return self.con.sql(query, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.con, name)

    monkeypatch.setattr(sp, "connect", lambda folder: Recording(connect(folder)))
    monkeypatch.setattr(sp, "SORT_WINDOW_ROWS", 7)
    monkeypatch.setattr(sp, "SPOOL_ROWS", 11)
    import_run("kineto", paths, tmp_path / "windowed")
    windows = [q for q in queries if "start >= $lo" in q]
    assert len(windows) > 20, "spans and comm ops were read in many windows"
    whole, windowed = _tables(tmp_path / "whole"), _tables(tmp_path / "windowed")
    assert len(whole["events"]) >= 2 * 40 * 5 and len(whole["steps"]) == 2 * 40
    assert {r["kind"] for r in whole["events"]} == {"compute", "collective"}
    assert windowed == whole


def test_writer_buffers_keep_every_value(tmp_path: Path):
    writer = RunWriter(tmp_path / "run", "test", flush_rows=3)
    big = 1_790_857_026_123_456_789
    for i in range(7):
        writer.event(2, i, "all_reduce", "collective", big + i, big + i - 1, group="dp", seq=i, peer=-1,
                     nbytes=2**40 + i)
        writer.step(2, i, big, big + 10, tokens=i, loss=math.nan if i % 2 else 0.5 * i, lr=1e-4)
    writer.finish(Layout(1, 1, 1), [2], {})
    events = _rows(tmp_path / "run", "events")
    assert len(list((tmp_path / "run" / "events" / "rank=00002").glob("*.parquet"))) == 3  # 3 + 3 + 1 rows
    assert [e["start_ns"] for e in events] == [big + i for i in range(7)]
    assert [e["end_ns"] for e in events] == [big + i for i in range(7)]  # never before the start
    assert [e["bytes"] for e in events] == [2**40 + i for i in range(7)]
    assert {(e["rank"], e["name"], e["group"], e["microbatch"], e["peer"]) for e in events} == {
        (2, "all_reduce", "dp", -1, -1)}
    steps = _rows(tmp_path / "run", "steps")
    assert [s["tokens"] for s in steps] == list(range(7))
    assert [s["loss"] is None for s in steps] == [bool(i % 2) for i in range(7)]  # NaN
    assert steps[4]["loss"] == 2.0 and steps[0]["lr"] == 1e-4


def test_writer_refuses_a_value_outside_its_column(tmp_path: Path):
    writer = RunWriter(tmp_path / "run", "test", flush_rows=2)
    writer.event(0, 0, "forward", "compute", 1, 2)
    with pytest.raises(Exception, match="not in range"):
        writer.event(0, 0, "forward", "compute", 1, 2, chunk=2**15)  # chunk is int16 in the schema: the flush
    writer.abort()
