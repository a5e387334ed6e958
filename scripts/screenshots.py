"""Remake the README screenshots: every page of the dashboard over real runs, in headless Chromium.

    python scripts/screenshots.py RUN [RUN...] [--out docs/screenshots]
        [--pages overview,heatmap,...] [--prefix NAME-] [--metric compute]

The first run is the one shown; further runs appear on the comparison page. "incidents" is the
overview scrolled to its incidents, restarts and self-checks panel, "findings" to its findings. Needs
the `test` extra (selenium) and the system packages chromium and chromium-driver; run it from a
checkout (it uses tests/browser.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: `tests` is not installed

from megascope.dashboard import ids  # noqa: E402
from megascope.dashboard.app import create_app  # noqa: E402
from tests.browser import chromium_driver, serve_in_thread, wait_for  # noqa: E402

# file name -> (path and query, CSS selector that is present once the page has drawn[, element to
# scroll into view before the picture])
PAGES: dict[str, tuple[str, ...]] = {
    "overview": ("/", f"#{ids.OVERVIEW_MFU} .main-svg"),
    "heatmap": ("/heatmap", f"#{ids.HEATMAP_GRAPH} .main-svg"),
    "links": ("/links?metric=wait", f"#{ids.LINKS_GRAPH} .main-svg"),
    "timeline": ("/timeline?view=pp", f"#{ids.TIMELINE_GRAPH} .main-svg"),
    "topology": ("/topology?color=compute", f"#{ids.TOPOLOGY_RANK_DETAILS}"),
    "gpu": ("/gpu", f"#{ids.GPU_GRAPH} .main-svg"),
    "compare": ("/compare", f"#{ids.COMPARE_MFU} .main-svg"),
    "incidents": ("/", f"#{ids.OVERVIEW_INCIDENTS_BODY}", f"#{ids.OVERVIEW_INCIDENTS}"),
    "findings": ("/", f"#{ids.OVERVIEW_FINDINGS_TABLE}", f"#{ids.OVERVIEW_FINDINGS}"),
}
DEFAULT_PAGES = ("overview", "heatmap", "timeline", "topology", "gpu", "compare")


def take_screenshots(runs: list[str], out_dir: Path, pages: dict[str, tuple[str, ...]] | None = None,
                     extra_query: dict[str, str] | None = None, prefix: str = "") -> list[Path]:
    """One PNG per page (1400x900 window), written to out_dir; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    server = serve_in_thread(create_app(runs, refresh_s=3600))  # no refresh while shooting
    driver = chromium_driver(1400, 900)
    written: list[Path] = []
    try:
        for name, (path, selector, *scroll) in (pages or {n: PAGES[n] for n in DEFAULT_PAGES}).items():
            query = (extra_query or {}).get(name, "")
            driver.get(server.url + path + (("&" if "?" in path else "?") + query if query else ""))
            wait_for(driver, selector)
            if scroll:
                driver.execute_script("document.querySelector(arguments[0]).closest('.panel').scrollIntoView()",
                                      scroll[0])
                time.sleep(0.3)
            target = out_dir / f"{prefix}{name}.png"
            driver.save_screenshot(str(target))
            written.append(target)
    finally:
        driver.quit()
        server.stop()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN")
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--step", type=int, help="step shown in the timeline (default: the latest)")
    parser.add_argument("--rank", type=int, default=0, help="rank selected in timeline and topology")
    parser.add_argument("--pages", default=",".join(DEFAULT_PAGES), help=f"comma-separated, of {', '.join(PAGES)}")
    parser.add_argument("--prefix", default="", help="prefix of the file names (e.g. restart-)")
    parser.add_argument("--metric", default="compute", help="heatmap metric (analyzer/views/heatmap.py METRICS, "
                        "e.g. gc for a garbage-collection finding's cause)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.pages.split(",") if n.strip()]
    if unknown := [n for n in names if n not in PAGES]:
        parser.error(f"unknown page(s) {unknown}; choose from {', '.join(PAGES)}")
    timeline = f"ranks={args.rank}" + (f"&step={args.step}" if args.step is not None else "")
    for path in take_screenshots(args.runs, args.out, {n: PAGES[n] for n in names}, prefix=args.prefix,
                                 extra_query={"timeline": timeline, "topology": f"ranks={args.rank}",
                                              "heatmap": f"metric={args.metric}"}):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
