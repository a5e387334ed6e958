"""`megascope watch`: the live watcher beside a running job (watcher.py), its windows over the recent
steps, the open-findings tracker, the sinks and metrics it reports to, and the fold of its records the
dashboard shows (live.py)."""
