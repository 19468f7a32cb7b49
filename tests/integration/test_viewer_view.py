"""``rlfleet-suite --view`` on a finished run, in a real browser: the one command that opens the rollout
viewer on what a run left (scripts/demo ends by naming it).

The run's work directory is what a stopped suite leaves: the trajectory store's SQLite file (written by
the store's own code, as the service writes it) and the port files of services that have exited. The
command starts the trajectory service on that store and the viewer (``--suite-dir``), which finds them
from the port files; the page shows the store's versions and samples and says that the collector does
not answer; Ctrl-C stops both.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlfleet.services.launch import free_port, written_address
from rlfleet.services.trajectory.store import TrajectoryStore
from tests.browser import chromium, screenshot
from rlfleet.wire import Ragged, encode_tensordict
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(600)]

START_TIMEOUT = 300.0
VERSIONS = 3
LONG_PROMPT = 100
"""Tokens of the prompt of version 2's first group: longer than the page shows unfolded."""
LONG_LINE = 300
"""Tokens of a response without a space: 300 characters, wider than the window."""
DIFFS = [[0.5, 1.0, 2.0, 4.0], [-1.0, -3.0, 6.0, 0.0]]
"""Behaviour minus reference log-probability of each response token of a group's two samples."""


def scored_group(version: int, group: int, prompt_length: int, response: list[int] | None = None):
    """One group of 2 as the collector appends it: tokens, behaviour and reference log-probs (``DIFFS``
    apart), per-token versions, score (``10 * version + group % 10 + sample``) and advantage; ``response``:
    both samples' response tokens instead, at the reference's log-probs."""
    def nested(rows):
        return Ragged.from_list(rows).to_nested()

    prompts = [torch.arange(prompt_length, dtype=torch.int64) % 50 + 10 for _ in range(2)]
    if response is None:
        responses, diffs = [torch.arange(4, dtype=torch.int64) + 60 + sample for sample in range(2)], DIFFS
    else:
        responses, diffs = [torch.tensor(response, dtype=torch.int64)] * 2, [[0.0] * len(response)] * 2
    behaviour = [torch.full((len(r),), -1.0) for r in responses]
    td = TensorDict({
        "tokens": TensorDict({"prompt": nested(prompts), "response": nested(responses),
                              "full": nested([torch.cat(pair) for pair in zip(prompts, responses)])}, batch_size=[2]),
        "log_probs": TensorDict({"response": nested(behaviour)}, batch_size=[2]),
        "ref_log_probs": TensorDict({"response": nested([b - torch.tensor(d) for b, d in zip(behaviour, diffs)])},
                                    batch_size=[2]),
        "versions": TensorDict({"response": nested([torch.full((len(r),), version) for r in responses])},
                               batch_size=[2]),
        "score": torch.tensor([10.0 * version + group % 10 + sample for sample in range(2)]),
        "advantage": torch.tensor([-0.5, 0.5]),
        "group_id": torch.full((2,), group, dtype=torch.int64),
        "group_size": torch.full((2,), 2, dtype=torch.int64),
        "policy_version_start": torch.full((2,), version, dtype=torch.int64),
        "policy_version_end": torch.full((2,), version, dtype=torch.int64),
    }, batch_size=[2])
    td["trajectory_id"] = NonTensorStack.from_list([f"traj-{group}-{sample}" for sample in range(2)])
    td["prompt_id"] = NonTensorStack.from_list([f"prompt-{group}"] * 2)
    td["reward_fn"] = NonTensorStack.from_list(["numeric_match"] * 2)
    td["ground_truth"] = NonTensorStack.from_list([f"answer-{group % 10}"] * 2)
    return encode_tensordict(td)


