-- diff_phase_steps: per pipeline stage, step and phase, the seconds the stage's ranks spent in the phase,
-- summed over the stage's ranks, and how many of its ranks the step has: what a run diff compares
-- (views/run_diff.py divides: seconds a step per rank, on a stage or job-wide).
--   pp INT          -- pipeline stage
--   step BIGINT
--   phase VARCHAR   -- a rank_step column: forward, backward, optimizer, data wait, host gaps (gap_s),
--                      pipeline wait (recv_s), collective wait (collective_s); or one op kind,
--                      '<group> <name>' ('dp grad_reduce_scatter', 'pp recv_forward', and the host
--                      `.wait` spans of async ones, 'dp grad_reduce_scatter.wait'): its spans' time
--                      (start to end, every op of the kind in the step; an async op's includes the
--                      time it hid behind compute)
--   seconds DOUBLE  -- summed over the stage's ranks (a rank without the op in the step adds 0)
--   ranks BIGINT    -- the stage's ranks with the step in rank_step (complete rank-steps only)
-- Op kinds are counted on complete rank-steps only (a semi join on rank_step): the same rank-steps
-- as the columns, so a damaged segment's steps move neither.
WITH _ranks AS (
    SELECT pp, step, count(*) AS ranks FROM rank_step GROUP BY pp, step
), _columns AS (
    UNPIVOT (SELECT pp, step, forward_s AS "forward", backward_s AS "backward", optimizer_s AS "optimizer",
                    data_wait_s AS "data wait", gap_s AS "host gaps", recv_s AS "pipeline wait",
                    collective_s AS "collective wait"
             FROM rank_step)
    ON COLUMNS(* EXCLUDE (pp, step)) INTO NAME phase VALUE seconds
), _ops AS (
    SELECT t.pp, e.step, trim(e."group" || ' ' || e.name) AS phase, sum(e.end_ns - e.start_ns) / 1e9 AS seconds
    FROM events e
    SEMI JOIN rank_step r ON e.rank = r.rank AND e.step = r.step
    JOIN topology t ON e.rank = t.rank
    WHERE e.kind IN ('collective', 'p2p') OR (e.kind = 'host' AND e.name LIKE '%.wait')
    GROUP BY ALL
), _all AS (
    SELECT pp, step, phase, sum(seconds) AS seconds FROM _columns GROUP BY ALL
    UNION ALL SELECT pp, step, phase, seconds FROM _ops
)
SELECT a.pp::INT AS pp, a.step, a.phase, a.seconds, r.ranks
FROM _all a JOIN _ranks r USING (pp, step)
ORDER BY a.pp, a.step, a.phase;
