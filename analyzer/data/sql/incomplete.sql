-- incomplete_collectives(ranges, groups, dp, tp, cp, renumber): the collective instances a damaged segment may
-- have hidden a member of: per group the analyzer matches and per incomplete rank-step range, the
-- rank's instance of that group and the steps. Incomplete data (store.py, Store.incomplete_ranges,
-- registered as _incomplete_ranges) is kept out of what the detectors read, so a rank with part of its
-- events missing is never judged slow or fast: event_pass.drop_incomplete moves the ranges' rank_step
-- rows aside, deletes their p2p rows (either end of a link) and the collective instances listed here
-- (a missing member would make another look last or the transfer look slow).
--   ranges VARCHAR           -- name of the (rank INT, first_step BIGINT, last_step BIGINT) relation
--   groups VARCHAR[]         -- the groups the analyzer matches (layout.MATCHED_GROUPS)
--   dp, tp, cp, renumber     -- the layout, as group_instance.sql takes it
--   "group" VARCHAR, instance BIGINT, first_step BIGINT, last_step BIGINT
CREATE OR REPLACE TEMP MACRO incomplete_collectives(ranges, groups, dp, tp, cp, renumber) AS TABLE
SELECT g.name AS "group", group_instance(g.name, r.rank, dp, tp, cp, renumber) AS instance,
    r.first_step, r.last_step
FROM query_table(ranges) r
CROSS JOIN (SELECT unnest(groups) AS name) g
