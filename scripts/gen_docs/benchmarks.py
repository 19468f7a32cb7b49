"""docs/benchmarks/*.md: one page per bench, built from the result files under docs/results.

A bench is a script of ``bench/`` (not starting with ``_``, and not a ``loadgen_`` load generator other
benches start) or one of the ``SCRIPTS`` (``scripts/compose-smoke``, the test command ``scripts/test``). Its
page opens with its latest result, then a short history: a table of every run on record, newest first,
with its date, commit and key figures; it ends with the script's own description (the module docstring,
or the leading comment of a shell script). A bench whose runs measure different things (the parts of
``bench/pipeline.py``, the modes of ``bench/fleet.py``) shows a latest result and a history per part
(``LAYOUTS``).

A result file is ``docs/results/<anything>.md`` with a front matter naming the bench and where the numbers
come from::

    ---
    bench: fleet                 # the script's stem (compose-smoke for scripts/compose-smoke, test for scripts/test)
    date: 2026-11-27             # when it ran
    commit: 0c4d2a9              # the code it measured
    machine: 2 cores, 24 GiB, no GPU (shared)
    command: .venv/bin/python bench/fleet.py --rounds 5
    result: {"ratio": 0.97}      # the RESULT line, if the bench prints one (optional)
    figures: {outcome: passed}   # key figures the RESULT line lacks, named as its keys would be (optional)
    attachments: [fleet-2026-11-27.png, fleet-2026-11-27.txt]   # optional, beside the file
    ---
    the table(s) the run printed and what was noticed about it (markdown)

The result files are the records: data files of the repository, left out of the built site
(``exclude_docs`` in mkdocs.yml). The page shows the latest run's body and attachments (a ``.png`` as a
picture, a ``.txt`` as its text, anything else as a link) and names every run's file in its history.
Relative links in the body are written from docs/results and rewritten to resolve from docs/benchmarks
(see ``relink``); a link to another run's record becomes a link to that run's row in a history table.
Every bench must have at least one result, and every result a bench. What a page shows is written for its
readers: no issue, plan step or session, nor who ran what (``tests/unit/test_docs.py`` checks the pages).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ._markdown import cell, generated_banner

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

    @property
    def anchor(self) -> str:
        """The id of this run's row in its page's history table."""
        return self.path.stem

    @property
    def values(self) -> dict:
        """The run's key figures: its ``figures``, overridden by its RESULT line's keys."""
        result = self.meta.get("result")
        if isinstance(result, str):
            result = json.loads(result)
        return {**(self.meta.get("figures") or {}), **(result if isinstance(result, dict) else {})}


SCRIPTS = {"compose-smoke": "docker compose, end to end", "test": "the test command, from a clean clone"}
"""Scripts measured like benches (their page is made from their header comment and their results)."""


@dataclass(frozen=True)
class Figure:
    """A key figure of a run: a column of the history, a row of the latest result's table."""

    label: str
    key: str  # a key of the run's values; "a.b" for b in the dict at a
    format: str = ""  # a str.format spec for the value; "" for the default (``_shown_value``)

    def value(self, values: dict):
        found = values
        for part in self.key.split("."):
            if not isinstance(found, dict):
                return None
            found = found.get(part, found.get(int(part)) if part.isdigit() else None)
            if found is None:
                return None
        return found

    def shown(self, values: dict) -> str:
        value = self.value(values)
        if value is None:
            return "—"
        if self.format and isinstance(value, (int, float)) and not isinstance(value, bool):
            return self.format.format(value)
        return _shown_value(value)


