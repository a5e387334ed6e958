-- breakdown: step-time breakdown per rank and step (seconds; the parts sum to the step time).
--   compute_s DOUBLE       -- own compute (compute spans minus the communication waits inside them)
--   exposed_comm_s DOUBLE  -- collective time not hidden behind compute (sync spans, `.wait` spans of
--                             async ops, waits inside compute; capped by what is left)
--   bubble_s DOUBLE        -- pipeline bubble: waiting on p2p receives (and p2p waits) from the neighbour stage
--   data_wait_s DOUBLE     -- waiting for the input batch
--   other_s DOUBLE         -- the rest: host gaps, launch delays, untraced work
-- Overlapping spans (async ops, receives posted ahead) are taken in this order, each capped by what
-- the previous parts leave of the step: compute, data wait, bubble, exposed communication.
-- Parameters: $first, $last (step range, inclusive).
WITH _parts AS (
    SELECT step, rank, step_time_s, least(compute_s, step_time_s) AS compute_s,
        least(data_wait_s, greatest(step_time_s - compute_s, 0)) AS data_wait_s, recv_s, collective_s
    FROM rank_step
    WHERE step BETWEEN $first AND $last
), _bubble AS (
    SELECT *, least(recv_s, greatest(step_time_s - compute_s - data_wait_s, 0)) AS bubble_s FROM _parts
), _exposed AS (
    SELECT *, least(collective_s, greatest(step_time_s - compute_s - data_wait_s - bubble_s, 0)) AS exposed_comm_s
    FROM _bubble
)
SELECT step, rank, compute_s, exposed_comm_s, bubble_s, data_wait_s,
    greatest(step_time_s - compute_s - data_wait_s - bubble_s - exposed_comm_s, 0) AS other_s
FROM _exposed
ORDER BY step, rank;