def finished_run(workdir) -> int:
    """A stopped suite's work directory: 2 groups of 2 per version in the store, and the port file of a
    collector that has exited; returns that collector's port."""
    (workdir / "trajectory").mkdir(parents=True)
    store = TrajectoryStore(str(workdir / "trajectory" / "trajectories.db"), 1000)
    for version in range(VERSIONS):
        for group in (10 * version, 10 * version + 1):
            long = version == VERSIONS - 1 and group % 10 == 0
            store.append(scored_group(version, group, LONG_PROMPT if long else 6), committed_version=version)
    store.close()
    (workdir / "collector").mkdir()
    port = free_port()  # nothing listens there: the collector is gone
    (workdir / "collector" / "collector.port").write_text(str(port))
    return port


def test_view_opens_the_viewer_on_a_finished_run_and_says_the_collector_is_gone(tmp_path, tiny_model_dir):
    workdir = tmp_path / "suite"
    collector_port = finished_run(workdir)
    with viewing(workdir, tiny_model_dir) as url:
        trajectory = written_address(workdir / "trajectory", "trajectory")
        with chromium(viewport={"width": 1400, "height": 1000}) as context:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            page.wait_for_selector("body[data-ready=true]")
            page.wait_for_selector("#notice:not([hidden])")
            # A sentence, not gRPC's error: its message (connection refused ...) is the tooltip.
            notice = page.locator("#notice").inner_text()
            assert notice == (f"the collector at 127.0.0.1:{collector_port} does not answer (UNAVAILABLE): "
                              f"showing what the trajectory store holds")
            assert not any(raw in notice for raw in ("_InactiveRpcError", "AioRpcError", "StatusCode.", "failed to"))
            assert "failed to connect" in page.locator("#notice").get_attribute("title")
            assert page.locator("#version-table tbody tr").count() == VERSIONS
            assert "12 ready" in page.locator("#run").inner_text()
            page.click("#version-table th:nth-child(1)")  # sorted by version, ascending
            assert page.locator("#version-table tbody tr td:nth-child(1)").all_inner_texts() == ["0", "1", "2"]
            screenshot(page, "viewer-finished-run")
            charts_follow_the_window(page)
            samples_sort_count_and_open_beside_the_table(page)
            texts_and_search(page, tiny_model_dir)
            ground_truth_reward_and_a_comparison(page)
            page.click("nav button[data-tab=failures]")
            page.wait_for_selector("#failure-table tbody td.notice")
            assert "does not answer" in page.locator("#failure-table tbody").inner_text()
    with pytest.raises(urllib.error.URLError):  # the viewer stopped with it
        urllib.request.urlopen(url, timeout=10)
    from rlfleet.services import healthcheck

    with pytest.raises(Exception):  # and the trajectory service it started
        healthcheck.check(trajectory, timeout=5.0)


def charts_follow_the_window(page) -> None:
    width = "document.querySelector('#chart-score .uplot').getBoundingClientRect().width"
    wide = page.evaluate(width)
    page.set_viewport_size({"width": 900, "height": 1000})
    page.wait_for_function(f"{width} < {wide} - 100")
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.wait_for_function(f"{width} > {wide} - 5")


