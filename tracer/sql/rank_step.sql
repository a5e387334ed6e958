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
--   gap_s DOUBLE                 -- host time before the rank issued its ops (launch delays, pauses),
--                                   from the step's start to its first span and after its last span too
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
        sum(n_events) AS n_events, min(first_start_ns) AS first_start_ns, max(last_end_ns) AS last_end_ns
    FROM query_table(peer_step)
    GROUP BY rank, step
), _gaps AS (
    SELECT s.rank, s.step, s.start_ns, s.end_ns, s.tokens, s.model_flops, e.* EXCLUDE (rank, step),
        CASE WHEN residual_gaps
             THEN greatest((s.end_ns - s.start_ns) / 1e9 - coalesce(e.compute_s, 0) - coalesce(e.recv_s, 0)
                           - coalesce(e.collective_s, 0) - coalesce(e.data_wait_s, 0), 0)
             -- the gaps between events, and the step's edges: host time from the step's start to its
             -- first span and from its last span to the step's end (an attached job's code outside
             -- any hooked span: a 30 ms sleep before the forward was in no column, issue 31 item 4)
             ELSE coalesce(e.gap_s, 0) + greatest(coalesce((e.first_start_ns - s.start_ns) / 1e9, 0), 0)
                  + greatest(coalesce((s.end_ns - e.last_end_ns) / 1e9, 0), 0)
        END AS host_gap_s
    FROM query_table(steps) s
    LEFT JOIN _per_rank_step e USING (rank, step)
    WHERE s.step >= first_step
)
SELECT g.rank, g.step, t.pp, t.dp, t.tp, t.host, g.start_ns, g.end_ns,
    (g.end_ns - g.start_ns) / 1e9 AS step_time_s, g.tokens, g.model_flops,
    greatest(coalesce(g.compute_s, 0), 0) AS compute_s, coalesce(g.forward_s, 0) AS forward_s,
    coalesce(g.backward_s, 0) AS backward_s, coalesce(g.optimizer_s, 0) AS optimizer_s,
    coalesce(g.recv_s, 0) AS recv_s, coalesce(g.collective_s, 0) AS collective_s,
    coalesce(g.nested_wait_s, 0) AS nested_wait_s, coalesce(g.data_wait_s, 0) AS data_wait_s,
    g.host_gap_s AS gap_s, coalesce(g.gap_p2p_s, 0) AS gap_p2p_s, coalesce(g.gap_coll_s, 0) AS gap_coll_s,
    greatest(coalesce(g.compute_s, 0), 0) + coalesce(g.data_wait_s, 0) + g.host_gap_s AS own_s,
    g.host_gap_s AS other_s,
    coalesce(g.n_events, 0)::BIGINT AS n_events
FROM _gaps g
JOIN topology t USING (rank)
