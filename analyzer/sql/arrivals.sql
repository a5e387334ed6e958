-- late_arrivals: per rank and step, how often and by how much the rank was the last to arrive at a
-- collective (the members that arrived early waited for it: they are its victims, not culprits).
--   rank INT, step BIGINT
--   late_count BIGINT      -- collectives where this rank arrived last with lateness > $min_lateness_s
--   lateness_s DOUBLE      -- summed lateness of those arrivals
SELECT last_rank AS rank, step,
    count(*) AS late_count,
    sum(lateness_s) AS lateness_s
FROM collective_instances
WHERE members > 1 AND lateness_s > $min_lateness_s
GROUP BY ALL;
