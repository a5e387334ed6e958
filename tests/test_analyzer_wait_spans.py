"""`<op>.wait` host spans (the tracer's record of the training thread blocked on an async op) leave
the dependency graph and the what-if replay unchanged (the op itself carries the dependency), and
mark a CPU trace, whose p2p spans are not link transfer times."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.tracer.schema import EVENTS, WAIT_SUFFIX


@pytest.fixture(scope="module")
def plain(simulated_run):
    return simulated_run(dp=2, tp=1, pp=2, steps=4, inject=["straggler:rank=1,slowdown=0.6,from=1"])


def _with_wait_spans(src, dst):
    """A copy of the run where every p2p and collective event also has its `.wait` span."""
    shutil.copytree(src, dst)
    for seg in sorted((dst / "events").glob("rank=*/*.parquet")):
        ev = pq.read_table(seg).to_pandas()
        ops = ev[ev.kind.isin(["p2p", "collective"])].copy()
        ops["name"] = ops["name"] + WAIT_SUFFIX
        ops["kind"] = "host"
        ops["bytes"] = 0
        ops["issue_ns"] = ops["start_ns"] = ops["end_ns"] - (ops["end_ns"] - ops["start_ns"]) // 2
        rows = pa.Table.from_pandas(ops, schema=pa.schema([EVENTS.field(f.name) for f in EVENTS]),
                                    preserve_index=False)
        pq.write_table(rows, seg.with_name(seg.stem + "-waits.parquet"))
    return dst


def test_wait_spans_do_not_change_the_graph_or_the_what_if(plain, tmp_path):
    waits = Run.open(_with_wait_spans(plain, tmp_path / "waits"))
    base = Run.open(plain)
    assert waits.events((2, 2)).name.str.endswith(WAIT_SUFFIX).any()   # the spans are there to see
    deps = waits.dependencies(2)
    ev = waits.events((2, 2))
    ids = set(ev[ev.name.str.endswith(WAIT_SUFFIX)].event_id)
    assert not ids & (set(deps.src_event_id) | set(deps.dst_event_id))
    assert len(deps) == len(base.dependencies(2))
    assert deps.groupby("kind").wait_s.sum().round(6).to_dict() == \
        base.dependencies(2).groupby("kind").wait_s.sum().round(6).to_dict()
    finding = next(f for f in base.findings() if f.kind == "straggler")
    assert waits.what_if(finding)["throughput_lost"] == pytest.approx(
        base.what_if(finding)["throughput_lost"], abs=1e-3)


def test_p2p_transfer_floors_are_not_read_as_link_times_on_cpu_traces(tmp_path, simulated_run):
    # a simulated flap shows in the p2p transfer series; the same spans in a trace with `.wait` rows
    # (the CPU tracer, whose p2p spans end at the host's wait()) are host scheduling, not the link
    run_dir = simulated_run(tmp_path / "flap", dp=2, tp=1, pp=2, steps=20,
                            inject=["flap:ranks=0-2,down_ms=150,period_steps=6,len=2"])
    flaps = [f for f in Run.open(run_dir).findings() if f.kind == "network_flap"]
    assert [(f.ranks, f.evidence["signal"]) for f in flaps] == [([0, 2], "transfer")]
    cpu = Run.open(_with_wait_spans(run_dir, tmp_path / "cpu"))
    assert not [f for f in cpu.findings() if f.evidence.get("signal") == "transfer"]
