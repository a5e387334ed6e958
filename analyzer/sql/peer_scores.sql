-- peer_scores: each rank-step judged against the ranks doing the same work (same pipeline stage, hence
-- the same chunks; tensor-parallel groups included) with robust statistics (median, MAD).
--   rank INT, step BIGINT, pp INT, host VARCHAR
--   work_s DOUBLE, work_ratio DOUBLE, work_z DOUBLE   -- forward+backward compute vs stage peers
--   gap_s DOUBLE, gap_excess_s DOUBLE, gap_z DOUBLE   -- other_s (host gaps / launch delays) vs peers
--   tp_ratio DOUBLE                                   -- work vs the rank's own tensor-parallel group
-- Only rows with work_ratio >= $min_ratio or gap_excess_s >= $min_gap_s are returned (candidates).
WITH _rs AS (
    SELECT rank, step, pp, dp, host, forward_s + backward_s AS work_s, other_s AS gap_s FROM rank_step
), _med AS (
    SELECT step, pp, median(work_s) AS work_med, median(gap_s) AS gap_med FROM _rs GROUP BY ALL
), _mad AS (
    SELECT r.step, r.pp, median(abs(r.work_s - m.work_med)) AS work_mad,
           median(abs(r.gap_s - m.gap_med)) AS gap_mad
    FROM _rs r JOIN _med m USING (step, pp) GROUP BY ALL
), _tp AS (
    SELECT step, pp, dp, median(work_s) AS tp_med FROM _rs GROUP BY ALL
)
SELECT r.rank, r.step, r.pp, r.host, r.work_s,
    r.work_s / nullif(m.work_med, 0) AS work_ratio,
    (r.work_s - m.work_med) / greatest(1.4826 * d.work_mad, 1e-3 * m.work_med, 1e-9) AS work_z,
    r.gap_s, r.gap_s - m.gap_med AS gap_excess_s,
    (r.gap_s - m.gap_med) / greatest(1.4826 * d.gap_mad, 1e-6) AS gap_z,
    r.work_s / nullif(t.tp_med, 0) AS tp_ratio
FROM _rs r
JOIN _med m USING (step, pp)
JOIN _mad d USING (step, pp)
JOIN _tp t USING (step, pp, dp)
WHERE r.work_s / nullif(m.work_med, 0) >= $min_ratio OR r.gap_s - m.gap_med >= $min_gap_s;
