"""Dashboard callbacks called as plain functions on simulated runs (a straggler run and a clean run)."""

from __future__ import annotations

import contextvars
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import dash
import numpy as np
import pytest

analyzer = pytest.importorskip("megascope.analyzer")
if not hasattr(analyzer, "Run"):
    pytest.skip("the analyzer facade (megascope.analyzer.Run) is not built yet", allow_module_level=True)

from megascope.dashboard import ids  # noqa: E402
from megascope.dashboard.app import create_app  # noqa: E402
from megascope.dashboard.runs import RunCatalog, directory_signature  # noqa: E402
from megascope.tracer.run_dir import write_manifest  # noqa: E402
from tests.dash_text import dash_text as _text  # noqa: E402

STEPS = 12
STRAGGLER = 3
ONSET = 5


def make_sample_runs(simulated_run, root: Path) -> tuple[Path, Path]:
    """A 2x2x2 run with rank 3 slowed 1.3x from step 5, and the same job without the fault, in `root`
    (`simulated_run`: the conftest fixture)."""
    slow = simulated_run(root / "straggler", dp=2, tp=2, pp=2, steps=STEPS,
                         inject=[f"straggler:rank={STRAGGLER},slowdown=1.3,from={ONSET}"])
    return slow, simulated_run(root / "clean", dp=2, tp=2, pp=2, steps=STEPS)


def make_empty_run(root: Path) -> Path:
    """A run whose job has started (run.json written) but has not finished a step."""
    run = root / "empty"
    source = analyzer.Run.open(root / "straggler").manifest if (root / "straggler").exists() else {}
    write_manifest(run, {k: v for k, v in source.items() if k != "schema_version"})
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, simulated_run) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dashboard-runs")
    slow, clean = make_sample_runs(simulated_run, root)
    return slow, clean, make_empty_run(root)


@pytest.fixture(scope="module")
def app(runs) -> dash.Dash:
    return create_app(list(runs))


@pytest.fixture(scope="module")
def pages(app):
    """The page modules of the app over the three runs (Dash executes them when the app is built)."""
    from megascope.dashboard.pages import compare, gpu, heatmap, links, overview, timeline, topology

    with app.server.test_request_context():
        yield dict(overview=overview, heatmap=heatmap, links=links, timeline=timeline, topology=topology, gpu=gpu,
                   compare=compare)




def test_overview_shows_steps_and_the_straggler_finding(pages):
    notices, summary, figure, findings, incidents = pages["overview"].refresh(0, 0)
    assert len(figure.data[0].x) == STEPS
    assert "2 x 2 x 2" in _text(summary)
    assert "straggler" in _text(findings) and str(STRAGGLER) in _text(findings)
    assert "No steps recorded yet" not in _text(notices)
    assert "No incidents" in _text(incidents)


def test_finding_link_points_at_the_heatmap_with_its_ranks(pages):
    finding = next(f for f in analyzer.Run.open(_run_path(0)).findings()
                   if f.kind == "straggler")
    href = pages["overview"].finding_href(finding, 0)
    query = parse_qs(urlparse(href).query)
    assert urlparse(href).path == "/heatmap" and str(STRAGGLER) in query["ranks"][0].split(",")


def test_empty_run_says_what_is_missing(pages):
    notices, _, figure, findings, _ = pages["overview"].refresh(2, 0)
    assert "No steps recorded yet" in _text(notices)
    assert not figure.data
    assert "No findings" in _text(findings)


def test_heatmap_marks_the_straggler_row_after_onset(pages):
    figure = pages["heatmap"].update_heatmap("compute", "rank", "rank", 0, 0)
    z = np.asarray(figure.data[0].z, dtype=float)
    rows = [int(str(y).split()[-1]) for y in figure.data[0].y]
    assert z.shape == (8, STEPS)
    late = z[:, ONSET + 1:]
    assert rows[int(np.nanargmax(np.nanmean(late, axis=1)))] == STRAGGLER


def test_heatmap_groups_rows_by_pipeline_stage(pages):
    figure = pages["heatmap"].update_heatmap("exposed_comm", "pp", "rank", 0, 0)
    assert np.asarray(figure.data[0].z).shape[0] == 2


def test_heatmap_click_opens_that_step_in_the_timeline(pages):
    href = pages["heatmap"].open_in_timeline({"points": [{"x": "7", "y": "3", "z": 0.5}]}, "rank", 0)
    url = urlparse(href)
    assert url.path == "/timeline" and parse_qs(url.query) == {"run": ["0"], "step": ["7"], "ranks": ["3"],
                                                                  "view": ["pp"]}
    assert pages["heatmap"].open_in_timeline(None, "rank", 0) is dash.no_update
    by_stage = urlparse(pages["heatmap"].open_in_timeline({"points": [{"x": "4", "y": "pp 1"}]}, "pp", 0))
    assert parse_qs(by_stage.query) == {"run": ["0"], "step": ["4"]}


def test_timeline_shows_the_pipeline_of_a_rank_with_dependency_arrows(pages):
    timeline = pages["timeline"]
    figure, details, _ = timeline.update_timeline(ONSET + 2, [STRAGGLER], "pp", [], None, 0, 0)
    names = {trace.name for trace in figure.data}
    assert {"compute", "p2p"} <= names and "dependency" in names
    assert list(figure.layout.yaxis.ticktext) == ["rank 3 · pp0 dp1 tp1", "rank 7 · pp1 dp1 tp1"]
    assert "Click an event" in _text(details)


