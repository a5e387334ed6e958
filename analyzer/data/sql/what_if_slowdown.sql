-- what_if_slowdown: how much slower a straggler's own forward and backward compute were than its
-- stage peers', over a finding's steps (the what-if divides its spans by this, what_if._unslowed).
--   forward, backward DOUBLE  -- median over the culprit's rank-steps of own / the median of its stage
--                                peers' (same pp, other data-parallel replicas) that step; NULL without peers
--   n BIGINT                  -- rank-steps judged
-- Parameters: $ranks (the culprit's ranks, a list), $first, $last (the finding's steps).
WITH me AS (
    SELECT rank, step, pp, dp, forward_s, backward_s FROM rank_step
    WHERE list_contains($ranks, rank) AND step BETWEEN $first AND $last
), peers AS (
    SELECT r.step, r.pp, median(r.forward_s) AS fwd, median(r.backward_s) AS bwd
    FROM rank_step r
    WHERE r.step BETWEEN $first AND $last AND r.pp IN (SELECT pp FROM me) AND r.dp NOT IN (SELECT dp FROM me)
    GROUP BY r.step, r.pp
)
SELECT median(me.forward_s / p.fwd) FILTER (WHERE p.fwd > 0) AS forward,
       median(me.backward_s / p.bwd) FILTER (WHERE p.bwd > 0) AS backward,
       count(*) AS n
FROM me JOIN peers p USING (step, pp);
