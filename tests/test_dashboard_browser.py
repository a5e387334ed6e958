"""End to end in headless Chromium: every page on a simulated run, heatmap click -> timeline, timeline
event click -> its dependencies outlined, topology rank.

Needs the system packages chromium and chromium-driver (and selenium); skipped cleanly without them.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlparse

import pytest

from tests.browser import find_chromium

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None, reason="needs chromium and chromedriver")]
selenium = pytest.importorskip("selenium")
analyzer = pytest.importorskip("megascope.analyzer")
if not hasattr(analyzer, "Run"):
    pytest.skip("the analyzer facade (megascope.analyzer.Run) is not built yet", allow_module_level=True)

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from megascope.dashboard import ids  # noqa: E402
from megascope.dashboard.app import create_app  # noqa: E402
from tests.browser import chromium_driver, serve_in_thread, wait_for  # noqa: E402
from tests.test_dashboard_callbacks import ONSET, STEPS, STRAGGLER, make_sample_runs  # noqa: E402


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory, simulated_run):
    return make_sample_runs(simulated_run, tmp_path_factory.mktemp("browser-runs"))


@pytest.fixture(scope="module")
def runs_dir(sample_runs):
    """The straggler run the site shows first."""
    return sample_runs[0]


@pytest.fixture(scope="module")
def site(sample_runs, tmp_path_factory):
    slow, clean = sample_runs
    server = serve_in_thread(create_app([slow, clean], refresh_s=3600))
    driver = chromium_driver(1400, 900, user_data_dir=tmp_path_factory.mktemp("chromium-profile"))
    yield server.url, driver
    driver.quit()
    server.stop()


def _open(site, path: str, selector: str) -> object:
    url, driver = site
    driver.get(url + path)
    wait_for(driver, selector)
    return driver


def _until(driver, condition, timeout_s: float = 20.0):
    return WebDriverWait(driver, timeout_s).until(condition)


def css(component_id: str, inside: str = "") -> str:
    """The CSS selector of a dashboard component (dashboard/ids.py), or of `inside` elements within it."""
    return f"#{component_id} {inside}".rstrip()


@pytest.mark.parametrize("path, selector, expected", [
    ("/", css(ids.OVERVIEW_FINDINGS_TABLE), "straggler"),
    ("/heatmap", css(ids.HEATMAP_GRAPH, ".main-svg"), "Click a cell"),
    ("/timeline", css(ids.TIMELINE_GRAPH, ".main-svg"), "rank 0 · pp0 dp0 tp0"),
    ("/topology", css(ids.TOPOLOGY_GRAPH, ".main-svg"), "stage 1"),
    ("/gpu", css(ids.GPU_PROBLEMS), "No GPU samples"),
    ("/compare", css(ids.COMPARE_TABLE), "clean"),
])
def test_every_page_renders(site, path, selector, expected):
    driver = _open(site, path, selector)
    assert expected in driver.find_element(By.TAG_NAME, "body").text
    assert not driver.find_elements(By.CSS_SELECTOR, ".dash-fe-error__title")  # no callback error overlay


def test_overview_plots_every_step(site):
    driver = _open(site, "/", css(ids.OVERVIEW_MFU, ".main-svg"))
    mfu_panel = driver.find_elements(By.CSS_SELECTOR, css(ids.OVERVIEW_MFU, ".scatterlayer"))[0]  # top subplot
    assert len(mfu_panel.find_elements(By.CSS_SELECTOR, ".point")) == STEPS


def test_heatmap_cell_click_opens_the_timeline_at_that_step(site):
    driver = _open(site, "/heatmap?metric=compute", css(ids.HEATMAP_GRAPH, ".hm"))
    step, rank = ONSET + 2, STRAGGLER
    plot = driver.find_element(By.CSS_SELECTOR, css(ids.HEATMAP_GRAPH, ".nsewdrag"))
    width, height = plot.size["width"], plot.size["height"]
    dx = (step + 0.5) / STEPS * width - width / 2  # selenium offsets are from the element's centre
    dy = (rank + 0.5) / 8 * height - height / 2     # rows top-down: rank 0 first
    ActionChains(driver).move_to_element_with_offset(plot, dx, dy).pause(0.3).click().perform()
    _until(driver, lambda d: urlparse(d.current_url).path == "/timeline")
    assert parse_qs(urlparse(driver.current_url).query)["step"] == [str(step)]
    wait_for(driver, css(ids.TIMELINE_GRAPH, ".main-svg"))
    _until(driver, lambda d: f"rank {rank} · pp0 dp1 tp1" in d.find_element(By.ID, ids.TIMELINE_GRAPH).text)
    assert driver.find_element(By.ID, ids.TIMELINE_STEP).get_attribute("value") == str(step)
    assert "rank 7 · pp1 dp1 tp1" in driver.find_element(By.ID, ids.TIMELINE_GRAPH).text  # its pipeline peer


def test_topology_rank_selection_shows_its_position_and_peers(site):
    driver = _open(site, "/topology?color=findings", css(ids.TOPOLOGY_GRAPH, ".hm"))
    plot = driver.find_element(By.CSS_SELECTOR, css(ids.TOPOLOGY_GRAPH, ".nsewdrag"))
    width, height = plot.size["width"], plot.size["height"]
    # rank 5 = stage 1 (second row), dp0 tp1 (second of four columns)
    ActionChains(driver).move_to_element_with_offset(plot, 1.5 / 4 * width - width / 2,
                                                     1.5 / 2 * height - height / 2).pause(0.3).click().perform()
    _until(driver, lambda d: d.find_elements(By.ID, ids.TOPOLOGY_RANK_DETAILS))
    time.sleep(0.3)
    details = driver.find_element(By.ID, ids.TOPOLOGY_RANK_DETAILS).text
    assert "rank 5 · pp1 dp0 tp1" in details
    assert "activations from (previous stage)" in details and "tp group" in details


_BAR_OF_EVENT_JS = """
const gd = document.getElementById(arguments[1]).querySelector('.js-plotly-plot');
const bars = gd._fullData.filter(t => t.type === 'bar' && t.visible !== false);
for (let k = 0; k < bars.length; k++) {
  const i = Array.from(bars[k].customdata || []).indexOf(arguments[0]);
  if (i >= 0 && !['selected', 'waited on', 'waited on it', 'critical path'].includes(bars[k].name)) {
    const layer = gd.querySelectorAll('.barlayer g.trace.bars')[k];
    const r = layer.querySelectorAll('g.point path')[i].getBoundingClientRect();
    return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height];
  }
}
return null;
"""
_OUTLINE_STROKES_JS = """
return Array.from(document.getElementById(arguments[0]).querySelectorAll('.barlayer g.point path'))
  .map(p => p.style.stroke).filter(s => s && s !== 'none');
