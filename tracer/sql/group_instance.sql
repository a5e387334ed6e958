-- group_instance(grp, rank, dp, tp, cp, renumber) -> BIGINT: the instance of collective group `grp`
-- that `rank` belongs to (analyzer/data/group_instances.py's rule): dp peers share (pp, tp) (with context parallelism
-- the gradient group spans dp x cp ranks), tp peers share (pp, dp, cp), cp peers (pp, dp, tp), pp and
-- embedding peers (dp, cp, tp), world is one instance; NULL for any other group (not matched).
--   grp VARCHAR, rank INT          -- the event's "group" and rank
--   dp, tp, cp INTEGER             -- the run's sizes (run.json topology; cp = 1 without context parallelism)
--   renumber INTEGER[]             -- NULL when ranks are in Megatron order (rank = tp_c + tp * (cp_c + cp *
--                                     (dp_c + dp * pp_c)): the key is rank arithmetic, no join per event);
--                                     else renumber[rank + 1] is the Megatron rank of `rank`'s coordinates
--                                     (event_pass.LayoutParams), from which the same arithmetic reads them
CREATE OR REPLACE TEMP MACRO group_instance(grp, rank, dp, tp, cp, renumber) AS
CASE grp
    WHEN 'dp' THEN (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) // (dp * cp * tp) * tp
                   + (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) % tp
    WHEN 'tp' THEN (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) // tp
    WHEN 'pp' THEN (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) % (dp * cp * tp)
    WHEN 'embedding' THEN (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) % (dp * cp * tp)
    WHEN 'cp' THEN (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) // (cp * tp) * tp
                   + (CASE WHEN renumber IS NULL THEN rank ELSE renumber[rank + 1] END) % tp
    WHEN 'world' THEN 0
    ELSE NULL END::BIGINT
