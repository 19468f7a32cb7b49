"""Several runs on one generation replica (a real process on real vLLM, the tiny model): each samples on
the base weights with its own LoRA adapter at its own versions, a push of one changes nothing another
sees, and the replica's slots are bounded (docs/concepts/many-runs.md)."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch

from rlfleet.client import connect
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, reward_pb2, reward_pb2_grpc, sampling_pb2, weights_pb2
from rlfleet.wire import decode_tensor, encode_tensor
from rlfleet.wire.push_messages import iter_push_messages
from tests.hf_reference import load_hf, perturbed, response_log_probs
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROMPT = [1, 348, 201, 330, 400, 223, 20, 267, 223, 21, 2, 201, 1, 305, 310, 201]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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


def peft_model(model_dir, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()


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


def generate(stub, run_id: str = "", n: int = 2, max_tokens: int = 12, **extra):
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))), run_id=run_id,
        sampling=sampling_pb2.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, **extra))
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


def test_two_trainers_share_a_suites_replica_each_on_its_own_run(adapters, tiny_model_dir, tmp_path, request):
    """``rlfleet-suite --runs 2``: two collectors (``shared_replicas``), each with its trainer and trajectory
    store, over one replica: each run starts at its own version 0 whatever the other pushed, and every sample
    of each run's batches was sampled by that run's adapter at the version it is labelled with; a SIGKILL of
    the replica while both runs generate loses and duplicates nothing in either (``kill_and_restart``)."""
    options = SuiteOptions(model_dir=tiny_model_dir, runs=2, kv_cache_bytes=128 << 20, max_model_len=512,
                           collector_args=["--group-size", "2", "--groups-per-step", "2", "--max-staleness", "1000",
                                           "--mismatch-kl-target", "null",
                                           "--sampling", '{"temperature": 1.0, "max_tokens": 12}'])
    suite = start_suite(options, tmp_path / "suite")
    request.addfinalizer(lambda: stop_suite(suite))
    assert [key for key in suite if key.startswith(("collector", "trajectory"))] == [
        "trajectory", "trajectory-1", "collector", "collector-1"]
    channel = grpc.insecure_channel(suite["generation-0"].address)
    request.addfinalizer(channel.close)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    with connect(suite["collector"].address, run="new", timeout=300) as a:
        assert a.push_adapter(adapters[1], progress=False).version == 1
        with connect(suite["collector-1"].address, run="new", timeout=300) as b:
            assert b.policy_version == 0  # a fresh run, whatever the replica serves the other run
            b.push_adapter(adapters[2], progress=False)
            assert b.push_adapter(adapters[3], progress=False).version == 2
            with pytest.raises(Exception, match="LoRA adapters"):
                b.push_weights(dict(load_hf(tiny_model_dir).state_dict()), progress=False)
            runs = served(stub)
            assert {runs[a.run.run_id].policy_version, runs[b.run.run_id].policy_version} == {1, 2}
            runs = ((a, 1, adapters[1]), (b, 2, adapters[3]))
            for client, version, model in runs:
                client.submit_prompts([{"prompt": PROMPT, "ground_truth": "1"} for _ in range(2)])
                rows = read_rows(client, 4)
                assert len(rows) == 4
                check_rows(rows, version, model)
            suite["generation-0"] = kill_and_restart(suite["generation-0"], runs, stub)
            # The shared reward service kept a KL controller per run, each fed its own run's batches only.
            with grpc.insecure_channel(suite["reward"].address) as reward_channel:
                kl = reward_pb2_grpc.RewardServiceStub(reward_channel).GetKLController
                assert all(kl(reward_pb2.GetKLControllerRequest(run_id=client.run.run_id)).updates >= 1
                           for client in (a, b))
                assert kl(reward_pb2.GetKLControllerRequest()).updates == 0


def kill_and_restart(replica: ServiceProcess, runs, stub) -> ServiceProcess:
    """SIGKILL the replica while both runs' groups generate there, restart it on its port: each collector
    re-syncs its own run's adapter (the replica came back serving no run), and every prompt submitted before
    the kill reaches its trainer exactly once, as a whole group, sampled by its own run's adapter."""
    for client, _, _ in runs:
        tag = client.run.run_id
        client.submit_prompts([{"prompt_id": f"{tag}-{i}", "prompt": PROMPT, "ground_truth": "1",
                                "sampling": {"temperature": 1.0, "max_tokens": 300, "ignore_eos": True}}
                               for i in range(4)])  # seconds each: still generating when the kill comes
    wait_for(lambda: all(run.requests_in_flight for run in served(stub).values()), SCHEDULE_TIMEOUT,
             "both runs generating on the replica")
    replica.kill()
    restarted = ServiceProcess("generation", [*replica.args, "--port", str(replica.port)])
    restarted.start(replica.log_path.parent / "restarted").wait_ready(600)
    for client, version, model in runs:
        rows = read_rows(client, 8)
        tag = client.run.run_id
        assert sorted(row["prompt_id"] for row in rows) == sorted(f"{tag}-{i}" for i in range(4) for _ in range(2))
        check_rows(rows, version, model)
    wait_for(lambda: {run.policy_version for run in served(stub).values()} == {1, 2}, SCHEDULE_TIMEOUT,
             "both runs re-synced on the restarted replica")
    return restarted
