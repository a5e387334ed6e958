-- event_timeline(events, first_step, base, async_ops, wait_suffix): each event of a batch placed on its
-- rank's timeline (a window over the rank-step ordered by start time), for traces whose spans nest or
-- overlap: its role, whether it is communication the rank sat in, nested in compute, a host pause, and
-- its own duration, wait and the host gap before it. What the timeline pass aggregates: both groupings
-- of the analyzer (event_pass.sql) and the per (rank, step, peer) rows alone (peer_step_timeline.sql:
-- the tracers' and the watcher's summaries, which keep no collective partials).
-- Timeline rules (spans of the real trainer overlap: async sends and reductions stay open while the
-- rank computes, receives are posted one action ahead, tensor-parallel ops run inside forward):
--   waits   : `<op>.wait` host spans (CPU tracer: the training thread blocked in wait() on async op
--             <op>; tracer.schema.WAIT_SUFFIX) are the exposed time of their op, which is matched by
--             (rank, group, seq, peer, direction) - in any step: a prefetched gather is waited in the
--             next step - and counted nowhere itself ("waited": issue -> completion overlaps compute,
--             hidden communication). On such traces (async_ops) an async op without a wait row (its
--             start, the enqueue, after its issue) completed before wait(): hidden too. Other ops
--             (sync ops; GPU and simulated traces: no wait rows, async_ops false) are their own
--             exposed time.
--   nested  : a collective/p2p span or a wait (not a waited op) that ends inside an open compute span
--             (sync op inside forward, backward or optimizer; ZeRO's prefetched param_all_gather
--             waited in the next forward); its time is waiting on communication, subtracted from
--             that compute span and counted as collective / p2p (recv_ns) time.
--   gap     : host time before an event is issued: start - the later of (the last compute/host end,
--             the previous issue, the previous event's end if it completed, the latest collective end).
--             An async send still in flight does not hide the rank's own delay before its next issue;
--             waiting for an async reduction to complete does not count (an async collective still in
--             flight does hide it: the conservative side, and it saves a second sort by end time).
--             Other host spans (role 5: NDTimeline's `gc`, the trainer's checkpoint_snapshot/restore)
--             outside compute are host pauses and count as gap too: the flat variant's step residual
--             already held them, while here their end hid the pause (a GC pause recorded as a `gc` row
--             before a forward was nowhere in the rank's own time: late_launch recall 0.50 on the
--             independent suite's recorded pauses).
-- Arguments (all bound by the callers, none spliced):
--   events VARCHAR        -- name of the relation holding the batch's events (tracer.schema.EVENTS columns)
--   first_step BIGINT     -- only events of steps >= first_step (the summary cache's extension of a live run)
--   base BIGINT           -- a time origin, ns: an hour before the run's first step (event_pass.run_start_ns)
--   async_ops BOOLEAN     -- the trace has `<op>.wait` rows: an op whose start is after its issue is async
--   wait_suffix VARCHAR   -- tracer.schema.WAIT_SUFFIX
-- Columns: the event's rank, step, peer, start_ns, end_ns; role (event_role.sql); "group", seq (the
-- collective key, on collectives only) and op_name; comm, busy_role (the role of the compute/host span
-- it ends in, if any), nested, host_pause (BOOLEAN); dur_ns, wait_ns, gap_ns (BIGINT); and the window's
-- working columns (op keys, running maxima) the aggregations do not read.
CREATE OR REPLACE TEMP MACRO event_timeline(events, first_step, base, async_ops, wait_suffix) AS TABLE
WITH _raw AS MATERIALIZED (
    -- one small integer per event role (event_role.sql), so the window sorts narrow rows
    SELECT rank, step, peer, start_ns, end_ns,
        event_role(kind, name, peer, wait_suffix) AS role,
        -- the op key (group, seq) of ops and waits; collective names for the collective grouping (event_pass.sql)
        CASE WHEN kind IN ('collective', 'p2p') OR kind = 'host' AND ends_with(name, wait_suffix)
             THEN "group" END AS op_group,
        CASE WHEN kind IN ('collective', 'p2p') OR kind = 'host' AND ends_with(name, wait_suffix)
             THEN seq END AS op_seq,
        CASE WHEN kind = 'collective' THEN name END AS op_name,
        kind IN ('collective', 'p2p') AND async_ops AND issue_ns < start_ns AS async_op
    FROM query_table(events)
    WHERE step >= first_step
), _waits AS (
    SELECT DISTINCT rank, op_group, op_seq, peer, role - 5 AS op_role FROM _raw WHERE role BETWEEN 11 AND 14
), _coded AS (
    SELECT r.rank, r.step, r.peer, r.start_ns, r.end_ns, r.role,
        -- communication the thread may have sat in: waits, and sync ops (an async op is hidden: its
        -- wait, if any, is the exposed part)
        r.role BETWEEN 11 AND 14 OR (r.role BETWEEN 6 AND 9 AND w.rank IS NULL AND NOT r.async_op) AS comm,
        -- collective key columns only on collectives: every other event falls in one junk group
        CASE WHEN r.role = 6 THEN r.op_group END AS "group",
        CASE WHEN r.role = 6 THEN r.op_seq END AS seq,
        r.op_name
    FROM _raw r LEFT JOIN _waits w
        ON r.role = w.op_role AND r.rank = w.rank AND r.op_group = w.op_group AND r.op_seq = w.op_seq
           AND r.peer = w.peer
), _timeline AS (
    SELECT *,
        -- the latest-ending compute/host span issued before, and its role, in one running max of
        -- (end in us since base) * 16 + role: each framed aggregate is a pass over the rows, and us
        -- keep any run length within BIGINT (base is an hour before the run's first step). The us
        -- grid is the clock's own (end_ns // 1000), not base's: a rank's tracer summarizing its own
        -- events (tracer/edge_summary.py) gets the same rows with its own base
        max((end_ns // 1000 - base // 1000) * 16 + role) FILTER (WHERE role <= 5 OR role BETWEEN 11 AND 14)
            OVER _before AS busy,
        max(end_ns) FILTER (WHERE role IN (6, 8)) OVER _before AS coll_end,
        max(end_ns) FILTER (WHERE comm) OVER _before AS comm_end,
        lag(end_ns) OVER _order AS prev_end,
        lag(start_ns) OVER _order AS prev_start
    FROM _coded
    WINDOW _order AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC),
           _before AS (PARTITION BY rank, step ORDER BY start_ns, end_ns DESC
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
), _busy AS (
    SELECT *, (busy // 16 + base // 1000) * 1000 + 999 AS busy_end, busy % 16 AS busy_role FROM _timeline
)
SELECT *, end_ns - start_ns AS dur_ns,
    coalesce(comm AND busy_end >= end_ns AND busy_role <= 3, false) AS nested,
    role = 5 AND NOT coalesce(busy_end >= end_ns AND busy_role <= 3, false) AS host_pause,
    -- a nested wait counts the time no earlier communication span covered (async ops without a
    -- wait row overlap each other and the waits): the union, not the sum
    CASE WHEN comm_end > start_ns THEN greatest(end_ns - comm_end, 0) ELSE end_ns - start_ns END AS wait_ns,
    -- the previous event completed when it ended by this start, or at most 1 us after it:
    -- float-second timestamps (NDTimeline: epoch seconds in float64, 0.24 us apart at 1.7e9 s) put an
    -- end a hair past the next start, and a blocked send was then taken for one still in flight and
    -- its whole wait for a host gap (late launches blamed on a straggler's pipeline neighbours)
    CASE WHEN busy_end > start_ns OR prev_start IS NULL THEN 0
         ELSE greatest(start_ns - greatest(coalesce(busy_end, 0), prev_start,
                                           CASE WHEN prev_end <= start_ns + 1000 THEN prev_end ELSE 0 END,
                                           least(coalesce(coll_end, 0), start_ns)), 0)
    END AS gap_ns
FROM _busy
