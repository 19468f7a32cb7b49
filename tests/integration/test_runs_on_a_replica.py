"""Several runs on one generation replica (a real process on real vLLM, the tiny model): each samples on
the base weights with its own LoRA adapter at its own versions, a push of one changes nothing another
sees, and the replica's slots are bounded (docs/concepts/many-runs.md)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from rlfleet.client import connect, credentials_from
from rlfleet.services.common.security import METHOD_ROLES
from rlfleet.services.credentials import upstream_files
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import (collector_pb2, diagnostics_pb2, generation_pb2, generation_pb2_grpc, reward_pb2, reward_pb2_grpc,
                        sampling_pb2, trajectory_pb2, trajectory_pb2_grpc, weights_pb2)
from rlfleet.wire import decode_tensor, encode_tensor
from rlfleet.wire.push_messages import iter_push_messages
from tests.browser import chromium
from tests.hf_reference import LORA_TARGETS as TARGETS, load_hf, peft_model, perturbed, response_log_probs
from tests.raw_calls import empty_call_status
from tests.scrape import scrape_metric
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROMPT = [1, 348, 201, 330, 400, 223, 20, 267, 223, 21, 2, 201, 1, 305, 310, 201]
LOG_PROB_TOLERANCE = 1e-4
MAX_RUNS = 3
LONG_TOKENS = 480
"""A request that runs for seconds (the replica's max_model_len is 512): still running when the step after
the wait for it comes (a push, an EndRun), however loaded the machine, since both slow down alike."""
SCHEDULE_TIMEOUT = 120.0
"""Until a call sent to the engine is running (a few engine steps; a loaded 2-core machine)."""


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    proc = ServiceProcess("generation", ["--model", str(tiny_model_dir), "--max-model-len", "512",
                                         "--metrics-port", str(metrics_port),
                                         "--kv-cache-memory-bytes", str(128 << 20), "--max-lora-rank", "8",
                                         "--max-runs", str(MAX_RUNS), "--log-format", "text"])
    proc.metrics_port = metrics_port
    proc.start(tmp_path_factory.mktemp("generation-runs"))
    try:
        proc.wait_ready(600)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(replica):
    channel = grpc.insecure_channel(replica.address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir):
    """Two trainers' adapters (peft, seeded, lora_B non-zero so that they change the outputs)."""
    return {seed: peft_model(tiny_model_dir, seed) for seed in (1, 2, 3)}


def push(stub, pairs, version: int, run_id: str = "", mode=weights_pb2.UPDATE_MODE_KEEP, lora=True):
    adapter = weights_pb2.LoraAdapter(rank=8, alpha=16, target_modules=sorted(TARGETS)) if lora else None

    def requests():
        for kind, msg in iter_push_messages(pairs, version=version, mode=mode, lora=adapter):
            if kind == "manifest":
                msg.run_id = run_id
            yield generation_pb2.UpdateWeightsRequest(**{kind: msg})
    return list(stub.UpdateWeights(requests(), timeout=300))[-1]


def push_adapter(stub, model, version: int, run_id: str, mode=weights_pb2.UPDATE_MODE_KEEP):
    from peft import get_peft_model_state_dict

    return push(stub, list(get_peft_model_state_dict(model).items()), version, run_id, mode)


def generate(stub, run_id: str = "", n: int = 2, max_tokens: int = 12, run_name: str = "", policy_run: str = "",
             **extra):
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))), run_id=run_id, run_name=run_name,
        policy_run=policy_run, sampling=sampling_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                                                    **extra))
    return sorted(stub.Generate(request, timeout=600), key=lambda r: r.sample_index)


def length(sample) -> int:
    return decode_tensor(sample.response_token_ids).numel()


def spans(sample):
    return [(s.version, s.start, s.end) for s in sample.policy_version_spans]


