"""Robust training: supervisor, heartbeats, checkpoints, self-checks, preflight and fault injection."""
