"""The docs site's generated pages match their sources, and the paths the docs name exist.

``scripts/gen-docs --check`` is the drift check the test command relies on; these tests show it
fails when a setting, an RPC, a console script or a result file changes without its page.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs.__main__ as gen_docs  # noqa: E402
from gen_docs import api, benchmarks, cli, rewards  # noqa: E402


def test_every_generated_page_matches_its_source(capsys):
    assert gen_docs.main(["--check"]) == 0, capsys.readouterr().err


def test_a_setting_whose_doc_changed_makes_the_settings_page_stale(monkeypatch, capsys):
    from rlfleet.services.trajectory.config import TrajectoryConfig

    monkeypatch.setattr(TrajectoryConfig.model_fields["capacity"], "description", "A changed meaning.")
    assert gen_docs.main(["--check", "--only", "settings"]) == 1
    assert "reference/settings.md" in capsys.readouterr().err


def test_a_new_rpc_makes_the_api_page_stale(monkeypatch, tmp_path, capsys):
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    reward = protos / "rlfleet" / "v1" / "reward.proto"
    text = reward.read_text()
    text = text.replace("service RewardService {",
                        "service RewardService {\n  // A new call nobody documented.\n"
                        "  rpc Forget(ComputeRewardsRequest) returns (ComputeRewardsResponse);", 1)
    reward.write_text(text)
    monkeypatch.setattr(api, "PROTOS", protos)
    assert gen_docs.main(["--check", "--only", "api"]) == 1
    assert "reference/api.md" in capsys.readouterr().err


def test_a_new_console_script_makes_the_cli_page_stale(monkeypatch, capsys):
    scripts = {**cli.console_scripts(), "rlfleet-new": "rlfleet.services.suite:main"}
    monkeypatch.setattr(cli, "console_scripts", lambda: scripts)
    assert gen_docs.main(["--check", "--only", "cli"]) == 1
    assert "reference/cli.md" in capsys.readouterr().err


def test_a_reward_function_whose_doc_changed_makes_the_rewards_page_stale(monkeypatch, capsys):
    from rlfleet.services.reward import scores

    monkeypatch.setattr(scores._REGISTRY["numeric_match"], "__doc__",
                        "A changed meaning.\n\nArgs:\n    tolerance: a changed tolerance.")
    assert gen_docs.main(["--check", "--only", "rewards"]) == 1
    assert "reference/rewards.md" in capsys.readouterr().err


def test_a_reward_function_whose_parameter_is_not_described_is_refused(monkeypatch):
    from rlfleet.services.reward import scores

    monkeypatch.setattr(scores._REGISTRY["exact_match"], "__doc__", "1.0 if the response equals the ground truth.")
    with pytest.raises(RuntimeError, match=r"'exact_match'.*does not describe \['strip', 'ignore_case'\]"):
        rewards.render()


def test_a_result_without_its_commit_is_refused(monkeypatch, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(benchmarks.RESULTS, results)
    (results / "codec-2099-01-01.md").write_text("---\nbench: codec\ndate: 2099-01-01\nmachine: m\n"
                                                 "command: python bench/codec.py\n---\nnumbers\n")
    monkeypatch.setattr(benchmarks, "RESULTS", results)
    assert gen_docs.main(["--check", "--only", "benchmarks"]) == 1
    assert "codec-2099-01-01.md: front matter lacks commit" in capsys.readouterr().err


def test_a_bench_without_a_result_is_refused(monkeypatch, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(benchmarks.RESULTS, results)
    for path in results.glob("*.md"):
        if "bench: codec\n" in path.read_text():
            path.unlink()
    monkeypatch.setattr(benchmarks, "RESULTS", results)
    assert gen_docs.main(["--check", "--only", "benchmarks"]) == 1
    assert "no result file in docs/results for: codec" in capsys.readouterr().err


def test_a_results_relative_links_are_rewritten_to_resolve_from_its_benchmark_page():
    body = ("The run of [before](fleet-2026-11-27-rolling.md#setup), its ![plot](plot.png \"a plot\"),\n"
            "[the guide](../guides/sdk.md), [a site](https://example.org/x.md), [here](#numbers),\n"
            "[root](/index.md), `[code](code.md)`\n[ref]: notes.txt\n```text\n[fenced](fenced.md)\n```\n")
    assert benchmarks.relink(body, "results", "benchmarks") == (
        "The run of [before](../results/fleet-2026-11-27-rolling.md#setup), "
        "its ![plot](../results/plot.png \"a plot\"),\n"
        "[the guide](../guides/sdk.md), [a site](https://example.org/x.md), [here](#numbers),\n"
        "[root](/index.md), `[code](code.md)`\n[ref]: ../results/notes.txt\n```text\n[fenced](fenced.md)\n```\n")


def test_every_relative_link_on_a_benchmark_page_names_a_file_and_every_anchor_a_run_or_heading():
    pages = benchmarks.render()
    missing = []
    for relative, text in pages.items():
        page_dir = (ROOT / "docs" / relative).parent
        for target in re.findall(r"\]\(([^)\s]+)", text):
            path, _, anchor = target.partition("#")
            if "://" in path:
                continue
            if path and not (page_dir / path).is_file():
                missing.append(f"{relative}: {target}")
            elif anchor and anchor not in _anchors(pages[posixpath.normpath(posixpath.join(page_dir.name, path))]
                                                   if path else text):
                missing.append(f"{relative}: {target} (no such anchor)")
    assert not missing, missing


def _anchors(page: str) -> set[str]:
    """The ids of a generated page: its runs' rows and its headings (as the toc names them)."""
    headings = re.findall(r"^#+ (.+)$", page, re.MULTILINE)
    return set(re.findall(r'<span id="([^"]+)">', page)) | {
        re.sub(r"[\s-]+", "-", re.sub(r"[^\w\s-]", "", h.lower())).strip("-") for h in headings}


