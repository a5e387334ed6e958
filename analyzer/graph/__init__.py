"""One step as a dependency graph of its spans: the graph, its critical path, spans split at their
waits, and the what-if replays that re-time the graph without a finding's slowdown."""
