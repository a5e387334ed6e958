"""Cut compute spans around the rank's own communication inside them, for the what-if replay.

On real traces tensor-parallel collectives are issued inside forward/backward: a rank's compute span
then includes the time it sat in them waiting for its peers. Cut into compute pieces around those
ops, the pieces hold only the rank's own work and the ops become synchronization points of the
replay (analyzer/graph/what_if.py), so a straggler's peers stop carrying its cost in their compute.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.graph.step_graph import ASYNC_NAMES, sends_block
from megascope.tracer.schema import WAIT_SUFFIX


def split_compute(events: pd.DataFrame, cpu_trace: bool) -> pd.DataFrame:
    """One step's events (events_window's frame) with each compute span that holds communication of
    its own rank (tensor-parallel collectives inside forward/backward: the rank sat in them, waiting
    for its peers) cut into compute pieces around it: piece, op, piece, ..., piece, in program order
    per rank. The pieces then hold only the rank's own work, and the nested ops are synchronization
    points of the replay. Columns added:
        span      event_id of the compute span a compute row belongs to (a piece or a whole span);
                  -1 on other rows (pieces share their span's event_id)
        internal  the ops and pieces after a span's first piece (host gaps there are 0 by construction)
    The cuts: a collective or p2p op, or a `<op>.wait` span, of the rank whose [start, end] lies inside
    a top-level compute span (the host sat in it); an async op issued inside one (send_forward/
    backward, unless the trace's sends are synchronous (step_graph.sends_block); on CPU traces,
    `cpu_trace`, an op whose start, the enqueue, is after its issue) is cut at
    its issue (it takes no time of the rank's own; graph_from_events(waits=True) lets it hold up
    nothing). Other events that start inside a split span (inner spans) are placed after its last
    piece: where the unsplit span's program order put them. `<op>.wait` rows are kept."""
    ev = events.reset_index(drop=True)
    ev = ev.assign(span=np.where(ev.kind == "compute", ev.event_id, -1).astype(np.int64), internal=False,
                   _ord=ev.issue_ns.astype(np.int64), _sub=0, _tie=np.arange(len(ev)))
    comp = ev[ev.kind == "compute"].sort_values(["rank", "start_ns", "end_ns"], ascending=[True, True, False])
    reach_before = comp.groupby("rank").end_ns.cummax().groupby(comp["rank"]).shift(fill_value=_NS_MIN)
    top = comp[comp.start_ns >= reach_before]  # spans inside an earlier span of the rank are not cut
    comm = ev.kind.isin(["collective", "p2p"])
    is_async = comm & ev.name.isin(ASYNC_NAMES) & (not sends_block(ev))
    if cpu_trace:
        is_async |= comm & (ev.issue_ns < ev.start_ns)
    cuts = ev[comm | ((ev.kind == "host") & ev.name.str.endswith(WAIT_SUFFIX))]
    asy = is_async[cuts.index].to_numpy()
    # the part of the span each cut takes: a blocking op its span; an async op nothing, at its issue
    lo = np.where(asy, cuts.issue_ns, cuts.start_ns)
    cuts = cuts.assign(cut_lo=lo, cut_hi=np.where(asy, cuts.issue_ns, cuts.end_ns), start_ns=lo)
    ops = _in_span(cuts, top)
    # an op issued at the span's very end follows it (a zero-length tail piece would split it)
    ops = ops[(ops.cut_hi <= ops.span_end) & (ops.cut_lo < ops.span_end) & (ops.issue_ns >= ops.span_issue)]
    if ops.empty:
        return ev.drop(columns=["_ord", "_sub", "_tie"])
    ops = ops.sort_values(["parent", "cut_lo"])
    by_parent = ops.groupby("parent", sort=False)
    reach = by_parent.cut_hi.cummax()  # overlapping ops (GPU streams) leave no negative piece
    prev_reach = reach.groupby(ops.parent).shift(fill_value=_NS_MIN)
    first = prev_reach == _NS_MIN
    begin = pd.Series(np.where(first, ops.span_start, prev_reach), index=ops.index)
    split = ev.loc[ops.parent.unique()]
    # the pieces: one before each op (from the previous op's end, or the span start), one after the
    # last; a piece after op k sorts right after op k; the first keeps the span's issue and order
    before = split.loc[ops.parent].set_index(ops.index)
    before = before.assign(
        start_ns=begin, end_ns=np.maximum(ops.cut_lo, begin), internal=~first,
        issue_ns=np.where(first, before.issue_ns, begin),
        _ord=np.where(first, before._ord, ops._ord.groupby(ops.parent).shift(fill_value=0)),
        _sub=np.where(first, before._sub, 1),
        _tie=np.where(first, before._tie, ops._tie.groupby(ops.parent).shift(fill_value=0)))
    last = by_parent.tail(1).set_index("parent")
    tail_start = reach.groupby(ops.parent).max().reindex(split.index).to_numpy()
    tail = split.assign(issue_ns=tail_start, start_ns=tail_start, end_ns=np.maximum(split.end_ns, tail_start),
                        internal=True, _ord=last._ord.reindex(split.index).to_numpy(), _sub=1,
                        _tie=last._tie.reindex(split.index).to_numpy())
    # other events that start inside a split span (inner compute or host spans): after its last
    # piece, where the unsplit span's program order put them
    rest = ev.drop(index=list(split.index) + list(ops.index))
    moved = _in_span(rest, top.loc[top.index.isin(split.index)])
    moved = moved[(moved.start_ns < moved.span_end) & (moved.issue_ns >= moved.span_issue)]
    rest.loc[moved.index, "_ord"] = last._ord.reindex(moved.parent).to_numpy()
    rest.loc[moved.index, "_sub"] = 2
    nested = ev.loc[ops.index].assign(internal=True)
    out = pd.concat([rest, before[rest.columns], nested, tail[rest.columns]])
    out = out.sort_values(["rank", "_ord", "_sub", "_tie", "start_ns"], kind="stable")
    return out.drop(columns=["_ord", "_sub", "_tie"]).reset_index(drop=True)


_NS_MIN = np.iinfo(np.int64).min


def _in_span(rows: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """`rows` (that match one) with the span of their rank that started last at or before their start:
    parent (its index in the frame), span_issue, span_start, span_end."""
    if rows.empty or spans.empty:
        return rows.iloc[:0].assign(parent=0, span_issue=0, span_start=0, span_end=0)
    left = pd.DataFrame({"rank": rows["rank"].to_numpy(), "start_ns": rows.start_ns.to_numpy(),
                         "row": np.arange(len(rows))}).sort_values("start_ns")
    right = pd.DataFrame({"rank": spans["rank"].to_numpy(), "start_ns": spans.start_ns.to_numpy(),
                          "parent": np.arange(len(spans))}).sort_values("start_ns")
    m = pd.merge_asof(left, right, on="start_ns", by="rank", direction="backward").dropna(subset=["parent"])
    at = m.parent.to_numpy().astype(np.int64)  # positions (small): exact through the float NaN column
    out = rows.iloc[m.row.to_numpy()]
    # ns columns stay int64: looked up by position, never through a NaN-holding merge column
    return out.assign(parent=spans.index.to_numpy()[at], span_issue=spans.issue_ns.to_numpy()[at],
                      span_start=spans.start_ns.to_numpy()[at], span_end=spans.end_ns.to_numpy()[at])
