-- late_arrivals_of(collectives, min_lateness_s): per rank and step, how often and by how much the rank
-- was the last to arrive at a collective (the members that arrived early waited for it: they are its
-- victims, not culprits). The run's table is `late_arrivals` (from `collective_instances`).
--   collectives VARCHAR    -- name of a collective_instances_of relation (collectives.sql)
--   min_lateness_s DOUBLE  -- arrivals later than this count (findings.MIN_LATENESS_S)
--   rank INT, step BIGINT
--   late_count BIGINT      -- collectives where this rank arrived last with lateness > min_lateness_s
--   lateness_s DOUBLE      -- summed lateness of those arrivals
CREATE OR REPLACE TEMP MACRO late_arrivals_of(collectives, min_lateness_s) AS TABLE
SELECT last_rank AS rank, step,
    count(*) AS late_count,
    sum(lateness_s) AS lateness_s
FROM query_table(collectives)
WHERE members > 1 AND lateness_s > min_lateness_s
GROUP BY ALL
