"""docs/benchmarks/*.md: one page per bench, built from the result files under docs/results.

A bench is a script of ``bench/`` (not starting with ``_``, and not a ``loadgen_`` load generator other
benches start) or ``scripts/compose-smoke``; its page
opens with the script's own description (the module docstring, or the leading comment of a shell
script) and lists its results newest first. A result file is ``docs/results/<anything>.md`` with a
front matter naming the bench and where the numbers come from::

    ---
    bench: fleet                 # the script's stem (compose-smoke for scripts/compose-smoke)
    date: 2026-11-27             # when it ran
    commit: 0c4d2a9              # the code it measured
    machine: 2 cores, 24 GiB, no GPU (shared)
    command: .venv/bin/python bench/fleet.py --rounds 5
    result: {"ratio": 0.97}      # the RESULT line, if the bench prints one (optional)
    attachments: [fleet-2026-11-27.png, fleet-2026-11-27.txt]   # optional, beside the file
    ---
    the table(s) the run printed and what was noticed about it (markdown)

Attachments are shown on the page: a ``.png`` as a picture, a ``.txt`` as its text, anything else
as a link. Every bench must have at least one result, and every result a bench.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ._markdown import generated_banner

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
REQUIRED = ("bench", "date", "commit", "machine", "command")


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


def benches() -> list[Bench]:
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name.startswith(("_", "loadgen_")):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        title, _, rest = doc.partition("\n")
        found.append(Bench(path.stem, f"bench/{path.name}", title.strip().rstrip("."), rest.strip()))
    smoke = ROOT / "scripts" / "compose-smoke"
    comment = []
    for line in smoke.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        comment.append(line[1:].strip())
    text = " ".join(comment)
    found.append(Bench("compose-smoke", "scripts/compose-smoke", "docker compose, end to end", text))
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


def results() -> list[Result]:
    return sorted((read_result(p) for p in RESULTS.glob("*.md")), key=lambda r: (r.meta["date"], r.path.name),
                  reverse=True)


def _result_section(result: Result) -> list[str]:
    meta = result.meta
    lines = [f"## {meta['date']} · `{meta['commit']}`", "",
             f"**Machine:** {meta['machine']}  ", f"**Command:** `{meta['command']}`  ",
             f"**Record:** [`docs/results/{result.path.name}`](../results/{result.path.name})", ""]
    if meta.get("result") is not None:
        value = meta["result"] if isinstance(meta["result"], str) else json.dumps(meta["result"])
        lines += ["```text", f"RESULT {value}", "```", ""]
    if result.body:
        lines += [result.body, ""]
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