# What a page written for users does not say: who ran what, in which session, for which issue or step of a plan.
_NOT_FOR_USERS = re.compile(r"\b(?:issues?\b(?:'s)?|(?:this|that|the|an earlier|other|same) sessions?\b|sessions'|"
                            r"stop \d+|I (?:ran|measured)|we (?:ran|measured))|(?<![\w&])#\d+\b", re.IGNORECASE)


def test_the_benchmark_pages_speak_of_no_issue_session_or_who_ran_what():
    found = [f"{relative}: {match[0]!r} in {text[max(0, match.start() - 60):match.end() + 20]!r}"
             for relative, text in benchmarks.render().items() for match in _NOT_FOR_USERS.finditer(text)]
    assert not found, found


def test_the_result_records_are_data_files_left_out_of_the_site():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0].replace("!!python/name:", ""))
    assert "/results/*.md" in config["exclude_docs"].split()
    # So a page never links to a record (it would be a broken link on the site): it names it, and links its row.
    for relative, text in benchmarks.render().items():
        assert not re.search(r"\]\([^)]*results/[^)]*\.md", text), relative


def test_each_page_opens_with_its_latest_result_then_its_history_of_every_run():
    pages = benchmarks.render()
    for result in benchmarks.results():
        page = pages[f"benchmarks/{result.meta['bench']}.md"]
        assert f'<span id="{result.anchor}"></span>`docs/results/{result.path.name}`' in page, result.path.name
    test = pages["benchmarks/test.md"]
    assert test.index("### Latest result: ") < test.index("### History") < test.index("## What the bench does")
    codec = pages["benchmarks/codec.md"]
    assert codec.index("## Latest result: 2026-11-22, `a122575`") < codec.index("## History")
    row = next(line for line in codec.splitlines() if line.startswith("| 2026-11-22 | `a122575` |"))
    assert "| 0.02 | 0.13 | 0.01 |" in row  # the key figures, from the record's front matter


