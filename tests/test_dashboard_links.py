"""The link view and the network findings on the dashboard, through the real app's callbacks: a simulated
job on two hosts (a pipeline stage per host) whose link 1-5 flaps, a single-host run without a fault, and
a run without pipeline stages (no p2p links); and the timeline's step box filled with the step it draws."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

import dash
import numpy as np
import pytest

analyzer = pytest.importorskip("megascope.analyzer")
if not hasattr(analyzer, "Run"):
    pytest.skip("the analyzer facade (megascope.analyzer.Run) is not built yet", allow_module_level=True)

from megascope.dashboard.app import create_app  # noqa: E402
from megascope.samples.sim_model import Hardware  # noqa: E402
from tests.dash_text import dash_text as _text  # noqa: E402

STEPS = 30
FLAP_LINK = (1, 5)  # stage 0's rank 1 (node0000) and stage 1's rank 5 (node0001)
PERIOD, DOWN, FIRST = 8, 2, 4  # down for 2 steps every 8 from step 4: steps 4-5, 12-13, 20-21, 28-29
EPISODES = [(s, s + DOWN - 1) for s in range(FIRST, STEPS, PERIOD)]


def make_flap_run(simulated_run, root: Path) -> Path:
    """2 x 2 x 2 ranks, four to a host (stage 0 on node0000, stage 1 on node0001), link 1-5 down 40 ms a
    transfer on the EPISODES (`simulated_run`: the conftest fixture)."""
    return simulated_run(root / "flap", dp=2, tp=2, pp=2, steps=STEPS, hardware=Hardware(ranks_per_host=4),
                         inject=[f"flap:ranks={FLAP_LINK[0]}-{FLAP_LINK[1]},down_ms=40,period_steps={PERIOD},"
                                 f"len={DOWN},from={FIRST}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, simulated_run) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dashboard-links")
    return (make_flap_run(simulated_run, root), simulated_run(root / "clean", dp=2, tp=2, pp=2, steps=12),
            simulated_run(root / "no-pipeline", dp=2, tp=2, pp=1, steps=6))


@pytest.fixture(scope="module")
def pages(runs):
    app = create_app(list(runs))
    from megascope.dashboard.pages import links, overview, timeline

    with app.server.test_request_context():
        yield dict(links=links, overview=overview, timeline=timeline)




def _hrefs(component) -> list[str]:
    if isinstance(component, (list, tuple)):
        return [h for c in component for h in _hrefs(c)]
    own = [component.href] if getattr(component, "href", None) else []
    return own + _hrefs(getattr(component, "children", None)) if hasattr(component, "children") else own


def _row(figure, link: tuple[int, int]) -> int:
    return next(i for i, label in enumerate(figure.data[0].y) if label.endswith(f"· {link[0]}-{link[1]}"))


def test_link_rows_are_the_pipeline_links_grouped_by_host_pair(pages):
    figure, _ = pages["links"].update_links("transfer", 0, 0)
    assert list(figure.data[0].y) == [f"node0000-node0001 · {a}-{a + 4}" for a in range(4)]
    assert [int(x) for x in figure.data[0].x] == list(range(STEPS))


@pytest.mark.parametrize("metric", ["transfer", "wait", "rate"])
def test_the_flapping_link_stands_out_on_its_episodes_only(pages, metric):
    figure, _ = pages["links"].update_links(metric, 0, 0)
    z = np.asarray(figure.data[0].customdata, dtype=float)  # the values (z: their log10, the colors)
    row = _row(figure, FLAP_LINK)
    down = [s for a, b in EPISODES for s in range(a, b + 1)]
    up = [s for s in range(1, STEPS) if s not in down]  # step 0: warm-up
    others = [r for r in range(z.shape[0]) if r != row]
    worse = (lambda a, b: a > b) if metric != "rate" else (lambda a, b: a < b)
    # the link while down against itself while up, and against the other links in the same steps
    assert worse(np.min(z[row, down]) if metric != "rate" else np.max(z[row, down]),
                 np.max(z[row, up]) if metric != "rate" else np.min(z[row, up]))
    assert all(worse(z[row, s], np.max(z[others, s]) if metric != "rate" else np.min(z[others, s])) for s in down)


def test_the_flap_finding_is_outlined_on_its_link_and_episodes(pages):
    figure, findings = pages["links"].update_links("wait", 0, 0)
    row = _row(figure, FLAP_LINK)
    boxes = sorted((s.x0 + 0.5, s.x1 - 0.5) for s in figure.layout.shapes)
    assert boxes == [tuple(float(v) for v in e) for e in EPISODES]
    assert {(s.y0 + 0.5, s.y1 - 0.5) for s in figure.layout.shapes} == {(row, row)}
    assert {s.name for s in figure.layout.shapes} == {"network_flap"}
    text = _text(findings)
    assert "network_flap" in text and "node0000, node0001" in text and f"{FLAP_LINK[0]}-{FLAP_LINK[1]}" in text
    assert "carried no p2p rows" not in text


def test_a_cell_click_opens_the_timeline_on_the_links_ends(pages):
    figure, _ = pages["links"].update_links("wait", 0, 0)
    label = figure.data[0].y[_row(figure, FLAP_LINK)]
    href = pages["links"].open_in_timeline({"points": [{"x": "12", "y": label, "z": 0.1}]}, 0)
    url = urlparse(href)
    assert url.path == "/timeline" and parse_qs(url.query) == {"run": ["0"], "step": ["12"], "ranks": ["1,5"],
                                                                  "view": ["ranks"]}
    assert pages["links"].open_in_timeline(None, 0) is dash.no_update
    assert pages["links"].open_in_timeline({"points": [{"x": "3", "y": "not a link"}]}, 0) is dash.no_update


def test_the_overview_lists_the_network_finding_and_links_to_the_link_view(pages):
    _, _, _, findings, _ = pages["overview"].refresh(0, 0)
    text = _text(findings)
    assert "network_flap" in text and "node0000, node0001" in text, text
    flap = next(f for f in analyzer.Run.open(pages["links"].current_catalog().paths[0]).findings()
                if f.kind == "network_flap")
    url = urlparse(pages["overview"].finding_href(flap, 0))
    assert url.path == "/links" and url.path in {urlparse(h).path for h in _hrefs(findings)}


def test_a_clean_run_has_its_links_and_no_network_finding(pages):
    figure, findings = pages["links"].update_links("transfer", 1, 0)
    assert len(figure.data[0].y) == 4 and all(" · " in y and "-node" not in y for y in figure.data[0].y)
    assert not figure.layout.shapes
    assert "No network findings" in _text(findings)


def test_a_run_without_pipeline_stages_says_it_has_no_links(pages):
    figure, _ = pages["links"].update_links("wait", 2, 0)
    assert not figure.data and "No p2p transfers" in figure.layout.annotations[0].text


def test_the_timeline_step_box_shows_the_step_it_draws(pages):
    follow = pages["timeline"].follow_last_step
    assert follow(0, 0, None, None) == (STEPS - 1, STEPS - 1)  # empty: the last step, which render draws
    assert follow(0, 1, STEPS - 1, STEPS - 1) == (dash.no_update, dash.no_update)  # nothing new
    assert follow(0, 0, "7", None) == (dash.no_update, dash.no_update)  # a linked step stays
    assert follow(0, 1, 7, STEPS - 1) == (dash.no_update, dash.no_update)  # a typed one too
    assert follow(1, 0, STEPS - 1, STEPS - 1) == (11, 11)  # another run: its last step, still followed



def test_folded_rows_keep_the_worst_cell_and_the_finding(runs):
    """More links than rows: neighbours share a row that keeps each cell's worst value, and the finding
    is drawn on the row holding its link."""
    run = analyzer.Run.open(runs[0])
    full, folded = run.links(), run.links(max_rows=2)
    assert folded.rows == ["node0000-node0001 · 0-4 .. 1-5 (2 links)", "node0000-node0001 · 2-6 .. 3-7 (2 links)"]
    assert folded.row_links == [(0, 4), (2, 6)]
    np.testing.assert_allclose(folded.values["transfer"][0], np.nanmax(full.values["transfer"][:2], axis=0))
    np.testing.assert_allclose(folded.values["rate"][1], np.nanmin(full.values["rate"][2:], axis=0))
    assert [(m.finding.kind, m.rows) for m in folded.marks] == [("network_flap", [0])]
