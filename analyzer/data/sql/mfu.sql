-- mfu_per_step: job-wide throughput per step.
--   step BIGINT
--   step_time_s DOUBLE   -- last rank's end - first rank's start of the step
--   tokens_per_s DOUBLE  -- tokens of all data-parallel replicas / step time
--   mfu DOUBLE           -- model FLOPs / (step time * world * peak FLOP/s per device), 0..1
-- Parameters: $world, $peak, $replica_size (tp*pp: ranks that report the same replica's tokens).
-- Reads rank_step and rank_step_incomplete (rank-steps whose events a damaged segment may have held:
-- their steps row, all this needs, is intact). Tokens are scaled by topology ranks / ranks reporting, so a
-- rank whose steps row is missing (damaged segment, a rank a step behind in a live run) does not
-- show as a throughput dip; with every rank reporting the scale is 1.
SELECT step,
    (max(end_ns) - min(start_ns)) / 1e9 AS step_time_s,
    sum(tokens) / $replica_size * (SELECT count(*) FROM topology) / count(*) / ((max(end_ns) - min(start_ns)) / 1e9) AS tokens_per_s,
    max(model_flops) / ((max(end_ns) - min(start_ns)) / 1e9 * $world * $peak) AS mfu,
    count(*) AS ranks_reporting
FROM (SELECT step, start_ns, end_ns, tokens, model_flops FROM rank_step
      UNION ALL SELECT step, start_ns, end_ns, tokens, model_flops FROM rank_step_incomplete)
GROUP BY step
ORDER BY step;
