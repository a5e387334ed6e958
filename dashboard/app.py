"""The Dash app: a header (pages, run chooser, live toggle) around the pages in dashboard/pages.

`create_app(paths)` builds a fresh app over a fixed list of run directories. Pages read the chosen
run through `current_catalog()` and refresh on the shared `app-interval` while "live" is on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import parse_qs

import dash
from dash import Input, NoUpdate, Output, State, dcc, html

from megascope.dashboard import ids
from megascope.dashboard.auth import TokenAuth
from megascope.dashboard.runs import CATALOG_KEY, RunCatalog, current_catalog

PAGES_FOLDER = Path(__file__).with_name("pages")
ASSETS_FOLDER = Path(__file__).with_name("assets")
DEFAULT_REFRESH_S = 3.0


def create_app(paths: list[str | Path], refresh_s: float = DEFAULT_REFRESH_S, token: str | None = None) -> dash.Dash:
    """A Dash app serving exactly these run directories (selected in the browser by index); with a
    token, every request must carry it (dashboard/auth.py) or is answered 401."""
    catalog = RunCatalog(paths)
    app = dash.Dash(
        "megascope.dashboard",
        use_pages=True,
        pages_folder=str(PAGES_FOLDER),
        assets_folder=str(ASSETS_FOLDER),
        title="megascope",
        suppress_callback_exceptions=True,  # page components appear only when their page is shown
        update_title=None,  # type: ignore[arg-type]  # None: no "Updating..." tab title (Dash's documented value; its annotation says str)
        on_error=_callback_failed,
    )
    app.server.config[CATALOG_KEY] = catalog
    if token is not None:
        app.server.wsgi_app = TokenAuth(app.server.wsgi_app, token)
    app.layout = _layout(catalog, refresh_s)
    # Registered per app (not with the global @callback) so several apps can live in one process.
    app.callback(Output(ids.APP_INTERVAL, "disabled"), Input(ids.APP_LIVE, "value"))(pause_refresh)
    app.callback(Output(ids.APP_RUN, "value"), Input(ids.APP_URL, "search"),
                 State(ids.APP_RUN, "value"))(run_from_url)
    return app


def _callback_failed(error: Exception) -> None:
    """A callback that raised (input no page of ours sends: a list where a name goes, a crafted click)
    leaves its outputs as they were instead of answering 500; one line in the server's log says why."""
    trigger = ",".join(dash.ctx.triggered_prop_ids) if dash.ctx.triggered_prop_ids else "?"
    print(f"megascope dashboard: callback on {trigger} failed: {type(error).__name__}: {error}",
          file=sys.stderr, flush=True)


def _layout(catalog: RunCatalog, refresh_s: float) -> html.Div:
    pages = sorted(dash.page_registry.values(), key=lambda p: p.get("order") or 0)
    nav = [dcc.Link(p["name"], href=p["relative_path"], className="app-nav-link",
                    id=ids.app_nav(p['module'].rsplit('.', 1)[-1])) for p in pages]
    header = html.Header(className="app-header", children=[
        html.Span("megascope", className="app-brand"),
        html.Nav(nav, className="app-nav"),
        dcc.Dropdown(id=ids.APP_RUN, options=catalog.options(), value=0, clearable=False,
                     className="app-run", persistence=True, persistence_type="session"),
        dcc.Checklist(id=ids.APP_LIVE, options=[{"label": " live", "value": "live"}], value=["live"],
                      className="app-live", inputStyle={"marginRight": "4px"}),
    ])
    return html.Div([
        dcc.Location(id=ids.APP_URL, refresh="callback-nav"),
        dcc.Interval(id=ids.APP_INTERVAL, interval=int(refresh_s * 1000)),
        header,
        html.Main(dash.page_container, className="app-main"),
    ])


def pause_refresh(live: list[str] | None) -> bool:
    """The user can pause live refresh (e.g. while reading a timeline)."""
    return "live" not in (live or [])


def run_from_url(search: str | None, current: int | None) -> int | NoUpdate:
    """`?run=N` in a link selects run N (an index into the served list, never a path)."""
    values = parse_qs((search or "").lstrip("?")).get("run")
    if not values:
        return dash.no_update if current is not None else 0
    return current_catalog().index(values[0])
