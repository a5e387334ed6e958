-- events_window: the events of a step range (optionally some ranks) with a stable event_id.
--   event_id BIGINT  -- rank << 40 | (step + {step_bias}) << 16 | position of the event in its rank-step (by
--                       issue time): the same event gets the same id whatever window or rank filter is
--                       asked for; >= 0 and decodable for steps >= -{step_bias} (events before the first
--                       step, e.g. at step -1, from init or importers), see step_graph.event_id_parts
--   plus every events column (rank, step, microbatch, chunk, name, kind, group, seq, peer, bytes,
--   issue_ns, start_ns, end_ns)
-- Parameters: $first, $last, $limit; formatted: {source} (the events view or the chosen ranks'
-- segments), {rank_filter} ('' or 'AND rank IN (...)'), {step_bias} (step_graph.EVENT_ID_STEP_BIAS).
SELECT (CAST(rank AS BIGINT) << 40) + ((step + {step_bias}) << 16)
       + row_number() OVER (PARTITION BY rank, step ORDER BY issue_ns, start_ns, kind, name, microbatch, seq) - 1
       AS event_id, *
FROM {source}
WHERE step BETWEEN $first AND $last {rank_filter}
ORDER BY rank, step, issue_ns, start_ns
LIMIT $limit;
