-- link_cells: link_step.sql folded into the link view's cells (views/links.py): rows of link_rows.sql x at
-- most $max_cols columns of steps, each metric folded so a bad cell stays visible (the longest wait and
-- transfer, the lowest rate).
--   $max_cols BIGINT        -- columns drawn at most
--   row_bucket BIGINT       -- link_rows.row_bucket
--   col_bucket BIGINT       -- 0..max_cols-1 (steps folded into buckets when there are more)
--   first_step BIGINT       -- first step of the column
--   wait_s DOUBLE           -- max of link_step.wait_s over the cell
--   transfer_s DOUBLE       -- max of link_step.transfer_s over the cell
--   bytes_per_s DOUBLE      -- min of link_step.bytes_per_s over the cell
WITH _steps AS (
    SELECT step, row_number() OVER (ORDER BY step) - 1 AS col_idx, count(*) OVER () AS n_cols
    FROM (SELECT DISTINCT step FROM link_step)
), _cols AS (
    SELECT step, col_idx * $max_cols // greatest(n_cols, $max_cols) AS col_bucket FROM _steps
)
SELECT r.row_bucket, c.col_bucket, min(s.step) AS first_step, max(s.wait_s) AS wait_s,
    max(s.transfer_s) AS transfer_s, min(s.bytes_per_s) AS bytes_per_s
FROM link_step s JOIN link_rows r USING (a, b) JOIN _cols c USING (step)
GROUP BY r.row_bucket, c.col_bucket
ORDER BY r.row_bucket, c.col_bucket;
