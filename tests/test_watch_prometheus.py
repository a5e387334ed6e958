"""The shipped alert rules against a real Prometheus (the `prometheus` binary; skipped without it).

Prometheus runs on loopback with samples/prometheus/alerts.yml and scrapes two watchers every
second: one beside a clean simulated run, one beside a run with a straggler from step ONSET. The
straggler run is held at step ONSET + 3 (no later step lands) until the alert fires, so the alert
comes within 3 steps of the onset by construction, not by a timing assertion. No alert of any kind
may have been pending or firing for the clean run (ALERTS over the whole test)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from megascope.analyzer.watch.metrics import WatchMetrics
from megascope.analyzer.watch.watcher import WatchConfig, Watcher
from tests.watch_feed import Feeder, simulate_steps

ROOT = Path(__file__).parents[1]
RULES = ROOT / "samples" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "samples" / "grafana-megascope-watch.json"
ONSET = 8
WAIT_S = 90.0  # generous: a loaded 2-core box; the test ends as soon as the alert fires

needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed "
                                      "(.ci/run installs the Debian package)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


def start_prometheus(tmp: Path, targets: dict[str, int]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    scrapes = "\n".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{p}']"
                        for job, p in targets.items())
    config = tmp / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"rule_files:\n  - {RULES}\nscrape_configs:\n{scrapes}\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2):
                return proc, port
        except OSError:
            if proc.poll() is not None:
                raise AssertionError((tmp / "prometheus.log").read_text()) from None
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("prometheus did not become ready")


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_promtool_accepts_the_rules():
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    done = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


@needs_prometheus
def test_straggler_alert_fires_within_3_steps_and_clean_run_stays_quiet(tmp_path):
    clean_src = simulate_steps(tmp_path / "clean_src", steps=16, seed=3)
    slow_src = simulate_steps(tmp_path / "slow_src", steps=20, inject=[f"straggler:rank=5,slowdown=0.3,from={ONSET}"])
    ports = {"clean": free_port(), "straggler": free_port()}
    clean = Watcher(tmp_path / "clean", WatchConfig(metrics_port=ports["clean"], summary=False))
    slow = Watcher(tmp_path / "slow", WatchConfig(metrics_port=ports["straggler"], summary=False))
    prom, prom_port = start_prometheus(tmp_path, ports)
    try:
        feeder = Feeder(clean_src, tmp_path / "clean")
        for _ in range(feeder.total):
            feeder.feed(4)
            if clean.poll():
                break
        assert clean.state.analyzed_step == 15 and clean.records == []
        feeder = Feeder(slow_src, tmp_path / "slow")
        while feeder.next <= ONSET + 3:  # land steps 0 .. ONSET + 3, then hold the run there
            feeder.feed(1)
            slow.poll()
        assert slow.state.analyzed_step == ONSET + 3

        def firing():
            return [a for a in api(prom_port, "alerts")["alerts"]
                    if a["labels"]["alertname"] == "MegascopeStraggler" and a["state"] == "firing"]
        alerts = wait_for(firing, "the straggler alert to fire")
        assert [(a["labels"]["job"], a["labels"]["rank"]) for a in alerts] == [("straggler", "5")]
        step = api(prom_port, "query", query='megascope_completed_step{job="straggler"}')["result"]
        assert int(float(step[0]["value"][1])) <= ONSET + 3
        # the clean watcher was scraped at its last step, and nothing ever alerted on it
        wait_for(lambda: api(prom_port, "query", query='megascope_completed_step{job="clean"} == 15')["result"],
                 "the clean run's last step in Prometheus")
        assert api(prom_port, "query", query='count_over_time(ALERTS{job="clean"}[10m])')["result"] == []
        # the straggler slows the whole job by ~30%: an MFU drop is true (pending: it needs 5 minutes);
        # anything else (hang, flap, late launch) would be a false alert
        others = api(prom_port, "query",
                     query='ALERTS{job="straggler", alertname!~"MegascopeStraggler|MegascopeMfuDrop"}')
        assert others["result"] == []
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
        clean.close()
        slow.close()


def test_rules_and_dashboard_name_only_exported_metrics():
    """A renamed metric would leave an alert that never fires and an empty panel: catch it here."""
    families = list(WatchMetrics("r").registry.collect())
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    exprs = re.findall(r"^\s*expr: (.+)$", RULES.read_text(), re.MULTILINE)  # (no YAML parser in the deps)
    assert len(exprs) == 7
    exprs += [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    named = {name for expr in exprs for name in re.findall(r"\b(megascope_[a-z0-9_]+)", expr)}
    assert named and named <= exported, named - exported
    assert {"megascope_straggler_score", "megascope_seconds_since_last_step", "megascope_mfu",
            "megascope_tracer_dropped_events", "megascope_findings_open"} <= named


def test_metrics_endpoint_has_bounded_series(tmp_path):
    """/metrics without Prometheus: the flagged rank only, per-stage aggregates, the run's progress."""
    from prometheus_client.parser import text_string_to_metric_families

    src = simulate_steps(tmp_path / "src", steps=20, inject=[f"straggler:rank=5,slowdown=0.3,from={ONSET}"])
    watcher = Watcher(tmp_path / "live", WatchConfig(metrics_port=0, summary=False), log=lambda m: None)
    try:
        feeder = Feeder(src, tmp_path / "live")
        while feeder.next <= ONSET + 4:
            feeder.feed(1)
            watcher.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{watcher.server.server_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        watcher.close()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    assert samples["megascope_straggler_score"] == [({"rank": "5", "kind": "straggler"}, pytest.approx(1.3, abs=0.1))]
    assert sorted(labels["stage"] for labels, _ in samples["megascope_stage_step_time_max_seconds"]) == ["0", "1"]
    assert samples["megascope_completed_step"] == [({}, ONSET + 4)]
    open_ = {labels["kind"]: v for labels, v in samples["megascope_findings_open"]}
    assert open_["straggler"] == 1 and sum(open_.values()) == 1
    announced = {labels["kind"]: v for labels, v in samples["megascope_findings_total"]}
    assert announced["straggler"] == 1 and sum(announced.values()) == 1
    assert 0 < samples["megascope_mfu"][0][1] < 1 and samples["megascope_tokens_per_second"][0][1] > 0
