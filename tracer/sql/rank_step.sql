-- rank_step_of(steps, peer_step, first_step, residual_gaps): one row per rank and step, where the rank's
-- time went (the base of most analyses; the run's table is `rank_step`).
-- Built from the event pass's per (rank, step, p2p peer) rows (event_pass.sql / flat_peer_step.sql; the
-- run keeps their p2p rows as _p2p_peer_step, for the p2p analyses), joined to steps rows and `topology`.
-- Run per batch of ranks (event_pass.py: each batch's steps and rows, appended to the run's table `rank_step`).
--   steps VARCHAR        -- name of the steps relation (tracer.schema.STEPS; only the columns below are read)
--   peer_step VARCHAR    -- name of the per (rank, step, peer) rows
--   first_step BIGINT    -- only steps >= first_step (the summary cache's extension of a live run)
--   residual_gaps BOOLEAN -- gap_s is the step time no span covers (the flat pass: traces whose spans
--                           neither nest nor overlap, checked on a sample) instead of the timeline's gaps
--   rank INT, step BIGINT, pp/dp/tp INT, host VARCHAR   -- who
--   start_ns, end_ns BIGINT      -- the rank's step span (aligned clock)
--   step_time_s DOUBLE           -- end - start of the rank's step
--   tokens BIGINT                -- tokens of the rank's data-parallel replica in the step
--   model_flops DOUBLE           -- job-wide model FLOPs of the step
--   compute_s DOUBLE             -- the rank's own compute: compute spans minus the waits nested in them
--   forward_s, backward_s DOUBLE -- own forward / backward compute (the work judged against peers)
--   optimizer_s DOUBLE           -- own optimizer time (its all-reduce/all-gather waits removed)
--   recv_s DOUBLE                -- p2p time the rank sat in (pipeline bubble): receive spans outside compute,
--                                   p2p `.wait` spans, p2p waits nested in compute
--   collective_s DOUBLE          -- collective time the rank sat in (the last member + transfer): sync
--                                   collective spans (outside compute, or their wait inside it) and
--                                   `.wait` spans of async ones (an async op itself is hidden)
--   nested_wait_s DOUBLE         -- collective/p2p waits inside compute spans (tensor parallelism, clipping,
--                                   a prefetched param_all_gather waited in forward): out of compute_s,
--                                   in collective_s / recv_s
--   data_wait_s DOUBLE           -- host data_wait spans
--   gap_s DOUBLE                 -- host time before the rank issued its ops (launch delays, pauses)
--   gap_p2p_s, gap_coll_s DOUBLE -- the part of gap_s right before p2p / collective issues
--   own_s DOUBLE                 -- time the rank itself was busy or slow: compute + data wait + gaps
--   other_s DOUBLE               -- step time covered by no blocking span (= gap_s, kept for readers)
--   n_events BIGINT              -- the rank-step's events
CREATE OR REPLACE TEMP MACRO rank_step_of(steps, peer_step, first_step, residual_gaps) AS TABLE
WITH _per_rank_step AS (
    SELECT rank, step,
        (sum(compute_ns) - sum(nested_ns)) / 1e9 AS compute_s, sum(forward_ns) / 1e9 AS forward_s,
        sum(backward_ns) / 1e9 AS backward_s, sum(optimizer_ns) / 1e9 AS optimizer_s,
        sum(recv_ns) / 1e9 AS recv_s, sum(collective_ns) / 1e9 AS collective_s,
        sum(nested_ns) / 1e9 AS nested_wait_s, sum(data_wait_ns) / 1e9 AS data_wait_s,
        sum(gap_ns) / 1e9 AS gap_s, sum(gap_p2p_ns) / 1e9 AS gap_p2p_s, sum(gap_coll_ns) / 1e9 AS gap_coll_s,
        sum(n_events) AS n_events
    FROM query_table(peer_step)
    GROUP BY rank, step
)
SELECT s.rank, s.step, t.pp, t.dp, t.tp, t.host, s.start_ns, s.end_ns,
    (s.end_ns - s.start_ns) / 1e9 AS step_time_s, s.tokens, s.model_flops,
    greatest(coalesce(e.compute_s, 0), 0) AS compute_s, coalesce(e.forward_s, 0) AS forward_s,
    coalesce(e.backward_s, 0) AS backward_s, coalesce(e.optimizer_s, 0) AS optimizer_s,
    coalesce(e.recv_s, 0) AS recv_s, coalesce(e.collective_s, 0) AS collective_s,
    coalesce(e.nested_wait_s, 0) AS nested_wait_s, coalesce(e.data_wait_s, 0) AS data_wait_s,
    CASE WHEN residual_gaps THEN greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0)
        - coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0) ELSE coalesce(e.gap_s, 0) END AS gap_s,
    coalesce(e.gap_p2p_s, 0) AS gap_p2p_s, coalesce(e.gap_coll_s, 0) AS gap_coll_s,
    greatest(coalesce(e.compute_s, 0), 0) + coalesce(e.data_wait_s, 0)
        + CASE WHEN residual_gaps THEN greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0)
        - coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0) ELSE coalesce(e.gap_s, 0) END AS own_s,
    CASE WHEN residual_gaps THEN greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0)
        - coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0) ELSE coalesce(e.gap_s, 0) END AS other_s,
    coalesce(e.n_events, 0)::BIGINT AS n_events
FROM query_table(steps) s
JOIN topology t USING (rank)
LEFT JOIN _per_rank_step e USING (rank, step)
WHERE s.step >= first_step
