-- breakdown: step-time breakdown per rank and step (seconds; the parts sum to the step time).
--   compute_s DOUBLE       -- compute spans
--   exposed_comm_s DOUBLE  -- collective time not hidden behind compute (spans, capped by what is left)
--   bubble_s DOUBLE        -- pipeline bubble: waiting on p2p receives from the neighbour stage
--   data_wait_s DOUBLE     -- waiting for the input batch
--   other_s DOUBLE         -- the rest: host gaps, launch delays, untraced work
-- Parameters: $first, $last (step range, inclusive).
SELECT step, rank,
    compute_s,
    least(collective_s, greatest(step_time_s - compute_s - recv_s - data_wait_s, 0)) AS exposed_comm_s,
    least(recv_s, greatest(step_time_s - compute_s - data_wait_s, 0)) AS bubble_s,
    data_wait_s,
    other_s
FROM rank_step
WHERE step BETWEEN $first AND $last
ORDER BY step, rank;
