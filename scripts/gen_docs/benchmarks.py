"""docs/benchmarks/*.md: one page per bench, built from the result files under docs/results.

A bench is a script of ``bench/`` (not starting with ``_``, and not a ``loadgen_`` load generator other
benches start) or one of the ``SCRIPTS`` (``scripts/compose-smoke``, the test command ``scripts/test``); its page
opens with the script's own description (the module docstring, or the leading comment of a shell
script) and lists its results newest first. A result file is ``docs/results/<anything>.md`` with a
front matter naming the bench and where the numbers come from::

    ---
    bench: fleet                 # the script's stem (compose-smoke for scripts/compose-smoke, test for scripts/test)
    date: 2026-11-27             # when it ran
    commit: 0c4d2a9              # the code it measured
    machine: 2 cores, 24 GiB, no GPU (shared)
    command: .venv/bin/python bench/fleet.py --rounds 5
    result: {"ratio": 0.97}      # the RESULT line, if the bench prints one (optional)
    attachments: [fleet-2026-11-27.png, fleet-2026-11-27.txt]   # optional, beside the file
    ---
    the table(s) the run printed and what was noticed about it (markdown)

Attachments are shown on the page: a ``.png`` as a picture, a ``.txt`` as its text, anything else
as a link. Relative links in the body are written from docs/results and rewritten to resolve from
docs/benchmarks (see ``relink``). Every bench must have at least one result, and every result a bench.

Newest first means by date, then by the measured commit's place in the history (a day holds several
runs; the file name says nothing about their order), then by file name with its numbers read as
numbers.
"""

from __future__ import annotations

import ast
import functools
import json
import posixpath
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from ._markdown import generated_banner

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
REQUIRED = ("bench", "date", "commit", "machine", "command")
# Where, under docs/, the result files sit and the pages that show them are written.
RESULTS_DIR = "results"
PAGES_DIR = "benchmarks"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    title: str
    description: str


@dataclass(frozen=True)
class Result:
    path: Path
    meta: dict
    body: str


SCRIPTS = {"compose-smoke": "docker compose, end to end", "test": "the test command, from a clean clone"}
"""Scripts measured like benches (their page is made from their header comment and their results)."""


def benches() -> list[Bench]:
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name.startswith(("_", "loadgen_")):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        title, _, rest = doc.partition("\n")
        found.append(Bench(path.stem, f"bench/{path.name}", title.strip().rstrip("."), rest.strip()))
    for name, title in SCRIPTS.items():
        comment = []
        for line in (ROOT / "scripts" / name).read_text().splitlines()[1:]:
            if not line.startswith("#"):
                break
            comment.append(line[1:].strip())
        found.append(Bench(name, f"scripts/{name}", title, " ".join(comment)))
    return found


class ResultError(ValueError):
    """A result file the page cannot be built from (names the file and what is wrong)."""


def _shown(path: Path) -> str:
    """``path`` as the error names it: relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read_result(path: Path) -> Result:
    text = path.read_text()
    if not text.startswith("---\n"):
        raise ResultError(f"{_shown(path)}: no front matter (--- ... ---)")
    head, sep, body = text[4:].partition("\n---\n")
    if not sep:
        raise ResultError(f"{_shown(path)}: front matter not closed by ---")
    meta = yaml.safe_load(head) or {}
    missing = [key for key in REQUIRED if not meta.get(key)]
    if missing:
        raise ResultError(f"{_shown(path)}: front matter lacks {', '.join(missing)}")
    for name in meta.get("attachments", []):
        if not (path.parent / name).is_file():
            raise ResultError(f"{_shown(path)}: attachment {name} is not in {_shown(path.parent)}")
    meta["date"] = str(meta["date"])
    meta["commit"] = str(meta["commit"])
    return Result(path, meta, body.strip())


@functools.cache
def commit_rank(commit: str) -> int:
    """How many commits ``commit`` has behind it, itself included: a later commit ranks higher.

    The count of ancestors does not move when history grows on top of it (unlike a position in
    ``git log``), so the pages it orders stay put until a result changes.
    """
    done = subprocess.run(["git", "rev-list", "--count", f"{commit}^{{commit}}", "--"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ResultError(f"commit {commit} is not in this checkout's history, so its runs cannot be ordered "
                          f"(a shallow clone? {done.stderr.strip()})")
    return int(done.stdout)


def _natural(name: str) -> tuple:
    """``name`` with its digit runs as numbers: ``run-10`` after ``run-2``, ``rolling-2`` after ``rolling``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def newest_first(found: list[Result]) -> list[Result]:
    """``found`` ordered latest run first: by date, then by the measured commit, then by file name."""
    def age(result: Result) -> tuple:
        try:
            rank = commit_rank(result.meta["commit"])
        except ResultError as err:
            raise ResultError(f"{_shown(result.path)}: {err}") from None
        return result.meta["date"], rank, _natural(result.path.stem)
    return sorted(found, key=age, reverse=True)


def results() -> list[Result]:
    return newest_first([read_result(p) for p in RESULTS.glob("*.md")])


