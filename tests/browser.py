"""A real headless browser for tests: Debian's chromium (scripts/bootstrap installs it), driven by Playwright.

Playwright's own browser download cannot work where the tests run, so it is pointed at the system's
chromium. ``screenshot`` writes a page's picture when ``RLFLEET_SCREENSHOTS`` names a folder (how the
docs' pictures are made: the test that checks a page also draws it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = "RLFLEET_SCREENSHOTS"


@contextlib.contextmanager
def chromium(**context_options) -> Iterator:
    """A browser context (``playwright.sync_api.BrowserContext``) of a fresh headless chromium."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "chromium is not installed (scripts/bootstrap installs it: apt-get install chromium)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_context(**context_options)
        finally:
            browser.close()


def screenshot(page, name: str, *, full_page: bool = True) -> Path | None:
    """``page``'s picture as ``$RLFLEET_SCREENSHOTS/<name>.png``; nothing unless the variable is set."""
    out = os.environ.get(SCREENSHOTS)
    if not out:
        return None
    path = Path(out) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=full_page, animations="disabled")
    return path
