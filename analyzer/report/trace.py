"""The trace of a window of steps and ranks, built from the Run (Chrome/Perfetto trace events): one track
(process) per rank, one thread per stream of work (compute, comm), flow arrows for p2p and collective
dependencies. perfetto.py writes it; `megascope export` builds it, then writes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from megascope.analyzer.run import Run

THREADS = {"compute": 1, "host": 1, "collective": 2, "p2p": 3}
THREAD_NAMES = {1: "compute", 2: "collectives", 3: "p2p"}


def trace_events(run: "Run", steps: tuple[int, int], ranks: list[int] | None, limit: int = 2_000_000) -> list[dict]:
    ev = run.events(steps, ranks, limit=limit)
    if ev.empty:
        return []
    t0 = int(ev.start_ns.min())
    hosts = dict(zip(run.topology["rank"], run.topology["host"]))
    out: list[dict] = []
    for rank in sorted(ev["rank"].unique()):
        out.append({"ph": "M", "name": "process_name", "pid": int(rank),
                    "args": {"name": f"rank {rank} ({hosts.get(rank, '?')})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": int(rank), "args": {"sort_index": int(rank)}})
        for tid, name in THREAD_NAMES.items():
            out.append({"ph": "M", "name": "thread_name", "pid": int(rank), "tid": tid, "args": {"name": name}})
    for r in ev.itertuples(index=False):
        out.append({"ph": "X", "name": r.name, "cat": r.kind, "pid": int(r.rank), "tid": THREADS.get(r.kind, 1),
                    "ts": (r.start_ns - t0) / 1e3, "dur": max(r.end_ns - r.start_ns, 0) / 1e3,
                    "args": {"event_id": int(r.event_id), "step": int(r.step), "microbatch": int(r.microbatch),
                             "chunk": int(r.chunk), "group": r.group, "seq": int(r.seq), "peer": int(r.peer),
                             "bytes": int(r.bytes), "issue_us": (r.issue_ns - t0) / 1e3}})
    out += _flows(run, ev, steps, ranks, t0)
    return out


def _flows(run: "Run", ev: pd.DataFrame, steps: tuple[int, int], ranks: list[int] | None, t0: int) -> list[dict]:
    """Flow arrows (s -> f) for every p2p/collective dependency edge inside the window."""
    by_id = ev.set_index("event_id")
    out: list[dict] = []
    flow = 0
    for step in range(steps[0], steps[1] + 1):
        edges = run.dependencies(step, ranks)
        edges = edges[edges.kind != "program_order"]
        edges = edges[edges.src_event_id.isin(by_id.index) & edges.dst_event_id.isin(by_id.index)]
        for e in edges.itertuples(index=False):
            src, dst = by_id.loc[e.src_event_id], by_id.loc[e.dst_event_id]
            flow += 1
            out.append({"ph": "s", "id": flow, "name": e.kind, "cat": e.kind, "pid": int(src["rank"]),
                        "tid": THREADS.get(src["kind"], 1), "ts": (src["end_ns"] - t0) / 1e3 - 0.001})
            out.append({"ph": "f", "bp": "e", "id": flow, "name": e.kind, "cat": e.kind, "pid": int(dst["rank"]),
                        "tid": THREADS.get(dst["kind"], 1), "ts": (dst["end_ns"] - t0) / 1e3 - 0.001})
    return out


def build_trace(run: "Run", steps: tuple[int, int], ranks: list[int] | None) -> dict[str, Any]:
    """The trace JSON object: traceEvents, displayTimeUnit, otherData (run_id, steps)."""
    return {"traceEvents": trace_events(run, steps, ranks), "displayTimeUnit": "ms",
            "otherData": {"run_id": run.manifest.get("run_id"), "steps": list(steps)}}
