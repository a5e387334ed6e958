-- event_pass_timeline(events, first_step, base, async_ops, wait_suffix, dp, tp, cp, renumber): the one
-- scan of a batch's events that every analysis derives from, for traces whose spans nest or overlap.
-- Each event is placed on its rank's timeline (event_timeline.sql), then
-- two groupings are aggregated in the same pass (GROUPING SETS): per (rank, step, peer) where the time
-- went, and per collective (group, instance, seq) the arrival of its members.
-- Its sort-free sibling for traces whose spans neither nest nor overlap is event_pass_flat.sql.
-- Arguments (all bound by event_pass.py, none spliced; the first five are event_timeline.sql's):
--   events VARCHAR        -- name of the relation holding the batch's events (tracer.schema.EVENTS columns)
--   first_step BIGINT     -- only events of steps >= first_step (the summary cache's extension of a live run)
--   base BIGINT           -- a time origin, ns: an hour before the run's first step (event_pass.run_start_ns)
--   async_ops BOOLEAN     -- the trace has `<op>.wait` rows: an op whose start is after its issue is async
--   wait_suffix VARCHAR   -- tracer.schema.WAIT_SUFFIX
--   dp, tp, cp, renumber  -- the layout, as group_instance.sql takes it
-- Columns (one row per group of either grouping set; collective rows with a NULL instance -
-- non-collectives, unknown groups - are junk of the second grouping and dropped by the caller):
--   gset INT                 -- 0: (rank, step, peer) rows; 1: collective partial rows
--   rank INT, step BIGINT, peer INT, "group" VARCHAR, instance BIGINT, seq BIGINT  -- the grouping keys
--   per (rank, step, peer), BIGINT ns: compute_ns (inclusive), forward_ns, backward_ns, optimizer_ns (own
--     time: nested waits removed), nested_ns, recv_ns (receives outside compute, p2p waits, p2p nested in
--     compute), collective_ns (collectives outside compute, collective waits, collectives nested in
--     compute; waited ops excluded), data_wait_ns, gap_ns (host gaps), gap_p2p_ns, gap_coll_ns (gaps
--     right before p2p / collective issues), send_min_ns, sends, recv_min_ns, n_events, first_start_ns and
--     last_end_ns (the first event's start and the last end: rank_step.sql counts the host time before
--     the step's first span and after its last one, which no event's gap holds)
--   per collective (and op_name, a key: members that disagree on it give one row each, which the merge
--     joins): first_step, n_events (members), last_rank, last_issue_ns, issue_sum_ms (DOUBLE: sum of
--     issue - base, ms, for the mean arrival), last_end_ns
CREATE OR REPLACE TEMP MACRO event_pass_timeline(events, first_step, base, async_ops, wait_suffix,
                                                 dp, tp, cp, renumber) AS TABLE
WITH _placed AS (
    SELECT *, group_instance("group", rank, dp, tp, cp, renumber) AS instance
    FROM event_timeline(events, first_step, base, async_ops, wait_suffix)
)
SELECT CAST(GROUPING(rank, step, peer) > 0 AS INT) AS gset, rank, step, peer, "group", instance, seq, op_name,
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
    min(step) AS first_step,
    arg_max(rank, (start_ns, rank)) AS last_rank,  -- a tie (same ns): the higher rank, not any row
    max(start_ns) AS last_issue_ns,
    sum((start_ns - base) / 1e6) AS issue_sum_ms,
    max(end_ns) AS last_end_ns
FROM _placed
GROUP BY GROUPING SETS ((rank, step, peer), ("group", instance, seq, op_name))