def _shown_value(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        size = abs(value)
        if size >= 100:
            return f"{value:,.0f}"
        if size >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


@dataclass(frozen=True)
class Group:
    """Runs of one bench that measure the same thing: they share a latest result and a history table."""

    title: str
    holds: Callable[[Result], bool]
    figures: tuple[Figure, ...]


def _has(key: str) -> Callable[[Result], bool]:
    return lambda result: Figure("", key).value(result.values) is not None


def _runs(flag: str) -> Callable[[Result], bool]:
    return lambda result: flag in result.meta["command"].split()


def _ratio(label: str, key: str) -> Figure:
    return Figure(label, key, "{:.2f}")


LAYOUTS: dict[str, tuple[Group, ...]] = {
    "codec": (Group("", lambda _: True, (
        _ratio("encode ÷ memory copy, 16 MiB", "encode_over_memcpy_16mib"),
        _ratio("decode ÷ memory copy, 16 MiB", "decode_over_memcpy_16mib"),
        _ratio("gRPC round trip ÷ memory copy, 16 MiB", "grpc_round_trip_over_memcpy_16mib"))),),
    "compose-smoke": (Group("", lambda _: True, (
        Figure("outcome", "outcome"), Figure("seconds in all", "seconds"))),),
    "dataplane": (Group("", lambda _: True, (
        Figure("delivered traj/s", "ceiling_traj_per_s", "{:,.0f}"),
        Figure("collector + reward + trajectory, CPU ms per trajectory", "services_cpu_ms_per_traj", "{:.2f}"),
        Figure("reference, CPU ms per trajectory", "cpu_ms_per_traj.reference", "{:.2f}"),
        Figure("saturates first", "saturates_first"))),),
    "multitenant": (Group("", lambda _: True, (
        _ratio("8 runs' samples/s ÷ one run alone", "aggregate_over_single_run.8"),
        Figure("Jain fairness, equal weights", "jain_fairness", "{:.4f}"),
        Figure("largest share error, weights 1:2:4", "weighted_share_error", "{:.3f}"),
        _ratio("p99 latency while another run pushes ÷ without", "push_impact_p99"),
        Figure("copies of the base weights held", "base_copies", "{:.2f}"))),),
    "dataplane_versus": (Group("", lambda _: True, (
        Figure("against", "base"),
        _ratio("collector + reward + trajectory CPU, new ÷ old", "c+r+t.ratio"),
        _ratio("reference CPU, new ÷ old", "reference.ratio"),
        _ratio("delivered traj/s, new ÷ old", "traj/s.ratio"))),),
    "fleet": (
        Group("Replicas, leave and join", _has("traj_per_s_by_replicas"), (
            Figure("traj/s, 1 replica", "traj_per_s_by_replicas.1", "{:,.0f}"),
            Figure("traj/s, 16 replicas", "traj_per_s_by_replicas.16", "{:,.0f}"),
            Figure("push s, 16 replicas", "push_seconds_by_replicas.16", "{:.3f}"),
            Figure("trajectories lost when a replica dies", "leave_lost_trajectories"))),
        Group("Rolling and pause-all updates", _has("rolling_over_steady"), (
            _ratio("rolling ÷ steady", "rolling_over_steady"),
            _ratio("pause-all ÷ steady", "pause_all_over_steady"),
            _ratio("rolling ÷ pause-all", "rolling_over_pause_all"),
            Figure("pin violations", "pin_violations"))),
        Group("Ray actors and plain processes", _has("ray_over_processes"), (
            _ratio("Ray ÷ processes", "ray_over_processes"),
            Figure("traj/s, processes", "processes_traj_per_s", "{:,.0f}"),
            Figure("traj/s, Ray", "ray_traj_per_s", "{:,.0f}"),
            _ratio("store appends, PostgreSQL ÷ SQLite", "postgres_over_sqlite_appends"))),
    ),
    "generation": (
        Group("The service against the same engine in-process", lambda r: "bench/generation.py" in r.meta["command"], (
            _ratio("service ÷ in-process, tokens/s", "service_over_inprocess"),
            _ratio("model in the engine core ÷ in a worker process", "engine_core_over_worker_process"))),
        Group("vLLM's stream_interval, 1 against 16", _has("cpu_us_per_token_interval_16"), (
            Figure("service CPU µs per token, interval 1", "cpu_us_per_token_interval_1", "{:.1f}"),
            Figure("service CPU µs per token, interval 16", "cpu_us_per_token_interval_16", "{:.1f}"))),
    ),
    "offpolicy_experiment": (
        Group("Every process sharing both cores", lambda r: "--split-cpus" not in r.meta["command"].split(), (
            Figure("best async arm, realistic", "realistic.best_async"),
            _ratio("time to target, best async ÷ sync, realistic", "realistic.time_to_target_best_async_over_sync"),
            Figure("best async arm, today", "today.best_async"),
            _ratio("time to target, best async ÷ sync, today", "today.time_to_target_best_async_over_sync"))),
        Group("Generation on a core of its own (`--split-cpus`)", _runs("--split-cpus"), (
            Figure("best async arm, realistic", "realistic.best_async"),
            _ratio("time to target, best async ÷ sync, realistic", "realistic.time_to_target_best_async_over_sync"),
            Figure("best async arm, today", "today.best_async"),
            _ratio("time to target, best async ÷ sync, today", "today.time_to_target_best_async_over_sync"))),
    ),
    "pipeline": (
        Group("(a) End to end against generation alone", _has("e2e_over_generation"), (
            _ratio("end to end ÷ generation alone", "e2e_over_generation"),
            Figure("end-to-end traj/s", "e2e_traj_per_s", "{:.1f}"))),
        Group("(b) Async against sync", _has("async_over_sync"), (
            _ratio("async ÷ sync", "async_over_sync"),
            _ratio("async ÷ sync, after the first batch", "async_over_sync_after_first_batch"),
            Figure("trainer step s", "step_seconds", "{:.2f}"))),
        Group("(c) End to end against in-process vLLM", _has("e2e_over_inprocess_64"), (
            _ratio("end to end ÷ in-process, 64 tokens", "e2e_over_inprocess_64"),
            _ratio("end to end ÷ in-process, 1,024 tokens", "e2e_over_inprocess_1024"),
            Figure("in-process engine", "inprocess_engine"))),
        Group("(d) Multi-turn episodes against single turns", _has("multiturn_ratio"), (
            _ratio("multi-turn ÷ single turn, tool calls", "multiturn_ratio"),
            _ratio("multi-turn ÷ single turn, tool output canned", "multiturn_canned_tools_ratio"),
            _ratio("multi-turn ÷ single turn, a sandbox per episode", "multiturn_episode_sandbox_ratio"))),
        Group("(e) Weight-swap modes under frequent pushes", _has("swap_traj_per_s"), (
            Figure("traj/s, wait", "swap_traj_per_s.wait", "{:.1f}"),
            Figure("traj/s, abort", "swap_traj_per_s.abort", "{:.1f}"),
            Figure("traj/s, keep", "swap_traj_per_s.keep", "{:.1f}"),
            Figure("traj/s, resume", "swap_traj_per_s.resume", "{:.1f}"),
            _ratio("resume ÷ keep", "resume_over_keep"))),
    ),
    "reference": (Group("", lambda _: True, (
        _ratio("service ÷ in-process, 1 caller", "service_over_inprocess_1"),
        _ratio("service ÷ in-process, 8 callers", "service_over_inprocess_8"),
        _ratio("service ÷ in-process, 64 callers", "service_over_inprocess_64"),
        Figure("padded tokens at 64 callers", "padding_64_callers"))),),
    "sandbox": (Group("", lambda _: True, (
        Figure("CPU ms per call, a fresh sandbox", "idle_current_cpu_ms", "{:.1f}"),
        Figure("CPU ms per call, a sandbox per episode", "idle_episode_cpu_ms", "{:.1f}"),
        Figure("CPU ms per call, no sandbox", "idle_floor_cpu_ms", "{:.1f}"))),),
    "soak": (Group("", lambda _: True, (
        Figure("errors other than backpressure", "non_backpressure_errors"),
        Figure("dead letters", "dead_letters"),
        Figure("RSS growth %", "rss_growth_percent", "{:.1f}"),
        Figure("traj/s", "trajectories_per_second", "{:.1f}"))),),
    "store_appends": (Group("", lambda _: True, (
        _ratio("PostgreSQL ÷ SQLite", "postgres_over_sqlite_appends"),
        Figure("SQLite appends/s", "sqlite_median_appends_per_s", "{:,.0f}"),
        Figure("PostgreSQL appends/s", "postgres_median_appends_per_s", "{:,.0f}"))),),
    "test": (
        Group("A clean clone on 2 cores", lambda r: not r.meta["machine"].startswith("CI"), (
            Figure("outcome", "outcome"), Figure("tests", "tests"),
            Figure("seconds in all", "seconds"), Figure("seconds of pytest", "pytest_seconds"))),
        Group("CI, everything installed from scratch", lambda r: r.meta["machine"].startswith("CI"), (
            Figure("outcome", "outcome"), Figure("seconds in all", "seconds"))),
    ),
    "torchrl_step": (Group("", lambda _: True, (
        _ratio("TorchRL ÷ plain SDK, step time", "torchrl_vs_plain_step_time"),
        Figure("plain step s", "plain_step_seconds", "{:.2f}"),
        Figure("TorchRL step s", "torchrl_step_seconds", "{:.2f}"))),),
    "weights": (Group("", lambda _: True, (
        _ratio("grpc push ÷ raw stream", "grpc_vs_raw"),
        _ratio("shm push ÷ floor", "shm_vs_reload"),
        _ratio("2 replicas ÷ 1", "two_vs_one_replica"),
        _ratio("shm push ÷ floor, the best its CPU seconds allow here", "shm_vs_reload_cpu_bound"),
        _ratio("streamed push ÷ loaded at the commit, 1 replica elsewhere", "streamed_over_unstreamed_1"),
        _ratio("the same, behind a 100 MB/s link", "link_streamed_over_unstreamed"),
        Figure("delta of 1 % of the tensors, bytes ÷ full", "delta_1pct_bytes_ratio", "{:.4f}"),
        Figure("LoRA rank 8, time ÷ full", "lora_r8_over_full", "{:.3f}"),
        _ratio("collector egress ÷ model, 3 replicas elsewhere", "collector_egress_over_model_3"))),),
    "fanout_sim": (Group("", lambda _: True, (
        Figure("70B to 1,024 replicas, star s", "star_70b_1024_s", "{:,.0f}"),
        Figure("70B to 1,024 replicas, relay s", "relay_70b_1024_s", "{:.1f}"),
        Figure("this host's relay rate, MB/s", "calibration_rate_mb_s", "{:.0f}"),
        Figure("fit's largest residual ÷ measured", "calibration_max_residual_rel", "{:.3f}"))),),
}
"""Per bench, what its runs measure and their key figures. A bench not listed, and a run no group of its
bench holds, gets one group whose figures are the run's first few plain values."""

FALLBACK_FIGURES = 4


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
    if not isinstance(meta.get("figures") or {}, dict):
        raise ResultError(f"{_shown(path)}: figures is not a mapping of names to values")
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


def _moved(url: str, source_dir: str, page_dir: str, runs: dict[str, str]) -> str:
    if not url or url.startswith(("#", "/")) or _SCHEME.match(url):
        return url  # an anchor on the same page, a site-absolute path or a URL: not relative to a file
    cut = re.search(r"[#?]", url)
    path, suffix = (url[:cut.start()], url[cut.start():]) if cut else (url, "")
    target = posixpath.normpath(posixpath.join(source_dir, path))
    if target in runs:
        return runs[target]  # a run's record, not a page of the site: its row in a history table
    return posixpath.relpath(target, page_dir) + suffix


def _outside_code(markdown: str, rewrite_prose: Callable[[str], str]) -> str:
    """``markdown`` with ``rewrite_prose`` applied to everything but its fenced code blocks."""
    out, prose, fence = [], [], None
    for line in markdown.splitlines(keepends=True):
        opening = _FENCE.match(line)
        if fence is None and opening:
            out.append(rewrite_prose("".join(prose)))
            prose, fence = [], opening[1]
            out.append(line)
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):  # a closing fence
                fence = None
            out.append(line)
        else:
            prose.append(line)
    out.append(rewrite_prose("".join(prose)))
    return "".join(out)