"""


def test_timeline_event_click_highlights_what_it_waited_on_and_what_waited_on_it(site, runs_dir):
    step, ranks = ONSET + 2, [STRAGGLER, STRAGGLER + 4]  # the straggler and its next pipeline stage
    run = analyzer.Run.open(runs_dir)
    deps = run.dependencies(step, ranks=ranks)
    events = run.events(steps=(step, step), ranks=ranks).set_index("event_id")
    cross = deps[(deps.kind == "p2p") & (deps.wait_s > 0)].copy()
    cross["width"] = [events.end_ns[e] - events.start_ns[e] for e in cross.dst_event_id]
    edge = cross.sort_values("width").iloc[-1]  # the widest receive that waited on the other rank
    target = int(edge.dst_event_id)
    waited_by = set(deps.loc[deps.src_event_id == target, "dst_event_id"].astype(int))
    assert waited_by, "the chosen receive should have something waiting on it"

    driver = _open(site, f"/timeline?step={step}&ranks={','.join(map(str, ranks))}&view=ranks",
                   css(ids.TIMELINE_GRAPH, ".barlayer"))
    _until(driver, lambda d: d.execute_script(_BAR_OF_EVENT_JS, target, ids.TIMELINE_GRAPH))
    x, y, width, _ = driver.execute_script(_BAR_OF_EVENT_JS, target, ids.TIMELINE_GRAPH)
    assert width > 4, "the event to click should be wide enough to hit"
    plot = driver.find_element(By.CSS_SELECTOR, css(ids.TIMELINE_GRAPH, ".nsewdrag"))
    box = plot.rect  # selenium offsets are from the element's centre
    ActionChains(driver).move_to_element_with_offset(plot, x - box["x"] - box["width"] / 2,
                                                     y - box["y"] - box["height"] / 2).pause(0.3).click().perform()
    _until(driver, lambda d: d.find_elements(By.ID, ids.TIMELINE_SELECTION))
    wait_for(driver, css(ids.TIMELINE_GRAPH, ".barlayer"))
    details = driver.find_element(By.ID, ids.TIMELINE_SELECTION).text
    name = events.loc[target]
    assert f"Selected: {name['name']} ({name['kind']} {name['group']}) on rank {name['rank']}" in details
    waited_on_part, waited_by_part = details.split("waited on it", 1)
    assert f"on rank {int(edge.src_rank)}" in waited_on_part.split("waited on", 1)[1]  # the sender
    assert "nothing" not in waited_by_part
    # the outlines are drawn in the figure: black (selected), blue (waited on), green (waited on it)
    strokes = set(driver.execute_script(_OUTLINE_STROKES_JS, ids.TIMELINE_GRAPH))
    assert {"rgb(0, 0, 0)", "rgb(31, 119, 180)", "rgb(44, 160, 44)"} <= strokes, strokes
    outlined = driver.execute_script("""return Object.fromEntries(
        document.getElementById(arguments[0]).querySelector('.js-plotly-plot')
        ._fullData.filter(t => ['selected', 'waited on', 'waited on it'].includes(t.name))
        .map(t => [t.name, Array.from(t.customdata)]));""", ids.TIMELINE_GRAPH)
    assert outlined["selected"] == [target]
    assert int(edge.src_event_id) in outlined["waited on"]
    assert waited_by <= set(outlined["waited on it"])
