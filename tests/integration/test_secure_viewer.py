"""The rollout viewer in a real headless browser, over the whole suite with TLS and role tokens on
(the secure suite shared with test_secure_suite.py, which ran first: its few groups are there too).

A trainer trains for a few steps on known prompts (some delivered, one group filtered by dynamic
sampling, one prompt dead-lettered); the viewer process reads the trajectory service and the
collector with a ``reader`` token over mTLS; Chromium, driven by Playwright, opens the page and the
test checks what it shows against the services' own answers and the batches the trainer received.
``RLFLEET_SCREENSHOTS=DIR`` also writes the page's screenshots there (the docs' pictures).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from rlfleet.client import connect, credentials_from
from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc
from tests.browser import chromium, screenshot
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

TIMEOUT = 300.0
"""Bound on the pipeline's work (a few groups through generation, reference, reward, on 2 loaded cores)."""
PAGE_TIMEOUT_MS = 60_000
STEPS = 3


@pytest.fixture(scope="module")
def suite(secure_suite):
    """The secure suite (tests/integration/conftest.py), shared with test_secure_suite.py."""
    return secure_suite


@pytest.fixture(scope="module")
def run(suite, tiny_model_dir):
    """A short run with known outcomes: what the trainer received, the filtered prompt, the dead letter."""
    from transformers import AutoModelForCausalLM

    procs, credentials = suite
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    received: dict[str, list[int]] = {}
    with connect(procs["collector"].address, **credentials_from(credentials), timeout=60) as trainer:
        # Scores that vary within a group (delivered), a task no sample solves (constant 0: filtered),
        # and a prompt longer than the model's context (generation refuses it: a dead letter).
        # The two odd ones first: sync mode admits the next step's groups only, in submission order.
        prompts = [{"prompt_id": "too-long", "prompt": "count " * 2000, "reward_fn": "char_fraction"},
                   {"prompt_id": "unsolvable", "prompt": "say a number", "reward_fn": "numeric_match",
                    "ground_truth": "987654321"}]
        prompts += [{"prompt_id": f"digits-{i}", "prompt": f"write the digits of {i}", "reward_fn": "char_fraction"}
                    for i in range(4 * STEPS)]  # more than the run needs: a group the filter drops is replaced
        trainer.submit_prompts(prompts)
        with trainer.batches(4, whole_groups=True) as batches:
            for step, batch in zip(range(STEPS), batches):
                for trajectory_id, tokens in zip(batch["trajectory_id"], batch.ragged("tokens/full").to_list()):
                    received[trajectory_id] = tokens.tolist()
                with torch.no_grad():  # a "training step": the policy moves away from the reference
                    for parameter in model.parameters():
                        parameter.add_(torch.randn_like(parameter, generator=generator) * 0.05)
                trainer.push_weights(model)
        wait_for(lambda: trainer.failures()[1] >= 1, TIMEOUT, "the dead letter")
        wait_for(lambda: trainer.status().dynamic_sampling.filtered_groups >= 1, TIMEOUT, "the filtered group")
    return received


@pytest.fixture(scope="module")
def viewer(suite, run, tiny_model_dir, tmp_path_factory):
    _, credentials = suite
    workdir = tmp_path_factory.mktemp("viewer")
    access = workdir / "access-tokens"
    access.write_text("reader browser-token-0123456789\n")
    # The suite's own directory: the viewer finds the services' addresses and the reader's credentials there.
    proc = ServiceProcess("viewer", [
        "--suite-dir", str(credentials.parent), "--tokenizer", str(tiny_model_dir),
        "--access-tokens-file", str(access), "--log-format", "text"])
    proc.start(workdir)
    proc.wait_listening(60)
    yield f"http://127.0.0.1:{proc.port}"
    proc.stop()


@pytest.fixture(scope="module")
def truth(suite, run):
    """What the trajectory service itself says, read with the reader's credentials."""
    procs, credentials = suite
    files = credentials_from(credentials, role="reader")
    channel = grpc.secure_channel(procs["trajectory"].address, grpc.ssl_channel_credentials(
        files["root_certificates"], files["private_key"], files["certificate_chain"]))
    stub = trajectory_pb2_grpc.TrajectoryServiceStub(channel)
    metadata = (("authorization", f"Bearer {files['auth_token']}"),)
    versions = stub.GetVersionStats(trajectory_pb2.GetVersionStatsRequest(), metadata=metadata, timeout=30).versions
    samples = stub.ListSamples(trajectory_pb2.ListSamplesRequest(limit=1000), metadata=metadata, timeout=30).samples
    channel.close()
    return versions, samples


@pytest.fixture(scope="module")
def page(viewer):
    with chromium(viewport={"width": 1400, "height": 1000}) as context:
        page = context.new_page()
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        page.goto(f"{viewer}/?token=browser-token-0123456789")
        page.wait_for_selector("body[data-ready=true]")
        yield page


def test_without_its_token_the_viewer_answers_nothing(viewer):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{viewer}/api/versions", timeout=30)
    assert refused.value.code == 401
    assert "UNAUTHENTICATED" in json.loads(refused.value.read())["error"]
    request = urllib.request.Request(f"{viewer}/api/versions",
                                     headers={"authorization": "Bearer browser-token-0123456789"})
    assert json.loads(urllib.request.urlopen(request, timeout=30).read())["versions"]


