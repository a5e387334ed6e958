-- stage_balance: per pipeline stage and step, the stage's median forward+backward compute against the
-- other stages' (stages hold equal numbers of layers, so they should take equal time).
--   step BIGINT, pp INT
--   stage_work_s DOUBLE   -- median over the stage's ranks
--   others_s DOUBLE       -- median of the other stages' medians
--   ratio DOUBLE
WITH _stage AS (
    SELECT step, pp, median(forward_s + backward_s) AS stage_work_s FROM rank_step GROUP BY ALL
)
SELECT a.step, a.pp, a.stage_work_s, median(b.stage_work_s) AS others_s,
    a.stage_work_s / nullif(median(b.stage_work_s), 0) AS ratio
FROM _stage a JOIN _stage b ON a.step = b.step AND a.pp <> b.pp
GROUP BY a.step, a.pp, a.stage_work_s
ORDER BY a.step, a.pp;
