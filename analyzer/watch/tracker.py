"""Which findings are open: each is announced once when it appears and once when it ends.

A finding is known by its kind and ranks. In a sliding window the same straggler comes back on every
tick with its steps clipped to the window; the tracker keeps the onset of the first sighting and
follows the last affected step. It ends when its last affected step falls more than `hold` complete
steps behind, reported by the window or not (a straggler that recovered at step 20 is still in a
window reaching step 30, with steps [.., 20]; one the window missed for a few noisy steps is not over).

The network between two hosts is one finding however its windows name it: a window holds one episode
of a link that flaps every few seconds (a `slow_link`), the next window the next episode. Live, the
episodes are gathered into the open finding (`network_flap` from its second episode on), announced as
an `update` whenever their count grows, and it stays open for `network_hold` steps after its last
episode (live_episodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megascope.analyzer.findings import NETWORK_KINDS, Finding
from megascope.analyzer.settings import StragglerConfig
from megascope.analyzer.watch.live_episodes import gather

Key = tuple[str, tuple[int, ...]]


def key_of(finding: Finding) -> Key:
    """Its kind (the network's two kinds as one) and ranks."""
    kind = "network" if finding.kind in NETWORK_KINDS else finding.kind
    return kind, tuple(sorted(int(r) for r in finding.ranks))


@dataclass
class Change:
    event: str
    """'start', 'update' (a network finding counted another episode), 'end', or 'open_at_end' (still
    held when the run finished)."""
    finding: Finding
    at_step: int
    """The last complete step when the change was seen."""


@dataclass
class Tracker:
    end_after: int = StragglerConfig.max_gap + 1
    """Steps a finding's last affected step may lag the last judged step and still be news (a start; at
    the run's end, open_at_end): the straggler detector bridges gaps of up to max_gap unflagged steps
    (settings.StragglerConfig; the watcher passes its own setting's)."""
    hold: int = 16
    """Steps an open finding's last affected step may lag before it is over (>= end_after): the window's
    detectors may miss a straggler for a while under noise. Measured (a real dp4 run, a 3x straggler
    from step 60 of 200, the load-10 2-core box, window 32): ended at step 155 with its last affected
    step 144 and announced again at 164, while the whole run's verdict held it from 60 to the end;
    the watcher passes half its window."""
    network_hold: int = 128
    """Steps a network finding stays open after its last episode, and at least twice its longest gap
    between episodes: a link throttled 2 s in every 8 s flaps every ~80 steps of the lab's tiny job
    (~0.1 s a step; benchmarks/watch_network.py); ended after `hold` (16) it was announced and ended once
    per episode, 13 times in a run, never as one flap. The watcher passes four windows."""
    open: dict[Key, Finding] = field(default_factory=dict)
    seen: set[Key] = field(default_factory=set)
    """Every finding ever announced (a final verdict repeats none of them)."""

    def update(self, findings: list[Finding], at_step: int, since: int | None = None) -> list[Change]:
        """Compare one window's findings with the open ones; the changes, starts first. `since`: the
        step judged last (None: at_step): a finding whose last step is after it (less end_after) is news
        even when the window reaches well past it (a tracer's flush lands 30-50 steps at once: an episode
        of steps 38-41 judged at step 56 was dropped as old, and the first of 13 was announced 37 s late)."""
        fresh = (at_step if since is None else min(since, at_step)) - self.end_after
        current: dict[Key, Finding] = {}
        for f in findings:
            if f.kind == "hang" or f.steps[1] >= fresh:
                current.setdefault(key_of(f), f)
        changes: list[Change] = []
        for key, f in current.items():
            if key not in self.open:
                self.open[key] = f
                self.seen.add(key)
                changes.append(Change("start", f, at_step))
            elif key[0] == "network":
                if gather(self.open[key], f):
                    changes.append(Change("update", self.open[key], at_step))
            else:
                known = self.open[key]
                known.steps = (known.steps[0], max(known.steps[1], f.steps[1]))
                known.severity, known.evidence = f.severity, f.evidence
        for key in [k for k in self.open if k not in current]:
            if self.open[key].kind == "hang" or self.open[key].steps[1] < at_step - self._hold(self.open[key]):
                changes.append(Change("end", self.open.pop(key), at_step))
        return changes

    def _hold(self, f: Finding) -> int:
        if f.kind not in NETWORK_KINDS:
            return max(self.hold, self.end_after)
        eps = f.evidence.get("episodes") or []
        gaps = [b[0] - a[1] for a, b in zip(eps, eps[1:])]
        return max(self.network_hold, 2 * max(gaps, default=0), self.end_after)

    def close_at_end(self, at_step: int) -> list[Change]:
        """The run is over at `at_step`: what still held at its last steps (within end_after, a network
        finding within its hold, or a hang) is 'open_at_end' (it never ended: the run did), the rest
        'end'. Nothing stays open."""
        def held(f: Finding) -> bool:
            return f.kind == "hang" or f.steps[1] >= at_step - (self._hold(f) if f.kind in NETWORK_KINDS
                                                                else self.end_after)
        changes = [Change("open_at_end" if held(f) else "end", f, at_step) for f in self.open.values()]
        self.open.clear()
        return changes
