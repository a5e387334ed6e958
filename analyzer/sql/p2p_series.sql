-- p2p_series: each link's per-step floor against the links of the same stage pair at the same step.
--   $warm BIGINT[]      -- warm-up steps, left out (bound parameter)
--   src INT, dst INT, step BIGINT, floor_s DOUBLE
--   baseline_s DOUBLE   -- median floor of the links of the same (src_pp, dst_pp) at the step
--   ratio DOUBLE        -- floor_s / baseline_s
WITH _baseline AS (
    SELECT src_pp, dst_pp, step, median(floor_s) AS baseline_s
    FROM p2p_link_steps GROUP BY ALL
)
SELECT l.src, l.dst, l.step, l.floor_s, b.baseline_s, l.floor_s / nullif(b.baseline_s, 0) AS ratio
FROM p2p_link_steps l JOIN _baseline b USING (src_pp, dst_pp, step)
WHERE NOT list_contains($warm, l.step);
