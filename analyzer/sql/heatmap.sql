-- heatmap: a metric over (row group x step), aggregated and downsampled in DuckDB.
-- Formatted placeholders (validated in heatmap.py): {source} (the rank-step summary), {metric_expr}, {row_key}, {agg}, {max_rows}, {max_cols}.
--   row_bucket BIGINT  -- 0..max_rows-1 (row groups folded into buckets when there are more)
--   col_bucket BIGINT  -- 0..max_cols-1 (steps folded into buckets)
--   row_label VARCHAR  -- first group key of the bucket (and the last when it holds several)
--   first_step BIGINT  -- first step of the column bucket
--   value DOUBLE       -- {agg} of the metric over the bucket (max for times: a straggler stays visible)
WITH _cells AS (
    SELECT {row_key} AS row_key, step, {metric_expr} AS v FROM {source}
), _rows AS (
    SELECT row_key, row_number() OVER (ORDER BY row_key) - 1 AS row_idx, count(*) OVER () AS n_rows
    FROM (SELECT DISTINCT row_key FROM _cells)
), _cols AS (
    SELECT step, row_number() OVER (ORDER BY step) - 1 AS col_idx, count(*) OVER () AS n_cols
    FROM (SELECT DISTINCT step FROM _cells)
)
SELECT r.row_idx * {max_rows} // greatest(r.n_rows, {max_rows}) AS row_bucket,
       c.col_idx * {max_cols} // greatest(c.n_cols, {max_cols}) AS col_bucket,
       min(r.row_key)::VARCHAR || CASE WHEN min(r.row_key) <> max(r.row_key) THEN '..' || max(r.row_key)::VARCHAR ELSE '' END AS row_label,
       min(c.step) AS first_step,
       {agg}(v) AS value
FROM _cells x JOIN _rows r USING (row_key) JOIN _cols c USING (step)
GROUP BY ALL
ORDER BY row_bucket, col_bucket;
