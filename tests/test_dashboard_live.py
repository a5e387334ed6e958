"""Live findings on the overview: a real watcher follows a simulated straggler run landing step by step
and writes RUN/findings.jsonl; the overview's callback shows the straggler open while the run goes on
(onset step, the step it was seen at, links to the heatmap on its metric and to the timeline at its
onset), then ended and confirmed once the watcher gave its final verdict, read anew on each refresh."""

from __future__ import annotations

import io
import json
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from megascope.analyzer import Run
from megascope.analyzer.views.live_findings import read_live_findings
from megascope.analyzer.watch.watcher import WatchConfig, Watcher
from megascope.dashboard.app import create_app
from megascope.tracer.run_dir import FINDINGS_FILE
from tests.test_dashboard_callbacks import _text
from tests.watch_feed import Feeder, simulate_steps

ONSET, STRAGGLER = 8, 5


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return simulate_steps(tmp_path_factory.mktemp("src") / "run", steps=20,
                          inject=[f"straggler:rank={STRAGGLER},slowdown=0.3,from={ONSET}"])


def _links(component) -> dict[str, str]:
    """text -> href of every dcc.Link in a component tree."""
    found: dict[str, str] = {}
    stack = [component]
    while stack:
        c = stack.pop()
        if isinstance(c, (list, tuple)):
            stack.extend(c)
        elif c is not None and not isinstance(c, str):
            if type(c).__name__ == "Link":
                found[_text(c)] = c.href
            stack.append(getattr(c, "children", None))
    return found


def test_overview_shows_the_watchers_findings_as_they_change(source, tmp_path):
    live = tmp_path / "live"
    feeder = Feeder(source, live)
    feeder.feed(1)  # run.json and a first step: the dashboard can open the run
    app = create_app([live])
    from megascope.dashboard.pages import overview

    watcher = Watcher(live, WatchConfig(), out=io.StringIO(), log=lambda line: None)
    with app.server.test_request_context():
        assert "No live findings" in _text(overview.refresh_live(0, 0))
        for _ in range(feeder.total):  # until the watcher announces the straggler, mid-run
            feeder.feed(1)
            watcher.poll()
            if read_live_findings(live / FINDINGS_FILE):
                break
        assert feeder.next < feeder.total, "the straggler was announced only once the run was over"
        table = overview.refresh_live(0, 0)
        row = next(r for r in table.children[1].children if "straggler" in _text(r))
        cells = [_text(c) for c in row.children]
        assert cells[:3] == ["open", "straggler", str(STRAGGLER)]
        assert ONSET <= int(cells[3]) <= ONSET + 3 and int(cells[3]) <= int(cells[4]) and cells[5] == ""
        links = _links(row)
        heat, timeline = urlparse(links["heatmap"]), urlparse(links["timeline"])
        assert heat.path == "/heatmap" and parse_qs(heat.query)["metric"] == ["compute"]
        assert parse_qs(heat.query)["ranks"] == [str(STRAGGLER)]
        assert timeline.path == "/timeline" and parse_qs(timeline.query)["step"] == [cells[3]]

        for _ in range(feeder.total + 2):  # the rest of the run, and the final verdict
            feeder.feed(1)
            if watcher.poll():
                watcher.finish()
                break
        watcher.close()
        cells = [_text(c) for c in next(r for r in overview.refresh_live(0, 0).children[1].children
                                        if "straggler" in _text(r)).children]
        # the straggler holds to the last step: open at the end of the run (no ended step), confirmed
        assert cells[0] == "open, confirmed" and cells[5] == ""
    final = [f for f in Run.open(live).findings() if f.kind == "straggler"]
    assert [f.ranks for f in final] == [[STRAGGLER]]


def test_read_live_findings_folds_episodes_and_skips_a_partial_line(tmp_path):
    base = {"kind": "straggler", "ranks": [3], "hosts": ["n0"], "severity": 1.3, "summary": "slow", "evidence": {}}
    recs = [dict(base, event="start", steps=[5, 7], at_step=7), dict(base, event="end", steps=[5, 12], at_step=17),
            dict(base, event="start", steps=[30, 32], at_step=32), dict(base, kind="hang", event="start",
                                                                         steps=[40, 40], at_step=41),
            dict(base, event="open_at_end", steps=[30, 45], at_step=45),
            dict(base, event="final", steps=[5, 35], at_step=45)]
    path = tmp_path / FINDINGS_FILE
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "strag')
    rows = read_live_findings(path)
    assert [(r.finding.kind, r.onset, r.state, r.seen_at, r.ended_at, r.final, r.at_end) for r in rows] == [
        ("straggler", 5, "ended", 7, 17, False, False), ("straggler", 30, "open", 32, None, True, True),
        ("hang", 40, "open", 41, None, False, False)]
    assert rows[1].finding.steps == (30, 45)
    assert rows[0].finding.steps == (5, 12)
    assert read_live_findings(tmp_path / "missing.jsonl") == []
