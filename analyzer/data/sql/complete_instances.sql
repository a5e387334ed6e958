-- complete_collective_instances(partials, base, dp, tp, cp, pp, world): collectives.sql's rows for the
-- partial rows (flat_partials.sql's columns) that already hold every member of their group instance
-- (n_events = group_size.sql's size): one batch of ranks held the whole group (a tensor-parallel group
-- lies on one host, so in one batch of whole hosts), so no other batch has a member and the row is the
-- finished instance, taken without an aggregation; the values are collective_instances_of's over that
-- one row, expression for expression. event_pass.py sends the other partial rows to the merge.
--   partials VARCHAR              -- name of the partial rows' relation
--   base BIGINT                   -- the time origin the partials' issue_sum_ms is counted from
--   dp, tp, cp, pp, world         -- the layout, as group_size.sql takes it
-- Columns: collectives.sql's, with its types.
CREATE OR REPLACE TEMP MACRO complete_collective_instances(partials, base, dp, tp, cp, pp, world) AS TABLE
SELECT "group", instance, seq,
    first_step AS step,
    op_name AS name,
    n_events AS members,
    last_rank,
    (last_issue_ns - base) / 1e9 - issue_sum_ms / 1e3 / n_events AS lateness_s,
    greatest(last_end_ns - last_issue_ns, 0) / 1e9 AS effective_s
FROM query_table(partials)
WHERE n_events = group_size("group", dp, tp, cp, pp, world)