def test_the_version_charts_and_table_show_every_version_the_store_counted(page, truth):
    versions, _ = truth
    assert len(versions) >= 2  # sync mode, three pushes: groups of several versions
    rows = page.locator("#version-table tbody tr")
    assert rows.count() == len(versions)
    newest = versions[-1]
    cells = rows.nth(0).locator("td").all_inner_texts()
    assert int(cells[0]) == newest.version and int(cells[1]) == newest.groups
    assert float(cells[4]) == pytest.approx(newest.mean_score, abs=1e-3)
    assert cells[7] == "0" and cells[8] == "0"  # sync mode: every group visible at its own version
    for chart in ("score", "kl", "length", "staleness"):
        assert page.locator(f"#chart-{chart}").get_attribute("data-points") == str(len(versions))
        assert page.locator(f"#chart-{chart} canvas").count() == 1
    assert "policy version" in page.locator("#run").inner_text()
    screenshot(page, "viewer-versions")


def test_the_samples_table_lists_the_log_and_filters_it(page, truth):
    _, samples = truth
    page.click("nav button[data-tab=samples]")
    page.wait_for_selector("#sample-table tbody tr")
    assert page.locator("#sample-table tbody tr").count() == min(len(samples), 100)
    filtered = [s for s in samples if s.filtered]
    assert "unsolvable" in {s.prompt_id for s in filtered}
    page.select_option("select[name=filter]", "filtered")
    page.click("#sample-filters button[type=submit]")
    page.wait_for_function(f"document.querySelectorAll('#sample-table tbody tr').length === {len(filtered)}")
    shown = page.eval_on_selector_all("#sample-table tbody tr", "rows => rows.map(r => r.dataset.promptId)")
    assert sorted(shown) == sorted(s.prompt_id for s in filtered)
    page.select_option("select[name=filter]", "")
    page.fill("input[name=min_score]", "0.5")
    page.click("#sample-filters button[type=submit]")
    expected = sum(1 for s in samples if s.score >= 0.5)
    page.wait_for_function(f"document.querySelectorAll('#sample-table tbody tr').length === {expected}")
    page.fill("input[name=min_score]", "")
    page.click("#sample-filters button[type=submit]")
    page.wait_for_function(f"document.querySelectorAll('#sample-table tbody tr').length === {min(len(samples), 100)}")


def test_one_trajectory_shows_its_tokens_parts_and_log_probs(page, truth, run, tiny_model_dir):
    from transformers import AutoTokenizer

    _, samples = truth
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # One the trainer received, sampled after a push: its policy differs from the reference.
    sample = next(s for s in samples if s.trajectory_id in run and s.policy_version_start >= 1)
    tokens = run[sample.trajectory_id]
    page.click("nav button[data-tab=samples]")
    page.click(f"#sample-table tbody tr[data-cursor='{sample.cursor}']")
    page.wait_for_selector("#sample-detail:not([hidden])")
    page.wait_for_function(f"document.querySelector('#tokens').dataset.tokens === '{len(tokens)}'")
    spans = page.locator("#tokens span.t")
    assert spans.count() == len(tokens)
    assert "".join(spans.all_text_contents()) == "".join(tokenizer.decode([t]) for t in tokens)
    parts = page.eval_on_selector_all("#tokens span.t", "spans => spans.map(s => s.dataset.part)")
    prompt_length = len(tokens) - sample.response_tokens
    assert parts[:prompt_length] == ["prompt"] * prompt_length
    assert set(parts[prompt_length:]) <= {"assistant", "tool_call"}  # sampled (a random model may write a tool call)
    assert page.locator("#tokens .turn").count() == 1
    # Behaviour vs reference log-probability as colour: the pushed weights moved, so some tokens differ.
    alphas = page.eval_on_selector_all(
        "#tokens span.t", "spans => spans.map(s => { const m = s.style.background.match(/rgba?\\(([^)]*)\\)/);"
                          " return m ? Number(m[1].split(',')[3] ?? 1) : null; })")
    assert all(alpha is None for alpha in alphas[:prompt_length])  # the prompt is not coloured
    assert max(alpha for alpha in alphas[prompt_length:] if alpha is not None) > 0.05
    spans.nth(prompt_length).hover()
    info = page.locator("#token-info").inner_text()
    assert f"id {tokens[prompt_length]}" in info and f"version {sample.policy_version_start}" in info
    assert re.search(r"behaviour -?\d+\.\d{4} · reference -?\d+\.\d{4}", info), info
    assert sample.trajectory_id in page.locator("#detail-title").inner_text()
    screenshot(page, "viewer-trajectory")


def test_the_dead_letters_show_the_refused_prompt_and_why(page):
    page.click("nav button[data-tab=failures]")
    page.wait_for_selector("#failure-table tbody[data-loaded=true]")
    rows = page.locator("#failure-table tbody tr")
    texts = [rows.nth(i).inner_text() for i in range(rows.count())]
    refused = [text for text in texts if "too-long" in text]
    assert len(refused) == 1 and "generation" in refused[0] and "INVALID_ARGUMENT" in refused[0]
    screenshot(page, "viewer-dead-letters")
