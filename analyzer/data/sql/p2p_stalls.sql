-- p2p_stalls: per pipeline link (a < b) and step, the host time BOTH ends lost right before issuing
-- their transfers to each other (p2p_link_pairs.stall_s, from gap_p2p_ns of the event pass), against
-- the links of the same stage pair at the same step.
--   a INT, b INT, step BIGINT
--   stall_s DOUBLE      -- min(stall of a toward b, stall of b toward a): both ends must stall
--   baseline_s DOUBLE   -- median stall of the links of the same (pp of a, pp of b) at the step
--   ratio DOUBLE        -- stall_s / baseline_s
WITH _links AS NOT MATERIALIZED (
    SELECT a, b, step, stall_s, a_pp, b_pp FROM p2p_link_pairs WHERE a < b
), _baseline AS (
    SELECT a_pp, b_pp, step, median(stall_s) AS baseline_s FROM _links GROUP BY ALL
)
SELECT l.a, l.b, l.step, l.stall_s, b.baseline_s, l.stall_s / nullif(b.baseline_s, 0) AS ratio
FROM _links l JOIN _baseline b USING (a_pp, b_pp, step);
