"""The episodes of a network finding, gathered across the watcher's windows (tracker.py): each window
names the episodes it holds; the open finding keeps their union, so its count grows as they come."""

from __future__ import annotations

from megascope.analyzer.findings import Finding


def episodes_of(f: Finding) -> list[tuple[int, int]]:
    """[first, last] step of each episode, from either detector's evidence (lost time: [a, b] pairs;
    flaps: {"first_step", "last_step"} objects), or the finding's steps as one episode."""
    out = []
    for e in f.evidence.get("episodes") or []:
        a, b = (e["first_step"], e["last_step"]) if isinstance(e, dict) else e
        out.append((int(a), int(b)))
    return out or [(int(f.steps[0]), int(f.steps[1]))]


def union(episodes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or adjacent episodes as one (a window clips an episode's edge: 38-40, then 38-41)."""
    out: list[list[int]] = []
    for a, b in sorted(episodes):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def gather(known: Finding, new: Finding) -> bool:
    """Fold a window's network finding into the open one with the same ranks; True when the episode
    count grew (the watcher announces an update). The open finding keeps its onset, takes the union of
    the episodes, the latest evidence and the worse severity, and is a network_flap from its second
    episode on; its summary gets a sentence with the live count."""
    before = episodes_of(known)
    merged = union(before + episodes_of(new))
    known.steps = (min(known.steps[0], merged[0][0]), max(known.steps[1], merged[-1][1]))
    known.severity = max(known.severity, new.severity)
    known.evidence = dict(new.evidence, episodes=[list(e) for e in merged], episode_count=len(merged))
    if len(merged) > 1:
        known.kind = "network_flap"
    a, b = merged[-1]
    known.summary = (new.summary.split(" Live: ")[0] + f" Live: {len(merged)} episode(s) since step "
                     f"{known.steps[0]}, the latest at steps {a}-{b}.")
    return len(merged) > len(union(before))
