"""Which findings are open: each is announced once when it appears and once when it ends.

A finding is known by its kind and ranks. In a sliding window the same straggler comes back on every
tick with its steps clipped to the window; the tracker keeps the onset of the first sighting and
follows the last affected step. It ends when its last affected step falls more than `hold` complete
steps behind, reported by the window or not (a straggler that recovered at step 20 is still in a
window reaching step 30, with steps [.., 20]; one the window missed for a few noisy steps is not over).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megascope.analyzer.findings import Finding
from megascope.analyzer.settings import StragglerConfig

Key = tuple[str, tuple[int, ...]]


def key_of(finding: Finding) -> Key:
    return finding.kind, tuple(sorted(int(r) for r in finding.ranks))


@dataclass
class Change:
    event: str
    """'start', 'end', or 'open_at_end' (still held when the run finished)."""
    finding: Finding
    at_step: int
    """The last complete step when the change was seen."""


@dataclass
class Tracker:
    end_after: int = StragglerConfig.max_gap + 1
    """Steps a finding's last affected step may lag the run and still be news (a start; at the run's
    end, open_at_end): the straggler detector bridges gaps of up to max_gap unflagged steps
    (settings.StragglerConfig; the watcher passes its own setting's)."""
    hold: int = 16
    """Steps an open finding's last affected step may lag before it is over (>= end_after): the window's
    detectors may miss a straggler for a while under noise. Measured (a real dp4 run, a 3x straggler
    from step 60 of 200, the load-10 2-core box, window 32): ended at step 155 with its last affected
    step 144 and announced again at 164, while the whole run's verdict held it from 60 to the end;
    the watcher passes half its window."""
    open: dict[Key, Finding] = field(default_factory=dict)
    seen: set[Key] = field(default_factory=set)
    """Every finding ever announced (a final verdict repeats none of them)."""

    def update(self, findings: list[Finding], at_step: int) -> list[Change]:
        """Compare one window's findings with the open ones; the changes, starts first."""
        current: dict[Key, Finding] = {}
        for f in findings:
            if f.kind == "hang" or f.steps[1] >= at_step - self.end_after:
                current.setdefault(key_of(f), f)
        changes: list[Change] = []
        for key, f in current.items():
            if key in self.open:
                known = self.open[key]
                known.steps = (known.steps[0], max(known.steps[1], f.steps[1]))
                known.severity, known.evidence = f.severity, f.evidence
            else:
                self.open[key] = f
                self.seen.add(key)
                changes.append(Change("start", f, at_step))
        for key in [k for k in self.open if k not in current]:
            if self.open[key].kind == "hang" or self.open[key].steps[1] < at_step - max(self.hold, self.end_after):
                changes.append(Change("end", self.open.pop(key), at_step))
        return changes

    def close_at_end(self, at_step: int) -> list[Change]:
        """The run is over at `at_step`: what still held at its last steps (within end_after, or a hang)
        is 'open_at_end' (it never ended: the run did), the rest 'end'. Nothing stays open."""
        changes = [Change("open_at_end" if f.kind == "hang" or f.steps[1] >= at_step - self.end_after else "end",
                          f, at_step) for f in self.open.values()]
        self.open.clear()
        return changes
