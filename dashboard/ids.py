"""Every Dash component id of the dashboard, in one place.

Layouts, callbacks, the browser tests and scripts/screenshots.py name components through these
constants: a renamed id then cannot leave a callback behind (Dash reports an unknown id only when the
page runs) or a test selector that no longer matches. Each id is prefixed by the page that owns it;
the `app-` ones belong to the shell around every page (dashboard/app.py). In the HTML they are the
elements' ids, so a CSS selector is `#` + the id.
"""

from __future__ import annotations

# the shell around every page (dashboard/app.py)
APP_URL = "app-url"
APP_INTERVAL = "app-interval"
APP_RUN = "app-run"
APP_LIVE = "app-live"


def app_nav(page_module: str) -> str:
    """The header's link to a page, by the last name of the page's module (e.g. "heatmap")."""
    return f"app-nav-{page_module}"


# overview (dashboard/pages/overview.py, dashboard/incidents_view.py)
OVERVIEW_NOTICES = "overview-notices"
OVERVIEW_SUMMARY = "overview-summary"
OVERVIEW_MFU = "overview-mfu"
OVERVIEW_LIVE = "overview-live"
OVERVIEW_LIVE_TABLE = "overview-live-table"
OVERVIEW_FINDINGS = "overview-findings"
OVERVIEW_FINDINGS_TABLE = "overview-findings-table"
OVERVIEW_INCIDENTS = "overview-incidents"
OVERVIEW_INCIDENTS_BODY = "overview-incidents-body"

# heatmap (dashboard/pages/heatmap.py)
HEATMAP_METRIC = "heatmap-metric"
HEATMAP_GROUP = "heatmap-group"
HEATMAP_ORDER = "heatmap-order"
HEATMAP_GRAPH = "heatmap-graph"

# links (dashboard/pages/links.py)
LINKS_METRIC = "links-metric"
LINKS_GRAPH = "links-graph"
LINKS_FINDINGS = "links-findings"
LINKS_FINDINGS_TABLE = "links-findings-table"

# timeline (dashboard/pages/timeline.py)
TIMELINE_STEP = "timeline-step"
TIMELINE_RANKS = "timeline-ranks"
TIMELINE_VIEW = "timeline-view"
TIMELINE_CRITICAL = "timeline-critical"
TIMELINE_NOTICES = "timeline-notices"
TIMELINE_SELECTED = "timeline-selected"
"""dcc.Store: the event id of the clicked event."""
TIMELINE_FOLLOWED = "timeline-followed"
"""dcc.Store: the last step the step box was filled with (it follows the run's last step until changed)."""
TIMELINE_GRAPH = "timeline-graph"
TIMELINE_DETAILS = "timeline-details"
TIMELINE_SELECTION = "timeline-selection"
"""What the selected event waited on and what waited on it (inside TIMELINE_DETAILS)."""

# topology (dashboard/pages/topology.py)
TOPOLOGY_COLOR = "topology-color"
TOPOLOGY_HANG = "topology-hang"
TOPOLOGY_RANK = "topology-rank"
"""dcc.Store: the selected rank."""
TOPOLOGY_GRAPH = "topology-graph"
TOPOLOGY_DETAILS = "topology-details"
TOPOLOGY_RANK_DETAILS = "topology-rank-details"

# GPU health (dashboard/pages/gpu.py)
GPU_METRIC = "gpu-metric"
GPU_GRAPH = "gpu-graph"
GPU_PROBLEMS = "gpu-problems"

# compare runs (dashboard/pages/compare.py)
COMPARE_NOTICES = "compare-notices"
COMPARE_STEP_TIME = "compare-step-time"
COMPARE_MFU = "compare-mfu"
COMPARE_SUMMARY = "compare-summary"
COMPARE_TABLE = "compare-table"
