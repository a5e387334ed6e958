-- mfu_per_step: job-wide throughput per step.
--   step BIGINT
--   step_time_s DOUBLE   -- last rank's end - first rank's start of the step
--   tokens_per_s DOUBLE  -- tokens of all data-parallel replicas / step time
--   mfu DOUBLE           -- model FLOPs / (step time * world * peak FLOP/s per device), 0..1
-- Parameters: $world, $peak, $replica_size (tp*pp: ranks that report the same replica's tokens).
SELECT step,
    (max(end_ns) - min(start_ns)) / 1e9 AS step_time_s,
    sum(tokens) / $replica_size / ((max(end_ns) - min(start_ns)) / 1e9) AS tokens_per_s,
    max(model_flops) / ((max(end_ns) - min(start_ns)) / 1e9 * $world * $peak) AS mfu,
    count(*) AS ranks_reporting
FROM rank_step
GROUP BY step
ORDER BY step;
