"""Read and change a running watcher (what /status and /settings of its HTTP port answer, control.py).

A change names any of `window`, `webhook` (an http(s) URL, or null for none) and `set` (detector
settings as `--set` takes them: {"detect.straggler.min_ratio": 1.05}). It is checked whole on a copy
of the watcher's config and applied only when every part is valid, from the next tick on; it lasts
until the watcher stops (a restarted watcher starts from its command line again) and is logged.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from megascope.analyzer.settings import SettingsError, apply_set, settings_dict

if TYPE_CHECKING:
    from megascope.analyzer.watch.watcher import WatchConfig, Watcher

CHANGEABLE = ("window", "webhook", "set")


def settings_of(watcher: Watcher) -> dict[str, Any]:
    cfg = watcher.cfg
    return {"window": cfg.window, "webhook": cfg.webhook, "settings": settings_dict(cfg.settings)}


def status_of(watcher: Watcher) -> dict[str, Any]:
    """What the watcher follows and how far behind the run it is."""
    state, cfg, now = watcher.state, watcher.cfg, time.monotonic()
    progress, follower = state.progress, watcher.follower
    # copies taken in one C call each: the loop's tick may add to them meanwhile (this is the HTTP thread)
    last = list(follower.last.values()) if follower is not None else []
    open_now = list(watcher.tracker.open.values())
    newest = max(last) if last else None
    analyzed = state.analyzed_step
    return {
        "following": {"run_dir": str(watcher.path), "source": cfg.follows or str(watcher.path),
                      "run_id": watcher.run_id, "findings_file": str(watcher.findings_path()),
                      "waiting_for_run_json": follower is None},
        "progress": {"analyzed_step": analyzed,
                     "summarized_step": state.summarized_step,
                     "complete_step": progress.complete_step if progress else None,
                     "newest_step": newest,
                     "last_step": progress.last_step if progress else None,
                     "ranks_reporting": progress.ranks_reporting if progress else 0,
                     "world": follower.world if follower is not None else None,
                     "finished": bool(progress and progress.finished)},
        "behind": {"steps": newest - analyzed if newest is not None and analyzed is not None else None,
                   "pending_segments": state.pending,
                   "pending_for_s": now - state.pending_since if state.pending_since is not None else 0.0,
                   "last_tick_lag_s": state.lag_s,
                   "since_last_tick_s": now - state.last_tick_at if state.last_tick_at is not None else None},
        "open_findings": [{"kind": f.kind, "ranks": f.ranks, "steps": list(f.steps), "severity": f.severity}
                          for f in open_now],
        "ticks": state.ticks, "errors": state.errors, "uptime_s": now - watcher.started_at,
        "judge_cpu_s": state.judge_cpu_s,
        "cpu_s": dict(state.cpu_s), "polls": state.polls,
        "late_rows": follower.late_rows if follower is not None else 0,
    }


def change(watcher: Watcher, body: dict[str, Any]) -> dict[str, Any]:
    """Apply `body` (see the module docstring) whole or not at all; returns the settings now in force.
    Raises ValueError (SettingsError included) with one line saying what is wrong."""
    unknown = sorted(set(body) - set(CHANGEABLE))
    if unknown or not body:
        raise ValueError(f"can change {', '.join(CHANGEABLE)}; got {', '.join(unknown) or 'nothing'}")
    cfg = _changed(watcher.cfg, body)
    watcher.reconfigure(cfg)
    watcher.log("settings changed over HTTP: " + ", ".join(
        f"{k} {v!r}" for k, v in body.items()) + " (from the next tick)")
    return settings_of(watcher)


def _changed(cfg: WatchConfig, body: dict[str, Any]) -> WatchConfig:
    new = dataclasses.replace(cfg, settings=copy.deepcopy(cfg.settings))
    if "window" in body:
        window = body["window"]
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1 (complete steps per tick), got {window!r}")
        new.window = window
    if "webhook" in body:
        new.webhook = _webhook(body["webhook"])
    items = body.get("set", {})
    if not isinstance(items, dict):
        raise ValueError('set must be an object of settings, e.g. {"detect.straggler.min_ratio": 1.05}')
    for key, value in items.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise SettingsError(f"--set {key}: expected a number, got {value!r}")
        apply_set(new.settings, f"{key}={value}")
    return new


def _webhook(url: Any) -> str | None:
    if url is None or url == "":
        return None
    parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"webhook must be an http(s) URL or null, got {url!r}")
    return str(url)