def relink(markdown: str, source_dir: str, page_dir: str, runs: dict[str, str] | None = None) -> str:
    """``markdown`` written in docs/<source_dir>, its relative links rewritten for a page in docs/<page_dir>.

    Absolute URLs, site-absolute paths and bare anchors are left alone, and so is anything inside
    code (fenced blocks and code spans), which is text, not links. ``runs`` maps a run's record (its
    path under docs/) to the link that replaces a link to it.
    """
    runs = runs or {}

    def rewrite(match: re.Match) -> str:
        return match["head"] + _moved(match["url"], source_dir, page_dir, runs)

    def outside_code_spans(text: str) -> str:
        text = _REFERENCE.sub(rewrite, text)
        pieces, start = [], 0
        for span in _CODE_SPAN.finditer(text):
            pieces += [_INLINE.sub(rewrite, text[start:span.start()]), span[0]]
            start = span.end()
        return "".join(pieces + [_INLINE.sub(rewrite, text[start:])])

    return _outside_code(markdown, outside_code_spans)


def _headings_down(markdown: str) -> str:
    """``markdown`` with its headings one level lower (a body shown under a heading of the page's third level)."""
    return _outside_code(markdown, lambda prose: re.sub(r"^(#{1,5} )", r"#\1", prose, flags=re.MULTILINE))


