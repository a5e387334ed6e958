-- link_rows: the rows of the link view (views/links.py): each link of link_step.sql in its place, grouped
-- by host pair (links crossing hosts first: the network between hosts is what the view is for), and
-- folded into at most $max_rows rows when there are more links (neighbours in that order share a row).
--   $max_rows BIGINT       -- rows drawn at most
--   a INT, b INT           -- the link's ends
--   host_pair VARCHAR      -- link_step.host_pair
--   cross_host BOOLEAN     -- the ends are on different hosts
--   row_bucket BIGINT      -- 0..max_rows-1: the row that draws the link
CREATE OR REPLACE TEMP TABLE link_rows AS
WITH _links AS (
    SELECT a, b, host_pair, cross_host,
        row_number() OVER (ORDER BY cross_host DESC, host_pair, a, b) - 1 AS row_idx, count(*) OVER () AS n_rows
    FROM (SELECT DISTINCT a, b, host_pair, cross_host FROM link_step)
)
SELECT a, b, host_pair, cross_host, row_idx * $max_rows // greatest(n_rows, $max_rows) AS row_bucket
FROM _links;
