-- collective_instances: one row per collective op instance (all members of one group instance, same seq).
-- The group instance comes from the topology: dp peers share (pp, tp), tp peers share (pp, dp),
-- pp peers share (dp, tp), world is one instance.
--   "group" VARCHAR, instance BIGINT, seq BIGINT, step BIGINT, name VARCHAR
--   members BIGINT            -- members that recorded the op
--   last_rank INT             -- the member that arrived (issued) last: the one the others waited for
--   lateness_s DOUBLE         -- last arrival - mean arrival: how late the last member was
--   skew_s DOUBLE             -- last arrival - first arrival
--   effective_s DOUBLE        -- end - last arrival: the transfer itself, peer waiting removed
-- Parameters (formatted, integers): {dp}, {tp}.
CREATE OR REPLACE TEMP TABLE collective_instances AS
SELECT e."group", 
    CASE e."group" WHEN 'dp' THEN t.pp * {tp} + t.tp
                   WHEN 'tp' THEN t.pp * {dp} + t.dp
                   WHEN 'pp' THEN t.dp * {tp} + t.tp
                   ELSE 0 END AS instance,
    e.seq,
    min(e.step) AS step,
    any_value(e.name) AS name,
    count(*) AS members,
    arg_max(e.rank, e.issue_ns) AS last_rank,
    (max(e.issue_ns) - avg(e.issue_ns)) / 1e9 AS lateness_s,
    (max(e.issue_ns) - min(e.issue_ns)) / 1e9 AS skew_s,
    greatest(max(e.end_ns) - max(e.issue_ns), 0) / 1e9 AS effective_s
FROM events e
JOIN topology t USING (rank)
WHERE e.kind = 'collective'
GROUP BY ALL;
