"""Summaries at the edge (tracer/edge_summary.py): the analysis of a run from its ranks' own summary
tables equals the analysis of the same run from its raw events, and the analyzer falls back to the raw
events whenever the summaries do not cover every rank-step (a rank killed before close, a restart).

A real traced gloo run (`megascope train`, dp=2 x pp=2, 12 steps, a straggler) and simulated runs
summarized post hoc (`summarize_run`) are each compared with a copy of themselves without the edge_*
tables: rank_step, the p2p rows and the collective instances equal to 1e-12, and the same findings.
The summarizer's step lag and its stop on a late event, and SummarizingSink's retry of a failed
summary write, run on a real ParquetSegmentSink with the events of a simulated rank.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data.event_pass import edge_summaries_cover
from megascope.tracer.edge_summary import LAG_STEPS, EdgeSummarizer, SummarizingSink, summarize_run
from megascope.tracer.schema import EDGE, EVENTS, STEPS
from megascope.tracer.sink import ParquetSegmentSink
from tests.test_analyzer_restarts import runs  # noqa: F401 - the restarted runs fixture

TABLE_KEYS = {"rank_step": ["rank", "step"], "_p2p_peer_step": ["rank", "step", "peer"],
              "collective_instances": ["group", "instance", "seq"]}
"""The event pass's tables (analyzer/data/event_pass.py build_event_pass) and the keys they are sorted by."""


# ---- helpers --------------------------------------------------------------------------------------

def _raw_copy(run: Path, dst: Path) -> Path:
    """The run without its edge summaries (and without a persisted analysis)."""
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("edge_*", "analysis"))
    return dst


def _tables(run: Run) -> dict[str, pd.DataFrame]:
    run.findings()  # builds the event pass's tables and late arrivals
    return {name: run.store.query(f"SELECT * FROM {name}").sort_values(keys).reset_index(drop=True)
            for name, keys in TABLE_KEYS.items()}


def _verdicts(run: Run) -> list[tuple]:
    return [(f.kind, f.ranks, tuple(f.steps), round(f.severity, 6), f.summary) for f in run.findings()]


def _assert_same_analysis(a: Run, b: Run) -> None:
    ta, tb = _tables(a), _tables(b)
    for name in TABLE_KEYS:
        assert len(ta[name]) > 0, name
        pd.testing.assert_frame_equal(ta[name], tb[name], check_exact=False, rtol=1e-12, obj=name)
    assert _verdicts(a) == _verdicts(b)


def _rank_rows(run: Path, table: str, rank: int) -> pa.Table:
    schema = EVENTS if table == "events" else STEPS
    files = sorted((run / table / f"rank={rank:05d}").glob("seg-*.parquet"))
    return pa.concat_tables([pq.read_table(f).select(schema.names).cast(schema) for f in files])


def _of_step(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pc.equal(table["step"], step))


def _edge_rows(run: Path, table: str, rank: int) -> pd.DataFrame:
    files = sorted((run / table / f"rank={rank:05d}").glob("seg-*.parquet"))
    rows = pa.concat_tables([pq.read_table(f) for f in files]).to_pandas()
    return rows.sort_values(list(rows.columns[:3])).reset_index(drop=True)


