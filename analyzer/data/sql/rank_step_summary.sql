-- rank_step_summary_of(rank_step, late, first_step): the rows of the per-rank-step summary persisted in
-- RUN/analysis/rank_step (summary_cache.py; the heatmap reads them as the view `rank_step_summary`).
--   rank_step VARCHAR      -- name of a rank_step relation (rank_step.sql)
--   late VARCHAR           -- name of its late arrivals (arrivals.sql)
--   first_step BIGINT      -- only steps >= first_step (an extension of a live run)
--   the columns of rank_step, then
--   late_count BIGINT      -- collectives the rank arrived at last (0 when none)
--   lateness_s DOUBLE      -- their summed lateness (NULL when none)
CREATE OR REPLACE TEMP MACRO rank_step_summary_of(rank_step, late, first_step) AS TABLE
SELECT rs.*, coalesce(la.late_count, 0)::BIGINT AS late_count, la.lateness_s
FROM query_table(rank_step) rs LEFT JOIN query_table(late) la USING (rank, step)
WHERE rs.step >= first_step
