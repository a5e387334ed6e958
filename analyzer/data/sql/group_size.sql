-- group_size(grp, dp, tp, cp, pp, world) -> BIGINT: how many ranks one instance of collective group `grp`
-- has (the instances of group_instance.sql; analyzer/data/group_instances.py group_members): dp spans dp x cp ranks
-- (the gradient group with context parallelism), tp, cp and pp their sizes, embedding the first and last
-- stage (one rank without pipeline parallelism), world every rank; NULL for any other group.
--   grp VARCHAR                      -- the collective's "group"
--   dp, tp, cp, pp INTEGER           -- the run's sizes (run.json topology)
--   world INTEGER                    -- ranks in the run's topology
CREATE OR REPLACE TEMP MACRO group_size(grp, dp, tp, cp, pp, world) AS
CASE grp
    WHEN 'dp' THEN dp * cp
    WHEN 'tp' THEN tp
    WHEN 'cp' THEN cp
    WHEN 'pp' THEN pp
    WHEN 'embedding' THEN least(pp, 2)
    WHEN 'world' THEN world
    ELSE NULL END::BIGINT
