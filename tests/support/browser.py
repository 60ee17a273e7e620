"""A real headless Chromium driven by Selenium, for the console's browser tests.

Debian's `chromium` and `chromium-driver` (same version); other paths through
SERVEWELL_CHROMIUM / SERVEWELL_CHROMEDRIVER. Selenium is told both paths, so it never tries to
download a browser or a driver.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = os.environ.get("SERVEWELL_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SERVEWELL_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def headless_chromium(profile_dir: Path, width: int = 1440, height: int = 1600) -> webdriver.Chrome:
    """A fresh browser with its own profile in `profile_dir`, keeping every console message."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            raise RuntimeError(f"{path} is missing: install Debian's chromium and chromium-driver "
                               "(or set SERVEWELL_CHROMIUM / SERVEWELL_CHROMEDRIVER)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


def console_problems(driver: webdriver.Chrome, seen: list[dict[str, Any]] | None = None) -> list[str]:
    """Messages the page logged at error level (JavaScript exceptions, failed loads, blocked by the
    Content-Security-Policy) since the last call; every entry is also appended to `seen`."""
    entries = driver.get_log("browser")
    if seen is not None:
        seen.extend(entries)
    return [e["message"] for e in entries
            if e["level"] == "SEVERE" or "Content Security Policy" in e["message"]]
