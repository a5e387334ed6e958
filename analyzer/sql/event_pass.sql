-- _pass: the one scan of the events every analysis derives from. Each event is placed on its rank's
-- timeline (a window over the rank-step ordered by start time), then two groupings are aggregated in
-- the same pass (GROUPING SETS): per (rank, step, peer) where the time went, and per collective
-- (group, instance, seq) the arrival of its members.
-- Timeline rules (spans of the real trainer overlap: async sends and reductions stay open while the
-- rank computes, receives are posted one action ahead, tensor-parallel ops run inside forward):
--   nested  : a collective/p2p span that ends inside an open compute span (sync op inside forward,
--             backward or optimizer); its time is waiting, subtracted from that compute span.
--   gap     : host time before an event is issued: start - the later of (the last compute/host end,
--             the previous issue, the previous event's end if it completed, the latest collective end).
--             An async send still in flight does not hide the rank's own delay before its next issue;
--             waiting for an async reduction to complete does not count (an async collective still in
--             flight does hide it: the conservative side, and it saves a second sort by end time).
-- Formatted: {source} (events of a batch of ranks), {instance} (layout.instance_sql), {join} (a topology
-- join when ranks are not numbered regularly), {base} (a time origin, ns: an hour before the first step). Collective rows with a NULL
-- instance (non-collectives, unknown groups) are junk of the second grouping and dropped by the caller.
--   gset INT                 -- 0: (rank, step, peer) rows; 1: collective partial rows
--   per (rank, step, peer): compute_ns (inclusive), forward_ns, backward_ns, optimizer_ns (own time:
--     nested waits removed), recv_ns, collective_ns (not nested), data_wait_ns, gap_ns (host gaps),
--     gap_p2p_ns, gap_coll_ns (gaps right before p2p / collective issues), send_min_ns, sends,
--     recv_min_ns, n_events
--   per collective: step, name, members, last_rank, last_issue_ns, first_issue_ns, issue_sum_ms
--     (sum of issue - run start, ms, for the mean arrival), end_ns
WITH _coded AS (
    -- one small integer per event role, so the window sorts narrow rows (strings stay behind)
    SELECT rank, step, peer, start_ns, end_ns,
        CASE WHEN kind = 'compute' THEN (CASE name WHEN 'forward' THEN 0 WHEN 'backward' THEN 1
                                                   WHEN 'optimizer' THEN 2 ELSE 3 END)
             WHEN kind = 'host' THEN (CASE WHEN name = 'data_wait' THEN 4 ELSE 5 END)
             WHEN kind = 'collective' THEN 6
             WHEN kind = 'p2p' THEN (CASE WHEN name LIKE 'send%' THEN 7 WHEN name LIKE 'recv%' THEN 8 ELSE 9 END)
             ELSE 10 END::UTINYINT AS role,
        -- collective key columns only on collectives: every other event falls in one junk group
        CASE WHEN kind = 'collective' THEN "group" END AS "group",
        CASE WHEN kind = 'collective' THEN seq END AS seq,
        CASE WHEN kind = 'collective' THEN name END AS op_name
    FROM {source}
), _timeline AS (  -- timeline:begin (event_pass.py swaps this block out for traces that need no sort)
    SELECT *,
        -- the latest-ending compute/host span issued before, and its role, in one running max of
        -- (end in us since base) * 16 + role: each framed aggregate is a pass over the rows, and us
        -- keep any run length within BIGINT ({base} is an hour before the run's first step)
        max(((end_ns - {base}) // 1000) * 16 + role) FILTER (WHERE role <= 5) OVER _before AS busy,
        max(end_ns) FILTER (WHERE role IN (6, 8)) OVER _before AS coll_end,
        lag(end_ns) OVER _order AS prev_end,
        lag(start_ns) OVER _order AS prev_start
    FROM _coded
    WINDOW _order AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC),
           _before AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    -- timeline:end
), _busy AS (
    SELECT *, (busy // 16) * 1000 + 999 + {base} AS busy_end, busy % 16 AS busy_role FROM _timeline
), _placed AS (
    SELECT *, end_ns - start_ns AS dur_ns,
        coalesce(role BETWEEN 6 AND 9 AND busy_end >= end_ns, false) AS nested,
        -- a nested wait overlapping the previous one (async gathers waited together) counts once
        CASE WHEN prev_end < end_ns THEN end_ns - greatest(start_ns, prev_end) ELSE end_ns - start_ns END AS wait_ns,
        CASE WHEN busy_end > start_ns OR prev_start IS NULL THEN 0
             ELSE greatest(start_ns - greatest(coalesce(busy_end, 0), prev_start,
                                               CASE WHEN prev_end <= start_ns THEN prev_end ELSE 0 END,
                                               least(coalesce(coll_end, 0), start_ns)), 0)
        END AS gap_ns,
        {instance} AS instance
    FROM _busy {join}
)
SELECT CAST(GROUPING(rank, step, peer) > 0 AS INT) AS gset, rank, step, peer, "group", instance, seq,
    coalesce(sum(dur_ns) FILTER (WHERE role <= 3), 0) AS compute_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 0), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 0), 0) AS forward_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 1), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 1), 0) AS backward_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 2), 0)
        - coalesce(sum(wait_ns) FILTER (WHERE nested AND busy_role = 2), 0) AS optimizer_ns,
    coalesce(sum(wait_ns) FILTER (WHERE nested), 0) AS nested_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 8 AND NOT nested), 0) AS recv_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 6 AND NOT nested), 0) AS collective_ns,
    coalesce(sum(dur_ns) FILTER (WHERE role = 4), 0) AS data_wait_ns,
    sum(gap_ns) AS gap_ns,
    coalesce(sum(gap_ns) FILTER (WHERE role BETWEEN 7 AND 9), 0) AS gap_p2p_ns,
    coalesce(sum(gap_ns) FILTER (WHERE role = 6), 0) AS gap_coll_ns,
    min(dur_ns) FILTER (WHERE role = 7) AS send_min_ns,
    count(*) FILTER (WHERE role = 7) AS sends,
    min(dur_ns) FILTER (WHERE role = 8) AS recv_min_ns,
    count(*) AS n_events,
    min(step) AS first_step,
    any_value(op_name) AS op_name,
    arg_max(rank, start_ns) AS last_rank,
    max(start_ns) AS last_issue_ns,
    min(start_ns) AS first_issue_ns,
    sum((start_ns - {base}) / 1e6) AS issue_sum_ms,
    max(end_ns) AS last_end_ns
FROM _placed
GROUP BY GROUPING SETS ((rank, step, peer), ("group", instance, seq));
