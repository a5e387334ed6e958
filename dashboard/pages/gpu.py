"""GPU health: NVML samples over time (utilization, memory, power, temperature, clocks, errors)."""

from __future__ import annotations

import dash
import pandas as pd
from dash import Input, Output, callback, dcc, html
from dash.development.base_component import Component

from megascope.dashboard import ids
from megascope.dashboard.runs import current_catalog
from megascope.dashboard.series_figure import gpu_figure
from megascope.dashboard.widgets import data_table

dash.register_page(__name__, path="/gpu", name="GPU health", order=5, title="megascope: GPU health")

GPU_METRICS = {"gpu_util": "GPU utilization (%)", "mem_util": "memory utilization (%)",
               "mem_used_bytes": "memory used (bytes)", "power_w": "power (W)", "temp_c": "temperature (C)",
               "sm_clock_mhz": "SM clock (MHz)", "pcie_tx_kbs": "PCIe TX (KB/s)", "pcie_rx_kbs": "PCIe RX (KB/s)",
               "nvlink_tx_kbs": "NVLink TX (KB/s)", "nvlink_rx_kbs": "NVLink RX (KB/s)"}


def layout(**_query: str) -> html.Div:
    return html.Div([
        html.H2("GPU health"),
        html.Div(className="controls", children=[
            html.Label(["metric", dcc.Dropdown(id=ids.GPU_METRIC, value="gpu_util", clearable=False,
                                               options=[{"label": v, "value": k} for k, v in GPU_METRICS.items()])]),
        ]),
        dcc.Loading(dcc.Graph(id=ids.GPU_GRAPH, config={"displaylogo": False})),
        html.Div(className="panel", children=[html.H3("Ranks with throttling or ECC errors"),
                                              html.Div(id=ids.GPU_PROBLEMS)]),
    ])


@callback(Output(ids.GPU_GRAPH, "figure"), Output(ids.GPU_PROBLEMS, "children"),
          Input(ids.GPU_METRIC, "value"), Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_gpu(metric: str, run_value: int | None, _tick: int | None):
    metric = metric if metric in GPU_METRICS else "gpu_util"
    return current_catalog().cached(run_value, ("gpu", metric), lambda run: (
        gpu_figure(run.gpu(), metric), problems_table(run.gpu())))


def problems_table(samples: pd.DataFrame) -> Component:
    """Per rank: samples with a clocks-event (throttle) reason, and the highest ECC error count."""
    if samples.empty:
        return html.P("No GPU samples in this run (CPU run, or NVML unavailable).", className="muted")
    per_rank = samples.groupby("rank").agg(
        throttled_samples=("throttle_reasons", lambda s: int((s != 0).sum())),
        ecc_errors=("ecc_errors", "max"), max_temp_c=("temp_c", "max")).reset_index()
    bad = per_rank[(per_rank["throttled_samples"] > 0) | (per_rank["ecc_errors"] > 0)]
    if bad.empty:
        return html.P(f"All {len(per_rank)} GPUs clean: no throttling, no ECC errors.", className="muted")
    return data_table(bad)
