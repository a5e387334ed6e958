"""The summary window in TensorBoard, where the job's own curves already are (opt-in:
`trace.tensorboard_dir`): every `trace.summary_every` steps rank 0's summary thread (step_summary.py)
writes the window's step time min / median / max, its median MFU (when run.json states the device's
peak FLOP/s, as megascope's trainer writes it; the MFU of the trainer's log and analyzer/views/mfu.py),
the number of open live findings, and one text entry per finding a live watcher opened or ended since
the last window, with its cause and cost when it says them:

    megascope/step_time_s/min, .../median, .../max   scalars at the window's last step
    megascope/mfu                                    scalar (median of the window's steps)
    megascope/findings_open                          scalar
    megascope/findings                               text: "opened: rank 1 straggler ... (data_loading
                                                     24.1 ms a step; costs 0.38 s, 0.001 GPU-hours)"

The writer is torch.utils.tensorboard's SummaryWriter (the `tensorboard` package: the `tensorboard`
extra). Without it the tracer says so in one line and the job runs on without it. Written from the
summary thread, never the training thread; a failure is the summary's (logged, counted, survived).
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megascope.tracer.run_dir import MANIFEST

log = logging.getLogger("megascope")
MISSING = ("trace.tensorboard_dir is set but TensorBoard is not installed (pip install 'megascope[tensorboard]'); "
           "training goes on without it")


@dataclass
class FindingNote:
    """A live finding as a tracker shows it (from the watcher's record: Finding.to_dict)."""

    kind: str
    ranks: list[int]
    steps: tuple[int, int]
    evidence: dict[str, Any]

    def text(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ",".join(map(str, self.ranks))
        out = f"{who} {self.kind} steps {self.steps[0]}-{self.steps[1]}"
        said = []
        cause, ms = self.evidence.get("explained_by"), self.evidence.get("explained_ms")
        if cause:
            said.append(f"{cause} {float(ms):.1f} ms a step" if ms is not None else str(cause))
        if self.evidence.get("cost_s") is not None:
            hours = self.evidence.get("gpu_hours")
            said.append(f"costs {float(self.evidence['cost_s']):.3g} s"
                        + (f", {float(hours):.3g} GPU-hours" if hours is not None else ""))
        return out + (f" ({'; '.join(said)})" if said else "")


@dataclass
class Window:
    """One summary window as the trackers take it."""

    first: int
    last: int
    seconds: list[float]
    model_flops: list[float]
    open: list[FindingNote]
    opened: list[FindingNote]
    ended: list[FindingNote]


class Tracker(Protocol):
    def window(self, w: Window) -> None: ...
    def close(self) -> None: ...


class TensorBoardLog:
    """Windows as TensorBoard scalars and text under `log_dir` (see the module docstring)."""

    def __init__(self, log_dir: str | Path, run_dir: str | Path | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.writer = SummaryWriter(str(log_dir))
        self.run_dir = run_dir
        self._peak: float | None = None

    def window(self, w: Window) -> None:
        at = w.last
        for name, value in (("min", min(w.seconds)), ("median", statistics.median(w.seconds)),
                            ("max", max(w.seconds))):
            self.writer.add_scalar(f"megascope/step_time_s/{name}", value, at)
        mfu = [f / (s * self.peak()) for f, s in zip(w.model_flops, w.seconds) if f > 0 and s > 0 and self.peak()]
        if mfu:
            self.writer.add_scalar("megascope/mfu", statistics.median(mfu), at)
        self.writer.add_scalar("megascope/findings_open", len(w.open), at)
        notes = [f"opened: {n.text()}" for n in w.opened] + [f"ended: {n.text()}" for n in w.ended]
        if notes:
            self.writer.add_text("megascope/findings", "  \n".join(notes), at)
        self.writer.flush()

    def peak(self) -> float:
        """The job's peak FLOP/s (the device's from run.json, times the world: model_flops is the whole
        job's, as analyzer/views/mfu.py divides it); 0 while unknown (no MFU), read until it is there."""
        if self._peak is None and self.run_dir is not None and "://" not in str(self.run_dir):
            try:
                manifest = json.loads((Path(self.run_dir) / MANIFEST).read_text())
                per_device = (manifest.get("peak_flops") or {}).get("per_device")
                world = int((manifest.get("topology") or {}).get("world") or 0)
                self._peak = float(per_device) * world if per_device and world else None
            except (OSError, ValueError):
                return 0.0  # not written yet (the trainer writes it beside the first steps): next window
        return self._peak or 0.0

    def close(self) -> None:
        self.writer.close()


def open_tracker(tensorboard_dir: str, run_dir: str | Path | None) -> Tracker | None:
    """The tracker the config asks for, or None (none asked for, or its package is missing: one line)."""
    if not tensorboard_dir:
        return None
    try:
        return TensorBoardLog(tensorboard_dir, run_dir)
    except ImportError:
        log.warning(MISSING)
        return None
