"""Headless Chromium through selenium, for the browser tests and the README screenshots."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


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