def log_prob_error(sample, model) -> float:
    tokens = decode_tensor(sample.response_token_ids).tolist()
    return (decode_tensor(sample.behavior_log_probs) - response_log_probs(model, PROMPT, tokens)).abs().max().item()


def served(stub) -> dict[str, generation_pb2.ServedRun]:
    return {run.run_id: run for run in stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest()).runs}


def test_each_run_samples_on_its_own_adapter_at_its_own_version(stub, adapters, tiny_model_dir):
    base = load_hf(tiny_model_dir)
    assert push_adapter(stub, adapters[1], 1, "run-a").version == 1
    assert push_adapter(stub, adapters[2], 1, "run-b").version == 1  # each run counts its own versions
    assert push_adapter(stub, adapters[2], 2, "run-b").version == 2
    expected = {"run-a": (1, adapters[1]), "run-b": (2, adapters[2]), "run-c": (0, base), "": (0, base)}
    for run_id, (version, model) in expected.items():
        for sample in generate(stub, run_id):
            assert spans(sample) == [(version, 0, length(sample))], run_id
            assert sample.policy_version_start == sample.policy_version_end == version
            assert log_prob_error(sample, model) <= LOG_PROB_TOLERANCE, run_id
    (sample,) = generate(stub, "run-a", n=1)
    assert log_prob_error(sample, adapters[2]) > 1e-2  # the runs' adapters differ where it shows
    runs = served(stub)
    assert {run_id: run.policy_version for run_id, run in runs.items()} == {"run-a": 1, "run-b": 2, "run-c": 0}
    assert all(run.generated_tokens > 0 and run.requests_in_flight == 0 for run in runs.values())
    status = stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest())
    assert status.policy_version == 0 and status.max_runs == MAX_RUNS


def test_a_push_of_one_run_changes_nothing_another_run_sees(stub, adapters):
    """run-a's abort-mode push while run-a and run-b both generate: run-a's request ends with "abort", run-b's
    runs to its end on its own adapter, not paused, every token labelled with its own version."""
    results: dict[str, list] = {}

    def long(run_id):
        results[run_id] = generate(stub, run_id, n=1, max_tokens=LONG_TOKENS, ignore_eos=True)
    threads = [threading.Thread(target=long, args=(run_id,)) for run_id in ("run-a", "run-b")]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(run.requests_in_flight == 1 and run.generated_tokens for run in
                         (served(stub)[r] for r in ("run-a", "run-b"))),
             SCHEDULE_TIMEOUT, "both runs' long requests running")
    before = served(stub)["run-b"].generated_tokens
    reply = push_adapter(stub, adapters[3], 2, "run-a", mode=weights_pb2.UPDATE_MODE_ABORT)
    assert reply.version == 2 and reply.aborted_requests == 1
    wait_for(lambda: served(stub)["run-b"].generated_tokens > before + 8, SCHEDULE_TIMEOUT,
             "run-b generating on after run-a's push")
    for thread in threads:
        thread.join(600)
    (aborted,) = results["run-a"]
    assert aborted.finish_reason == sampling_pb2.FINISH_REASON_ABORT
    assert {span.version for span in aborted.policy_version_spans} == {1}
    (kept,) = results["run-b"]
    assert kept.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert spans(kept) == [(2, 0, LONG_TOKENS)]
    assert log_prob_error(kept, adapters[2]) <= LOG_PROB_TOLERANCE
    (fresh,) = generate(stub, "run-a", n=1)
    assert spans(fresh) == [(2, 0, length(fresh))]
    assert log_prob_error(fresh, adapters[3]) <= LOG_PROB_TOLERANCE


