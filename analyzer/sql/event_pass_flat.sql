-- event_pass_flat: the event pass for traces whose spans neither nest nor overlap (checked on a sample
-- of ranks: event_pass.needs_timeline), the 10^4-rank case. No timeline window, hence no sort: the
-- batch's events are read ONCE into a narrow table, then aggregated twice from memory (a GROUPING SETS
-- query would compute every aggregate for both groupings, and a second scan of 10^4 files costs more
-- than the copy). Same output columns as event_pass.sql's two grouping sets; nested waits and host gaps
-- are 0 (nothing nests; rank_step.sql takes the gaps from the step residual instead).
-- Formatted: {source} (events of a batch of ranks), {instance} (layout.instance_sql), {join} (a topology
-- join when ranks are not numbered regularly), {base} (the time origin, ns), {wait_suffix} (the name
-- suffix of `<op>.wait` spans, an SQL literal), {async_op} (SQL: an async op of a trace with wait rows;
-- see event_pass.sql for waits and async ops). Statements are separated by
-- lines holding only ';' (event_pass.py runs them in order).
CREATE OR REPLACE TEMP TABLE _batch_events AS
SELECT rank, step, peer, start_ns, end_ns,
    -- one small integer per event role (sql/_event_role.sql), so the aggregates compare integers
    {event_role} AS role,
    -- communication the thread may have sat in: sync ops and waits (a waited op is cleared below; an
    -- async op, {async_op}, is hidden: its wait, if any, is the exposed part)
    kind IN ('collective', 'p2p') AND NOT {async_op} OR kind = 'host' AND ends_with(name, {wait_suffix}) AS comm,
    -- op keys (group, seq) of ops and waits (NULL elsewhere: cheap to hold), collective names on collectives
    CASE WHEN kind IN ('collective', 'p2p') OR comm THEN "group" END AS "group",
    CASE WHEN kind IN ('collective', 'p2p') OR comm THEN seq END AS seq,
    CASE WHEN kind = 'collective' THEN name END AS op_name
FROM {source}
;
-- an op with a `<op>.wait` row (any step: a prefetched gather is waited in the next one) is hidden
-- communication: its wait is the exposed part (a join on the waits only: none on GPU/simulated traces)
UPDATE _batch_events e SET comm = false
FROM (SELECT DISTINCT rank, "group", seq, peer, role - 5 AS op_role FROM _batch_events
      WHERE role BETWEEN 11 AND 14) w
WHERE e.role = w.op_role AND e.rank = w.rank AND e."group" = w."group" AND e.seq = w.seq AND e.peer = w.peer
;
CREATE OR REPLACE TEMP TABLE _batch_peer_step AS
SELECT rank, step, peer,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role <= 3), 0) AS compute_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 0), 0) AS forward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 1), 0) AS backward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 2), 0) AS optimizer_ns,
    0::HUGEINT AS nested_ns,
    -- nothing nests: receives and all p2p waits, collectives and their waits (waited ops excluded)
    coalesce(sum(end_ns - start_ns) FILTER (WHERE comm AND role IN (8, 12, 13, 14)), 0) AS recv_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE comm AND role IN (6, 11)), 0) AS collective_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 4), 0) AS data_wait_ns,
    0::HUGEINT AS gap_ns, 0::HUGEINT AS gap_p2p_ns, 0::HUGEINT AS gap_coll_ns,
    min(end_ns - start_ns) FILTER (WHERE role = 7) AS send_min_ns,
    count(*) FILTER (WHERE role = 7) AS sends,
    min(end_ns - start_ns) FILTER (WHERE role = 8) AS recv_min_ns,
    count(*) AS n_events
FROM _batch_events
GROUP BY rank, step, peer
;
CREATE OR REPLACE TEMP TABLE _batch_partials AS
WITH _coll AS (
    SELECT *, {instance} AS instance FROM _batch_events {join} WHERE role = 6
)
SELECT "group", instance, seq,
    min(step) AS first_step,
    any_value(op_name) AS op_name,
    count(*) AS n_events,
    arg_max(rank, start_ns) AS last_rank,
    max(start_ns) AS last_issue_ns,
    min(start_ns) AS first_issue_ns,
    sum((start_ns - {base}) / 1e6) AS issue_sum_ms,
    max(end_ns) AS last_end_ns
FROM _coll
WHERE instance IS NOT NULL
GROUP BY "group", instance, seq
