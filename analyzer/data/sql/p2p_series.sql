-- p2p_series: each directed link's per-step floor (p2p_link_pairs, both directions) against the links
-- of the same stage pair at the same step.
--   src INT, dst INT, step BIGINT, floor_s DOUBLE
--   baseline_s DOUBLE   -- median floor of the links of the same (src_pp, dst_pp) at the step
--   ratio DOUBLE        -- floor_s / baseline_s
WITH _links AS NOT MATERIALIZED (
    SELECT a AS src, b AS dst, step, a_pp AS src_pp, b_pp AS dst_pp, ab_floor_s AS floor_s
    FROM p2p_link_pairs WHERE ab_floor_s IS NOT NULL
    UNION ALL
    SELECT b, a, step, b_pp, a_pp, ba_floor_s FROM p2p_link_pairs WHERE ba_floor_s IS NOT NULL
), _baseline AS (
    SELECT src_pp, dst_pp, step, median(floor_s) AS baseline_s FROM _links GROUP BY ALL
)
SELECT l.src, l.dst, l.step, l.floor_s, b.baseline_s, l.floor_s / nullif(b.baseline_s, 0) AS ratio
FROM _links l JOIN _baseline b USING (src_pp, dst_pp, step);
