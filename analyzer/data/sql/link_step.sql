-- link_step: per p2p link (a < b: its two ends, by rank) and step, what the link view draws (views/links.py):
-- the time its ends sat waiting on it, its fastest transfer, and the rate that transfer moved its payload.
-- One scan of the run's p2p events (and, on traces with them, the `<op>.wait` spans of p2p ops): the
-- payload is only in the events (the edge summaries keep durations, not bytes).
-- Transfer time with peer waiting removed, as p2p_links.sql: a transfer's span ends on both sides when it
-- completes, so the fastest effective transfer a -> b in a step is min(fastest send of a to b, fastest
-- receive of b from a); the link's is the slower direction's (a throttled NIC shapes one direction).
--   $async_ops BOOLEAN    -- the trace has `<op>.wait` rows (event_pass.has_wait_spans): the waits are the
--                            exposed time of async ops; otherwise a receive's span is (sync ops)
--   $wait_suffix VARCHAR  -- tracer.schema.WAIT_SUFFIX
--   a INT, b INT, step BIGINT        -- the link's ends and the step
--   host_a VARCHAR, host_b VARCHAR   -- the ends' hosts
--   host_pair VARCHAR                -- 'hostA-hostB' (the two sorted; one name when both ends share a host)
--   cross_host BOOLEAN               -- the ends are on different hosts
--   wait_s DOUBLE         -- both ends' time in p2p waits toward each other (async: `<op>.wait` spans with
--                            the peer; sync: the receives' spans)
--   transfer_s DOUBLE     -- the slower direction's fastest effective transfer (NULL: no matched transfer)
--   bytes_per_s DOUBLE    -- the slower direction's mean payload per send over its fastest transfer (NULL:
--                            no payload recorded, or no matched transfer)
CREATE OR REPLACE TEMP TABLE link_step AS
WITH _ends AS (
    -- each rank's p2p traffic toward one peer in one step
    SELECT rank, peer, step,
        sum(end_ns - start_ns) FILTER (WHERE CASE WHEN $async_ops THEN kind = 'host'
                                                  ELSE kind = 'p2p' AND starts_with(name, 'recv') END) AS sat_ns,
        min(end_ns - start_ns) FILTER (WHERE kind = 'p2p' AND starts_with(name, 'send')) AS send_min_ns,
        min(end_ns - start_ns) FILTER (WHERE kind = 'p2p' AND starts_with(name, 'recv')) AS recv_min_ns,
        sum(bytes) FILTER (WHERE kind = 'p2p' AND starts_with(name, 'send')) AS send_bytes,
        count(*) FILTER (WHERE kind = 'p2p' AND starts_with(name, 'send')) AS sends
    FROM events
    WHERE peer >= 0 AND peer <> rank AND (kind = 'p2p' OR kind = 'host' AND ends_with(name, $wait_suffix))
    GROUP BY rank, peer, step
), _lo AS (
    SELECT rank AS a, peer AS b, * EXCLUDE (rank, peer) FROM _ends WHERE rank < peer
), _hi AS (
    SELECT peer AS a, rank AS b, * EXCLUDE (rank, peer) FROM _ends WHERE rank > peer
), _pairs AS (
    SELECT coalesce(l.a, h.a) AS a, coalesce(l.b, h.b) AS b, coalesce(l.step, h.step) AS step,
        (coalesce(l.sat_ns, 0) + coalesce(h.sat_ns, 0)) / 1e9 AS wait_s,
        CASE WHEN l.sends > 0 AND h.recv_min_ns IS NOT NULL THEN least(l.send_min_ns, h.recv_min_ns) END AS ab_ns,
        CASE WHEN h.sends > 0 AND l.recv_min_ns IS NOT NULL THEN least(h.send_min_ns, l.recv_min_ns) END AS ba_ns,
        nullif(l.send_bytes, 0) / nullif(l.sends, 0) AS ab_payload,
        nullif(h.send_bytes, 0) / nullif(h.sends, 0) AS ba_payload
    FROM _lo l FULL JOIN _hi h ON l.a = h.a AND l.b = h.b AND l.step = h.step
)
SELECT p.a, p.b, p.step, ta.host AS host_a, tb.host AS host_b,
    CASE WHEN ta.host = tb.host THEN ta.host
         ELSE least(ta.host, tb.host) || '-' || greatest(ta.host, tb.host) END AS host_pair,
    ta.host <> tb.host AS cross_host,
    p.wait_s,
    greatest(p.ab_ns, p.ba_ns) / 1e9 AS transfer_s,  -- greatest/least skip NULLs: one direction may be idle
    least(p.ab_payload / nullif(p.ab_ns, 0), p.ba_payload / nullif(p.ba_ns, 0)) * 1e9 AS bytes_per_s
FROM _pairs p JOIN topology ta ON ta.rank = p.a JOIN topology tb ON tb.rank = p.b;
