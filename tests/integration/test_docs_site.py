"""The docs site in a real browser, offline: every page of the built site, opened in headless chromium.

The site is built as the test command builds it (``mkdocs build --strict``), served from a local HTTP
server, and every request off that server is refused, as it would fail on a machine with no network.
Each page must then show its diagrams drawn (no mermaid source left), its formulas typeset (no TeX
left), every image loaded, every request to the site answered, and no console error.
``RLFLEET_SCREENSHOTS=DIR`` also writes the pictures of a few pages there (the docs' results).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.browser import chromium, screenshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PAGE_TIMEOUT_MS = 60_000
PICTURED = {"index.html": ("docs-home", ".mermaid"),
            "concepts/sample-walk/index.html": ("docs-sample-walk", ".mermaid"),
            "guides/off-policy/index.html": ("docs-off-policy", ".arithmatex")}
"""Pages whose screenshots go into the docs' results (with ``RLFLEET_SCREENSHOTS``): a screen's worth from
the first diagram or formula."""

# Text of the page outside code, as the reader sees it; TeX or mermaid source left in it was not rendered.
LEFT_OVER_SOURCE = """() => {
  const out = [];
  const walker = document.createTreeWalker(document.querySelector("article") || document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest("pre, code, .katex, script, style")) continue;
    const text = node.textContent;
    if (/\\$\\$|\\\\\\(|\\\\\\[|\\\\(frac|exp|log|sum|text|pi)\\b/.test(text)) out.push("TeX: " + text.trim().slice(0, 80));
  }
  for (const el of document.querySelectorAll(".mermaid")) {
    const drawn = (el.shadowRoot && el.shadowRoot.querySelector("svg")) || el.querySelector("svg");
    if (!drawn) out.push("mermaid source: " + el.textContent.trim().slice(0, 80));
  }
  for (const el of document.querySelectorAll(".arithmatex")) {
    if (!el.querySelector(".katex")) out.push("formula not typeset: " + el.textContent.trim().slice(0, 80));
  }
  for (const img of document.images) {
    if (!img.complete || img.naturalWidth === 0) out.push("image not shown: " + img.getAttribute("src"));
  }
  return out;
}"""
OPEN_SHADOW_ROOTS = """{
  const attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: "open"}); };
}"""
"""Material draws each diagram into a closed shadow root; opened, the test can see the SVG in it."""
RENDERED = """() => [...document.querySelectorAll(".mermaid")].every(
  el => (el.shadowRoot && el.shadowRoot.querySelector("svg")) || el.querySelector("svg"))
  && [...document.querySelectorAll(".arithmatex")].every(el => el.querySelector(".katex"))"""


SEARCH_INDEX = "search/search_index.json"
"""The site's search index (~1 MB): every page's search worker loads and indexes it, which took half the
CPU of opening every page. The sweep below gives each page an empty index instead (the same config, no
documents); ``test_search_finds_pages_offline`` checks the real one on one page."""


def empty_search_index(site_dir: Path) -> str:
    index = json.loads((site_dir / SEARCH_INDEX).read_text())
    return json.dumps({**index, "docs": []})


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """(built site directory, its URL): the docs built and served locally."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _pages(site_dir: Path) -> list[str]:
    return sorted(str(path.relative_to(site_dir)) for path in site_dir.rglob("*.html") if path.name != "404.html")


