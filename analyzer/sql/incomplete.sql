-- Incomplete data: the rank-steps a damaged events or steps segment may have held (store.py,
-- Store.incomplete_ranges, registered as _incomplete_ranges: rank, first_step, last_step) are kept out
-- of what the detectors read, so a rank with part of its events missing is never judged slow or fast.
-- Statements (split on lines holding only ';'), formatted by event_pass.drop_incomplete:
--   {rank_step}: the rank-step table; its incomplete rows move to {rank_step_incomplete} (their steps
--                row is intact, so MFU still counts their tokens and times);
--   {peer_step}: per (rank, step, peer) rows: both ends of a p2p link must be complete;
--   {collectives}: collective instances with a member among the incomplete rank-steps (a missing
--                member would make another look last or the transfer look slow); {instance}/{join} as
--                in the event pass (layout.instance_sql) over the groups the analyzer matches.
CREATE OR REPLACE TEMP TABLE {rank_step_incomplete} AS
SELECT * FROM {rank_step} r
WHERE EXISTS (SELECT 1 FROM _incomplete_ranges i WHERE i.rank = r.rank AND r.step BETWEEN i.first_step AND i.last_step)
;
DELETE FROM {rank_step} r
WHERE EXISTS (SELECT 1 FROM _incomplete_ranges i WHERE i.rank = r.rank AND r.step BETWEEN i.first_step AND i.last_step)
;
DELETE FROM {peer_step} p
WHERE EXISTS (SELECT 1 FROM _incomplete_ranges i
              WHERE (i.rank = p.rank OR i.rank = p.peer) AND p.step BETWEEN i.first_step AND i.last_step)
;
DELETE FROM {collectives} c
WHERE EXISTS (
    SELECT 1 FROM (
        SELECT "group", {instance} AS instance, first_step, last_step
        FROM (SELECT r.rank, r.first_step, r.last_step, g.name AS "group"
              FROM _incomplete_ranges r CROSS JOIN (VALUES {groups}) g(name))
        {join}
    ) k
    WHERE k."group" = c."group" AND k.instance = c.instance AND c.step BETWEEN k.first_step AND k.last_step)
