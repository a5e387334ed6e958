"""The link view on the real trainer's trace (not the simulator's): a `megascope train` job of two pipeline
stages, its cells checked against the raw events through the dashboard's callback. Its own module: the
callbacks module keeps a request context of its app open, in which Dash refuses to build another app."""

from __future__ import annotations

import subprocess
import sys

import pytest

analyzer = pytest.importorskip("megascope.analyzer")
if not hasattr(analyzer, "Run"):
    pytest.skip("the analyzer facade (megascope.analyzer.Run) is not built yet", allow_module_level=True)

from megascope.dashboard.app import create_app  # noqa: E402


@pytest.mark.slow
def test_link_view_of_the_real_trainer_reads_its_waits_and_payloads(tmp_path):
    """A `megascope train` job of two pipeline stages (gloo, async p2p with `<op>.wait` spans): each
    step's cell is what the raw events say, computed here in pandas: the ends' waits toward each other,
    the slower direction's fastest transfer (a send's or the matching receive's span, whichever is
    shorter), and that direction's payload over it."""
    run_dir = tmp_path / "real"
    subprocess.run([sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--pp", "2", "--steps", "6",
                    "--run-dir", str(run_dir)], check=True, capture_output=True, timeout=600)
    app = create_app([run_dir])
    from megascope.dashboard.pages import links

    with app.server.test_request_context():
        figures = {m: links.update_links(m, 0, 0)[0] for m in ("wait", "transfer", "rate")}
    assert [y.split(" · ")[1] for y in figures["wait"].data[0].y] == ["0-1"]
    steps = [int(x) for x in figures["wait"].data[0].x]
    events = analyzer.Run.open(run_dir).store.query("SELECT * FROM events WHERE peer >= 0")
    events["dur"] = (events.end_ns - events.start_ns) / 1e9
    assert events["name"].str.endswith(".wait").any(), "the real trainer's p2p ops have wait spans"
    for col, step in enumerate(steps):
        e = events[events.step == step]
        p2p = e[e.kind == "p2p"]

        def fastest(src: int, dst: int) -> tuple[float, float]:
            sends = p2p[(p2p["rank"] == src) & (p2p.peer == dst) & p2p["name"].str.startswith("send")]
            recvs = p2p[(p2p["rank"] == dst) & (p2p.peer == src) & p2p["name"].str.startswith("recv")]
            return min(sends.dur.min(), recvs.dur.min()), sends["bytes"].mean()

        (ab, ab_bytes), (ba, ba_bytes) = fastest(0, 1), fastest(1, 0)
        expected = {"wait": e[e["name"].str.endswith(".wait")].dur.sum(), "transfer": max(ab, ba),
                    "rate": min(ab_bytes / ab, ba_bytes / ba)}
        for metric, value in expected.items():
            assert float(figures[metric].data[0].customdata[0][col]) == pytest.approx(value, rel=1e-6), (metric, step)
