"""The trace simulator writes what the tracer writes: schema, paths, manifest, schedules, faults."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from megascope.samples.faults_sim import FaultSpecError, parse_fault
from megascope.samples.sim_schedule import global_order, stage_order
from megascope.tracer.run_dir import read_manifest
from megascope.tracer.schema import EVENTS, STEPS


@pytest.fixture(scope="module")
def run_dir(simulated_run):
    return simulated_run(dp=2, tp=2, pp=2, steps=4)


def test_paths_and_schemas(run_dir):
    for rank in range(8):
        seg = sorted((run_dir / "events" / f"rank={rank:05d}").glob("seg-*.parquet"))
        assert seg, f"no events segment for rank {rank}"
        assert pq.read_schema(seg[0]).equals(EVENTS)
        steps = pq.read_table(sorted((run_dir / "steps" / f"rank={rank:05d}").glob("seg-*.parquet"))[0])
        assert steps.schema.equals(STEPS)
        assert steps.column("step").to_pylist() == [0, 1, 2, 3]


def test_manifest_contract(run_dir):
    man = read_manifest(run_dir)
    assert man["source"] == "simulator"
    assert man["topology"]["world"] == 8 and len(man["topology"]["ranks"]) == 8
    assert man["schedule"] == "1f1b" and man["micro_batches"] == 8
    assert man["peak_flops"]["per_device"] > 0
    assert set(man["model"]) == {"n_layers", "hidden", "n_heads", "seq_len", "vocab_size", "window", "ffn_mult"}
    assert man["injected"] == []


def test_events_are_consistent(run_dir):
    ev = pq.read_table(run_dir / "events" / "rank=00004" / "seg-000000.parquet").to_pandas()
    assert (ev.end_ns >= ev.start_ns).all() and (ev.start_ns >= ev.issue_ns).all()
    fwd = ev[(ev.name == "forward") & (ev.step == 0)]
    assert sorted(fwd.microbatch) == list(range(8))
    recvs = ev[ev.name == "recv_forward"]  # rank 4 is stage 1: receives from rank 0
    assert set(recvs.peer) == {0} and recvs.groupby("step").size().eq(8).all()
    send = pq.read_table(run_dir / "events" / "rank=00000" / "seg-000000.parquet").to_pandas()
    send = send[send.name == "send_forward"].set_index("seq").end_ns
    assert (recvs.set_index("seq").end_ns == send.loc[recvs.seq].to_numpy()).all()


def test_collective_members_share_end(run_dir):
    ends = []
    for rank in (0, 2):  # a dp group: pp 0, tp 0
        ev = pq.read_table(run_dir / "events" / f"rank={rank:05d}").to_pandas()
        ends.append(ev[ev.name == "reduce_scatter"].sort_values("seq").end_ns.to_numpy())
    np.testing.assert_array_equal(ends[0], ends[1])


def test_schedules():
    assert [f"{o.kind}{o.microbatch}" for o in stage_order(0, 4, 4)] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert [f"{o.kind}{o.microbatch}" for o in stage_order(3, 4, 4)][:4] == ["F0", "B0", "F1", "B1"]
    order = stage_order(0, 2, 4, vpp=2)
    assert len(order) == 16 and {o.chunk for o in order} == {0, 1}
    assert len(global_order(4, 8, 2)) == 4 * 8 * 2 * 2


def test_fault_specs():
    f = parse_fault("straggler:rank=3,slowdown=0.1,from=5,to=9")
    assert f.factor == pytest.approx(1.1) and f.active(5) and not f.active(10)
    assert parse_fault("straggler:rank=3,slowdown=1.2").factor == pytest.approx(1.2)
    flap = parse_fault("flap:ranks=1-9,down_ms=5,period_steps=6")
    assert flap.ranks == [1, 9] and [flap.active(s) for s in range(6, 12)] == [True, True, False, False, False, False]
    for bad in ("nosuch:rank=1", "straggler:slowdown=0.1", "hang:rank=1", "flap:ranks=3-3,down_ms=1,period_steps=4"):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)


def test_hang_writes_inflight(simulated_run):
    out = simulated_run(dp=2, tp=2, pp=2, steps=6, inject=["hang:rank=5,at=2"])
    records = [json.loads(p.read_text()) for p in (out / "inflight").glob("rank=*.json")]
    assert records and all(r["rank"] != 5 for r in records)
    assert {"rank", "step", "microbatch", "op", "group", "seq", "peers", "bytes", "since_ns",
            "last_completed"} <= set(records[0])
    assert not (out / "inflight" / "rank=00005.json").exists()
    assert any(5 in r["peers"] for r in records)


@pytest.mark.parametrize("vpp", [1, 2])
def test_one_step_per_segment_writes_the_same_run(tmp_path, simulated_run, vpp):
    """rows_per_window at one step's events (one segment per step) once crashed ("cannot reshape array of
    size 80 into shape (40,4)": the second segment's steps added their event slots again); it must write
    the same events, split into one segment per step."""
    base = dict(dp=2, tp=1, pp=2, vpp=vpp, steps=3, micro_batches=4, inject=["straggler:rank=1,slowdown=1.5"])
    whole = simulated_run(tmp_path / "whole", **base)
    per_step_rows = 2 * (6 * 4 * vpp + 4)   # world * (6 * micro_batches * vpp + 4): one step's events
    split = simulated_run(tmp_path / "split", **base, rows_per_window=per_step_rows)
    for rank in range(2):
        segs = sorted((split / "events" / f"rank={rank:05d}").glob("seg-*.parquet"))
        assert [pq.read_table(s).column("step").unique().to_pylist() for s in segs] == [[0], [1], [2]]
        for table in ("events", "steps"):
            # loss and grad_norm noise is drawn per segment (seeded by its first step): not compared
            a, b = (pq.ParquetDataset(run / table / f"rank={rank:05d}").read().to_pandas()
                    .drop(columns=["loss", "grad_norm"], errors="ignore") for run in (whole, split))
            assert len(a) > 0 and a.equals(b), f"{table} of rank {rank} differ"
