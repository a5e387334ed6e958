-- flat_peer_step(coded): the flat event pass's per (rank, step, p2p peer) rows, aggregated from a batch's
-- coded events (event_pass_flat.sql, after the waited ops' `comm` is cleared). The same columns as the
-- timeline pass's gset = 0 rows (event_pass.sql); nested waits and host gaps are 0 (nothing nests).
--   coded VARCHAR           -- name of the coded-events relation (event_pass.py: _batch_events)
--   rank INT, step BIGINT, peer INT
--   compute_ns, forward_ns, backward_ns, optimizer_ns BIGINT  -- compute spans (inclusive, then by name)
--   nested_ns BIGINT        -- 0
--   recv_ns BIGINT          -- receives and all p2p waits (waited ops excluded)
--   collective_ns BIGINT    -- collectives and their waits (waited ops excluded)
--   data_wait_ns BIGINT     -- host data_wait spans
--   gap_ns, gap_p2p_ns, gap_coll_ns BIGINT  -- 0 (rank_step.sql takes the step residual)
--   send_min_ns BIGINT, sends BIGINT, recv_min_ns BIGINT  -- fastest send / receive span, send count
--   n_events BIGINT
--   first_start_ns, last_end_ns BIGINT  -- the first event's start, the last end (rank_step.sql's step edges)
CREATE OR REPLACE TEMP MACRO flat_peer_step(coded) AS TABLE
SELECT rank, step, peer,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role <= 3), 0)::BIGINT AS compute_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 0), 0)::BIGINT AS forward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 1), 0)::BIGINT AS backward_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 2), 0)::BIGINT AS optimizer_ns,
    0::BIGINT AS nested_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE comm AND role IN (8, 12, 13, 14)), 0)::BIGINT AS recv_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE comm AND role IN (6, 11)), 0)::BIGINT AS collective_ns,
    coalesce(sum(end_ns - start_ns) FILTER (WHERE role = 4), 0)::BIGINT AS data_wait_ns,
    0::BIGINT AS gap_ns, 0::BIGINT AS gap_p2p_ns, 0::BIGINT AS gap_coll_ns,
    min(end_ns - start_ns) FILTER (WHERE role = 7) AS send_min_ns,
    count(*) FILTER (WHERE role = 7) AS sends,
    min(end_ns - start_ns) FILTER (WHERE role = 8) AS recv_min_ns,
    count(*) AS n_events,
    min(start_ns) AS first_start_ns,
    max(end_ns) AS last_end_ns
FROM query_table(coded)
GROUP BY rank, step, peer
