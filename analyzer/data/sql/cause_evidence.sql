-- cause_evidence(ranks, span_gc): per rank and step of `ranks`, what the rank's time went to, in ms: its
-- rank_step phases beside the host evidence its tracer sampled (host_steps, tracer/host_sampler.py) and its
-- GPU's clock throttling (gpu, NVML). Read by analyzer/detect/cause.py for the culprit findings' ranks and
-- their stage peers. A measure the run lacks is NULL (older runs and imports have no host_steps).
--   ranks INT[]          -- the ranks to read (bound)
--   span_gc BOOLEAN      -- also sum `gc` host spans per rank-step (NDTimeline imports record GC as spans):
--                           only when host_steps has no rows for these ranks (it scans the events)
--   rank INT, step BIGINT, pp INT           -- who, when
--   step_ms DOUBLE       -- the rank's step time
--   own_ms DOUBLE        -- its own time: compute + data wait + host gaps (rank_step.own_s)
--   compute_ms, forward_ms, backward_ms, optimizer_ms DOUBLE  -- own compute (waits nested in it removed)
--   data_ms DOUBLE       -- data_wait spans
--   gap_ms DOUBLE        -- host time outside spans (before its ops were issued, at the step's edges)
--   wait_ms DOUBLE       -- time waiting for others: p2p receives and collectives
--   wall_ms DOUBLE       -- host_steps' window (previous record_step to this one)
--   cpu_ms DOUBLE        -- the training thread's CPU time in the window
--   delay_ms DOUBLE      -- the training thread's run delay (runnable, waiting for a CPU)
--   throttled_ms DOUBLE  -- the cgroup's CPU-quota throttled time
--   gc_ms DOUBLE         -- Python GC pauses (host_steps; else the `gc` spans when span_gc)
--   gpu_slowdown DOUBLE  -- share of the GPU's NVML samples inside the step with a slowdown reason set
--                           (SW power cap 0x4, HW slowdown 0x8, SW/HW thermal 0x20/0x40, power brake 0x80)
--   sm_clock_mhz DOUBLE  -- their mean SM clock
CREATE OR REPLACE TEMP MACRO cause_evidence(ranks, span_gc) AS TABLE
WITH _rs AS (
    SELECT rank, step, pp, start_ns, end_ns, 1e3 * step_time_s AS step_ms, 1e3 * own_s AS own_ms,
        1e3 * compute_s AS compute_ms, 1e3 * forward_s AS forward_ms, 1e3 * backward_s AS backward_ms,
        1e3 * optimizer_s AS optimizer_ms, 1e3 * data_wait_s AS data_ms, 1e3 * gap_s AS gap_ms,
        1e3 * (recv_s + collective_s) AS wait_ms
    FROM rank_step
    WHERE list_contains(ranks, rank) AND step_time_s > 0
), _host AS (
    SELECT rank, step, (end_ns - start_ns) / 1e6 AS wall_ms, CASE WHEN cpu_ns >= 0 THEN cpu_ns / 1e6 END AS cpu_ms,
        CASE WHEN run_delay_ns >= 0 THEN run_delay_ns / 1e6 END AS delay_ms,
        CASE WHEN throttled_ns >= 0 THEN throttled_ns / 1e6 END AS throttled_ms, gc_ns / 1e6 AS gc_ms
    FROM host_steps
    WHERE list_contains(ranks, rank)
), _gc_spans AS (
    SELECT rank, step, sum(end_ns - start_ns) / 1e6 AS gc_span_ms
    FROM events
    WHERE span_gc AND kind = 'host' AND name = 'gc' AND list_contains(ranks, rank)
    GROUP BY rank, step
), _gpu AS (
    SELECT r.rank, r.step, avg(CASE WHEN g.throttle_reasons >= 0 THEN
                                    CAST((g.throttle_reasons & 236) <> 0 AS DOUBLE) END) AS gpu_slowdown,
        avg(g.sm_clock_mhz) AS sm_clock_mhz
    FROM _rs r JOIN gpu g ON g.rank = r.rank AND g.ts_ns BETWEEN r.start_ns AND r.end_ns
    GROUP BY r.rank, r.step
)
SELECT r.rank, r.step, r.pp, r.step_ms, r.own_ms, r.compute_ms, r.forward_ms, r.backward_ms, r.optimizer_ms,
    r.data_ms, r.gap_ms, r.wait_ms, h.wall_ms, h.cpu_ms, h.delay_ms, h.throttled_ms,
    coalesce(h.gc_ms, s.gc_span_ms, CASE WHEN span_gc THEN 0.0 END) AS gc_ms, g.gpu_slowdown, g.sm_clock_mhz
FROM _rs r
LEFT JOIN _host h USING (rank, step)
LEFT JOIN _gc_spans s USING (rank, step)
LEFT JOIN _gpu g USING (rank, step)
ORDER BY r.rank, r.step
