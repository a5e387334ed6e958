"""`megascope watch`: the live watcher beside a running job (watcher.py), its windows over the recent
steps, the open-findings tracker, the sinks and metrics it reports to. What it wrote is read back by
views/live_findings.py (the dashboard's live findings)."""
