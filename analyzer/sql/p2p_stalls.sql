-- p2p_stalls: per pipeline link (a < b) and step, the host time BOTH ends lost right before issuing
-- their transfers to each other (gap_p2p_ns of the event pass), against the links of the same stage
-- pair at the same step. Reads _p2p_peer_step (event_pass.py), not the events.
--   a INT, b INT, step BIGINT
--   stall_s DOUBLE      -- min(stall of a toward b, stall of b toward a): both ends must stall
--   baseline_s DOUBLE   -- median stall of the links of the same (pp of a, pp of b) at the step
--   ratio DOUBLE        -- stall_s / baseline_s
WITH _ends AS (
    SELECT least(rank, peer) AS a, greatest(rank, peer) AS b, step,
        min(gap_p2p_ns) / 1e9 AS stall_s, count(*) AS sides
    FROM _p2p_peer_step
    GROUP BY ALL
), _links AS (
    SELECT e.a, e.b, e.step, CASE WHEN e.sides = 2 THEN e.stall_s ELSE 0 END AS stall_s, ta.pp AS a_pp, tb.pp AS b_pp
    FROM _ends e JOIN topology ta ON ta.rank = e.a JOIN topology tb ON tb.rank = e.b
), _baseline AS (
    SELECT a_pp, b_pp, step, median(stall_s) AS baseline_s FROM _links GROUP BY ALL
)
SELECT l.a, l.b, l.step, l.stall_s, b.baseline_s, l.stall_s / nullif(b.baseline_s, 0) AS ratio
FROM _links l JOIN _baseline b USING (a_pp, b_pp, step);