def metric_runs(replica, name: str) -> dict[str, float]:
    """The replica's ``name`` samples on /metrics, by run: a run that ended has none."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=10).read().decode()
    return {sample.labels["run"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def test_slots_are_bounded_and_every_refusal_names_its_cause(stub, replica, adapters, tiny_model_dir):
    def refused(code, call, *args, **kwargs) -> str:
        with pytest.raises(grpc.RpcError) as err:
            call(*args, **kwargs)
        assert err.value.code() == code, err.value.details()
        return err.value.details()

    assert set(served(stub)) == {"run-a", "run-b", "run-c"}
    details = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, generate, stub, "run-d")
    assert f"max_runs={MAX_RUNS}" in details and "run-a, run-b, run-c" in details
    assert "run-d" not in served(stub)
    assert metric_runs(replica, "rlfleet_replica_run_policy_version") == {"run-a": 2, "run-b": 2, "run-c": 0}
    assert stub.EndRun(generation_pb2.EndRunRequest(run_id="run-c")).requests_in_flight == 0
    assert "run-c" not in served(stub)
    assert set(metric_runs(replica, "rlfleet_replica_run_generated_tokens_total")) == {"run-a", "run-b"}
    (sample,) = generate(stub, "run-d", n=1)  # the slot run-c left
    assert spans(sample) == [(0, 0, length(sample))]
    assert "not served" in refused(grpc.StatusCode.NOT_FOUND, stub.EndRun,
                                   generation_pb2.EndRunRequest(run_id="run-c"))
    refused(grpc.StatusCode.INVALID_ARGUMENT, stub.EndRun, generation_pb2.EndRunRequest(run_id=""))
    assert "not a run id" in refused(grpc.StatusCode.INVALID_ARGUMENT, generate, stub, "run a")
    assert "share_weight" in refused(grpc.StatusCode.INVALID_ARGUMENT, _generate_weighted, stub, -1.0)
    from peft import get_peft_model_state_dict

    pairs = list(get_peft_model_state_dict(adapters[1]).items())
    assert "not newer than its current 2" in refused(grpc.StatusCode.FAILED_PRECONDITION, push, stub, pairs, 2,
                                                     "run-a")
    from safetensors.torch import load_file

    weights = list(perturbed(load_file(str(tiny_model_dir / "model.safetensors")), seed=5).items())
    assert "gets replicas of its own" in refused(grpc.StatusCode.FAILED_PRECONDITION, push, stub, weights, 3,
                                                 "run-a", lora=False)
    assert "share this replica" in refused(grpc.StatusCode.FAILED_PRECONDITION, push, stub, weights, 1, "",
                                           lora=False)
    assert {run_id: run.policy_version for run_id, run in served(stub).items()} == {"run-a": 2, "run-b": 2,
                                                                                   "run-d": 0}
    assert stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest()).policy_version == 0


def test_a_run_ended_mid_call_finishes_its_call_and_takes_no_new_one(stub):
    """EndRun while a call of the run runs: that call runs to its end, a new one is refused, and the run
    leaves (its slot free) once the call ended."""
    results = []
    thread = threading.Thread(target=lambda: results.append(generate(stub, "run-d", n=1, max_tokens=LONG_TOKENS,
                                                                     ignore_eos=True)))
    thread.start()
    wait_for(lambda: served(stub)["run-d"].generated_tokens > 0 and served(stub)["run-d"].requests_in_flight,
             SCHEDULE_TIMEOUT, "run-d's call running")
    assert stub.EndRun(generation_pb2.EndRunRequest(run_id="run-d")).requests_in_flight == 1
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "run-d", n=1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ended" in err.value.details()
    thread.join(600)
    ((sample,),) = results
    assert sample.finish_reason == sampling_pb2.FINISH_REASON_LENGTH and length(sample) == LONG_TOKENS
    wait_for(lambda: "run-d" not in served(stub), SCHEDULE_TIMEOUT, "run-d to leave once its call ended")


def test_a_call_samples_on_another_runs_policy_by_the_name_it_gave(stub, adapters):
    """Several policies in one episode, at the replica: run-b's call asking for ``policy_run`` "a" samples on
    run-a's adapter at run-a's version once run-a gave that name (log-probs of that adapter, 1e-4), while it
    counts as run-b's call; before, FAILED_PRECONDITION naming what is missing."""
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "run-b", policy_run="a")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no run of that name" in err.value.details()
    generate(stub, "run-a", n=1, run_name="a")  # run-a's collector names its run on each call
    assert served(stub)["run-a"].name == "a"
    before = served(stub)["run-a"].generated_tokens
    for sample in generate(stub, "run-b", policy_run="a"):
        assert spans(sample) == [(2, 0, length(sample))]  # run-a's version
        assert log_prob_error(sample, adapters[3]) <= LOG_PROB_TOLERANCE  # run-a's adapter, not run-b's
    assert served(stub)["run-a"].generated_tokens > before  # sampled by run-a's policy
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "", policy_run="a")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "policy_run" in err.value.details()


