-- peer_step_timeline(events, first_step, base, async_ops, wait_suffix): event_pass_timeline's per
-- (rank, step, peer) rows alone (its gset = 0 rows), for the summaries that keep no collective partials:
-- a rank's tracer summarizing its own events and the watcher (tracer/edge_summary.py). The analyzer's
-- second grouping set (the collective partials) was ~1/3 of that pass's CPU (a 5-step flush of 3,072
-- ranks, 430 k events: 0.36-0.40 CPU-s with both sets, 0.24 with this one; same rows). The aggregates
-- are event_pass.sql's, expression for expression: tests/test_edge_summary.py checks the two agree.
-- Arguments: event_timeline.sql's. Columns: rank INT, step BIGINT, peer INT, and event_pass.sql's per
-- (rank, step, peer) columns (compute_ns ... recv_min_ns, n_events, first_start_ns, last_end_ns).
CREATE OR REPLACE TEMP MACRO peer_step_timeline(events, first_step, base, async_ops, wait_suffix) AS TABLE
SELECT rank, step, peer,
    coalesce(sum(dur_ns) FILTER (WHERE role <= 3), 0)::BIGINT AS compute_ns,
    (coalesce(sum(dur_ns) FILTER (WHERE role = 0), 0)
     - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 0), 0))::BIGINT AS forward_ns,
    (coalesce(sum(dur_ns) FILTER (WHERE role = 1), 0)
     - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 1), 0))::BIGINT AS backward_ns,
    (coalesce(sum(dur_ns) FILTER (WHERE role = 2), 0)
     - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 2), 0))::BIGINT AS optimizer_ns,
    coalesce(sum(wait_ns) FILTER (WHERE nested), 0)::BIGINT AS nested_ns,
    -- communication the rank sat in: outside compute its span, nested its wait (async sends in flight
    -- outside compute are not waiting)
    coalesce(sum(CASE WHEN nested THEN wait_ns ELSE dur_ns END)
             FILTER (WHERE comm AND (role IN (8, 12, 13, 14) OR nested AND role IN (7, 9))), 0)::BIGINT AS recv_ns,
    coalesce(sum(CASE WHEN nested THEN wait_ns ELSE dur_ns END) FILTER (WHERE comm AND role IN (6, 11)), 0)::BIGINT
        AS collective_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 4), 0)::BIGINT AS data_wait_ns,
    (sum(gap_ns) + coalesce(sum(dur_ns) FILTER (WHERE host_pause), 0))::BIGINT AS gap_ns,
    coalesce(sum(gap_ns) FILTER (WHERE role BETWEEN 7 AND 9), 0)::BIGINT AS gap_p2p_ns,
    coalesce(sum(gap_ns) FILTER (WHERE role = 6), 0)::BIGINT AS gap_coll_ns,
    min(dur_ns) FILTER (WHERE role = 7) AS send_min_ns,
    count(*) FILTER (WHERE role = 7) AS sends,
    min(dur_ns) FILTER (WHERE role = 8) AS recv_min_ns,
    count(*) AS n_events,
    min(start_ns) AS first_start_ns,
    max(end_ns) AS last_end_ns
FROM event_timeline(events, first_step, base, async_ops, wait_suffix)
GROUP BY rank, step, peer
