"""Rules written once and read everywhere (issue 15, item 3): the tracer's event rows against
schema.EVENTS, the config's string choices against their Literal types, the finding kinds' order.

The tracer builds each events row as a positional tuple on its hot path (a tuple is the cheapest
thing to append); nothing but these tests ties those positions to the schema's column order. Every
builder gets a distinct value for each column and the row is read back by column name."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megascope import tracer
from megascope.tracer.buffer import TableBuffer
from megascope.tracer.config import TraceConfig
from megascope.tracer.schema import EVENTS, WAIT_SUFFIX
from megascope.tracer.watchdog import CommOp

STEP, MICROBATCH, CHUNK, PEER, NBYTES = 11, 12, 13, 14, 15
SEQ = 16  # the 17th op on its key


@pytest.fixture
def traced():
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, 3, TraceConfig(nvml=False), "cpu", sink=sink)
    tracer.activate(t)
    tracer.set_step(STEP)
    tracer.set_microbatch(MICROBATCH, chunk=CHUNK)
    yield t, sink
    tracer.deactivate()


def _rows(t: tracer.Tracer, sink: tracer.MemorySink) -> list[dict]:
    t.close()
    table = sink.table("events")
    assert table.schema == EVENTS
    return table.to_pylist()


def _expect(row: dict, **columns) -> None:
    assert set(columns) | {"issue_ns", "start_ns", "end_ns", "rank"} == set(EVENTS.names)
    assert {k: row[k] for k in columns} == columns
    assert row["rank"] == 3 and 0 < row["issue_ns"] <= row["start_ns"] <= row["end_ns"]


def test_span_row(traced):  # api.Span.__exit__ (the CPU path)
    t, sink = traced
    with tracer.span("send_x", kind="p2p", group="pp", peer=PEER, bytes=NBYTES):
        pass
    [row] = _rows(t, sink)
    _expect(row, step=STEP, microbatch=MICROBATCH, chunk=CHUNK, name="send_x", kind="p2p", group="pp", seq=-1,
            peer=PEER, bytes=NBYTES)


def test_end_span_row(traced):  # Tracer.end_span: the same prefix goes to the CUDA timeline on a GPU
    t, sink = traced
    t.end_span("recv_x", "p2p", "pp", PEER, NBYTES, MICROBATCH + 10, CHUNK + 10, t.begin_span())
    [row] = _rows(t, sink)
    _expect(row, step=STEP, microbatch=MICROBATCH + 10, chunk=CHUNK + 10, name="recv_x", kind="p2p", group="pp",
            seq=-1, peer=PEER, bytes=NBYTES)


def _comm_op(t: tracer.Tracer, issue_ns: int) -> CommOp:
    for _ in range(SEQ):
        t.registry.complete(t.begin_comm("warm", "collective", "dp", None, "key", PEER, NBYTES, None, False))
    op = t.begin_comm("all_reduce_x", "collective", "dp", None, "key", PEER, NBYTES, None, False, issue_ns)
    assert op is not None and op.seq == SEQ
    return op


def test_comm_rows(traced):  # Tracer.end_comm_host and Tracer.record_wait
    t, sink = traced
    issue = t.now_ns()
    op = _comm_op(t, issue)
    t.end_comm_host(op, issue + 1000)
    t.record_wait(op, issue + 2000, issue + 3000)
    comm, wait = _rows(t, sink)
    _expect(comm, step=STEP, microbatch=MICROBATCH, chunk=CHUNK, name="all_reduce_x", kind="collective",
            group="dp", seq=SEQ, peer=PEER, bytes=NBYTES)
    assert (comm["issue_ns"], comm["end_ns"]) == (issue, issue + 1000)
    _expect(wait, step=STEP, microbatch=MICROBATCH, chunk=CHUNK, name="all_reduce_x" + WAIT_SUFFIX, kind="host",
            group="dp", seq=SEQ, peer=PEER, bytes=0)
    assert (wait["start_ns"], wait["end_ns"]) == (issue + 2000, issue + 3000)


def test_comm_op_row_prefix():  # CommOp.row_prefix + (issue, start, end): what gpu_timing emits
    op = CommOp("all_gather_x", "collective", "tp", SEQ, PEER, NBYTES, STEP, MICROBATCH, CHUNK, 100, None, None)
    buffer = TableBuffer("events", EVENTS, 3, capacity=10, flush_rows=10)
    buffer.append(op.row_prefix() + (100, 200, 300))
    [row] = buffer.drain().to_pylist()
    _expect(row, step=STEP, microbatch=MICROBATCH, chunk=CHUNK, name="all_gather_x", kind="collective", group="tp",
            seq=SEQ, peer=PEER, bytes=NBYTES)


def test_config_choices_are_their_literal_types():
    from megascope.trainer import config

    for key, (_, allowed) in config.CHOICES.items():
        section, name = key.split(".")
        cls = type(getattr(config.JobConfig(), section))
        hint = typing.get_type_hints(cls)[name]
        assert typing.get_origin(hint) is typing.Literal and typing.get_args(hint) == allowed, key
        assert getattr(cls(), name) in allowed, key
    literal_fields = {f"{s}.{f.name}" for s in config.SECTIONS
                      for f in dataclasses.fields(type(getattr(config.JobConfig(), s)))
                      if typing.get_origin(typing.get_type_hints(type(getattr(config.JobConfig(), s)))[f.name])
                      is typing.Literal}
    assert literal_fields == set(config.CHOICES)  # every Literal field is checked by validate


def test_unknown_choice_names_the_valid_values():
    from megascope.trainer.config import ConfigError, JobConfig, validate

    cfg = JobConfig()
    cfg.parallel.recompute = "most"
    with pytest.raises(ConfigError, match="recompute 'most' unknown; use none, selective or full"):
        validate(cfg)
    cfg = JobConfig()
    cfg.trace.level = "all"
    with pytest.raises(ConfigError, match="trace level 'all' unknown; use step, op or detail"):
        validate(cfg)


def test_finding_kinds_one_order():
    from megascope.analyzer.findings import KINDS, SEVERITY_ORDER, Finding, Kind

    assert typing.get_args(Kind) == KINDS and list(SEVERITY_ORDER) == list(KINDS)
    assert KINDS[0] == "hang"  # a hang leads the list: nothing else matters while the job is stuck
    assert typing.get_type_hints(Finding)["kind"] == Kind