def _generate_weighted(stub, weight: float):
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))), run_id="run-a",
        share_weight=weight, sampling=sampling_pb2.SamplingParams(n=1, max_tokens=4))
    return list(stub.Generate(request, timeout=60))


# ---------------------------------------------------------------- two collectors, one replica


def read_rows(client, rows: int, batch_size: int = 4) -> list[dict]:
    """``rows`` rows of the client's batches (acked as read)."""
    out: list[dict] = []
    for batch in client.batches(batch_size, max_batches=rows // batch_size):
        out += [{"prompt_id": prompt_id, "prompt": prompt.tolist(), "response": response.tolist(),
                 "log_probs": log_probs, "versions": versions.tolist()}
                for prompt_id, prompt, response, log_probs, versions in zip(
                    batch["prompt_id"], batch.ragged(("tokens", "prompt")).to_list(),
                    batch.ragged(("tokens", "response")).to_list(), batch.ragged(("log_probs", "response")).to_list(),
                    batch.ragged(("versions", "response")).to_list())]
    return out


def check_rows(rows: list[dict], version: int, model) -> None:
    """Every row sampled by ``model`` (its run's adapter) at ``version``, and labelled so."""
    for row in rows:
        assert set(row["versions"]) == {version}
        expected = response_log_probs(model, row["prompt"], row["response"])
        assert (row["log_probs"] - expected).abs().max().item() <= LOG_PROB_TOLERANCE


RUNS = 4


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """``rlfleet-suite --secure --runs 4``: one replica, and per run a collector (``shared_replicas``) and a
    trajectory store of its own; every service over mTLS with role tokens, each run's trainer with a
    certificate and tokens acting for its run alone. ``(processes, credentials directory)``."""
    workdir = tmp_path_factory.mktemp("four-runs")
    examples = str(Path(__file__).resolve().parents[2] / "examples")
    options = SuiteOptions(model_dir=tiny_model_dir, runs=RUNS, secure=True, metrics=True, kv_cache_bytes=128 << 20,
                           max_model_len=512, environments={"number_duel": "number_duel:NumberDuel"},
                           environment_env={"PYTHONPATH": examples},
                           run_collector_args={"r2": ["--players", '{"opponent": "r3"}'],
                                               "r3": ["--players", '{"opponent": "r2"}']},
                           collector_args=["--group-size", "2", "--groups-per-step", "2", "--max-staleness", "1000",
                                           "--mismatch-kl-target", "null",
                                           "--sampling", '{"temperature": 1.0, "max_tokens": 12}'])
    suite = start_suite(options, workdir)
    try:
        yield suite, workdir / "credentials"
    finally:
        stop_suite(suite)


def operator_channel(credentials, address: str) -> grpc.Channel:
    """A channel to ``address`` over mTLS with the operator's token (it sees every run)."""
    tls = grpc.ssl_channel_credentials(*((credentials / name).read_bytes()
                                         for name in ("ca.pem", "trainer.key", "trainer.pem")))
    token = (credentials / "token-operator").read_text().strip()
    return grpc.secure_channel(address, grpc.composite_channel_credentials(
        tls, grpc.access_token_call_credentials(token)))


@pytest.fixture(scope="module")
def replica_stub(fleet):
    suite, credentials = fleet
    channel = operator_channel(credentials, suite["generation-0"].address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def trainers(fleet):
    """Run i's trainer (``run="new"``) on collector i with run i's credentials (``credentials_from(run=)``)."""
    suite, credentials = fleet
    clients = [connect(suite[key].address, run="new", timeout=300, **credentials_from(credentials, run=f"r{i}"))
               for i, key in enumerate(SuiteOptions(model_dir="", runs=RUNS).run_keys("collector"))]
    yield clients
    for client in clients:
        client.close()


def test_four_trainers_share_a_suites_replica_each_on_its_own_run(fleet, trainers, replica_stub, adapters,
                                                                  tiny_model_dir):
    """Each run starts at its own version 0 whatever the others pushed; every sample of each run's batches
    was sampled by that run's adapter (the base model for a run that pushed none) at the version it is
    labelled with; a full push is refused (the runs share the base weights)."""
    a, b, c, d = trainers
    assert a.push_adapter(adapters[1], progress=False).version == 1
    assert b.policy_version == 0  # a fresh run, whatever the replica serves the other runs
    b.push_adapter(adapters[2], progress=False)
    assert b.push_adapter(adapters[3], progress=False).version == 2
    assert d.push_adapter(adapters[1], progress=False).version == 1  # a's adapter, d's run
    with pytest.raises(Exception, match="LoRA adapters"):
        b.push_weights(dict(load_hf(tiny_model_dir).state_dict()), progress=False)
    for client, version, model in runs_of(trainers, adapters, tiny_model_dir):
        client.submit_prompts([{"prompt": PROMPT, "ground_truth": "1"} for _ in range(2)])
        rows = read_rows(client, 4)
        assert len(rows) == 4
        check_rows(rows, version, model)
    assert [client.run.name for client in trainers] == ["r0", "r1", "r2", "r3"]  # joined, each its own run
    suite, _ = fleet
    for key, client in zip(SuiteOptions(model_dir="", runs=RUNS).run_keys("collector"), trainers):
        assert scrape_metric(suite[key].metrics_port, "rlfleet_run_info", run=client.run.name,
                             run_id=client.run.run_id, resumed="false") == 1  # each collector's metrics name its run
    served_versions = {run_id: run.policy_version for run_id, run in served(replica_stub).items()}
    assert served_versions == {a.run.run_id: 1, b.run.run_id: 2, c.run.run_id: 0, d.run.run_id: 1}


def runs_of(trainers, adapters, model_dir):
    """Each trainer, the version it pushed, and the model its run's samples come from."""
    a, b, c, d = trainers
    return ((a, 1, adapters[1]), (b, 2, adapters[3]), (c, 0, load_hf(model_dir).eval()), (d, 1, adapters[1]))


DUEL = {"prompt": [{"role": "user", "content": "number duel"}], "environment": "number_duel", "reward_fn": "none"}


def test_two_runs_play_each_others_turns_and_each_trains_on_its_own(fleet, trainers, replica_stub, adapters,
                                                                    tiny_model_dir):
    """Runs r2 and r3 play number duels (examples/number_duel.py), each run's collector mapping the game's
    opponent to the other run: each run's batch holds its own episodes, whose two own turns are trainable and
    were sampled by its own policy at its version (behaviour log-probs = a Hugging Face forward of its model
    over the whole episode, 1e-4), the opponent's turn context (mask false, log-probs 0, version -1),
    sampled on the replica by the other run's policy."""
    _, _, c, d = trainers
    for (client, version, model), other in zip(runs_of(trainers, adapters, tiny_model_dir)[2:], (d, c)):
        before = served(replica_stub)[other.run.run_id].generated_tokens
        client.submit_prompts([DUEL, DUEL])
        with client.batches(4, max_batches=1) as batches:
            batch = next(iter(batches))
        assert served(replica_stub)[other.run.run_id].generated_tokens > before  # the opponent's policy played
        columns = [batch.ragged(key).to_list() for key in ("tokens/prompt", "tokens/response",
                                                           "masks/all_assistant_mask", "log_probs/response",
                                                           "versions/response", "turns/policy_versions")]
        assert len(batch) == 4
        for prompt, response, assistant, behaviour, versions, turn_versions in zip(*columns):
            sampled = assistant[len(prompt):]
            own_turns = sampled.int().diff(prepend=torch.tensor([0])).eq(1).sum().item()
            assert own_turns == 2 and sampled[-1]  # own, (opponent), own: it ends on its own turn
            expected = response_log_probs(model, prompt.tolist(), response.tolist())
            assert (behaviour[sampled] - expected[sampled]).abs().max().item() <= LOG_PROB_TOLERANCE
            assert (behaviour[~sampled] == 0).all()
            assert set(versions[sampled].tolist()) == {version} and set(versions[~sampled].tolist()) == {-1}
            assert turn_versions.tolist() == [[version, version]] * 2  # the own turns' alone


COLLECTOR_RPCS = [*collector_pb2.DESCRIPTOR.services_by_name["CollectorService"].methods,
                  *trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"].methods,
                  *diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"].methods]
STORE_RPCS = [*trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"].methods,
              *diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"].methods]


def test_a_runs_credentials_reach_its_own_run_alone(fleet, trainers):
    """Run r0's token (trainer or reader) or certificate gets PERMISSION_DENIED, naming the run, on every RPC
    of run r1's collector and trajectory store: batches, pushes, prompts, mismatch reports, the breaker,
    status, samples; run r1's own credentials get through, and so does an operator, whatever its
    certificate. A token of one run presented with another run's certificate is refused too."""
    suite, credentials = fleet

    def token(name: str) -> str:
        return (credentials / f"token-{name}").read_text().strip()

    def tls(certificate: str):
        return grpc.ssl_channel_credentials(*((credentials / name).read_bytes()
                                              for name in ("ca.pem", f"{certificate}.key", f"{certificate}.pem")))

    refused, calls = [], 0
    for key, rpcs in (("collector-1", COLLECTOR_RPCS), ("trajectory-1", STORE_RPCS)):
        for certificate, presented in (("trainer-r0", "trainer-r0"), ("trainer", "trainer-r0"),
                                       ("trainer", "reader-r0"), ("trainer-r0", "trainer-r1")):
            with grpc.secure_channel(suite[key].address, tls(certificate)) as channel:
                for method in rpcs:
                    calls += 1
                    path = f"/{method.containing_service.full_name}/{method.name}"
                    code, details = empty_call_status(channel, path, method, token(presented))
                    role = presented.split("-")[0]  # an RPC its role may not call is refused for that first
                    expected = "this service serves run r1" if role in METHOD_ROLES[path] else "may not call it"
                    if code != grpc.StatusCode.PERMISSION_DENIED or expected not in details:
                        refused.append(f"{key} {path}, certificate {certificate}, token {presented}: "
                                       f"{code.name} {details}")
    assert calls == 4 * (len(COLLECTOR_RPCS) + len(STORE_RPCS))
    assert not refused, refused
    status = COLLECTOR_RPCS[[m.name for m in COLLECTOR_RPCS].index("GetStatus")]
    path = "/rlfleet.v1.CollectorService/GetStatus"
    for certificate, presented in (("trainer-r1", "trainer-r1"), ("trainer", "trainer-r1"),
                                   ("trainer-r0", "operator")):
        with grpc.secure_channel(suite["collector-1"].address, tls(certificate)) as channel:
            assert empty_call_status(channel, path, status, token(presented)) == (grpc.StatusCode.OK, ""), presented
    # The services every run shares take no run's trainer token (the inner roles only).
    generate = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].methods_by_name["Generate"]
    with grpc.secure_channel(suite["generation-0"].address, tls("trainer-r0")) as channel:
        code, details = empty_call_status(channel, "/rlfleet.v1.GenerationService/Generate", generate,
                                          token("trainer-r0"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call it" in details


def test_the_viewer_filters_by_run_and_a_runs_credentials_show_that_run_alone(fleet, trainers, tiny_model_dir,
                                                                             tmp_path):
    """The rollout viewer over the four-run suite's directory (its reader acts on every run) has a run filter:
    each run's samples are its own store's, and the page (a real browser) shows the run chosen, switching on
    the filter; a viewer with run r0's reader token and certificate shows r0's samples and r1's refusal."""
    suite, credentials = fleet
    everything = start_viewer(tmp_path / "all", ["--suite-dir", str(credentials.parent), "--tokenizer",
                                                 str(tiny_model_dir)])
    names = [f"r{i}" for i in range(RUNS)]
    runs = {name: {"trajectory_address": suite[store].address, "collector_address": suite[collector].address}
            for name, store, collector in zip(names, SuiteOptions(model_dir="", runs=RUNS).run_keys("trajectory"),
                                               SuiteOptions(model_dir="", runs=RUNS).run_keys("collector"))}
    settings = tmp_path / "r0-viewer.json"
    settings.write_text(json.dumps({"runs": runs, **upstream_files(credentials, "trainer-r0", "reader-r0")}))
    r0_only = start_viewer(tmp_path / "r0", ["--config", str(settings)])
    try:
        assert get_json(everything, "/api/runs") == (200, {"runs": names})
        seen = {}
        for name, store in zip(names, SuiteOptions(model_dir="", runs=RUNS).run_keys("trajectory")):
            code, page = get_json(everything, f"/api/samples?run={name}&limit=1000")
            seen[name] = {sample["trajectory_id"] for sample in page["samples"]}
            assert code == 200 and seen[name] == store_samples(suite[store].address, credentials, name), name
        assert all(seen.values()) and len(set.union(*seen.values())) == sum(map(len, seen.values()))
        code, body = get_json(everything, "/api/samples?run=r9")
        assert code == 404 and body["error"] == "run: no run 'r9' here (runs: r0, r1, r2, r3)"
        code, page = get_json(r0_only, "/api/samples?run=r0&limit=1000")
        assert code == 200 and {sample["trajectory_id"] for sample in page["samples"]} == seen["r0"]
        code, body = get_json(r0_only, "/api/samples?run=r1")
        assert code == 502 and "PERMISSION_DENIED" in body["error"] and "acts for run r0" in body["error"], body
        with chromium() as context:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"http://127.0.0.1:{everything.port}/?run=r2")
            picker = page.locator("[data-testid=run-select]")
            assert picker.input_value() == "r2" and picker.locator("option").all_inner_texts() == names
            versions = {name: client.status().policy_version for name, client in zip(names, trainers)}
            page.wait_for_function("document.querySelector('#run').textContent.includes('policy version')")
            assert f"policy version {versions['r2']} " in page.locator("#run").inner_text()
            picker.select_option("r1")
            page.wait_for_url("**/?run=r1")
            page.wait_for_function("document.querySelector('#run').textContent.includes('policy version')")
            assert f"policy version {versions['r1']} " in page.locator("#run").inner_text()
            assert page.locator("[data-testid=run-select]").input_value() == "r1"
    finally:
        everything.stop()
        r0_only.stop()


def start_viewer(workdir: Path, args: list[str]) -> ServiceProcess:
    viewer = ServiceProcess("viewer", [*args, "--log-format", "text"])
    viewer.start(workdir)
    viewer.wait_listening(60)
    return viewer


def get_json(viewer: ServiceProcess, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{viewer.port}{path}", timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def store_samples(address: str, credentials: Path, run: str) -> set[str]:
    """The trajectory ids of a run's sample log, as its store answers its own reader."""
    files = credentials_from(credentials, role="reader", run=run)
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(
            files["root_certificates"], files["private_key"], files["certificate_chain"])) as channel:
        samples = trajectory_pb2_grpc.TrajectoryServiceStub(channel).ListSamples(
            trajectory_pb2.ListSamplesRequest(limit=1000), timeout=60,
            metadata=(("authorization", f"Bearer {files['auth_token']}"),)).samples
    return {sample.trajectory_id for sample in samples}


def test_sigkills_of_the_replica_and_of_a_collector_with_four_runs_in_flight_lose_nothing(
        fleet, trainers, replica_stub, adapters, tiny_model_dir):
    """SIGKILL of the replica, then of run r0's collector, each while all four runs' groups generate on the
    replica: every prompt submitted before each kill reaches its own run's trainer exactly once, as a whole
    group, sampled by its run's adapter at its version; the shared reward service kept a KL controller per
    run, each fed its own run's batches only."""
    suite, credentials = fleet
    runs = runs_of(trainers, adapters, tiny_model_dir)
    replica = suite["generation-0"]
    submit_long(runs, "replica")
    replica.kill()
    suite["generation-0"] = restart(replica)
    suite["generation-0"].wait_ready(600)
    read_exactly_once(runs, "replica")
    wait_for(lambda: {run_id: run.policy_version for run_id, run in served(replica_stub).items()} == {
        client.run.run_id: version for client, version, _ in runs}, SCHEDULE_TIMEOUT,
        "every run re-synced on the restarted replica")

    submit_long(runs, "collector")
    wait_for(lambda: len(served(replica_stub)) == RUNS and all(
        run.requests_in_flight for run in served(replica_stub).values()), SCHEDULE_TIMEOUT,
        "all four runs generating on the replica")
    collector = suite["collector"]
    collector.kill()
    suite["collector"] = restart(collector)
    suite["collector"].wait_ready(300)
    read_exactly_once(runs, "collector")
    with operator_channel(credentials, suite["reward"].address) as channel:
        kl = reward_pb2_grpc.RewardServiceStub(channel).GetKLController
        assert all(kl(reward_pb2.GetKLControllerRequest(run_id=client.run.run_id)).updates >= 1
                   for client, _, _ in runs)
        assert kl(reward_pb2.GetKLControllerRequest()).updates == 0


def submit_long(runs, tag: str) -> None:
    """Four prompts per run, tagged with the run and ``tag``, seconds each: generating when a kill comes."""
    for client, _, _ in runs:
        client.submit_prompts([{"prompt_id": f"{client.run.run_id}-{tag}-{i}", "prompt": PROMPT, "ground_truth": "1",
                                "sampling": {"temperature": 1.0, "max_tokens": 300, "ignore_eos": True}}
                               for i in range(4)])


def read_exactly_once(runs, tag: str) -> None:
    """Each run's trainer reads its four ``tag`` prompts as whole groups of two, once, on its own adapter."""
    for client, version, model in runs:
        rows = read_rows(client, 8)
        run = client.run.run_id
        assert sorted(row["prompt_id"] for row in rows) == sorted(f"{run}-{tag}-{i}" for i in range(4) for _ in range(2))
        check_rows(rows, version, model)


def restart(proc: ServiceProcess) -> ServiceProcess:
    """``proc`` (SIGKILLed) started again on its port and state, not waited for."""
    proc.stop()  # reaps the process group, closes the log
    args = proc.args if "--port" in proc.args else [*proc.args, "--port", str(proc.port)]
    restarted = ServiceProcess(proc.name, args, env=proc.env, health_credentials=proc.health_credentials,
                               metrics_port=proc.metrics_port)
    return restarted.start(proc.log_path.parent / "restarted")
