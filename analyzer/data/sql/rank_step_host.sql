-- rank_step_host: where each rank-step's host time went (host_steps, sampled by megascope's tracer:
-- tracer/host_sampler.py) beside the rank-step summary's keys, for the heatmap's cause measures
-- (views/heatmap.py): the slow rank's column shows why. Only rank-steps with a host sample (imports
-- have none); a measure the host could not read (-1: no schedstat, no cgroup cpu.stat) is NULL.
--   rank INT, step BIGINT, dp INT, pp INT, tp INT, host VARCHAR  -- the summary's keys (heatmap rows)
--   gc_s DOUBLE         -- Python garbage-collection pauses in the step (gc.callbacks)
--   run_delay_s DOUBLE  -- the training thread runnable but waiting for a CPU (/proc/self/task/*/schedstat)
--   throttled_s DOUBLE  -- the process's cgroup throttled by its CPU quota (cpu.stat)
--   cpu_s DOUBLE        -- the training thread's CPU time in the step
SELECT s.rank, s.step, s.dp, s.pp, s.tp, s.host, h.gc_ns / 1e9 AS gc_s,
    CASE WHEN h.run_delay_ns >= 0 THEN h.run_delay_ns / 1e9 END AS run_delay_s,
    CASE WHEN h.throttled_ns >= 0 THEN h.throttled_ns / 1e9 END AS throttled_s,
    CASE WHEN h.cpu_ns >= 0 THEN h.cpu_ns / 1e9 END AS cpu_s
FROM rank_step_summary s
JOIN host_steps h USING (rank, step)
