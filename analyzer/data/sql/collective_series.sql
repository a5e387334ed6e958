-- collective_series: per collective group instance and step, the effective transfer time (peer
-- waiting removed) against the same kind of group at the same step.
--   $warm BIGINT[]         -- warm-up steps, left out (bound parameter)
--   "group" VARCHAR, instance BIGINT, step BIGINT, name VARCHAR
--   effective_s DOUBLE     -- median effective time of the instance's ops of that name in the step
--   baseline_s DOUBLE      -- median of effective_s over all instances of the group kind at that step
--   ratio DOUBLE           -- effective_s / baseline_s
WITH _per_step AS (
    SELECT "group", instance, step, name, median(effective_s) AS effective_s
    FROM collective_instances
    WHERE members > 1
    GROUP BY ALL
), _baseline AS (
    SELECT "group", step, name, median(effective_s) AS baseline_s
    FROM _per_step GROUP BY ALL
)
SELECT p."group", p.instance, p.step, p.name, p.effective_s, b.baseline_s,
    p.effective_s / nullif(b.baseline_s, 0) AS ratio
FROM _per_step p JOIN _baseline b USING ("group", step, name)
WHERE NOT list_contains($warm, p.step);