# ---- a real traced run ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    """A real gloo run whose ranks wrote their summaries at the edge (the tracer's default)."""
    run = tmp_path_factory.mktemp("edge") / "traced"
    # slowdown 3: at 2 the tiny model's step on a shared 2-core box hides the straggler in the noise
    cmd = [sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "2", "--pp", "2", "--steps", "12",
           "--run-dir", str(run), "--inject", "straggler:rank=1,slowdown=3,from=5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.slow
def test_traced_run_analyzes_from_its_edge_summaries_like_from_its_events(traced, tmp_path):
    for table in EDGE:
        assert sorted(p.name for p in (traced / table).iterdir()) == [f"rank={r:05d}" for r in range(4)], table
    edge = Run.open(traced)
    raw = Run.open(_raw_copy(traced, tmp_path / "raw"))
    assert edge_summaries_cover(edge.store)
    assert not edge_summaries_cover(raw.store)
    _assert_same_analysis(edge, raw)
    stragglers = [f for f in edge.findings() if f.kind == "straggler"]
    assert stragglers and stragglers[0].ranks == [1], _verdicts(edge)  # the injected one, the costliest
    # another only where the OS's own counter says other processes took its CPU: CI's run of 4c71a23 named
    # rank 2 from step 2 (before the injection), "waits 10 ms a step for a CPU (other processes on its cores)"
    assert all(f.evidence.get("explained_by") == "cpu_contention" for f in stragglers[1:]), _verdicts(edge)


@pytest.mark.slow
def test_a_rank_killed_before_close_sends_the_analyzer_to_the_raw_events(traced, tmp_path):
    cut = Path(shutil.copytree(traced, tmp_path / "cut", ignore=shutil.ignore_patterns("analysis")))
    segments = sorted((cut / "edge_rank_step" / "rank=00002").glob("seg-*.parquet"))
    # its summaries since the last whole segment never written: with 12 steps (< SEGMENT_STEPS) a rank
    # writes one segment, at close, so a rank killed before close leaves none
    assert segments
    segments[-1].unlink()
    run = Run.open(cut)
    assert not edge_summaries_cover(run.store)
    _assert_same_analysis(run, Run.open(_raw_copy(traced, tmp_path / "raw")))



@pytest.mark.slow
def test_peer_step_timeline_is_the_event_pass_per_peer_grouping(traced):
    """The summaries' per (rank, step, peer) pass (peer_step_timeline.sql) repeats the aggregates of the
    analyzer's two-grouping pass (event_pass.sql): on the real run's events (async ops and their waits,
    nested tensor-parallel ops) the two give the same rows."""
    import duckdb

    from megascope.tracer.edge_summary import NO_FIRST_STEP, define_edge_sql
    from megascope.tracer.schema import WAIT_SUFFIX

    events = pa.concat_tables([_rank_rows(traced, "events", rank) for rank in range(4)])
    con = duckdb.connect()
    define_edge_sql(con)
    con.register("events", events)
    columns = ", ".join(f'"{c}"' for c in EDGE["edge_peer_step"].names + ["first_start_ns", "last_end_ns"])
    for async_ops in (True, False):  # the run's traces have waits (True); False: every op its own exposed time
        params = {"first": NO_FIRST_STEP, "base": pc.min(events["start_ns"]).as_py() - 3_600_000_000_000,
                  "async_ops": async_ops, "suffix": WAIT_SUFFIX}
        both = con.sql(f"SELECT {columns} FROM event_pass_timeline('events', $first, $base, $async_ops, $suffix, "
                       "2, 1, 1, NULL) WHERE gset = 0 ORDER BY rank, step, peer", params=params).df()
        alone = con.sql(f"SELECT {columns} FROM peer_step_timeline('events', $first, $base, $async_ops, $suffix) "
                        "ORDER BY rank, step, peer", params=params).df()
        assert len(alone) >= 4 * 12
        pd.testing.assert_frame_equal(alone, both)

# ---- simulated runs summarized post hoc -----------------------------------------------------------

@pytest.mark.parametrize("inject", ["straggler:rank=5,slowdown=0.3,from=4", "late_launch:rank=2,ms=15,from=3"])
def test_summarize_run_gives_the_raw_analysis(simulated_run, tmp_path, inject):
    sim = simulated_run(tmp_path / "sim", dp=2, tp=2, pp=2, steps=12, micro_batches=4, seed=3, inject=[inject])
    raw = Run.open(_raw_copy(sim, tmp_path / "raw"))
    assert summarize_run(sim) == 8
    edge = Run.open(sim)
    assert edge_summaries_cover(edge.store) and not edge_summaries_cover(raw.store)
    _assert_same_analysis(edge, raw)
    kind, rank = inject.split(":")[0], int(inject.split("rank=")[1].split(",")[0])
    assert any(f.kind == kind and f.ranks == [rank] for f in edge.findings()), _verdicts(edge)
    with pytest.raises(FileExistsError, match="already has edge summaries"):
        summarize_run(sim)


def test_a_restarted_run_is_analyzed_from_its_events(runs, tmp_path):  # noqa: F811 - the imported fixture
    run_dir = shutil.copytree(runs["restarted"], tmp_path / "restarted")
    summarize_run(run_dir)  # each (rank, step) re-run after the restart is summarized from both attempts
    run = Run.open(run_dir)
    assert run.store.attempt_bounds > 0 and run.store.files["edge_rank_step"]
    assert not edge_summaries_cover(run.store)
    pd.testing.assert_frame_equal(run.rank_steps(), Run.open(runs["reference"]).rank_steps())


# ---- the summarizer on a rank's flushes -----------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, simulated_run) -> tuple[Path, pa.Table, pa.Table]:
    """A small simulated run, and its rank 0's events and steps rows."""
    sim = simulated_run(tmp_path_factory.mktemp("edge") / "sim", dp=2, tp=1, pp=2, steps=8, micro_batches=4)
    return sim, _rank_rows(sim, "events", 0), _rank_rows(sim, "steps", 0)


def test_summarizer_waits_lag_steps_and_stops_on_a_late_event(one_rank):
    _, events, steps = one_rank
    s = EdgeSummarizer(0)
    try:
        for step in range(5):
            s.add("events", _of_step(events, step))
        assert s.ready() is None  # events alone complete no step
        for step in range(5):
            s.add("steps", _of_step(steps, step))
        first = s.ready()
        assert first is not None and set(first) == set(EDGE)
        assert first["edge_rank_step"]["step"].to_pylist() == list(range(5 - LAG_STEPS))
        assert s.ready() is None and s.done_through == 4 - LAG_STEPS  # nothing new
        s.add("events", _of_step(events, 5))
        s.add("steps", _of_step(steps, 5))
        assert s.ready()["edge_rank_step"]["step"].to_pylist() == [5 - LAG_STEPS]
        rest = s.ready(final=True)
        assert rest["edge_rank_step"]["step"].to_pylist() == list(range(6 - LAG_STEPS, 6))
        assert set(pc.unique(rest["edge_peer_step"]["step"]).to_pylist()) == set(range(6 - LAG_STEPS, 6))
        # a GPU timing of step 2 resolved after the step was summarized: this rank's summaries stop
        s.add("events", _of_step(events, 6))
        s.add("events", _of_step(events, 2).slice(0, 1))
        assert s.stopped
        s.add("steps", _of_step(steps, 6))
        assert s.ready() is None and s.ready(final=True) is None
    finally:
        s.close()


class FailFirstEdgeWrite:
    """A ParquetSegmentSink whose first write of an edge table fails (a full disk, a dropped PUT)."""

    def __init__(self, inner: ParquetSegmentSink) -> None:
        self.inner = inner
        self.failed: list[str] = []

    def write(self, table: str, batch: pa.Table) -> None:
        if table in EDGE and not self.failed:
            self.failed.append(table)
            raise OSError(f"injected: writing {table} failed")
        self.inner.write(table, batch)

    def close(self) -> None:
        self.inner.close()


def test_a_failed_summary_write_is_retried_and_the_raw_batch_written_once(one_rank, tmp_path):
    sim, events, steps = one_rank
    out = tmp_path / "run"
    sink = SummarizingSink(FailFirstEdgeWrite(ParquetSegmentSink(out, 0)), 0, segment_steps=1)
    n_steps = pc.max(steps["step"]).as_py() + 1
    for step in range(n_steps):  # one flush per step: its events, then its steps row
        sink.write("events", _of_step(events, step))
        sink.write("steps", _of_step(steps, step))
        if step == LAG_STEPS:  # the first summary (step 0) failed to write: kept, nothing on disk
            assert sink.inner.failed == ["edge_peer_step"] and sink.errors == 1
            assert not (out / "edge_rank_step").exists() and not (out / "edge_peer_step").exists()
        if step == LAG_STEPS + 1:  # ... and written by the next write, with step 1's
            assert _edge_rows(out, "edge_rank_step", 0)["step"].tolist() == [0, 1]
    sink.close()
    assert sink.errors == 1
    # every raw batch exactly once
    assert _rank_rows(out, "events", 0).num_rows == events.num_rows
    assert _rank_rows(out, "steps", 0)["step"].to_pylist() == list(range(n_steps))
    # and the summaries the tracer wrote step by step are those of the whole run at once, but for
    # `final`: only the rows of the last summary, written at close (after step n - 1 - LAG_STEPS)
    whole = _raw_copy(sim, tmp_path / "whole")
    summarize_run(whole)
    final = _edge_rows(out, "edge_rank_step", 0)["final"].tolist()
    assert final == [s >= n_steps - LAG_STEPS for s in range(n_steps)]
    assert _edge_rows(whole, "edge_rank_step", 0)["final"].all()
    for table in EDGE:
        pd.testing.assert_frame_equal(_edge_rows(out, table, 0).drop(columns="final", errors="ignore"),
                                      _edge_rows(whole, table, 0).drop(columns="final", errors="ignore"),
                                      check_exact=False, rtol=1e-12, obj=table)


def test_summaries_are_written_in_segments_of_segment_steps(one_rank, tmp_path):
    """One segment per table per `segment_steps` steps (and the rest at close), not one per flush: the
    same rows as a summary written per flush, in far fewer files."""
    _, events, steps = one_rank
    n_steps = pc.max(steps["step"]).as_py() + 1
    outs = {}
    for segment_steps in (1, 3):
        out = outs[segment_steps] = tmp_path / f"every-{segment_steps}"
        sink = SummarizingSink(ParquetSegmentSink(out, 0), 0, segment_steps=segment_steps)
        for step in range(n_steps):  # one flush per step: its events, then its steps row
            sink.write("events", _of_step(events, step))
            sink.write("steps", _of_step(steps, step))
            if segment_steps == 3 and step == LAG_STEPS + 1:  # steps 0 and 1 summarized, held
                assert not (out / "edge_rank_step").exists()
        sink.close()
        assert sink.errors == 0
    segments = sorted((outs[3] / "edge_rank_step" / "rank=00000").glob("seg-*.parquet"))
    assert [pq.read_table(f)["step"].to_pylist() for f in segments] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    for table in EDGE:
        assert len(list((outs[3] / table / "rank=00000").glob("seg-*.parquet"))) == 3, table
        assert len(list((outs[1] / table / "rank=00000").glob("seg-*.parquet"))) == n_steps - LAG_STEPS + 1, table
        pd.testing.assert_frame_equal(_edge_rows(outs[3], table, 0), _edge_rows(outs[1], table, 0), obj=table)


# ---- the central merge of the ranks' collective rows ------------------------------------------------

def test_member_partials_and_the_complete_shortcut_equal_the_flat_partials_merge():
    """edge_collectives.sql (one aggregation of a batch's member rows) gives flat_partials.sql's rows for
    the batch; a batch's partials that hold a whole group instance taken as finished instances
    (complete_instances.sql) and the rest merged (collectives.sql), as event_pass.split_partials and
    merge_partials do, give collectives.sql's merge of every partial. On members of tp, dp, pp and
    world ops over batches that hold some tp groups whole and split the others, with ties (the higher
    rank arrived last), issues before the epoch and an unmatched group."""
    import duckdb
    import numpy as np

    from megascope.analyzer.data.event_pass import library_sql

    con = duckdb.connect()
    for text in library_sql():
        con.execute(text)
    dp, tp, pp = 2, 4, 2  # 16 ranks in Megatron order
    gen = np.random.default_rng(7)
    rows = []
    for step in range(3):
        for rank in range(dp * tp * pp):
            for group, ops in (("tp", 3), ("dp", 2), ("pp", 1), ("world", 1), ("custom", 1)):
                for op in range(ops):
                    seq = step * ops + op
                    # starts on a 1 us grid over 40 us: many members of an op issue in the same ns
                    late = group == "world" and rank in (9, 12)
                    start = -5_000 + 1_000_000 * seq + 1_000 * (50 if late else int(gen.integers(0, 40)))
                    # rank 2 names its first tp op of step 0 differently (a desync): two partial rows
                    name = "tp_other" if (rank, group, seq) == (2, "tp", 0) else f"{group}_op"
                    rows.append((rank, step + (rank == 3 and group == "dp"), group, seq, name, start,
                                 start + int(gen.integers(1, 5_000))))
    members = pd.DataFrame(rows, columns=["rank", "step", "group", "seq", "op_name", "start_ns", "end_ns"]).astype(
        {"rank": "int32", "step": "int64", "seq": "int64", "start_ns": "int64", "end_ns": "int64"})
    con.register("members_df", members)
    con.execute("CREATE TABLE m AS SELECT *, 6::UTINYINT AS role FROM members_df")
    layout = {"base": -3_600_000_000_000, "dp": dp, "tp": tp, "cp": 1, "renumber": None}
    sizes = {"dp": dp, "tp": tp, "cp": 1, "pp": pp, "world": dp * tp * pp}
    keys = ["group", "instance", "seq"]
    # batches 0-4 and 11-15 hold two tp and two dp groups whole; 5-10 splits two tp groups; pp and world span all
    for i, (lo, hi) in enumerate(((0, 5), (5, 11), (11, 16))):
        con.execute(f"CREATE OR REPLACE VIEW b AS FROM m WHERE rank >= {lo} AND rank < {hi}")
        flat = con.execute("FROM flat_partials('b', $base, $dp, $tp, $cp, $renumber)", layout).df()
        edge = con.execute("FROM collective_partials_of_members('b', $base, $dp, $tp, $cp, $renumber)", layout).df()
        flat, edge = (f.sort_values(keys).reset_index(drop=True) for f in (flat, edge))
        pd.testing.assert_frame_equal(edge, flat, check_exact=False, rtol=1e-12)
        con.register("batch_df", edge)
        verb = "CREATE TABLE {} AS " if i == 0 else "INSERT INTO {} "
        con.execute(verb.format("p") + "FROM batch_df")
        con.execute(verb.format("done") + "FROM complete_collective_instances('batch_df', $base, $dp, $tp, $cp, $pp, "
                    "$world)", {"base": layout["base"], **sizes})
        con.execute(verb.format("rest") + "SELECT * FROM batch_df "
                    'WHERE n_events IS DISTINCT FROM group_size("group", $dp, $tp, $cp, $pp, $world)', sizes)
        con.unregister("batch_df")
    # whole in a batch: the tp groups 0-3 and 12-15 (3 ops x 3 steps each), the dp groups {0, 4} and {11, 15}
    # (2 ops x 3 steps each), less the op rank 2 named differently (its two partial rows are merged)
    assert con.execute("SELECT count(*) FROM done").fetchone()[0] == 2 * 9 + 2 * 6 - 1
    con.execute("INSERT INTO done FROM collective_instances_of('rest', $base)", {"base": layout["base"]})
    merged = con.execute("FROM collective_instances_of('p', $base)", {"base": layout["base"]}).df()
    direct = con.execute("FROM done").df()
    merged, direct = (f.sort_values(keys).reset_index(drop=True) for f in (merged, direct))
    assert set(direct["group"]) == {"tp", "dp", "pp", "world"} and len(direct) == 3 * (4 * 3 + 8 * 2 + 8 + 1)
    pd.testing.assert_frame_equal(direct, merged, check_exact=False, rtol=1e-12)
    # ranks 9 and 12 (two batches) issue every world op last, in the same ns: the higher rank is the last
    assert direct[direct["group"] == "world"].last_rank.tolist() == [12, 12, 12]
    desync = direct[(direct["group"] == "tp") & (direct.instance == 0) & (direct.seq == 0)]
    assert len(desync) == 1 and int(desync.members.iloc[0]) == tp
