-- rank_step_of_edge(summaries): the run's rank_step rows from the ranks' own summaries (the tracer's
-- edge_rank_step table, tracer/edge_summary.py: rank_step_of's columns less the topology's, computed
-- by each rank with the same macros), joined to `topology`: rank_step.sql's columns in its order, then
-- `final` (event_pass.from_edge_summaries checks the coverage on it, then drops it).
--   summaries VARCHAR   -- name of the edge_rank_step relation
-- Columns: rank_step.sql's, final BOOLEAN.
CREATE OR REPLACE TEMP MACRO rank_step_of_edge(summaries) AS TABLE
SELECT s.rank, s.step, t.pp, t.dp, t.tp, t.host, s.* EXCLUDE (rank, step)
FROM query_table(summaries) s
JOIN topology t USING (rank)
