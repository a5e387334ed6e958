-- rank_step: one row per rank and step, where the rank's time went (the base of most analyses).
-- Built once per Run from a single scan of `events` (grouped by rank, step and p2p peer, so the
-- same scan also feeds p2p_links.sql through _rank_peer_step), joined to `steps` and `topology`.
--   rank INT, step BIGINT, pp/dp/tp INT, host VARCHAR   -- who
--   start_ns, end_ns BIGINT      -- the rank's step span (aligned clock)
--   step_time_s DOUBLE           -- end - start of the rank's step
--   tokens BIGINT                -- tokens of the rank's data-parallel replica in the step
--   model_flops DOUBLE           -- job-wide model FLOPs of the step
--   compute_s DOUBLE             -- all compute spans (forward, backward, optimizer)
--   forward_s, backward_s DOUBLE -- forward / backward compute only (the work judged against peers)
--   recv_s DOUBLE                -- p2p receive spans: waiting for the neighbour stage (pipeline bubble)
--   collective_s DOUBLE          -- collective spans (waiting for the last member + transfer)
--   data_wait_s DOUBLE           -- host data_wait spans
--   other_s DOUBLE               -- step time covered by no blocking span (host gaps, late launches)
--   n_events BIGINT
CREATE OR REPLACE TEMP TABLE _rank_peer_step AS
SELECT rank, step, peer,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'compute'), 0) AS compute_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'compute' AND name = 'forward'), 0) AS forward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'compute' AND name = 'backward'), 0) AS backward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'recv%'), 0) AS recv_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'collective'), 0) AS collective_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE kind = 'host' AND name = 'data_wait'), 0) AS data_wait_ns,
    min(end_ns - issue_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'send%') AS send_min_ns,
    count(*) FILTER (WHERE kind = 'p2p' AND name LIKE 'send%') AS sends,
    min(end_ns - issue_ns) FILTER (WHERE kind = 'p2p' AND name LIKE 'recv%') AS recv_min_ns,
    count(*) AS n_events
FROM events
GROUP BY rank, step, peer;

CREATE OR REPLACE TEMP TABLE rank_step AS
WITH _per_rank_step AS (
    SELECT rank, step,
        sum(compute_ns) / 1e9 AS compute_s, sum(forward_ns) / 1e9 AS forward_s,
        sum(backward_ns) / 1e9 AS backward_s, sum(recv_ns) / 1e9 AS recv_s,
        sum(collective_ns) / 1e9 AS collective_s, sum(data_wait_ns) / 1e9 AS data_wait_s,
        sum(n_events) AS n_events
    FROM _rank_peer_step
    GROUP BY rank, step
)
SELECT s.rank, s.step, t.pp, t.dp, t.tp, t.host, s.start_ns, s.end_ns,
    (s.end_ns - s.start_ns) / 1e9 AS step_time_s, s.tokens, s.model_flops,
    coalesce(e.compute_s, 0) AS compute_s, coalesce(e.forward_s, 0) AS forward_s,
    coalesce(e.backward_s, 0) AS backward_s, coalesce(e.recv_s, 0) AS recv_s,
    coalesce(e.collective_s, 0) AS collective_s, coalesce(e.data_wait_s, 0) AS data_wait_s,
    greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0)
             - coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0) AS other_s,
    coalesce(e.n_events, 0) AS n_events
FROM steps s
JOIN topology t USING (rank)
LEFT JOIN _per_rank_step e USING (rank, step);
