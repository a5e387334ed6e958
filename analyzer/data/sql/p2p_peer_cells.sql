-- p2p_peer_cells: each row of _p2p_peer_step outside the warm-up steps, placed in the flap detector's
-- dense link x step layout (detect/p2p_pairs.py) with the values p2p_links.sql pairs, in seconds.
-- Dividing each value by 1e9 before the pairing takes the least of two ends gives the same doubles as
-- p2p_links' least-then-divide: the int -> double cast and the division round monotonically.
--   $warm BIGINT[]        -- warm-up steps, left out (bound parameter)
--   $lo BIGINT            -- the step of each link's first cell (bound parameter)
--   $span BIGINT          -- cells per link (bound parameter)
--   reads _p2p_link_ids (rank INT, peer INT, link INT, side TINYINT), which p2p_pairs.py registers:
--   the links of p2p_peer_links present in the topology (the JOIN leaves the others' rows out)
--   side TINYINT          -- 0: rank < peer (the link's a end), 1: rank > peer (its b end), 2: rank = peer
--   cell BIGINT           -- link * $span + step - $lo
--   send_s DOUBLE         -- send_min_ns / 1e9 when the rank sent (sends > 0); +inf when that minimum is
--                            NULL (least() in p2p_links skips a NULL: the other end's value is taken)
--   recv_s DOUBLE         -- recv_min_ns / 1e9 (NULL: no receive recorded)
--   gap_s DOUBLE          -- gap_p2p_ns / 1e9: the rank's stall before its transfers to the peer
SELECT l.side, l.link::BIGINT * $span + (p.step - $lo) AS cell,
    CASE WHEN p.sends > 0 THEN coalesce(p.send_min_ns / 1e9, 'inf'::DOUBLE) END AS send_s,
    p.recv_min_ns / 1e9 AS recv_s,
    p.gap_p2p_ns / 1e9 AS gap_s
FROM _p2p_peer_step p JOIN _p2p_link_ids l ON l.rank = p.rank AND l.peer = p.peer
WHERE NOT list_contains($warm, p.step);