def test_a_new_result_file_becomes_its_pages_latest_result_and_a_row_of_its_history(monkeypatch, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(benchmarks.RESULTS, results)
    result = {"ceiling_traj_per_s": 812.4, "services_cpu_ms_per_traj": 0.81, "saturates_first": "collector",
              "cpu_ms_per_traj": {"collector": 0.4, "reward": 0.2, "trajectory": 0.21, "reference": 1.1}}
    (results / "dataplane-2099-01-01.md").write_text(
        "---\nbench: dataplane\ndate: 2099-01-01\ncommit: 8486d44\nmachine: m\n"
        "command: .venv/bin/python bench/dataplane.py\n"
        f"result: '{json.dumps(result)}'\n---\nThe table it printed.\n")
    runs_before = sum("bench: dataplane\n" in p.read_text() for p in benchmarks.RESULTS.glob("*.md"))
    monkeypatch.setattr(benchmarks, "RESULTS", results)
    page = benchmarks.render()["benchmarks/dataplane.md"]
    assert page.index("## Latest result: 2099-01-01, `8486d44`") < page.index("The table it printed.") \
        < page.index("## History")
    rows = [line for line in page.splitlines() if line.startswith("| 20")]
    assert rows[0] == ('| 2099-01-01 | `8486d44` | 812 | 0.81 | 1.10 | collector | '
                       '<span id="dataplane-2099-01-01"></span>`docs/results/dataplane-2099-01-01.md` |')
    assert len(rows) == 1 + runs_before


def test_a_run_of_several_parts_is_the_latest_of_each_and_a_bench_without_a_layout_gets_its_plain_values(
        monkeypatch, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(benchmarks.RESULTS, results)
    both = {"parts": "cd", "e2e_over_inprocess_64": 0.83, "multiturn_ratio": 0.71}
    (results / "pipeline-2099-01-01.md").write_text(
        "---\nbench: pipeline\ndate: 2099-01-01\ncommit: 8486d44\nmachine: m\n"
        f"command: .venv/bin/python bench/pipeline.py --parts cd\nresult: '{json.dumps(both)}'\n---\n")
    monkeypatch.setattr(benchmarks, "RESULTS", results)
    monkeypatch.delitem(benchmarks.LAYOUTS, "codec")
    pages = benchmarks.render()
    sections = pages["benchmarks/pipeline.md"].split("\n## ")
    for part in ("(c) ", "(d) "):
        section = next(s for s in sections if s.startswith(part))
        assert "### Latest result: 2099-01-01, `8486d44`" in section
    (a,) = [s for s in sections if s.startswith("(a) ")]
    assert "2099-01-01" not in a
    codec = pages["benchmarks/codec.md"]
    assert "| date | commit | encode over memcpy 16mib | decode over memcpy 16mib |" in codec


def _result(name: str, date: str, commit: str) -> benchmarks.Result:
    return benchmarks.Result(Path(name), {"date": date, "commit": commit}, "")


def test_the_latest_run_is_the_latest_date_then_the_latest_commit_then_the_name(monkeypatch):
    ranks = {"c1": 1, "c2": 2, "c3": 3}
    monkeypatch.setattr(benchmarks, "commit_rank", ranks.__getitem__)
    found = [_result("fleet-2026-11-27-rolling.md", "2026-11-27", "c2"),
             _result("fleet-2026-11-26.md", "2026-11-26", "c3"),  # a later commit, an earlier day
             _result("fleet-2026-11-27-rolling-2.md", "2026-11-27", "c3"),
             _result("fleet-2026-11-27-ray.md", "2026-11-27", "c1"),
             _result("fleet-2026-11-27-run-2.md", "2026-11-27", "c1"),
             _result("fleet-2026-11-27-run-10.md", "2026-11-27", "c1")]
    assert [r.path.stem for r in benchmarks.newest_first(found)] == [
        "fleet-2026-11-27-rolling-2", "fleet-2026-11-27-rolling", "fleet-2026-11-27-run-10",
        "fleet-2026-11-27-run-2", "fleet-2026-11-27-ray", "fleet-2026-11-26"]


def test_commits_rank_by_their_place_in_the_history():
    assert benchmarks.commit_rank("8486d44") > benchmarks.commit_rank("d0f974f") > benchmarks.commit_rank("a122575")
    with pytest.raises(benchmarks.ResultError, match="not in this checkout's history"):
        benchmarks.commit_rank("0000000")


def test_the_index_shows_the_later_commit_of_a_day_and_its_page_links_the_earlier_run(monkeypatch, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(benchmarks.RESULTS, results)
    head = "---\nbench: codec\ndate: 2099-01-01\nmachine: m\ncommand: python bench/codec.py\n"
    (results / "codec-2099-01-01-rolling.md").write_text(head + "commit: a122575\n---\nfirst\n")
    (results / "codec-2099-01-01-rolling-2.md").write_text(
        head + "commit: 8486d44\n---\nagain, as [the first](codec-2099-01-01-rolling.md)\n")
    monkeypatch.setattr(benchmarks, "RESULTS", results)
    pages = benchmarks.render()
    row = next(line for line in pages["benchmarks/index.md"].splitlines() if line.startswith("| [codec]"))
    assert row.endswith("| 2099-01-01 | `8486d44` |")
    page = pages["benchmarks/codec.md"]
    # The latest run's link to the earlier one's record goes to that run's row of the history.
    assert "again, as [the first](#codec-2099-01-01-rolling)" in page
    assert '<span id="codec-2099-01-01-rolling"></span>`docs/results/codec-2099-01-01-rolling.md`' in page
    assert page.index("`8486d44`") < page.index("`a122575`")
    assert "first\n" not in page  # an earlier run's body stays in its record


# A repository path in backticks or a link: `services/collector/admission.py`, (../batch-schema.md) aside.
_PATH = re.compile(r"`((?:services|client|bench|examples|scripts|tests|deploy|docker|protos|docs)/[A-Za-z0-9_./-]+)`")


def _hand_written_pages() -> list[Path]:
    generated = {"reference/settings.md", "reference/api.md", "reference/cli.md", "batch-schema.md"}
    pages = [p for p in (ROOT / "docs").rglob("*.md")
             if str(p.relative_to(ROOT / "docs")) not in generated
             and not p.relative_to(ROOT / "docs").parts[0] in ("benchmarks", "results")]
    return [ROOT / "README.md", *pages]


@pytest.mark.parametrize("page", _hand_written_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    missing = []
    for match in _PATH.finditer(page.read_text()):
        name = match.group(1).rstrip(".,:;")
        # Placeholders (`services/<service>/config.py`) and globs name no one file.
        if any(ch in name for ch in "<>*{}"):
            continue
        if not (ROOT / name).exists():
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


def test_the_vendored_scripts_are_the_pinned_packages_files():
    """docs/assets/vendor holds what scripts/vendor-docs-assets fetched and hashed, nothing edited or missing."""
    import hashlib

    vendor = ROOT / "docs" / "assets" / "vendor"
    listed = {}
    for line in (vendor / "SHA256SUMS").read_text().splitlines():
        if line and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            listed[name.removeprefix("./")] = digest
    present = {str(path.relative_to(vendor)) for path in vendor.rglob("*") if path.is_file()} - {"SHA256SUMS"}
    assert present == set(listed) and "mermaid/mermaid.min.js" in listed and "katex/katex.min.js" in listed
    for name, digest in listed.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, f"{name} differs from its pin"
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert all(f"assets/vendor/{name}" in mkdocs for name in ("mermaid/mermaid.min.js", "katex/katex.min.js",
                                                               "katex/auto-render.min.js", "katex/katex.min.css"))
