-- collective_partials_of_members(member_rows, base, dp, tp, cp, renumber): flat_partials.sql's rows (one per
-- collective op instance, over the members in `member_rows`) straight from one row per member: the
-- summaries-at-the-edge path, where the ranks wrote their own collective rows (edge_collectives). The
-- values are flat_partials' expression for expression; the key is integers (a group code, not the
-- name) plus op_name, and the last arrival is one HUGEINT max of (issue, rank) instead of an arg_max
-- over a struct: the same tie rule (the higher rank), several times cheaper per row. Collectives of
-- groups not matched across ranks (group_instance NULL) are left out.
--   member_rows VARCHAR      -- name of the member rows' relation (rank, step, "group", seq, op_name,
--                               start_ns, end_ns: tracer/schema.py EDGE_COLLECTIVES)
--   base BIGINT              -- the time origin, ns (event_pass.run_start_ns)
--   dp, tp, cp, renumber     -- the layout, as group_instance.sql takes it
-- Columns: flat_partials.sql's, with its types.
CREATE OR REPLACE TEMP MACRO collective_partials_of_members(member_rows, base, dp, tp, cp, renumber) AS TABLE
WITH _member AS (
    SELECT rank, step, seq, op_name, start_ns, end_ns,
        -- group_instance's groups, coded so the key compares integers (unmatched groups: NULL, left out)
        CASE "group" WHEN 'dp' THEN 0 WHEN 'tp' THEN 1 WHEN 'pp' THEN 2 WHEN 'embedding' THEN 3
                     WHEN 'cp' THEN 4 WHEN 'world' THEN 5 END::UTINYINT AS gcode,
        group_instance("group", rank, dp, tp, cp, renumber) AS instance
    FROM query_table(member_rows)
), _instance AS (
    SELECT gcode, instance, seq, op_name,
        min(step) AS first_step,
        count(*) AS n_events,
        -- (issue, rank) as one number, issue * 2^32 + rank (0 <= rank < 2^32): its max is the latest issue,
        -- then the higher rank; the issue and the rank are its high and low bits
        max(start_ns::HUGEINT * 4294967296 + rank) AS last_key,
        sum((start_ns - base) / 1e6) AS issue_sum_ms,
        max(end_ns) AS last_end_ns
    FROM _member
    WHERE instance IS NOT NULL
    -- op_name in the key, not any_value(op_name): ~7% less CPU (no string copied into each group's
    -- state); members that disagree on the name give two partial rows, neither complete, which the
    -- merge (collectives.sql) joins into one instance as before
    GROUP BY gcode, instance, seq, op_name
)
SELECT ['dp', 'tp', 'pp', 'embedding', 'cp', 'world'][gcode + 1] AS "group", instance, seq, first_step, op_name,
    n_events,
    (last_key & 4294967295)::INTEGER AS last_rank,
    (last_key >> 32)::BIGINT AS last_issue_ns,
    issue_sum_ms, last_end_ns
FROM _instance