def _fallback(found: list[Result]) -> tuple[Figure, ...]:
    """The first few plain values (numbers, words) of the runs: the figures of a bench ``LAYOUTS`` lacks."""
    keys: list[str] = []
    for result in found:
        for key, value in result.values.items():
            if isinstance(value, (int, float, str)) and key not in keys:
                keys.append(key)
    return tuple(Figure(key.replace("_", " "), key) for key in keys[:FALLBACK_FIGURES])


def grouped(bench: str, found: list[Result]) -> list[tuple[Group, list[Result]]]:
    """``found`` (runs of ``bench``, newest first) by what they measure, in the order of ``LAYOUTS``; a run
    may measure several things (the parts of one pipeline run). Groups with no run are left out."""
    out = [(group, [r for r in found if group.holds(r)]) for group in LAYOUTS.get(bench, ())]
    out = [(group, runs) for group, runs in out if runs]
    held = {r.path for _, runs in out for r in runs}
    others = [r for r in found if r.path not in held]
    if others:
        out.append((Group("Other runs" if out else "", lambda _: True, _fallback(others)), others))
    return out


def _record(result: Result) -> str:
    return f"docs/{RESULTS_DIR}/{result.path.name}"


def _latest(result: Result, group: Group, runs: dict[str, str], nested: bool) -> list[str]:
    meta = result.meta
    lines = [f"**Machine:** {meta['machine']}  ", f"**Command:** {_code(meta['command'])}  ",
             f"**Record:** `{_record(result)}`", ""]
    shown = [(figure.label, figure.shown(result.values)) for figure in group.figures]
    shown = [(label, value) for label, value in shown if value != "—"]
    if shown:
        lines += ["| key figure | value |", "|---|---:|",
                  *(f"| {cell(label)} | {cell(value)} |" for label, value in shown), ""]
    if result.body:
        body = relink(result.body, RESULTS_DIR, PAGES_DIR, runs)
        lines += [_headings_down(body) if nested else body, ""]
    for name in meta.get("attachments", []):
        attachment = result.path.parent / name
        if attachment.suffix == ".png":
            lines += [f"![{name}](../{RESULTS_DIR}/{name})", ""]
        elif attachment.suffix == ".txt":
            lines += [f"??? note \"{name}\"", "    ```text",
                      *("    " + line if line else "" for line in attachment.read_text().rstrip().splitlines()),
                      "    ```", ""]
        else:
            lines += [f"[`{name}`](../{RESULTS_DIR}/{name})", ""]
    if meta.get("result") is not None:
        value = meta["result"] if isinstance(meta["result"], str) else json.dumps(meta["result"])
        lines += ["??? note \"RESULT line\"", "    ```text", f"    RESULT {value}", "    ```", ""]
    return lines


