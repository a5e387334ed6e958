-- event_pass_flat_events(events, first_step, async_ops, wait_suffix): the event pass's first step for
-- traces whose spans neither nest nor overlap (checked on a sample of ranks: event_pass.needs_timeline),
-- the 10^4-rank case. No timeline window, hence no sort: event_pass.py copies a batch's events ONCE into
-- a narrow table (_batch_events) with this, clears `comm` on the ops that have a `<op>.wait` row (an
-- UPDATE joined to the waits only: none on GPU/simulated traces), then aggregates the copy twice from
-- memory (flat_peer_step.sql, flat_partials.sql: a GROUPING SETS query would compute every aggregate
-- for both groupings, and a second scan of 10^4 files costs more than the copy). Nested waits and host
-- gaps are 0 there (nothing nests; rank_step.sql takes the gaps from the step residual instead).
-- Arguments: as event_pass_timeline (event_pass.sql); none spliced.
-- Columns:
--   rank INT, step BIGINT, peer INT, start_ns, end_ns BIGINT   -- the event's
--   role UTINYINT          -- event_role.sql
--   comm BOOLEAN           -- communication the thread may have sat in: sync ops and waits (an async op
--                             is hidden: its wait, if any, is the exposed part; a waited op is cleared
--                             by the caller)
--   "group" VARCHAR, seq BIGINT  -- op keys of ops and waits (NULL elsewhere: cheap to hold)
--   op_name VARCHAR        -- collective names on collectives
CREATE OR REPLACE TEMP MACRO event_pass_flat_events(events, first_step, async_ops, wait_suffix) AS TABLE
SELECT rank, step, peer, start_ns, end_ns,
    event_role(kind, name, peer, wait_suffix) AS role,
    kind IN ('collective', 'p2p') AND NOT (async_ops AND issue_ns < start_ns)
        OR kind = 'host' AND ends_with(name, wait_suffix) AS comm,
    CASE WHEN kind IN ('collective', 'p2p') OR kind = 'host' AND ends_with(name, wait_suffix) THEN "group" END
        AS "group",
    CASE WHEN kind IN ('collective', 'p2p') OR kind = 'host' AND ends_with(name, wait_suffix) THEN seq END AS seq,
    CASE WHEN kind = 'collective' THEN name END AS op_name
FROM query_table(events)
WHERE step >= first_step
