"""A node of a multi-node job is lost and does not come back: which one, and the one line that says so.

When every process of a node dies (the host is gone, killed, out of memory), the other nodes' ranks
fail in their next collective ("Connection reset by peer"), their elastic agents restart the worker
group and wait in the rendezvous for the full set of nodes again. A node started again with the same
command joins that rendezvous and the job continues from its latest checkpoint; when none comes within
--rdzv-timeout, torch raises RendezvousTimeoutError. The ranks of the lost node are the ones that ended
without a last beat: a rank that fails or finishes writes `failed` or `done` as its final heartbeat
(trainer/robust/heartbeat.py), a killed one cannot.
"""

from __future__ import annotations

import time
from typing import Any

ENDED = ("done", "failed")


def lost_ranks(beats: dict[int, dict[str, Any]], this_host: str) -> dict[str, list[int]]:
    """host -> its ranks, for the hosts other than this one none of whose ranks wrote a final heartbeat
    (one rank killed on a host whose other ranks failed cleanly is a dead rank, not a lost node)."""
    by_host: dict[str, list[int]] = {}
    for rank, beat in sorted(beats.items()):
        by_host.setdefault(str(beat.get("host", "?")), []).append(rank)
    return {host: ranks for host, ranks in by_host.items()
            if host != this_host and all(beats[r].get("status") not in ENDED for r in ranks)}


def lost_node_record(beats: dict[int, dict[str, Any]], lost: dict[str, list[int]], attempt: int,
                     nodes: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `node_lost` incident for the hosts in `lost` (lost_ranks): which node, which ranks, the last
    heartbeat (time, step) and how long ago it was. `nodes`: the roll call's records (node rank -> host)."""
    node_of = {str(n.get("host")): r for r, n in (nodes or {}).items()}
    ranks = sorted(r for rs in lost.values() for r in rs)
    last_time = max((float(beats[r].get("time", 0)) for r in ranks), default=0.0)
    step = max((int(beats[r].get("step", -1)) for r in ranks), default=-1)
    names = [f"node {node_of[h]} ({h})" if h in node_of else h for h in sorted(lost)]
    when = time.strftime("%H:%M:%S", time.localtime(last_time)) if last_time else "?"
    return {"kind": "node_lost", "ranks": ranks, "hosts": sorted(lost), "attempt": attempt,
            "nodes": sorted(node_of[h] for h in lost if h in node_of), "step": step,
            "last_heartbeat": last_time, "silent_s": round(time.time() - last_time, 1) if last_time else None,
            "detail": f"{', '.join(names)} lost: ranks {', '.join(map(str, ranks))} ended without a final "
                      f"heartbeat (the last at {when}, step {step})"}


def node_lost_incident(beats: dict[int, dict[str, Any]], nodes: dict[int, dict[str, Any]], this_host: str,
                       timeout_s: float, checkpoint_step: int | None) -> tuple[dict[str, Any], str]:
    """After the rendezvous timed out: the `node_lost` incident (RUN/incidents.jsonl) and the driver's
    one line. `nodes`: the roll call's records; `beats`: the ranks' latest heartbeats."""
    lost = lost_ranks(beats, this_host)
    attempt = max((int(b.get("restart", 0)) for b in beats.values()), default=0)
    incident = lost_node_record(beats, lost, attempt, nodes)
    resume = (f"from its checkpoint at step {checkpoint_step}" if checkpoint_step is not None
              else "(no complete checkpoint yet: it starts over)")
    what = incident["detail"] if lost else "a node was lost (no rank's last heartbeat names it)"
    line = (f"{what}, and not back within --rdzv-timeout {timeout_s:g} s; to continue, run the same command "
            f"with --resume on every node {resume}")
    return {**incident, "detail": line}, line