def test_every_page_renders_offline_with_nothing_left_raw_broken_or_failing(site):
    site_dir, url = site
    pages = _pages(site_dir)
    assert len(pages) > 40 and "guides/off-policy/index.html" in pages
    problems: dict[str, list[str]] = {}
    search_index = empty_search_index(site_dir)
    with chromium(viewport={"width": 1280, "height": 900}, service_workers="block") as context:
        def offline(route) -> None:
            if route.request.url == f"{url}/{SEARCH_INDEX}":
                route.fulfill(status=200, content_type="application/json", body=search_index)
            elif route.request.url.startswith(url):
                route.continue_()
            else:
                problems.setdefault(current, []).append(f"request off the site: {route.request.url}")
                route.abort()
        context.route("**/*", offline)
        context.add_init_script(OPEN_SHADOW_ROOTS)
        page = context.new_page()
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        page.on("console", lambda message: message.type == "error" and problems.setdefault(current, []).append(
            f"console error: {message.text}"))
        page.on("pageerror", lambda error: problems.setdefault(current, []).append(f"page error: {error}"))
        # ERR_ABORTED: a request the next navigation cancelled (a favicon, the search worker), not a failure.
        page.on("requestfailed", lambda request: request.url.startswith(url) and request.failure != "net::ERR_ABORTED"
                and problems.setdefault(current, []).append(f"request failed: {request.url} ({request.failure})"))
        page.on("response", lambda response: response.url.startswith(url) and response.status >= 400 and
                problems.setdefault(current, []).append(f"HTTP {response.status}: {response.url}"))
        for current in pages:
            page.goto(f"{url}/{current}", wait_until="load")
            try:
                page.wait_for_function(RENDERED, timeout=PAGE_TIMEOUT_MS)
            except Exception:  # what is left raw is listed below
                pass
            left = page.evaluate(LEFT_OVER_SOURCE)
            if left:
                problems.setdefault(current, []).extend(left)
            if current in PICTURED:
                name, shown = PICTURED[current]
                page.eval_on_selector(shown, "el => window.scrollTo(0, el.getBoundingClientRect().top + "
                                             "window.scrollY - 120)")
                screenshot(page, name, full_page=False)
    assert not problems, "\n".join(f"{page}: {problem}" for page, found in problems.items() for problem in found)


def test_the_diagrams_and_the_formula_are_drawn_by_the_sites_own_scripts(site):
    """The pages that have them: each mermaid diagram an SVG, the formula typeset by KaTeX (no page can
    pass the check above by having lost its diagrams)."""
    site_dir, url = site
    with chromium(viewport={"width": 1280, "height": 900}) as context:
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
        context.add_init_script(OPEN_SHADOW_ROOTS)
        page = context.new_page()
        counts = {}
        for current in ("index.html", "concepts/sample-walk/index.html", "concepts/versions/index.html",
                        "guides/off-policy/index.html"):
            page.goto(f"{url}/{current}", wait_until="load")
            page.wait_for_function(RENDERED, timeout=PAGE_TIMEOUT_MS)
            counts[current] = page.evaluate("""() => [
                [...document.querySelectorAll(".mermaid")].filter(
                    el => el.shadowRoot && el.shadowRoot.querySelector("svg g")).length,
                document.querySelectorAll(".arithmatex .katex").length]""")
    assert counts["index.html"][0] >= 1 and counts["concepts/sample-walk/index.html"][0] >= 1
    assert counts["concepts/versions/index.html"][0] >= 1
    assert counts["guides/off-policy/index.html"][1] >= 1
    html = (site_dir / "index.html").read_text()
    assert re.search(r'src="[./]*assets/vendor/mermaid/mermaid.min.js"', html), "mermaid is not the site's own"


def test_search_finds_pages_offline(site):
    """The real search index, on the home page: a query typed into the search box lists pages."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    _, url = site
    errors: list[str] = []
    with chromium(viewport={"width": 1280, "height": 900}, service_workers="block") as context:
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
        page = context.new_page()
        page.on("console", lambda message: message.type == "error" and errors.append(message.text))
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{url}/index.html", wait_until="load")
        page.click(".md-search__input", timeout=PAGE_TIMEOUT_MS)
        deadline = time.monotonic() + 2 * PAGE_TIMEOUT_MS / 1000
        while True:  # typed as keys (the search listens to them); again if the index was not ready yet
            page.fill(".md-search__input", "")
            page.locator(".md-search__input").press_sequentially("rolling update", delay=20)
            try:
                page.wait_for_selector(".md-search-result__item", state="attached", timeout=5_000)
                break
            except PlaywrightTimeout:
                assert time.monotonic() < deadline, "no search results: " + page.inner_text(".md-search-result__meta")
        titles = page.eval_on_selector_all(".md-search-result__item", "items => items.map(i => i.textContent)")
    assert titles and any("rolling" in title.lower() for title in titles), titles
    assert not errors, errors