def test_timeline_selected_event_shows_what_it_waited_on(pages):
    run = analyzer.Run.open(_run_path(0))
    step = ONSET + 2
    deps = run.dependencies(step, ranks=[3, 7])
    cross = deps[deps["kind"] == "p2p"].iloc[0]
    figure, details, _ = pages["timeline"].render(run, step, [3, 7], "ranks", True, int(cross["dst_event_id"]))
    names = {trace.name for trace in figure.data}
    assert {"selected", "waited on"} <= names
    assert "waited on" in _text(details) and "p2p" in _text(details)


def test_timeline_event_click_is_remembered(pages):
    assert pages["timeline"].select_event({"points": [{"customdata": 42}]}) == 42
    assert pages["timeline"].select_event({"points": [{"customdata": -1}]}) is None


def test_topology_colors_by_finding_and_details_a_rank(pages):
    topology = pages["topology"]
    figure, _ = topology.update_grid("findings", STRAGGLER, 0, 0)
    grid = figure.data[0]
    z, ranks = np.asarray(grid.z, dtype=float), np.asarray(grid.customdata)
    assert z[ranks == STRAGGLER][0] > 0
    details = _text(topology.update_details(STRAGGLER, 0, 0))
    assert "pp0 dp1 tp1" in details and "straggler" in details
    assert "activations to (next stage)" in details and "7" in details


def test_gpu_page_says_there_are_no_samples_on_a_cpu_run(pages):
    figure, problems = pages["gpu"].update_gpu("gpu_util", 0, 0)
    assert "no GPU samples" in _text(problems) or "No GPU samples" in _text(problems)
    assert not figure.data


def test_compare_puts_runs_side_by_side(pages):
    step_time, mfu, table, _ = pages["compare"].update_comparison(0)
    assert [t.name for t in step_time.data] == ["straggler", "clean"]
    assert len(mfu.data) == 2
    assert "straggler" in _text(table) and "clean" in _text(table)


def test_catalog_accepts_only_indexes_into_its_list(runs):
    catalog = RunCatalog(list(runs))
    assert [catalog.index(v) for v in (1, "2", "../../etc", None, 99, -1)] == [1, 2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="at least one run"):
        RunCatalog([])


def test_catalog_reopens_a_run_when_new_segments_arrive(runs, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(runs[0], live)
    catalog = RunCatalog([live], recheck_s=0.0)
    with catalog.using(0) as first:
        pass
    with catalog.using(0) as again:
        assert again is first  # nothing changed: no reopen
    before = directory_signature(live)
    extra = live / "steps" / "rank=00008"
    extra.mkdir()
    assert directory_signature(live) != before
    with catalog.using(0) as reopened:
        assert reopened is not first


def test_foreign_directory_is_refused_clearly(tmp_path):
    catalog = RunCatalog([tmp_path])
    with pytest.raises(Exception, match="run"):
        with catalog.using(0):
            pass


def _run_path(index: int) -> Path:
    from megascope.dashboard.runs import current_catalog

    return current_catalog().paths[index]


def test_heatmap_color_scale_is_not_taken_by_a_warmup_outlier():
    from megascope.dashboard.heatmap_figure import color_range

    values = np.ones((8, 40))
    values[3, 12:] = 1.5       # a straggler
    values[:4, 0] = 10.0       # the warm-up step
    zmin, zmax, clipped = color_range(values, higher_is_worse=True)
    assert clipped and zmin == 1.0 and 1.5 <= zmax < 10.0
    assert color_range(np.where(values > 5, 1.0, values), higher_is_worse=True) == (None, None, False)
    mfu = np.full((8, 40), 0.5)
    mfu[:4, 0] = 0.01
    zmin, zmax, clipped = color_range(mfu, higher_is_worse=False)
    assert clipped and zmin == 0.5 and zmax == 0.5


def test_topology_metric_color_is_the_median_over_steps(pages):
    """The straggler (slow on 7 of 12 steps) is the hottest rank by compute; a single slow step of
    another rank would not be (a max over steps would let one outlier color the grid)."""
    figure, _ = pages["topology"].update_grid("compute", None, 0, 0)
    z, ranks = np.asarray(figure.data[0].z, dtype=float), np.asarray(figure.data[0].customdata)
    assert int(ranks.flat[np.nanargmax(z)]) == STRAGGLER
    assert "median over steps" in figure.data[0].colorbar.title.text


def _component_ids(component) -> set[str]:
    """The ids in a Dash component tree."""
    if isinstance(component, (list, tuple)):
        return set().union(*map(_component_ids, component)) if component else set()
    if not hasattr(component, "to_plotly_json"):
        return set()
    own = {component.id} if getattr(component, "id", None) else set()
    return own | _component_ids(getattr(component, "children", None))


def test_every_component_id_comes_from_the_ids_module(app, pages):
    """The ids of each page's layout and of every callback's inputs, states and outputs are constants of
    dashboard/ids.py (Dash's own start with "_"), and no two constants share a value."""
    declared = [v for k, v in vars(ids).items() if k.isupper() and isinstance(v, str)]
    assert len(declared) == len(set(declared))
    known = set(declared) | {ids.app_nav(name) for name in pages}
    in_layouts = set().union(_component_ids(app.layout), *(_component_ids(page.layout()) for page in pages.values()))
    # in a copy of the context: Dash sets its current-app context variable while serving, which would
    # otherwise stay pointing at this app for the test modules that build their own app after this one
    dependencies = contextvars.copy_context().run(
        lambda: app.server.test_client().get("/_dash-dependencies").get_json())
    in_callbacks = {part.split(".")[0] for d in dependencies for part in d["output"].strip(".").split("...")}
    in_callbacks |= {x["id"] for d in dependencies for x in d["inputs"] + d["state"]}
    assert ids.TIMELINE_GRAPH in in_callbacks and ids.OVERVIEW_MFU in in_layouts  # the walk finds them
    assert {i for i in in_layouts | in_callbacks if not i.startswith("_")} <= known
