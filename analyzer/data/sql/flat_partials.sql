-- flat_partials(coded, base, dp, tp, cp, renumber): the flat event pass's per collective rows of one
-- batch (the timeline pass's gset = 1 rows, event_pass.sql): the members of one op instance that are in
-- the batch (per op_name: members that disagree on it give one row each); collectives.sql merges the
-- batches' partials. Collectives of groups not matched across ranks (group_instance NULL) are left out.
--   coded VARCHAR            -- name of the coded-events relation (event_pass.py: _batch_events)
--   base BIGINT              -- the time origin, ns (event_pass.run_start_ns)
--   dp, tp, cp, renumber     -- the layout, as group_instance.sql takes it
--   "group" VARCHAR, instance BIGINT, seq BIGINT   -- the op instance
--   first_step BIGINT        -- earliest step a member recorded it in
--   op_name VARCHAR
--   n_events BIGINT          -- members in the batch
--   last_rank INT, last_issue_ns BIGINT   -- the member that issued last, and when
--   issue_sum_ms DOUBLE      -- sum of (issue - base) in ms, for the mean arrival
--   last_end_ns BIGINT
CREATE OR REPLACE TEMP MACRO flat_partials(coded, base, dp, tp, cp, renumber) AS TABLE
WITH _coll AS (
    SELECT *, group_instance("group", rank, dp, tp, cp, renumber) AS instance FROM query_table(coded) WHERE role = 6
)
SELECT "group", instance, seq,
    min(step) AS first_step,
    op_name,
    count(*) AS n_events,
    arg_max(rank, (start_ns, rank)) AS last_rank,  -- a tie (same ns): the higher rank, not any row
    max(start_ns) AS last_issue_ns,
    sum((start_ns - base) / 1e6) AS issue_sum_ms,
    max(end_ns) AS last_end_ns
FROM _coll
WHERE instance IS NOT NULL
-- op_name in the key (cheaper than any_value of a string): members that disagree on it give two
-- partial rows, neither complete, which the merge (collectives.sql) joins into one instance
GROUP BY "group", instance, seq, op_name
