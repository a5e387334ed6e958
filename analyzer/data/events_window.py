"""The events of a window of steps, each with a stable event_id: the raw events the step graph, the
what-if replay, the trace-back along the pipeline and the timeline read (data/, so the detectors and
the graph share it without depending on each other)."""

from __future__ import annotations

import pandas as pd

from megascope.analyzer.data.store import Store, load_sql

EVENT_ID_STEP_BIAS = 256
"""event_id holds step + this bias (24 bits), so events before the first step (step -1: init,
importers) get ids that are >= 0, unique and decodable like any other."""
MIN_EVENT_STEP = -EVENT_ID_STEP_BIAS
MAX_EVENT_STEP = (1 << 24) - 1 - EVENT_ID_STEP_BIAS


def event_id(rank: int, step: int, position: int) -> int:
    """The id events_window gives the `position`-th event (by issue time) of a rank-step."""
    return (int(rank) << 40) | ((int(step) + EVENT_ID_STEP_BIAS) << 16) | int(position)


def event_id_parts(event_id: int) -> tuple[int, int, int]:
    """(rank, step, position) of an event id."""
    event_id = int(event_id)
    return event_id >> 40, ((event_id >> 16) & 0xFFFFFF) - EVENT_ID_STEP_BIAS, event_id & 0xFFFF


def events_window(store: Store, first: int, last: int, ranks: list[int] | None, limit: int) -> pd.DataFrame:
    """Events of steps [first, last] with their event_id; steps outside the ids' range hold no events
    the analyzer can name (a window reaching past it is clipped to it)."""
    first, last = max(int(first), MIN_EVENT_STEP), min(int(last), MAX_EVENT_STEP)
    rank_filter = ""
    if ranks is not None:
        ids = ", ".join(str(int(r)) for r in ranks) or "-1"
        rank_filter = f"AND rank IN ({ids})"
    return store.query(load_sql("events_window").format(source=store.events_source(ranks), rank_filter=rank_filter,
                                                        step_bias=EVENT_ID_STEP_BIAS),
                       {"first": int(first), "last": int(last), "limit": int(limit)})
