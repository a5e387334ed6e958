-- p2p_stalls: per pipeline link (a < b) and step, the host time BOTH ends lost right before issuing
-- their transfers to each other (gap_p2p_ns of the event pass), against the links of the same stage
-- pair at the same step. Reads _p2p_peer_step (event_pass.py), not the events.
--   $warm BIGINT[]      -- warm-up steps, left out (bound parameter)
--   a INT, b INT, step BIGINT
--   stall_s DOUBLE      -- min(stall of a toward b, stall of b toward a): both ends must stall
--   baseline_s DOUBLE   -- median stall of the links of the same (pp of a, pp of b) at the step
--   ratio DOUBLE        -- stall_s / baseline_s
WITH _lo AS (
    SELECT rank AS a, peer AS b, step, gap_p2p_ns FROM _p2p_peer_step WHERE rank < peer
), _hi AS (
    SELECT peer AS a, rank AS b, step, gap_p2p_ns FROM _p2p_peer_step WHERE rank > peer
), _ends AS (
    -- the two ends' rows of a link-step side by side (a join, not a GROUP BY of 21.5 M rows into
    -- 10.75 M groups: about half the CPU and memory at 12,288 ranks x 1,000 steps); one end only: no stall
    SELECT coalesce(l.a, h.a) AS a, coalesce(l.b, h.b) AS b, coalesce(l.step, h.step) AS step,
        CASE WHEN l.a IS NOT NULL AND h.a IS NOT NULL THEN least(l.gap_p2p_ns, h.gap_p2p_ns) / 1e9 ELSE 0 END AS stall_s
    FROM _lo l FULL JOIN _hi h ON l.a = h.a AND l.b = h.b AND l.step = h.step
), _links AS (
    SELECT e.a, e.b, e.step, e.stall_s, ta.pp AS a_pp, tb.pp AS b_pp
    FROM _ends e JOIN topology ta ON ta.rank = e.a JOIN topology tb ON tb.rank = e.b
), _baseline AS (
    SELECT a_pp, b_pp, step, median(stall_s) AS baseline_s FROM _links GROUP BY ALL
)
SELECT l.a, l.b, l.step, l.stall_s, b.baseline_s, l.stall_s / nullif(b.baseline_s, 0) AS ratio
FROM _links l JOIN _baseline b USING (a_pp, b_pp, step)
WHERE NOT list_contains($warm, l.step);