def _code(text: str) -> str:
    """``text`` as a code span, its fence longer than any run of backticks in it."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if fence != "`" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _history(group: Group, found: list[Result], anchored: set[Path]) -> list[str]:
    """The table of ``found``; a run's record cell carries its anchor the first time the page lists it."""
    head = ["date", "commit", *(figure.label for figure in group.figures), "record"]
    lines = ["| " + " | ".join(cell(h) for h in head) + " |",
             "|---|---|" + "---:|" * len(group.figures) + "---|"]
    for result in found:
        anchor = "" if result.path in anchored else f'<span id="{result.anchor}"></span>'
        anchored.add(result.path)
        figures = [cell(figure.shown(result.values)) for figure in group.figures]
        lines.append(f"| {result.meta['date']} | `{result.meta['commit']}` | " + " | ".join(figures)
                     + (" | " if figures else "") + f"{anchor}`{_record(result)}` |")
    return lines + [""]


def _page(bench: Bench, groups: list[tuple[Group, list[Result]]], runs: dict[str, str]) -> list[str]:
    """The bench's page: per group, its latest run and the history of its runs; then what the bench does."""
    nested = len(groups) > 1
    page = [f"# {bench.name}: {bench.title}", "",
            f"`{bench.script}`" + (": what it does is [at the end of the page](#what-the-bench-does)."
                                   if bench.description else ""), ""]
    level = "###" if nested else "##"
    anchored: set[Path] = set()
    for group, found in groups:
        latest = found[0]
        if nested:
            page += [f"## {group.title}", ""]
        page += [f"{level} Latest result: {latest.meta['date']}, `{latest.meta['commit']}`", "",
                 *_latest(latest, group, runs, nested)]
        page += [f"{level} History", ""]
        if not anchored:
            page += ["Every run on record, newest first. A run's record, a file of the repository, holds its machine, "
                     "its command, the tables it printed and what was noticed about them.", ""]
        page += _history(group, found, anchored)
    if bench.description:
        page += ["## What the bench does", "", bench.description, ""]
    return page


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
    # A link to a run's record (not a page of the site) goes to the run's row in its page's history.
    runs = {f"{RESULTS_DIR}/{r.path.name}": f"{r.meta['bench']}.md#{r.anchor}"
            for found in by_bench.values() for r in found}
    banner = generated_banner("scripts/gen_docs/benchmarks.py", "the bench scripts and docs/results/*.md")
    pages = {}
    index = [*banner, "# Benchmarks", "",
             "Each bench prints a table of ratios measured side by side in one run: the machine these ran "
             "on is shared and noisy, so compare ratios, not absolute numbers. Each page opens with the "
             "bench's latest result (its machine, its command, the tables it printed), then a history of its runs "
             "with their dates, commits and key figures.", "",
             "| bench | what it measures | latest run | commit |", "|---|---|---|---|"]
    for bench in all_benches:
        found = by_bench[bench.name]
        index.append(f"| [{bench.name}]({bench.name}.md) | {bench.title} | {found[0].meta['date']} | "
                     f"`{found[0].meta['commit']}` |")
        own = {record: link.partition("#")[2] for record, link in runs.items() if link.startswith(f"{bench.name}.md#")}
        page_runs = {**runs, **{record: f"#{anchor}" for record, anchor in own.items()}}
        page = [*banner, *_page(bench, grouped(bench.name, found), page_runs)]
        pages[f"{PAGES_DIR}/{bench.name}.md"] = "\n".join(page).rstrip() + "\n"
    pages[f"{PAGES_DIR}/index.md"] = "\n".join(index) + "\n"
    return pages
