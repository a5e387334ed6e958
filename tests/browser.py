"""Browser tooling of the tests and of scripts/screenshots.py (not shipped in the package): a Dash app
served from a background thread on 127.0.0.1, and headless Chromium driven through selenium (the
`test` extra) waiting until a page has drawn."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dash
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@dataclass
class BackgroundServer:
    server: BaseWSGIServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args, **kwargs) -> None:  # one line per request drowns test output
        pass


def serve_in_thread(app: dash.Dash, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Start app on host:port (0 picks a free port) in a daemon thread (Werkzeug); stop() ends it."""
    server = make_server(host, port, app.server, threaded=True, request_handler=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="megascope-dashboard", daemon=True)
    thread.start()
    return BackgroundServer(server, thread)


def find_chromium() -> tuple[str, str] | None:
    """(browser binary, chromedriver) from the system packages, None when either is missing."""
    browser = next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def chromium_driver(width: int = 1400, height: int = 900, user_data_dir: str | Path | None = None) -> Any:
    """A selenium WebDriver on headless Chromium; raises RuntimeError when it is not installed."""
    found = find_chromium()
    if found is None:
        raise RuntimeError("Chromium and chromedriver are needed: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir or tempfile.mkdtemp(prefix='megascope-chromium-')}")
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(found[1]), options=options)


def wait_for(driver, selector: str, timeout_s: float = 30.0) -> None:
    """Wait until selector is on the page and Dash has no callback in flight."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(ec.presence_of_element_located((By.CSS_SELECTOR, selector)))
    WebDriverWait(driver, timeout_s).until(
        lambda d: not d.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']"))
    time.sleep(0.8)  # let Plotly finish its transitions before the picture is taken
