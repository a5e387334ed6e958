-- p2p_link_steps: per directed pipeline link (src -> dst) and step, the fastest transfer's time with
-- peer waiting removed. A transfer's span ends on both sides when it completes, so its effective time
-- end - max(send issue, recv issue) = min(send duration, recv duration); the per-step floor over the
-- link's transfers is then min(min send duration, min recv duration): no send/recv join needed.
-- Reads _p2p_peer_step (event_pass.py), not the events.
--   src INT, dst INT, step BIGINT
--   floor_s DOUBLE        -- fastest effective transfer on the link in the step
--   transfers BIGINT      -- transfers seen on the sender side
--   src_pp, dst_pp INT    -- pipeline stages (links of the same stage pair are each other's peers)
CREATE OR REPLACE TEMP TABLE p2p_link_steps AS
WITH _sends AS (
    SELECT rank AS src, peer AS dst, step, send_min_ns AS send_ns, sends AS transfers
    FROM _p2p_peer_step WHERE sends > 0
), _recvs AS (
    SELECT peer AS src, rank AS dst, step, recv_min_ns AS recv_ns
    FROM _p2p_peer_step WHERE recv_min_ns IS NOT NULL
)
SELECT s.src, s.dst, s.step, least(s.send_ns, r.recv_ns) / 1e9 AS floor_s, s.transfers,
    ts.pp AS src_pp, td.pp AS dst_pp
FROM _sends s
JOIN _recvs r USING (src, dst, step)
JOIN topology ts ON ts.rank = s.src
JOIN topology td ON td.rank = s.dst;
