-- heatmap: a metric over (row group x step), aggregated and downsampled in DuckDB.
-- Formatted placeholders (validated in heatmap.py): {source} (the rank-step summary), {metric_expr},
-- {row_key}, {agg}, {max_rows}, {max_cols}.
--   row_bucket BIGINT  -- 0..max_rows-1 (row groups folded into buckets when there are more)
--   col_bucket BIGINT  -- 0..max_cols-1 (steps folded into buckets)
--   row_label VARCHAR  -- first group key of the bucket (and the last when it holds several)
--   first_step BIGINT  -- first step of the column bucket
--   value DOUBLE       -- {agg} of the metric over the bucket (max for times: a straggler stays visible)
-- The big source is read once for the cells (streaming, one integer key per cell); the distinct keys
-- and steps come from narrow scans of one column each, and the labels from those small tables.
WITH _rows AS (
    SELECT row_key, row_number() OVER (ORDER BY row_key) - 1 AS row_idx, count(*) OVER () AS n_rows
    FROM (SELECT DISTINCT {row_key} AS row_key FROM {source})
), _row_buckets AS (
    SELECT row_key, row_idx * {max_rows} // greatest(n_rows, {max_rows}) AS row_bucket FROM _rows
), _cols AS (
    SELECT step, row_number() OVER (ORDER BY step) - 1 AS col_idx, count(*) OVER () AS n_cols
    FROM (SELECT DISTINCT step FROM {source})
), _col_buckets AS (
    SELECT step, col_idx * {max_cols} // greatest(n_cols, {max_cols}) AS col_bucket FROM _cols
), _values AS (
    SELECT r.row_bucket * {max_cols} + c.col_bucket AS cell, {agg}({metric_expr}) AS value
    FROM {source} x JOIN _row_buckets r ON x.{row_key} = r.row_key JOIN _col_buckets c ON x.step = c.step
    GROUP BY cell
), _row_labels AS (
    SELECT row_bucket, min(row_key)::VARCHAR || CASE WHEN min(row_key) <> max(row_key)
                                                     THEN '..' || max(row_key)::VARCHAR ELSE '' END AS row_label
    FROM _row_buckets GROUP BY row_bucket
), _col_labels AS (
    SELECT col_bucket, min(step) AS first_step FROM _col_buckets GROUP BY col_bucket
)
SELECT v.cell // {max_cols} AS row_bucket, v.cell % {max_cols} AS col_bucket, rl.row_label, cl.first_step, v.value
FROM _values v
JOIN _row_labels rl ON rl.row_bucket = v.cell // {max_cols}
JOIN _col_labels cl ON cl.col_bucket = v.cell % {max_cols}
ORDER BY row_bucket, col_bucket;
