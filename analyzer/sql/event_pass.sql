-- _pass: the one scan of the events every analysis derives from. Each event is placed on its rank's
-- timeline (a window over the rank-step ordered by start time), then two groupings are aggregated in
-- the same pass (GROUPING SETS): per (rank, step, peer) where the time went, and per collective
-- (group, instance, seq) the arrival of its members.
-- Timeline rules (spans of the real trainer overlap: async sends and reductions stay open while the
-- rank computes, receives are posted one action ahead, tensor-parallel ops run inside forward):
--   nested  : a collective/p2p span that ends inside an open compute span (sync op inside forward,
--             backward or optimizer); its time is waiting, subtracted from that compute span.
--   gap     : host time before an event is issued: start - the later of (the last completion of any
--             span on the rank, the previous issue). An async op still in flight does not hide the
--             rank's own delay before its next issue; waiting for one that completes does not count.
-- Formatted: {source} (events of a batch of ranks), {instance} (layout.instance_sql), {join} (a topology
-- join when ranks are not numbered regularly), {base} (run start, ns). Collective rows with a NULL
-- instance (non-collectives, unknown groups) are junk of the second grouping and dropped by the caller.
--   gset INT                 -- 0: (rank, step, peer) rows; 1: collective partial rows
--   per (rank, step, peer): compute_ns (inclusive), forward_ns, backward_ns, optimizer_ns (own time:
--     nested waits removed), recv_ns, collective_ns (not nested), data_wait_ns, gap_ns (host gaps),
--     gap_p2p_ns, gap_coll_ns (gaps right before p2p / collective issues), send_min_ns, sends,
--     recv_min_ns, n_events
--   per collective: step, name, members, last_rank, last_issue_ns, first_issue_ns, issue_sum_ms
--     (sum of issue - run start, ms, for the mean arrival), end_ns
WITH _timeline AS (
    SELECT rank, step, kind, name, "group", seq, peer, start_ns, end_ns,
        max(end_ns) FILTER (WHERE kind IN ('compute', 'host')) OVER _before AS busy_end,
        max(end_ns) FILTER (WHERE name = 'forward') OVER _before AS fwd_end,
        max(end_ns) FILTER (WHERE name = 'backward') OVER _before AS bwd_end,
        max(end_ns) FILTER (WHERE name = 'optimizer') OVER _before AS opt_end,
        lag(end_ns) OVER _order AS prev_end,
        lag(start_ns) OVER _order AS prev_start,
        -- the last completion on the rank before this event was issued (ordered by end time)
        max(end_ns) OVER (PARTITION BY rank, step ORDER BY end_ns
                          RANGE BETWEEN UNBOUNDED PRECEDING AND (end_ns - start_ns) PRECEDING) AS last_done
    FROM {source}
    WINDOW _order AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC),
           _before AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
), _placed AS (
    SELECT *, end_ns - start_ns AS dur_ns,
        kind IN ('collective', 'p2p') AND busy_end >= end_ns AS nested,
        -- a nested wait overlapping the previous one (async gathers waited together) counts once
        CASE WHEN prev_end < end_ns THEN end_ns - greatest(start_ns, prev_end) ELSE end_ns - start_ns END AS wait_ns,
        CASE WHEN busy_end > start_ns OR prev_start IS NULL THEN 0
             ELSE greatest(start_ns - greatest(coalesce(last_done, 0), prev_start), 0)
        END AS gap_ns,
        CASE WHEN kind = 'collective' THEN {instance} END AS instance
    FROM _timeline {join}
)
SELECT CAST(GROUPING(rank, step, peer) > 0 AS INT) AS gset, rank, step, peer, "group", instance, seq,
    coalesce(sum(dur_ns) FILTER (WHERE kind = 'compute'), 0) AS compute_ns,
    coalesce(sum(dur_ns) FILTER (WHERE name = 'forward' AND kind = 'compute'), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND fwd_end >= end_ns), 0) AS forward_ns,
    coalesce(sum(dur_ns) FILTER (WHERE name = 'backward' AND kind = 'compute'), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND bwd_end >= end_ns AND coalesce(fwd_end, 0) < end_ns), 0) AS backward_ns,
    coalesce(sum(dur_ns) FILTER (WHERE name = 'optimizer' AND kind = 'compute'), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND opt_end >= end_ns), 0) AS optimizer_ns,
    coalesce(sum(wait_ns) FILTER (WHERE nested), 0) AS nested_ns,
    coalesce(sum(dur_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'recv%' AND NOT nested), 0) AS recv_ns,
    coalesce(sum(dur_ns) FILTER (WHERE kind = 'collective' AND NOT nested), 0) AS collective_ns,
    coalesce(sum(dur_ns) FILTER (WHERE kind = 'host' AND name = 'data_wait'), 0) AS data_wait_ns,
    sum(gap_ns) AS gap_ns,
    coalesce(sum(gap_ns) FILTER (WHERE kind = 'p2p'), 0) AS gap_p2p_ns,
    coalesce(sum(gap_ns) FILTER (WHERE kind = 'collective'), 0) AS gap_coll_ns,
    min(dur_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'send%') AS send_min_ns,
    count(*) FILTER (WHERE kind = 'p2p' AND name LIKE 'send%') AS sends,
    min(dur_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'recv%') AS recv_min_ns,
    count(*) AS n_events,
    min(step) AS first_step,
    any_value(name) AS op_name,
    arg_max(rank, start_ns) AS last_rank,
    max(start_ns) AS last_issue_ns,
    min(start_ns) AS first_issue_ns,
    sum((start_ns - {base}) / 1e6) AS issue_sum_ms,
    max(end_ns) AS last_end_ns
FROM _placed
GROUP BY GROUPING SETS ((rank, step, peer), ("group", instance, seq));