def samples_sort_count_and_open_beside_the_table(page) -> None:
    rows = "#sample-table tbody tr"
    page.click("nav button[data-tab=samples]")
    page.wait_for_function(f"document.querySelectorAll('{rows}').length === 12")
    assert page.locator("#sample-count").inner_text() == "12 shown of 12 matching (12 in the sample log)"
    page.fill("input[name=min_score]", "11")
    page.click("#sample-filters button[type=submit]")
    page.wait_for_function(f"document.querySelectorAll('{rows}').length === 7")  # 11, 11, 12 and version 2
    assert page.locator("#sample-count").inner_text() == "7 shown of 7 matching (12 in the sample log)"
    page.fill("input[name=min_score]", "")
    page.click("#sample-filters button[type=submit]")
    page.wait_for_function(f"document.querySelectorAll('{rows}').length === 12")
    scores = lambda: [float(text) for text in page.locator(f"{rows} td:nth-child(3)").all_inner_texts()]  # noqa: E731
    page.click("#sample-table th:nth-child(3)")
    assert scores() == sorted(scores()) and scores()[0] == 0.0
    page.click("#sample-table th:nth-child(3)")
    assert scores() == sorted(scores(), reverse=True) and scores()[0] == 22.0
    # The long prompt's first sample (score 20, DIFFS[0]): the detail opens beside the table, the prompt
    # folded above the turn.
    row = page.locator(f"{rows}:has(td:nth-child(3):text-is('20'))")
    row.click()
    page.wait_for_selector("#sample-detail:not([hidden])")
    page.wait_for_function("document.querySelector('#tokens').dataset.tokens === String(%d)" % (LONG_PROMPT + 4))
    table, detail = page.locator(".sample-list").bounding_box(), page.locator("#sample-detail").bounding_box()
    assert detail["x"] >= table["x"] + table["width"] - 1 and detail["y"] < 1000
    fold = page.locator("#tokens details.prompt-fold")
    assert fold.locator("summary").inner_text().startswith(f"prompt · {LONG_PROMPT} tokens")
    assert fold.locator("span.t").count() == LONG_PROMPT and not fold.evaluate("el => el.open")
    # Colour strength grows with the log of the nats apart: 0.5, 1, 2 and 4 nats stay distinguishable.
    alphas = page.eval_on_selector_all(
        "#tokens > span.t", "spans => spans.map(s => Number(s.style.background.match(/rgba\\(([^)]*)\\)/)[1]"
                            ".split(',')[3]))")
    assert len(alphas) == 4 and alphas == sorted(alphas) and alphas[-1] < 1 and alphas[1] - alphas[0] > 0.1
    page.locator("#tokens > span.t").nth(3).hover()
    assert "reference -5 (4 nats)" in page.locator("#token-info").inner_text()
    assert "8+" in page.locator("#scale").inner_text()
    screenshot(page, "viewer-samples")


