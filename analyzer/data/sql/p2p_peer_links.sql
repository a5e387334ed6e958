-- p2p_peer_links: the directed pairs (rank -> peer) of _p2p_peer_step outside the warm-up steps, with
-- their step range and row count: what the flap detector's numpy pairing (detect/p2p_pairs.py) needs to
-- lay each link's rows out densely, one cell per link and step (~25 k pairs at 12,288 ranks).
--   $warm BIGINT[]        -- warm-up steps, left out (bound parameter)
--   rank INT, peer INT    -- a row's rank and the peer it sent to / received from
--   lo BIGINT, hi BIGINT  -- the pair's first and last step with a row
--   n BIGINT              -- its rows
SELECT rank, peer, min(step) AS lo, max(step) AS hi, count(*) AS n
FROM _p2p_peer_step
WHERE NOT list_contains($warm, step)
GROUP BY rank, peer;