# An inline link or image target, ``](target)`` or ``](<target> "title")``, and a reference definition,
# ``[name]: target``; group "url" is the target.
_INLINE = re.compile(r"(?P<head>\]\(\s*<?)(?P<url>[^)\s<>]+)")
_REFERENCE = re.compile(r"(?P<head>^ {0,3}\[[^\]]+\]:[ \t]*<?)(?P<url>[^\s<>]+)", re.MULTILINE)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)[^`]*?\1")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _moved(url: str, source_dir: str, page_dir: str) -> str:
    if not url or url.startswith(("#", "/")) or _SCHEME.match(url):
        return url  # an anchor on the same page, a site-absolute path or a URL: not relative to a file
    cut = re.search(r"[#?]", url)
    path, suffix = (url[:cut.start()], url[cut.start():]) if cut else (url, "")
    target = posixpath.normpath(posixpath.join(source_dir, path))
    return posixpath.relpath(target, page_dir) + suffix


def relink(markdown: str, source_dir: str, page_dir: str) -> str:
    """``markdown`` written in docs/<source_dir>, its relative links rewritten for a page in docs/<page_dir>.

    Absolute URLs, site-absolute paths and bare anchors are left alone, and so is anything inside
    code (fenced blocks and code spans), which is text, not links.
    """
    def rewrite(match: re.Match) -> str:
        return match["head"] + _moved(match["url"], source_dir, page_dir)

    def outside_code_spans(text: str) -> str:
        text = _REFERENCE.sub(rewrite, text)
        pieces, start = [], 0
        for span in _CODE_SPAN.finditer(text):
            pieces += [_INLINE.sub(rewrite, text[start:span.start()]), span[0]]
            start = span.end()
        return "".join(pieces + [_INLINE.sub(rewrite, text[start:])])

    out, prose, fence = [], [], None
    for line in markdown.splitlines(keepends=True):
        opening = _FENCE.match(line)
        if fence is None and opening:
            out.append(outside_code_spans("".join(prose)))
            prose, fence = [], opening[1]
            out.append(line)
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):  # a closing fence
                fence = None
            out.append(line)
        else:
            prose.append(line)
    out.append(outside_code_spans("".join(prose)))
    return "".join(out)


def _result_section(result: Result) -> list[str]:
    meta = result.meta
    lines = [f"## {meta['date']} · `{meta['commit']}`", "",
             f"**Machine:** {meta['machine']}  ", f"**Command:** `{meta['command']}`  ",
             f"**Record:** [`docs/results/{result.path.name}`](../results/{result.path.name})", ""]
    if meta.get("result") is not None:
        value = meta["result"] if isinstance(meta["result"], str) else json.dumps(meta["result"])
        lines += ["```text", f"RESULT {value}", "```", ""]
    if result.body:
        lines += [relink(result.body, RESULTS_DIR, PAGES_DIR), ""]
    for name in meta.get("attachments", []):
        attachment = result.path.parent / name
        if attachment.suffix == ".png":
            lines += [f"![{name}](../results/{name})", ""]
        elif attachment.suffix == ".txt":
            lines += [f"??? note \"{name}\"", "    ```text",
                      *("    " + line if line else "" for line in attachment.read_text().rstrip().splitlines()),
                      "    ```", ""]
        else:
            lines += [f"[`{name}`](../results/{name})", ""]
    return lines


def render() -> dict[str, str]:
    all_benches = benches()
    by_bench: dict[str, list[Result]] = {b.name: [] for b in all_benches}
    for result in results():
        if result.meta["bench"] not in by_bench:
            raise ResultError(f"{_shown(result.path)}: bench {result.meta['bench']!r} is not a bench "
                              f"(one of {', '.join(by_bench)})")
        by_bench[result.meta["bench"]].append(result)
    empty = [name for name, found in by_bench.items() if not found]
    if empty:
        raise ResultError(f"no result file in docs/results for: {', '.join(empty)} (every bench needs one)")
    banner = generated_banner("scripts/gen_docs/benchmarks.py", "the bench scripts and docs/results/*.md")
    pages = {}
    index = [*banner, "# Benchmarks", "",
             "Each bench prints a table of ratios measured side by side in one run: the machine these ran "
             "on is shared and noisy, so compare ratios, not absolute numbers. Every figure here comes from "
             "a result file under `docs/results/` that records its date, commit and machine.", "",
             "| bench | what it measures | latest run | commit |", "|---|---|---|---|"]
    for bench in all_benches:
        found = by_bench[bench.name]
        index.append(f"| [{bench.name}]({bench.name}.md) | {bench.title} | {found[0].meta['date']} | "
                     f"`{found[0].meta['commit']}` |")
        page = [*banner, f"# {bench.name}: {bench.title}", "", f"`{bench.script}`", ""]
        if bench.description:
            page += [bench.description, ""]
        for result in found:
            page += _result_section(result)
        pages[f"benchmarks/{bench.name}.md"] = "\n".join(page).rstrip() + "\n"
    pages["benchmarks/index.md"] = "\n".join(index) + "\n"
    return pages
