-- collective_instances_of(partials, base): one row per collective op instance (all members of one group
-- instance, same seq), merged from the event pass's per-batch partial rows (event_pass.sql gset = 1,
-- flat_partials.sql; the run's are _collective_partials, its table `collective_instances`). The group
-- instance comes from the topology (group_instance.sql): dp peers share (pp, tp) (with context
-- parallelism the dp group spans dp x cp ranks), tp peers share (pp, dp, cp), cp peers (pp, dp, tp), pp
-- and embedding peers (dp, cp, tp), world is one instance; unknown groups are not matched.
--   partials VARCHAR          -- name of the partial rows' relation
--   base BIGINT               -- the time origin the partials' issue_sum_ms is counted from
--   "group" VARCHAR, instance BIGINT, seq BIGINT, step BIGINT, name VARCHAR
--   members BIGINT            -- members that recorded the op
--   last_rank INT             -- the member that arrived (issued) last: the one the others waited for
--   lateness_s DOUBLE         -- last arrival - mean arrival: how late the last member was
--   effective_s DOUBLE        -- end - last arrival: the transfer itself, peer waiting removed
-- (24.7 M rows at 12,288 ranks x 1,000 steps: no column nobody reads, e.g. the first-to-last arrival skew,
-- and no HUGEINT; each 8 bytes a row less is ~200 MB less for DuckDB to hold or spill)
CREATE OR REPLACE TEMP MACRO collective_instances_of(partials, base) AS TABLE
SELECT "group", instance, seq,
    min(first_step) AS step,
    any_value(op_name) AS name,
    sum(n_events)::BIGINT AS members,
    arg_max(last_rank, (last_issue_ns, last_rank)) AS last_rank,  -- a tie: the higher rank
    (max(last_issue_ns) - base) / 1e9 - sum(issue_sum_ms) / 1e3 / sum(n_events) AS lateness_s,
    greatest(max(last_end_ns) - max(last_issue_ns), 0) / 1e9 AS effective_s
FROM query_table(partials)
GROUP BY "group", instance, seq
