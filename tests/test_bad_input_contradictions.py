"""Data that contradicts itself (issue 30), through the real `megascope analyze`: a segment whose `rank`
column is text (a DuckDB COPY from a hive-partitioned read writes it so), rows naming a rank outside
run.json's topology, spans that end before they start. Each is cast or left out with one warning line
naming the segment and the count, rows left out make their rank-steps incomplete data, and the real
straggler is still the one finding. Runs come from the simulator, several segments per rank."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

STEPS, STRAGGLER, WORLD, MICRO_BATCHES = 12, 3, 4, 8
SEGMENTED = dict(dp=2, tp=1, pp=2, steps=STEPS, micro_batches=MICRO_BATCHES,
                 rows_per_window=WORLD * (6 * MICRO_BATCHES + 4) * 3)
"""dp=2 pp=2 over 12 steps, 4 segments per rank and table (steps 0-2, 3-5, 6-8, 9-11)."""


@pytest.fixture(scope="module")
def straggler(simulated_run) -> Path:
    return simulated_run(**SEGMENTED, inject=[f"straggler:rank={STRAGGLER},slowdown=0.3,from=2"])


def analyze(run: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run), "--json"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def lines_about(report: dict, segment: str) -> list[str]:
    return [w for w in report["warnings"] if w.startswith(segment)]


def rewrite(segment: Path, column: str, values) -> None:
    table = pq.read_table(segment)
    i = table.schema.get_field_index(column)
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type)), segment)


@pytest.mark.parametrize("table", ["events", "steps"])
def test_rank_written_as_text_is_read_as_an_integer(straggler, tmp_path, table):
    """Rank 0's first segment (the one a glob view binds its columns from) rewritten by a DuckDB COPY
    from a hive-partitioned read: `rank` comes back as text ('00000'). Before: a Binder-error traceback."""
    run = Path(shutil.copytree(straggler, tmp_path / "run"))
    segment = run / table / "rank=00000" / "seg-000000.parquet"
    rows = pq.read_metadata(segment).num_rows
    duckdb.sql(f"COPY (SELECT * FROM read_parquet('{segment}', hive_partitioning=true)) "
               f"TO '{segment}.tmp' (FORMAT parquet)")
    Path(f"{segment}.tmp").replace(segment)
    assert pa.types.is_string(pq.read_schema(segment).field("rank").type)  # the damage is real
    before = segment.read_bytes()
    report = analyze(run)
    rel = f"{table}/rank=00000/seg-000000.parquet"
    assert lines_about(report, rel) == [f"{rel}: column rank is text, not INTEGER as the schema says "
                                        f"(docs/schema.md); its {rows} row(s) were read cast to it"]
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [STRAGGLER])]
    assert report["incomplete_data"] == []  # nothing was left out
    assert segment.read_bytes() == before  # read cast, never rewritten


def test_rows_naming_a_rank_outside_the_topology_are_left_out(straggler, tmp_path):
    run = Path(shutil.copytree(straggler, tmp_path / "run"))
    segment = run / "events" / "rank=00001" / "seg-000001.parquet"
    ranks = pq.read_table(segment, columns=["rank"]).column("rank").to_numpy().copy()
    steps = pq.read_table(segment, columns=["step"]).column("step").to_numpy()
    ranks[:7] = 9  # a world of 4: ranks 0-3
    rewrite(segment, "rank", ranks)
    report = analyze(run)
    rel = "events/rank=00001/seg-000001.parquet"
    assert lines_about(report, rel) == [f"{rel}: 7 row(s) name a rank outside run.json's topology (ranks 0-3) "
                                        "and were left out"]
    first, last = int(steps[:7].min()), int(steps[:7].max())
    assert report["incomplete_data"] == [{"rank": 1, "steps": [first, last], "segment": rel,
                                          "reason": "contradicts the run"}]
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [STRAGGLER])]


def test_spans_that_end_before_they_start_are_left_out(straggler, tmp_path):
    run = Path(shutil.copytree(straggler, tmp_path / "run"))
    segment = run / "events" / "rank=00000" / "seg-000002.parquet"
    table = pq.read_table(segment, columns=["step", "start_ns", "end_ns"])
    end = table.column("end_ns").to_numpy().copy()
    end[-5:] = table.column("start_ns").to_numpy()[-5:] - 1_000_000
    rewrite(segment, "end_ns", end)
    report = analyze(run)
    rel = "events/rank=00000/seg-000002.parquet"
    assert lines_about(report, rel) == [f"{rel}: 5 row(s) end before they start (end_ns < start_ns) and were "
                                        "left out"]
    steps = table.column("step").to_numpy()[-5:]
    assert report["incomplete_data"] == [{"rank": 0, "steps": [int(steps.min()), int(steps.max())], "segment": rel,
                                          "reason": "contradicts the run"}]
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [STRAGGLER])]
    text = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run)], capture_output=True, text=True,
                          timeout=300).stdout
    assert "Incomplete data" in text and rel in text
