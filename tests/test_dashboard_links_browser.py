"""The link view end to end in headless Chromium, on a simulated two-host job whose link 1-5 flaps: the
overview's Findings panel names the network finding and links to the link view, which outlines the
finding over the link's row and episodes; a cell click opens the timeline on the link's two ends at that
step, and a timeline opened without a step says which step it draws.

Needs the system packages chromium and chromium-driver (and selenium); skipped cleanly without them.
A site of its own (one run): the dashboard keeps the chosen run for the browser session, which would
carry over into test_dashboard_browser's pages."""

from __future__ import annotations

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
from tests.test_dashboard_browser import css  # noqa: E402
from tests.test_dashboard_links import EPISODES, FLAP_LINK, STEPS, make_flap_run  # noqa: E402

LINKS = 4  # rows: the pipeline links 0-4, 1-5, 2-6, 3-7, all between node0000 and node0001


@pytest.fixture(scope="module")
def site(tmp_path_factory, simulated_run):
    run = make_flap_run(simulated_run, tmp_path_factory.mktemp("links-browser"))
    server = serve_in_thread(create_app([run], refresh_s=3600))
    driver = chromium_driver(1400, 900, user_data_dir=tmp_path_factory.mktemp("chromium-profile"))
    yield server.url, driver
    driver.quit()
    server.stop()


def _open(site, path: str, selector: str):
    url, driver = site
    driver.get(url + path)
    wait_for(driver, selector)
    return driver


def _until(driver, condition, timeout_s: float = 20.0):
    return WebDriverWait(driver, timeout_s).until(condition)


def test_overview_findings_name_the_flap_and_link_to_the_link_view(site):
    driver = _open(site, "/", css(ids.OVERVIEW_FINDINGS_TABLE))
    row = driver.find_element(By.CSS_SELECTOR, css(ids.OVERVIEW_FINDINGS_TABLE, "tr.finding-network_flap"))
    assert "node0000, node0001" in row.text and "flapped" in row.text
    row.find_element(By.LINK_TEXT, "show").click()
    _until(driver, lambda d: urlparse(d.current_url).path == "/links")
    wait_for(driver, css(ids.LINKS_GRAPH, ".hm"))
    assert "network_flap" in driver.find_element(By.ID, ids.LINKS_FINDINGS).text
    assert not driver.find_elements(By.CSS_SELECTOR, ".dash-fe-error__title")


def test_link_view_outlines_the_flap_and_a_click_opens_the_timeline_on_its_ends(site):
    driver = _open(site, "/links?metric=transfer", css(ids.LINKS_GRAPH, ".hm"))
    labels = driver.execute_script(
        "return Array.from(document.getElementById(arguments[0]).querySelector('.js-plotly-plot')"
        ".data[0].y);", ids.LINKS_GRAPH)
    assert len(labels) == LINKS and labels[1].endswith(f"· {FLAP_LINK[0]}-{FLAP_LINK[1]}")
    outlines = driver.find_elements(By.CSS_SELECTOR, css(ids.LINKS_GRAPH, ".shapelayer path"))
    assert len(outlines) == len(EPISODES)
    plot = driver.find_element(By.CSS_SELECTOR, css(ids.LINKS_GRAPH, ".nsewdrag"))
    top = plot.rect["y"]
    row_height = plot.rect["height"] / LINKS
    for outline in outlines:  # each drawn over the flapping link's row (the second from the top)
        box = outline.rect
        assert abs(box["y"] + box["height"] / 2 - (top + 1.5 * row_height)) < row_height / 2

    step = EPISODES[1][0]
    width, height = plot.size["width"], plot.size["height"]
    dx = (step + 0.5) / STEPS * width - width / 2  # selenium offsets are from the element's centre
    dy = 1.5 / LINKS * height - height / 2
    ActionChains(driver).move_to_element_with_offset(plot, dx, dy).pause(0.3).click().perform()
    _until(driver, lambda d: urlparse(d.current_url).path == "/timeline")
    query = parse_qs(urlparse(driver.current_url).query)
    assert query["step"] == [str(step)] and query["ranks"] == [f"{FLAP_LINK[0]},{FLAP_LINK[1]}"]
    wait_for(driver, css(ids.TIMELINE_GRAPH, ".main-svg"))
    graph = driver.find_element(By.ID, ids.TIMELINE_GRAPH).text
    assert f"rank {FLAP_LINK[0]} ·" in graph and f"rank {FLAP_LINK[1]} ·" in graph
    assert driver.find_element(By.ID, ids.TIMELINE_STEP).get_attribute("value") == str(step)


def test_timeline_without_a_step_says_which_step_it_draws(site):
    driver = _open(site, "/timeline", css(ids.TIMELINE_GRAPH, ".main-svg"))
    _until(driver, lambda d: d.find_element(By.ID, ids.TIMELINE_STEP).get_attribute("value") == str(STEPS - 1))
