"""The rollout viewer's logic above the services: token rendering, access tokens, error mapping."""

from __future__ import annotations

import grpc
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from rlfleet.services.viewer.reader import TEXT_CHARS, BadQuery, render_tokens, summary_texts
from rlfleet.services.viewer.web import TOKEN_COOKIE, make_app
from rlfleet.wire import Ragged, encode_tensordict

TOKEN = "reader-token-0123456789"


class Letters:
    """A stand-in tokenizer: token id i is the letter chr(i)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def episode():
    """One episode row: a prompt "Hi", a turn that calls a tool, an observation, a final turn."""
    prompt = [ord(c) for c in "Hi"]
    turn1 = [ord(c) for c in "<tool_call>x</tool_call>"]
    observation = [ord(c) for c in "=1"]
    turn2 = [ord(c) for c in "ok"]
    response = turn1 + observation + turn2
    mask = [False] * len(prompt) + [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    behaviour = [-0.5] * len(turn1) + [0.0] * len(observation) + [-1.0] * len(turn2)
    versions = [3] * len(turn1) + [-1] * len(observation) + [4] * len(turn2)
    ragged = lambda values, dtype: Ragged.from_list([torch.tensor(values, dtype=dtype)])  # noqa: E731
    row = encode_tensordict({
        "tokens": {"prompt": ragged(prompt, torch.int64), "response": ragged(response, torch.int64),
                   "full": ragged(prompt + response, torch.int64)},
        "masks": {"all_assistant_mask": ragged(mask, torch.bool)},
        "log_probs": {"response": ragged(behaviour, torch.float32)},
        "ref_log_probs": {"response": ragged([-2.0] * len(response), torch.float32)},
        "versions": {"response": ragged(versions, torch.int64)},
    }, batch_size=[1])
    return row, prompt, turn1, observation, turn2


def test_an_episode_renders_prompt_turns_tool_call_and_observation():
    row, prompt, turn1, observation, turn2 = episode()
    shown = render_tokens(row, Letters())
    parts = [token["part"] for token in shown["tokens"]]
    assert parts == ["prompt"] * 2 + ["tool_call"] * len(turn1) + ["observation"] * 2 + ["assistant"] * 2
    assert [token["turn"] for token in shown["tokens"]] == [0, 0] + [1] * len(turn1) + [1, 1] + [2, 2]
    assert shown["turns"] == 2 and shown["prompt_tokens"] == 2 and shown["response_tokens"] == len(turn1) + 4
    first, observed, last = shown["tokens"][2], shown["tokens"][2 + len(turn1)], shown["tokens"][-1]
    assert (first["logprob"], first["ref_logprob"], first["version"]) == (-0.5, -2.0, 3)
    assert (observed["logprob"], observed["version"]) == (None, None)  # not sampled
    assert (last["text"], last["logprob"], last["version"]) == ("k", -1.0, 4)
    assert shown["text"] == "Hi<tool_call>x</tool_call>=1ok"


def test_the_table_shows_the_prompts_end_and_the_completion_with_tool_calls_and_observations_marked():
    row, *_ = episode()
    assert summary_texts(row, Letters()) == {"prompt_text": "Hi", "completion_text": "⟦<tool_call>x</tool_call>⟧⟨=1⟩ok"}
    long = encode_tensordict({"tokens": {
        "prompt": Ragged.from_list([torch.tensor([ord("s")] * 500 + [ord("?")])]),
        "response": Ragged.from_list([torch.tensor([ord("a")] * 500)]),
        "full": Ragged.from_list([torch.tensor([ord("s")] * 500 + [ord("?")] + [ord("a")] * 500)])}}, batch_size=[1])
    texts = summary_texts(long, Letters())
    assert texts["prompt_text"].endswith("s?") and len(texts["prompt_text"]) == TEXT_CHARS  # the question's end
    assert texts["completion_text"] == "a" * TEXT_CHARS


def test_without_a_tokenizer_tokens_show_their_ids():
    row, *_ = episode()
    assert render_tokens(row, None)["tokens"][0]["text"] == f"[{ord('H')}]"


class FakeReader:
    """Answers the app's reads without services (the app's own rules are under test)."""

    async def versions(self, min_version=0):
        return {"versions": [{"version": min_version}]}

    async def samples(self, query):
        raise BadQuery("min_score: 'x' is not a number")

    async def sample(self, cursor):
        raise _RpcError(grpc.StatusCode.NOT_FOUND, f"cursor: no trajectory {cursor} in the sample log")

    async def stats(self):
        raise _RpcError(grpc.StatusCode.PERMISSION_DENIED, "GetStats needs one of the roles reader")

    async def status(self):
        return {"unavailable": "no collector"}

    async def failures(self):
        return {"failures": [], "unavailable": "no collector"}


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


async def client(tokens=None) -> TestClient:
    test_client = TestClient(TestServer(make_app(FakeReader(), tokens)))
    await test_client.start_server()
    return test_client


async def test_reads_answer_json_and_errors_name_the_problem_with_their_status():
    test_client = await client()
    try:
        assert (await (await test_client.get("/api/versions?min_version=4")).json()) == {"versions": [{"version": 4}]}
        bad = await test_client.get("/api/samples?min_score=x")
        assert bad.status == 400 and (await bad.json())["error"] == "min_score: 'x' is not a number"
        gone = await test_client.get("/api/samples/7")
        assert gone.status == 404 and "NOT_FOUND: cursor: no trajectory 7" in (await gone.json())["error"]
        upstream = await test_client.get("/api/stats")
        assert upstream.status == 502 and (await upstream.json())["error"].startswith("PERMISSION_DENIED")
        page = await test_client.get("/")
        assert page.status == 200 and "rollout viewer" in await page.text()
    finally:
        await test_client.close()


class RunReader(FakeReader):
    """A run's reader: its versions say which run answered."""

    def __init__(self, run):
        self.run = run

    async def versions(self, min_version=0):
        return {"versions": [{"run": self.run}]}


