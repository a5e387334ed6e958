-- event_role(kind, name, peer, wait_suffix) -> UTINYINT: one small integer per event, so the timeline
-- window sorts narrow rows and the aggregates compare integers; both event-pass variants
-- (event_pass.sql, event_pass_flat.sql) code roles with it, so they must agree.
--   0-3 compute (forward, backward, optimizer, other), 4 data_wait, 5 other host, 6 collective,
--   7 send, 8 recv, 9 other p2p, 10 other, 11-14 `<op>.wait` of a 6-9 op (its role + 5)
--   kind, name VARCHAR, peer INT: the event's columns (tracer.schema.EVENTS)
--   wait_suffix VARCHAR: the name suffix of `<op>.wait` host spans (tracer.schema.WAIT_SUFFIX, bound)
CREATE OR REPLACE TEMP MACRO event_role(kind, name, peer, wait_suffix) AS
CASE WHEN kind = 'compute' THEN (CASE name WHEN 'forward' THEN 0 WHEN 'backward' THEN 1
                                           WHEN 'optimizer' THEN 2 ELSE 3 END)
     WHEN kind = 'host' THEN (CASE WHEN name = 'data_wait' THEN 4
                                   WHEN NOT ends_with(name, wait_suffix) THEN 5
                                   WHEN peer < 0 THEN 11 WHEN starts_with(name, 'send') THEN 12
                                   WHEN starts_with(name, 'recv') THEN 13 ELSE 14 END)
     WHEN kind = 'collective' THEN 6
     WHEN kind = 'p2p' THEN (CASE WHEN starts_with(name, 'send') THEN 7
                                  WHEN starts_with(name, 'recv') THEN 8 ELSE 9 END)
     ELSE 10 END::UTINYINT
