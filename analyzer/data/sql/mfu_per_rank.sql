-- mfu_per_rank: each rank's own step time and the MFU it would give if every rank ran at its pace.
--   rank INT, step BIGINT, step_time_s DOUBLE, mfu DOUBLE
-- Parameters: $world, $peak.
SELECT rank, step, step_time_s,
    model_flops / (step_time_s * $world * $peak) AS mfu
FROM rank_step
ORDER BY rank, step;