async def test_a_fleet_that_runs_share_is_read_run_by_run():
    test_client = TestClient(TestServer(make_app({"r0": RunReader("r0"), "r1": RunReader("r1")})))
    await test_client.start_server()
    try:
        assert await (await test_client.get("/api/runs")).json() == {"runs": ["r0", "r1"]}
        for query, run in (("", "r0"), ("?run=r1", "r1"), ("?run=r0&min_version=2", "r0")):
            assert await (await test_client.get(f"/api/versions{query}")).json() == {"versions": [{"run": run}]}
        unknown = await test_client.get("/api/samples/3?run=r2")
        assert unknown.status == 404 and (await unknown.json())["error"] == "run: no run 'r2' here (runs: r0, r1)"
    finally:
        await test_client.close()
    single = await client()
    try:
        assert await (await single.get("/api/runs")).json() == {"runs": [""]}  # one run: no filter shown
    finally:
        await single.close()


async def test_with_access_tokens_every_request_needs_one():
    test_client = await client({TOKEN: frozenset({"reader"})})
    try:
        refused = await test_client.get("/api/versions")
        assert refused.status == 401 and "UNAUTHENTICATED" in (await refused.json())["error"]
        assert (await test_client.get("/?token=wrong-token-0123456789", allow_redirects=False)).status == 401
        opened = await test_client.get(f"/?token={TOKEN}&tab=samples", allow_redirects=False)
        assert opened.status == 302 and opened.headers["Location"] == "/?tab=samples"  # the token leaves the address
        assert opened.cookies[TOKEN_COOKIE].value == TOKEN
        assert (await test_client.get("/api/versions")).status == 200  # the cookie, kept by the client
        test_client.session.cookie_jar.clear()
        bearer = await test_client.get("/api/versions", headers={"authorization": f"Bearer {TOKEN}"})
        assert bearer.status == 200
    finally:
        await test_client.close()


async def test_without_a_collector_the_reader_says_so_instead_of_failing():
    """No collector configured, or one that does not answer (a real channel to a port nothing listens on):
    status and dead letters say why, and the page shows the store alone."""
    from rlfleet.client.channel import ChannelSettings
    from rlfleet.services.viewer.reader import NO_COLLECTOR, Reader

    from rlfleet.services.launch import free_port

    settings = ChannelSettings(timeout=5.0, retries=0)
    alone = Reader(f"127.0.0.1:{free_port()}", None, settings)
    assert await alone.status() == {"unavailable": NO_COLLECTOR}
    assert await alone.failures() == {"failures": [], "unavailable": NO_COLLECTOR}
    await alone.close()
    address = f"127.0.0.1:{free_port()}"
    gone = Reader(f"127.0.0.1:{free_port()}", address, settings)
    status = await gone.status()
    assert status["unavailable"] == (f"the collector at {address} does not answer (UNAVAILABLE): showing what the "
                                     f"trajectory store holds")
    assert "failed to connect" in status["unavailable_details"]  # gRPC's own message: the notice's tooltip
    assert (await gone.failures())["unavailable"].startswith(f"the collector at {address} does not answer")
    await gone.close()


def test_suite_dir_reads_the_suites_port_files_and_credentials(tmp_path):
    from rlfleet.services.common.errors import StartupError
    from rlfleet.services.viewer.config import ViewerConfig
    from rlfleet.services.viewer.web import in_suite

    config = ViewerConfig(suite_dir=str(tmp_path))
    with pytest.raises(StartupError, match=r"no trajectory service has run there \(no .*trajectory.port\)"):
        in_suite(config)
    (tmp_path / "trajectory").mkdir()
    (tmp_path / "trajectory" / "trajectory.port").write_text("41001")
    found = in_suite(config)
    assert (found.trajectory_address, found.collector_address) == ("127.0.0.1:41001", None)  # no collector ran
    assert found.upstream_tls_ca_file is None
    (tmp_path / "collector").mkdir()
    (tmp_path / "collector" / "collector.port").write_text("41002")
    (tmp_path / "credentials").mkdir()
    (tmp_path / "credentials" / "ca.pem").write_text("a CA")
    found = in_suite(config)
    assert found.collector_address == "127.0.0.1:41002"
    assert (found.upstream_tls_ca_file, found.upstream_auth_token_file) == (
        str(tmp_path / "credentials" / "ca.pem"), str(tmp_path / "credentials" / "token-reader"))


def test_suite_dir_of_a_suite_of_runs_names_each_runs_services(tmp_path):
    from rlfleet.services.viewer.config import ViewerConfig, ViewerRun
    from rlfleet.services.viewer.web import in_suite

    for key, port in (("trajectory", 41001), ("collector", 41002), ("trajectory-1", 41003), ("collector-1", 41004),
                      ("trajectory-2", 41005)):
        (tmp_path / key).mkdir()
        (tmp_path / key / f"{key.split('-')[0]}.port").write_text(str(port))
    found = in_suite(ViewerConfig(suite_dir=str(tmp_path)))
    assert found.runs == {"r0": ViewerRun(trajectory_address="127.0.0.1:41001", collector_address="127.0.0.1:41002"),
                          "r1": ViewerRun(trajectory_address="127.0.0.1:41003", collector_address="127.0.0.1:41004"),
                          "r2": ViewerRun(trajectory_address="127.0.0.1:41005", collector_address=None)}
