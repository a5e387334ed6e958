-- p2p_link_pairs: per pipeline link (a <= b: its two ends) and step, what the two p2p series read,
-- from ONE pairing of the two ends' rows (each rank's row toward the other: a join of 10.75 M rows to
-- 10.75 M at 12,288 ranks x 1,000 steps, where p2p_series and p2p_stalls each joined before: 21.5 M
-- sends to 21.5 M recvs, then the two ends again). Reads _p2p_peer_step (event_pass.py), not the events.
-- The flap detector pairs the ends in numpy (detect/p2p_pairs.py: the same rows, dense links x steps
-- cells) and takes this table only where those cells would not be dense (a sampled trace's steps).
-- Transfer time with peer waiting removed: a transfer's span ends on both sides when it completes, so
-- its effective time end - max(send issue, recv issue) = min(send duration, recv duration); the
-- per-step floor over the link's transfers is then min(min send duration, min recv duration).
--   $warm BIGINT[]        -- warm-up steps, left out (bound parameter; every baseline is per step)
--   a INT, b INT, step BIGINT, a_pp INT, b_pp INT   -- the ends and their pipeline stages
--   ab_floor_s DOUBLE     -- fastest effective transfer a -> b in the step (NULL: a sent nothing to b,
--                            or b recorded no receive from a)
--   ba_floor_s DOUBLE     -- the same b -> a (NULL when a = b: a rank's transfers to itself are ab)
--   stall_s DOUBLE        -- min(stall of a toward b, stall of b toward a) (gap_p2p_ns): both ends must
--                            stall; 0 when one end has no row; NULL when a = b
CREATE OR REPLACE TEMP TABLE p2p_link_pairs AS
WITH _lo AS (
    SELECT rank AS a, peer AS b, step, sends, send_min_ns, recv_min_ns, gap_p2p_ns
    FROM _p2p_peer_step WHERE rank < peer AND NOT list_contains($warm, step)
), _hi AS (
    SELECT peer AS a, rank AS b, step, sends, send_min_ns, recv_min_ns, gap_p2p_ns
    FROM _p2p_peer_step WHERE rank > peer AND NOT list_contains($warm, step)
), _pairs AS (
    SELECT coalesce(l.a, h.a) AS a, coalesce(l.b, h.b) AS b, coalesce(l.step, h.step) AS step,
        CASE WHEN l.sends > 0 AND h.recv_min_ns IS NOT NULL
            THEN least(l.send_min_ns, h.recv_min_ns) / 1e9 END AS ab_floor_s,
        CASE WHEN h.sends > 0 AND l.recv_min_ns IS NOT NULL
            THEN least(h.send_min_ns, l.recv_min_ns) / 1e9 END AS ba_floor_s,
        CASE WHEN l.a IS NOT NULL AND h.a IS NOT NULL
            THEN least(l.gap_p2p_ns, h.gap_p2p_ns) / 1e9 ELSE 0 END AS stall_s
    FROM _lo l FULL JOIN _hi h ON l.a = h.a AND l.b = h.b AND l.step = h.step
    UNION ALL
    SELECT rank, peer, step, CASE WHEN recv_min_ns IS NOT NULL THEN least(send_min_ns, recv_min_ns) / 1e9 END,
        NULL, NULL
    FROM _p2p_peer_step WHERE rank = peer AND sends > 0 AND NOT list_contains($warm, step)
)
SELECT p.a, p.b, p.step, ta.pp AS a_pp, tb.pp AS b_pp, p.ab_floor_s, p.ba_floor_s, p.stall_s
FROM _pairs p JOIN topology ta ON ta.rank = p.a JOIN topology tb ON tb.rank = p.b;