def texts_and_search(page, tiny_model_dir) -> None:
    """The table shows each trajectory's prompt and completion as text; the search keeps the rows that
    hold it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = lambda ids: " ".join("".join(tokenizer.decode([i]) for i in ids).split())  # noqa: E731
    rows = "#sample-table tbody tr"
    completions = page.eval_on_selector_all(f"{rows} td.completion", "cells => cells.map(c => c.title)")
    second = text(range(61, 65))  # sample 1 of every group: tokens 61..64 (sample 0: 60..63)
    assert sorted(set(completions)) == sorted({text(range(60, 64)), second})
    prompts = page.eval_on_selector_all(f"{rows} td.prompt", "cells => cells.map(c => c.title)")
    assert all(title.split("\n", 1)[0].startswith("prompt-") for title in prompts)
    assert any(title.endswith(text([(i % 50) + 10 for i in range(LONG_PROMPT)])[-40:]) for title in prompts)
    page.fill("#sample-search", second)
    page.wait_for_function(f"[...document.querySelectorAll('{rows}')].filter(r => !r.hidden).length === 6")
    assert page.locator("#search-count").inner_text() == f'6 of the 12 rows shown hold "{second.lower()}"'
    page.fill("#sample-search", "")
    page.wait_for_function(f"[...document.querySelectorAll('{rows}')].filter(r => !r.hidden).length === 12")


def test_a_token_line_without_a_space_wraps_in_its_box(tmp_path, tiny_model_dir):
    """A response without a space (digits, a tiny model's babble) is a line of tokens with no place to break
    it: the token box wraps it anyway (viewer.css, ``overflow-wrap``) instead of running it off its right
    edge."""
    workdir = tmp_path / "suite"
    (workdir / "trajectory").mkdir(parents=True)
    store = TrajectoryStore(str(workdir / "trajectory" / "trajectories.db"), 1000)
    letters = [35 + i % 25 for i in range(LONG_LINE)]  # "ABC...XY" over and over: the tiny tokenizer's letters
    store.append(scored_group(0, 0, 6, response=letters), committed_version=0)
    store.close()
    with viewing(workdir, tiny_model_dir) as url, chromium(viewport={"width": 1400, "height": 1000}) as context:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("body[data-ready=true]")
        page.click("nav button[data-tab=samples]")
        page.locator("#sample-table tbody tr").first.click()
        page.wait_for_function("document.querySelector('#tokens').dataset.tokens === '%d'" % (6 + LONG_LINE))
        scroll_width, client_width, line = page.eval_on_selector(
            "#tokens", "box => [box.scrollWidth, box.clientWidth, box.querySelector('span.t:last-child').offsetHeight]")
        assert scroll_width <= client_width
        assert page.eval_on_selector("#tokens", "box => box.scrollHeight") > 4 * line  # wrapped onto lines
        screenshot(page, "viewer-long-line")


@contextlib.contextmanager
def viewing(workdir, model_dir):
    """``rlfleet-suite --view`` on ``workdir``: the viewer's address; stopped by SIGINT (a Ctrl-C) at exit, which
    it must survive with exit code 0."""
    command = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.services.suite", "--view", "--workdir", str(workdir),
         "--model-dir", str(model_dir), "--viewer-port", "0"], stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(iter(command.stderr.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: command.poll() is not None or any("rollout viewer of the run" in line for line in said),
                 START_TIMEOUT, "the viewer to serve")
        assert command.poll() is None, "".join(said)
        yield re.search(r"(http://127\.0\.0\.1:\d+)", next(line for line in said if "rollout viewer" in line))[1]
    finally:
        command.send_signal(signal.SIGINT)
        try:
            command.wait(60)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait()
    assert command.returncode == 0, "".join(said)  # a Ctrl-C is a clean stop


def test_view_refuses_a_directory_that_holds_no_run(tmp_path, tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "rlfleet.services.suite", "--view", "--workdir",
                           str(tmp_path / "nothing"), "--model-dir", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"{tmp_path / 'nothing'} holds no run" in done.stderr


def ground_truth_reward_and_a_comparison(page) -> None:
    """Each row shows its ground truth and reward function, as does the trajectory's detail; the detail
    offers the same prompt's trajectories of other versions, and opens the chosen one beside it."""
    rows = "#sample-table tbody tr"
    page.fill("#sample-search", "")
    truths = page.locator(f"{rows} td.truth").all_inner_texts()
    assert sorted(set(truths)) == ["answer-0", "answer-1"] and len(truths) == 12
    assert set(page.locator(f"{rows} td.reward-fn").all_inner_texts()) == {"numeric_match"}
    # Version 0's first group (score 0): a 6-token prompt, the same text as every group's but version 2's first.
    page.locator(f"{rows}:has(td:nth-child(3):text-is('0'))").click()
    page.wait_for_function("document.querySelector('#detail-title').textContent.includes('version 0')")
    assert "reward fn numeric_match · ground truth answer-0" in page.locator("#detail-title").inner_text()
    options = page.locator("#compare-with option:not([value=''])").all_inner_texts()
    assert len(options) == 6 and all(o.startswith(("version 1 ", "version 2 ")) for o in options), options
    page.select_option("#compare-with", label=next(o for o in options if o.startswith("version 2 ")))
    page.wait_for_selector("#compare:not([hidden])")
    page.wait_for_function("document.querySelector('#compare-tokens').dataset.tokens === '10'")
    assert "version 2" in page.locator("#compare-title").inner_text()
    assert "ground truth answer-1" in page.locator("#compare-title").inner_text()  # version 2's 6-token group: 21
    first, second = page.locator("#tokens").bounding_box(), page.locator("#compare-tokens").bounding_box()
    assert second["x"] >= first["x"] + first["width"] - 1 and abs(second["y"] - first["y"]) < 5  # side by side
    screenshot(page, "viewer-compare")
    page.select_option("#compare-with", value="")
    page.wait_for_selector("#compare[hidden]", state="attached")
