"""The whole pipeline through real processes: collector + trajectory + reference + reward + 2 vLLM replicas."""

from __future__ import annotations

import collections
import json
import queue
import time

import grpc
import pytest
import torch

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import (collector_pb2, collector_pb2_grpc, generation_pb2, generation_pb2_grpc, sampling_pb2,
                        trajectory_pb2, trajectory_pb2_grpc)
from rlfleet.wire import get_ragged
from tests.hf_reference import load_hf, perturbed, response_log_probs
from tests.integration.pushes import push
from tests.integration.readers import Reader
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
GROUP = 4
PIPELINE_TIMEOUT = 120.0
"""Until the pipeline has done something observable (groups generated, scored and appended; a dead letter; a
ledger emptied; a replica busy): a few groups of at most 200 tokens from the tiny model on CPU take seconds,
minutes on a loaded 2-core machine."""
RELEASE_TIMEOUT = 60.0
"""Until the trajectory service releases a broken stream's lease: one store call once the stream ends."""


@pytest.fixture(scope="module")
def backends(tiny_model_dir, tmp_path_factory):
    """reference, reward, trajectory and two generation replicas (shared); collectors are per test."""
    workdir = tmp_path_factory.mktemp("suite")
    options = SuiteOptions(model_dir=tiny_model_dir, generation_replicas=2, kv_cache_bytes=128 << 20,
                           generation_args=["--max-num-seqs", "32"])
    procs = start_suite(options, workdir, without_collector=True)
    yield procs
    stop_suite(procs)


def start_collector(backends, tmp_path, *args) -> tuple[ServiceProcess, grpc.Channel]:
    """A collector on the module's services; admission by measured divergence off unless ``args`` set a
    ``--mismatch-kl-target`` (these tests' trainers report no mismatch: it would hold them one step ahead)."""
    replicas = [p.address for k, p in backends.items() if k.startswith("generation")]
    if "--mismatch-kl-target" not in args:
        args = ("--mismatch-kl-target", "null", *args)
    proc = ServiceProcess("collector", [
        "--generation-addresses", json.dumps(replicas),
        "--reference-address", backends["reference"].address, "--reward-address", backends["reward"].address,
        "--trajectory-address", backends["trajectory"].address, "--state-dir", str(tmp_path / "collector"),
        "--group-size", str(GROUP), "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 24}),
        "--reward-fn", "char_fraction", "--replica-check-seconds", "0.5", "--log-format", "text", *args])
    proc.start(tmp_path / "collector-proc").wait_ready(120)
    return proc, grpc.insecure_channel(proc.address)


def submit(channel, count: int, tag: str) -> list[str]:
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    prompts = [collector_pb2.PromptSpec(prompt_id=f"{tag}-{i}", prompt=sampling_pb2.Prompt(text=f"what is {i} plus {i}"))
               for i in range(count)]
    return list(stub.SubmitPrompts(collector_pb2.SubmitPromptsRequest(prompts=prompts), timeout=30).prompt_ids)


def current_version(channel) -> int:
    return collector_pb2_grpc.CollectorServiceStub(channel).GetPolicyVersion(
        collector_pb2.GetPolicyVersionRequest(), timeout=30).version


def test_sync_mode_every_batch_after_a_push_carries_the_new_version(backends, tmp_path, tiny_model_dir):
    proc, channel = start_collector(backends, tmp_path, "--mode", "sync", "--groups-per-step", "2")
    state = load_hf(tiny_model_dir).state_dict()
    submit(channel, 8, "sync")
    reader = Reader(channel, batch_size=2 * GROUP)
    try:
        for step in range(3):
            batch = reader.next()
            version = current_version(channel)
            assert batch["policy_version_start"].tolist() == [version] * (2 * GROUP)
            assert batch["policy_version_end"].tolist() == [version] * (2 * GROUP)
            reply = push(channel, state)
            assert reply.version == version + 1 and all(r.applied for r in reply.replicas)
            assert len(reply.replicas) == 2
        status = collector_pb2_grpc.CollectorServiceStub(channel).GetStatus(collector_pb2.GetStatusRequest())
        assert status.mode == "sync" and status.policy_version == version + 1
    finally:
        reader.close()
        channel.close()
        proc.stop()


def test_async_mode_staleness_is_bounded(backends, tmp_path, tiny_model_dir):
    proc, channel = start_collector(backends, tmp_path, "--mode", "async", "--max-staleness", "1",
                                    "--groups-per-step", "2")
    state = load_hf(tiny_model_dir).state_dict()
    submit(channel, 10, "async")
    reader = Reader(channel, batch_size=2 * GROUP)
    try:
        consumed = []
        for step in range(4):
            batch = reader.next()
            version = current_version(channel)
            starts, ends = batch["policy_version_start"], batch["policy_version_end"]
            # Guaranteed: no trajectory became visible more than k=1 versions after it started.
            assert bool((starts >= ends - 1).all()), (starts.tolist(), ends.tolist())
            assert int(starts.max()) <= version
            consumed.append((version, sorted(set(starts.tolist())), sorted(set(ends.tolist()))))
            if step == 0:
                # Async runs ahead: with k=1 the groups of the next step are generated on the current
                # weights without waiting for the trainer's push (sync mode would stop after one step).
                stub = collector_pb2_grpc.CollectorServiceStub(channel)
                wait_for(lambda: stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=10).trajectories
                         >= 2 * 2 * GROUP, PIPELINE_TIMEOUT, "the next step to be generated before the push",
                         interval=0.1)
            time.sleep(0.5)  # a trainer step: the work a trainer does, not a wait (async runs ahead meanwhile)
            push(channel, state)
        status = collector_pb2_grpc.CollectorServiceStub(channel).GetStatus(collector_pb2.GetStatusRequest())
        assert 1 <= len(status.staleness_histogram) <= 2, list(status.staleness_histogram)
        assert sum(status.staleness_histogram) >= 4 * 2 * GROUP, consumed
    finally:
        reader.close()
        channel.close()
        proc.stop()


LONG_TURN = 400
"""Tokens a sample of the keep-swap test runs to: long enough for a push to land while it generates."""


@pytest.mark.parametrize("swap_mode", ["keep", "resume"])
def test_a_keep_or_resume_swap_mid_generation_splits_versions_response_where_the_engine_applied_it(
        backends, tmp_path, tiny_model_dir, swap_mode):
    """Each response token's version (``versions/response``) is the version whose weights sampled it: the
    tokens before a keep- or resume-mode swap have the old weights' log-probs (Hugging Face's, within 1e-4), the
    ones after it the new weights', and no sampled token is thrown away. The trainer's pushes ask for keep; the
    collector's ``swap_mode`` makes them resume. A push lands mid-generation in most tries; up to 5 tries,
    alternating weights."""
    proc, channel = start_collector(backends, tmp_path, "--mode", "async", "--max-staleness", "1000",
                                    "--groups-per-step", "1", "--swap-mode", swap_mode)
    collector = collector_pb2_grpc.CollectorServiceStub(channel)
    replicas = [generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(p.address))
                for name, p in backends.items() if name.startswith("generation")]
    base = load_hf(tiny_model_dir).state_dict()
    weights = [base, perturbed(base, seed=7)]  # served now (the module's pushes are all of base), then pushed
    reader = Reader(channel, batch_size=GROUP)
    split = []
    try:
        for attempt in range(5):
            prompt_id = f"{swap_mode}-split-{attempt}"
            collector.SubmitPrompts(collector_pb2.SubmitPromptsRequest(prompts=[collector_pb2.PromptSpec(
                prompt_id=prompt_id, prompt=sampling_pb2.Prompt(text="count on and on"),
                sampling=sampling_pb2.SamplingParams(max_tokens=LONG_TURN, ignore_eos=True))]), timeout=30)
            wait_for(lambda: any(r.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=10).running_requests
                                 for r in replicas), PIPELINE_TIMEOUT, "the group to be generating", interval=0.02)
            old, new = weights[attempt % 2], weights[(attempt + 1) % 2]
            push(channel, new)
            rows = read_rows(reader, prompt_id)
            assert len(rows) == GROUP
            for row in rows:
                versions = row["versions"].tolist()
                assert len(versions) == len(row["response"]) == LONG_TURN
                assert versions[0] == row["start"] and versions[-1] == row["end"] and versions == sorted(versions)
                if row["start"] != row["end"]:
                    split.append((row, old, new))
            if split:
                break
        assert split, "no push landed while a sample generated, in 5 tries"
        for row, old, new in split[:2]:
            switch = row["versions"].tolist().index(row["end"])
            assert 0 < switch < LONG_TURN and set(row["versions"].tolist()) == {row["start"], row["end"]}
            for model, part in ((load_hf(tiny_model_dir, old), slice(0, switch)),
                                (load_hf(tiny_model_dir, new), slice(switch, None))):
                expected = response_log_probs(model, row["prompt"].tolist(), row["response"].tolist())
                assert (row["log_probs"][part] - expected[part]).abs().max() <= 1e-4, (switch, part)
        current = status(channel)
        assert (current.discarded_samples, current.discarded_tokens) == (0, 0)  # every sampled token kept
        if swap_mode == "resume":  # the engine continued the samples as new requests
            resumed = sum(r.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=10).resumed_samples
                          for r in replicas)
            assert resumed >= len(split)
    finally:
        push(channel, base)  # the module's other tests expect the base weights served
        reader.close()
        channel.close()
        proc.stop()


def test_a_trainer_computing_with_other_weights_than_it_pushed_trips_the_mismatch_breaker(backends, tmp_path,
                                                                                            tiny_model_dir):
    """The trainer computes its log-probs with the base weights but pushed perturbed ones (a broken push, as
    the replicas see it): its lag-0 k3 KL reports cross the threshold, and the second in a row opens the
    breaker; trainer calls are refused naming the measurement until an operator closes it, then the run
    resumes. Before the bad push the same reports measure nothing."""
    from rlfleet.client import FailedPreconditionError, connect

    proc, channel = start_collector(backends, tmp_path, "--mode", "async", "--max-staleness", "1000",
                                    "--groups-per-step", "1", "--mismatch-kl-threshold", "0.01",
                                    "--mismatch-trip-batches", "2", "--mismatch-kl-target", "0.05")
    collector = collector_pb2_grpc.CollectorServiceStub(channel)
    base = load_hf(tiny_model_dir).state_dict()
    trainer = load_hf(tiny_model_dir)  # what the trainer computes with: always the base weights
    reader = Reader(channel, batch_size=GROUP)
    client = connect(proc.address, timeout=60)

    def measure_and_report(tag: str):
        prompt_id, = submit(channel, 1, tag)
        rows = read_rows(reader, prompt_id)
        version = current_version(channel)
        by_lag = mismatch_by_lag(trainer, rows, version)
        return by_lag, client.report_mismatch(by_lag, version)

    try:
        push(channel, base)
        by_lag, breaker = measure_and_report("mismatch-matching")
        assert by_lag[0]["kl_k3"] < 1e-5 and not breaker.breaker_open and breaker.consecutive_over == 0
        bad_version = push(channel, perturbed(base, seed=11)).version
        first, breaker = measure_and_report("mismatch-broken-1")
        assert first[0]["kl_k3"] > 0.01 and not breaker.breaker_open and breaker.consecutive_over == 1
        second, breaker = measure_and_report("mismatch-broken-2")
        assert breaker.breaker_open and breaker.consecutive_over == 2

        reason = f"lag-0 k3 KL of {second[0]['kl_k3']:.4g} (threshold 0.01) in 2 batches in a row, since policy " \
                 f"version {bad_version}"
        assert reason in breaker.reason and client.status().mismatch.reason == breaker.reason
        for call in (lambda: submit(channel, 1, "mismatch-refused"), lambda: push(channel, base),
                     lambda: Reader(channel, batch_size=GROUP).next()):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and reason in refused.value.details()
        with pytest.raises(FailedPreconditionError, match="mismatch breaker is open"):
            client.submit_prompts([{"prompt": "refused too"}])
        assert current_version(channel) == bad_version  # nothing half-applied

        assert client.close_mismatch_breaker() and not client.status().mismatch.breaker_open
        push(channel, base)  # the trainer's weights, pushed right this time
        fixed, breaker = measure_and_report("mismatch-fixed")
        assert fixed[0]["kl_k3"] < 1e-5 and not breaker.breaker_open and breaker.consecutive_over == 0
        assert breaker.admission_staleness == 1000  # the ceiling: no lag >= 1 measured over the target
        # A trainer that measured lag 1 over the target: admission keeps to lag 0 (the ceiling stays 1000).
        stale = {1: {"kl_k3": 0.4, "kl_k1": 0.3, "ess_token": 0.5, "tokens": 96}}
        breaker = client.report_mismatch(stale, current_version(channel))
        assert breaker.admission_staleness == 0 and breaker.measured[1]["kl_k3"] == pytest.approx(0.4)
        assert client.status().max_staleness == 1000 and not breaker.breaker_open
    finally:
        if client.status().mismatch.breaker_open:
            client.close_mismatch_breaker()
        push(channel, base)  # the module's other tests expect the base weights served
        client.close()
        reader.close()
        channel.close()
        proc.stop()


def test_an_open_mismatch_breaker_stays_open_across_a_collector_sigkill_until_an_operator_closes_it(backends, tmp_path):
    """Killed just after the report that opened it returned: the restarted collector keeps it open, with the
    same reason, and refuses trainer calls; closed, it stays closed across the next restart. The measured KL per
    lag survives too: admission stays bounded below the lag found over the KL target."""
    from rlfleet.client import connect

    args = ("--mode", "async", "--max-staleness", "1000", "--groups-per-step", "1",
            "--mismatch-kl-threshold", "0.01", "--mismatch-trip-batches", "2", "--mismatch-kl-target", "0.05")
    over = {0: {"kl_k3": 0.5, "kl_k1": 0.4, "ess_token": 0.3, "tokens": 96},
            3: {"kl_k3": 0.2, "kl_k1": 0.1, "ess_token": 0.6, "tokens": 32}}  # lag 3 over the KL target too
    proc, channel = start_collector(backends, tmp_path, *args)
    try:
        with connect(proc.address, timeout=60) as client:
            client.report_mismatch(over, 1)
            reason = client.report_mismatch(over, 2).reason
        assert "lag-0 k3 KL of 0.5 (threshold 0.01) in 2 batches in a row, since policy version 1" in reason
        proc.kill()  # SIGKILL, right after the report that opened it returned
        channel.close()
        for closing in (True, False):
            proc, channel = start_collector(backends, tmp_path, *args)  # the same state directory
            with connect(proc.address, timeout=60) as client:
                mismatch = client.status().mismatch
                assert mismatch.breaker_open == closing and mismatch.reason == (reason if closing else "")
                # Admission by divergence resumes from what was measured, not from the ceiling.
                assert (sorted(mismatch.measured), mismatch.admission_staleness) == ([0, 3], 2)
                if closing:
                    with pytest.raises(grpc.RpcError) as refused:
                        submit(channel, 1, "breaker-after-restart")
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert reason in refused.value.details()
                    assert client.close_mismatch_breaker()
                else:
                    assert submit(channel, 1, "breaker-closed-after-restart")
            proc.stop()
            channel.close()
    finally:
        proc.stop()
        channel.close()


def test_admission_by_measured_divergence_comes_down_on_genuinely_stale_batches_and_back_up_when_kl_falls(
        backends, tmp_path, tiny_model_dir):
    """A trainer that reads a group two versions after it was sampled, with weights that moved since
    (perturbed at each push), measures lag 2 over the KL target: admission comes down to 1, in status and in
    the metrics. When its weights stop moving, the next stale group measures lag 2 under the target and
    admission goes back up to the ceiling. The trainer's log-probs are computed by its own model on the
    batch's tokens; the retried report of each measurement counts once."""
    from rlfleet.client import connect
    from rlfleet.services.launch import free_port
    from tests.scrape import scrape_metric

    metrics_port = free_port()
    proc, channel = start_collector(backends, tmp_path, "--mode", "async", "--max-staleness", "4",
                                    "--groups-per-step", "1", "--mismatch-kl-target", "0.05",
                                    "--mismatch-horizon", "2", "--metrics-port", str(metrics_port))
    base = load_hf(tiny_model_dir).state_dict()
    trainer = load_hf(tiny_model_dir)
    reader = Reader(channel, batch_size=GROUP)
    client = connect(proc.address, timeout=60)

    def stale_group(tag: str, pushes: list[dict]) -> dict[int, dict[str, float]]:
        """One group sampled at the current version, read after ``pushes``; the trainer computes with the last."""
        appended = status(channel).trajectories
        prompt_id, = submit(channel, 1, tag)
        wait_for(lambda: status(channel).trajectories >= appended + GROUP, PIPELINE_TIMEOUT,
                 f"{tag} to be generated before the pushes")
        for weights in pushes:
            push(channel, weights)
        trainer.load_state_dict(pushes[-1])
        return mismatch_by_lag(trainer, read_rows(reader, prompt_id), current_version(channel))

    def report_twice(by_lag):  # the second call is a retry: the same request, the same report id
        stub = collector_pb2_grpc.CollectorServiceStub(channel)
        request = collector_pb2.ReportMismatchRequest(
            policy_version=current_version(channel), report_id=f"report-{status(channel).mismatch.reports}",
            lags=[collector_pb2.LagMismatch(lag=lag, kl_k3=v["kl_k3"], kl_k1=v["kl_k1"], ess_token=v["ess_token"],
                                            tokens=v["tokens"]) for lag, v in sorted(by_lag.items())])
        first, again = (stub.ReportMismatch(request, timeout=30).status for _ in range(2))
        assert again.reports == first.reports  # counted once
        return again

    try:
        # No report yet: admission starts low (one step ahead), not at the ceiling of 4.
        assert status(channel).mismatch.admission_staleness == 1 and status(channel).max_staleness == 4
        push(channel, base)
        moved = [perturbed(base, seed=21), perturbed(base, seed=22)]
        over = stale_group("divergence-moving", moved)  # sampled on base, read two versions later
        assert sorted(over) == [2] and over[2]["kl_k3"] > 0.05, over
        mismatch = report_twice(over)
        assert mismatch.admission_staleness == 1 and mismatch.reports == 1
        assert status(channel).max_staleness == 4  # the ceiling stays
        wait_for(lambda: scrape_metric(metrics_port, "rlfleet_admission_staleness") == 1, 30,
                 "the metric to show the lowered bound")

        still = [moved[-1], moved[-1]]  # the trainer's weights stop moving: versions change, the policy does not
        under = stale_group("divergence-still", still)
        assert sorted(under) == [2] and under[2]["kl_k3"] < 0.05 / 100, under
        mismatch = report_twice(under)
        assert mismatch.admission_staleness == 4 and mismatch.reports == 2
        assert client.status().mismatch.admission_staleness == 4
        wait_for(lambda: scrape_metric(metrics_port, "rlfleet_admission_staleness") == 4, 30,
                 "the metric to show the bound back at the ceiling")
    finally:
        push(channel, base)  # the module's other tests expect the base weights served
        client.close()
        reader.close()
        channel.close()
        proc.stop()


def mismatch_by_lag(trainer, rows: list[dict], trainer_version: int) -> dict[int, dict[str, float]]:
    """What a trainer computing with ``trainer`` measures of ``rows`` (``read_rows``) per version lag: its own
    log-probs of the sampled tokens against the behaviour's (``rlfleet.client.offpolicy``, no correction)."""
    from rlfleet.client.offpolicy import importance_weights

    padded = torch.nn.utils.rnn.pad_sequence
    mine = padded([response_log_probs(trainer, r["prompt"].tolist(), r["response"].tolist()) for r in rows],
                  batch_first=True)
    behaviour = padded([r["log_probs"] for r in rows], batch_first=True)
    mask = padded([torch.ones(len(r["response"]), dtype=torch.bool) for r in rows], batch_first=True)
    versions = padded([r["versions"] for r in rows], batch_first=True)
    return importance_weights(mine, behaviour, mask, "none", versions=versions,
                              trainer_version=trainer_version).by_lag


def read_rows(reader: "Reader", prompt_id: str) -> list[dict]:
    """The rows of ``prompt_id``'s group, read whole: tokens, behaviour log-probs and versions per sample."""
    while True:
        batch = reader.next()
        rows = []
        for i, pid in enumerate(list(batch["prompt_id"])):
            if pid == prompt_id:  # else left in the shared buffer by an earlier test's collector
                rows.append({
                    "prompt": get_ragged(batch, ("tokens", "prompt")).to_list()[i],
                    "response": get_ragged(batch, ("tokens", "response")).to_list()[i],
                    "log_probs": get_ragged(batch, ("log_probs", "response")).to_list()[i],
                    "versions": get_ragged(batch, ("versions", "response")).to_list()[i],
                    "start": int(batch["policy_version_start"][i]), "end": int(batch["policy_version_end"][i])})
        if rows:
            return rows


def status(channel) -> collector_pb2.GetStatusResponse:
    return collector_pb2_grpc.CollectorServiceStub(channel).GetStatus(collector_pb2.GetStatusRequest(), timeout=30)


def read_groups(reader: "Reader", prompt_ids: list[str]) -> dict[str, collections.Counter]:
    """Rows per group id of each of ``prompt_ids``, reading until every one has a whole group."""
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    while not all(sum(seen[p].values()) >= GROUP for p in prompt_ids):
        batch = reader.next()
        for pid, gid in zip(list(batch["prompt_id"]), batch["group_id"].tolist()):
            if pid in prompt_ids:  # else left in the shared buffer by an earlier test's collector
                seen[pid][gid] += 1
    return seen


def test_sync_mode_generates_again_the_groups_that_went_stale_unread(backends, tmp_path, tiny_model_dir):
    """The trainer reads one group per step of two: the other goes stale at each push. It is dropped from
    the trajectory service and its prompt generated again, so every prompt reaches the trainer once, on-policy."""
    proc, channel = start_collector(backends, tmp_path, "--mode", "sync", "--groups-per-step", "2")
    state = load_hf(tiny_model_dir).state_dict()
    prompt_ids = submit(channel, 4, "stale")
    reader = Reader(channel, batch_size=GROUP, ack_late=True)
    trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(grpc.insecure_channel(backends["trajectory"].address))
    dropped = lambda: trajectory.GetStats(trajectory_pb2.GetStatsRequest(), timeout=30).dropped_stale  # noqa: E731
    seen: collections.Counter = collections.Counter()
    idle = lambda: all(s.queued == 0 and s.in_flight == 0 for s in status(channel).stages)  # noqa: E731
    try:
        for step in range(12):
            batch = reader.next()  # acks the previous one (after the push, as a trainer does)
            version = current_version(channel)
            assert batch["policy_version_start"].tolist() == [version] * GROUP  # on-policy
            seen.update(set(batch["prompt_id"]) & set(prompt_ids))
            if set(seen) == set(prompt_ids):
                break
            # The step's other group stays in the buffer, unread.
            wait_for(idle, PIPELINE_TIMEOUT, "the step's other group to be appended")
            before = dropped()
            push(channel, state)
            if step == 0:  # the first step's other group is ready, unread: the collector's DropStale deletes it
                wait_for(lambda: dropped() >= before + GROUP, PIPELINE_TIMEOUT, "DropStale after the commit")
        assert seen == collections.Counter(prompt_ids), seen  # each exactly once
        current = status(channel)
        assert current.discarded_samples >= GROUP and current.failed_prompts == 0
    finally:
        reader.close()
        channel.close()
        proc.stop()


def test_a_prompt_whose_input_a_stage_refuses_is_a_dead_letter_at_once(backends, tmp_path):
    proc, channel = start_collector(backends, tmp_path)
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    reader = Reader(channel, batch_size=GROUP)
    try:
        prompts = [collector_pb2.PromptSpec(prompt_id=f"poison-{i}", prompt=sampling_pb2.Prompt(text=f"what is {i}"))
                   for i in range(3)]
        # What the reward service would refuse is refused at submission, naming the prompt; nothing queued.
        prompts[1].reward_fn = "no_such_fn"
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitPrompts(collector_pb2.SubmitPromptsRequest(prompts=prompts), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details().startswith("prompts[1]: reward function 'no_such_fn' is not registered")
        assert status(channel).pending_prompts == 0
        # Longer than the model's context: only generation can tell, and refuses it.
        prompts[1].reward_fn = ""
        prompts[1].prompt.text = "count " * 2000
        stub.SubmitPrompts(collector_pb2.SubmitPromptsRequest(prompts=prompts), timeout=30)
        seen = read_groups(reader, ["poison-0", "poison-2"])
        assert all(list(rows.values()) == [GROUP] for rows in seen.values())
        failures = wait_for(lambda: stub.ListFailures(collector_pb2.ListFailuresRequest(), timeout=30).failures,
                            PIPELINE_TIMEOUT, "the dead letter")
        assert [(f.prompt_id, f.stage, f.code, f.attempts) for f in failures] == [
            ("poison-1", "generation", "INVALID_ARGUMENT", 0)], failures
        current = status(channel)
        assert (current.failed_prompts, current.pending_prompts) == (1, 0)  # not retried: nothing pending
    finally:
        reader.close()
        channel.close()
        proc.stop()


def test_a_collector_killed_with_prompts_queued_and_generating_loses_and_duplicates_none(backends, tmp_path):
    args = ("--mode", "async", "--max-staleness", "1000", "--max-groups-in-flight", "4",
            "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 120, "ignore_eos": True}))
    proc, channel = start_collector(backends, tmp_path, *args)
    try:
        prompt_ids = submit(channel, 10, "chaos")
        # Groups generating: replicas count the samples outstanding, GROUP per group.
        generating = lambda current: sum(r.in_flight for r in current.replicas) // GROUP  # noqa: E731
        before = wait_for(lambda: (lambda current: current if generating(current) else None)(status(channel)),
                          PIPELINE_TIMEOUT, "generations in flight")
        assert before.pending_prompts > generating(before)  # some generating, the rest queued behind them
        proc.kill()  # SIGKILL: no shutdown, nothing saved beyond what was already durable
    finally:
        proc.stop()
        channel.close()

    proc, channel = start_collector(backends, tmp_path, *args)  # the same state directory
    reader = Reader(channel, batch_size=GROUP)
    try:
        seen = read_groups(reader, prompt_ids)
        # Every submitted prompt ended as exactly one whole group: none lost, none twice.
        assert {pid: list(rows.values()) for pid, rows in seen.items()} == {pid: [GROUP] for pid in prompt_ids}
        wait_for(lambda: status(channel).pending_prompts == 0, PIPELINE_TIMEOUT, "the ledger to empty")
        assert status(channel).failed_prompts == 0
    finally:
        reader.close()
        channel.close()
        proc.stop()


def test_dynamic_sampling_delivers_only_groups_whose_scores_vary_and_counts_the_rest_once_across_a_sigkill(
        backends, tmp_path):
    """Half the prompts score 0 whatever is sampled (reward "none"): their groups are stored as filtered, never
    delivered. The collector is SIGKILLed as soon as the trajectory service committed a filtered group (the
    instant before the collector's own ledger records it); after the restart every prompt is counted exactly
    once: in its pass rate, in the collector's filtered count, in the trajectory service's."""
    from rlfleet.client import connect

    trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(grpc.insecure_channel(backends["trajectory"].address))
    filtered_in_log = lambda: trajectory.GetStats(trajectory_pb2.GetStatsRequest(), timeout=30).filtered_groups  # noqa: E731
    before = filtered_in_log()
    args = ("--mode", "async", "--max-staleness", "1000", "--groups-per-step", "2", "--max-groups-in-flight", "4",
            "--dynamic-sampling", "true")
    specs = [collector_pb2.PromptSpec(prompt_id=f"ds-{kind}-{i}", prompt=sampling_pb2.Prompt(text=f"say {i} words"),
                                      reward_fn="none" if kind == "flat" else "char_fraction",
                                      reward_args={} if kind == "flat" else {"pattern": "[a-z]"})
             for i in range(6) for kind in ("flat", "varied")]
    keys = [spec.prompt_id for spec in specs]
    proc, channel = start_collector(backends, tmp_path, *args)
    try:
        collector_pb2_grpc.CollectorServiceStub(channel).SubmitPrompts(
            collector_pb2.SubmitPromptsRequest(prompts=specs), timeout=30)
        wait_for(lambda: filtered_in_log() > before, PIPELINE_TIMEOUT, "a group stored as filtered", interval=0.01)
        proc.kill()  # SIGKILL, as soon as the trajectory service committed it: the collector's ledger may not have
    finally:
        proc.stop()
        channel.close()

    proc, channel = start_collector(backends, tmp_path, *args)  # the same state directory
    reader = Reader(channel, batch_size=GROUP)
    try:
        wait_for(lambda: status(channel).pending_prompts == 0, PIPELINE_TIMEOUT, "every prompt to end")
        with connect(proc.address, timeout=60) as client:
            rates, _ = client.pass_rates(keys)
            sampling = client.status().dynamic_sampling
        rates = {rate.prompt_key: rate for rate in rates}
        assert sorted(rates) == sorted(keys)
        assert {key: (rate.groups, rate.samples) for key, rate in rates.items()} == {key: (1, GROUP) for key in keys}
        filtered = {key for key, rate in rates.items() if rate.filtered_groups}
        assert {key for key in keys if key.startswith("ds-flat")} <= filtered  # a constant score is always filtered
        assert all(rates[key].passed == 0 for key in keys if key.startswith("ds-flat"))
        # Counted once each, across the kill: by the collector's ledger and by the trajectory service's log.
        assert (sampling.enabled, sampling.filtered_groups, sampling.filtered_samples) == (
            True, len(filtered), GROUP * len(filtered))
        assert filtered_in_log() - before == len(filtered)
        delivered = [key for key in keys if key not in filtered]
        scores: dict[str, list[float]] = collections.defaultdict(list)
        while any(len(scores[key]) < GROUP for key in delivered):
            batch = reader.next()
            assert len(batch["prompt_id"]) == GROUP  # full batches
            for pid, score in zip(list(batch["prompt_id"]), batch["score"].tolist()):
                if pid.startswith("ds-"):  # else left in the shared buffer by an earlier test's collector
                    assert pid in delivered, f"{pid} was filtered, yet delivered"
                    scores[pid].append(score)
        assert all(len(set(values)) > 1 for values in scores.values()), scores  # only groups whose scores vary
        assert status(channel).failed_prompts == 0
    finally:
        reader.close()
        channel.close()
        proc.stop()


def test_a_malformed_message_through_the_proxy_fails_at_once_and_releases_the_batch(backends, tmp_path):
    """The collector forwards StreamBatches; a message it cannot parse ends the stream with
    INVALID_ARGUMENT (it used to hang until the deadline, the batch leased upstream)."""
    proc, channel = start_collector(backends, tmp_path)
    upstream = grpc.insecure_channel(backends["trajectory"].address)
    trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(upstream)
    requests = queue.Queue()
    try:
        submit(channel, 1, "garbage")
        requests.put(trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(
            batch_size=GROUP)).SerializeToString())
        stream = channel.stream_stream("/rlfleet.v1.TrajectoryService/StreamBatches", request_serializer=None,
                                       response_deserializer=trajectory_pb2.StreamBatchesResponse.FromString)
        responses = stream(iter(requests.get, None), timeout=120)  # a hang would end DEADLINE_EXCEEDED
        assert next(responses).lease_id
        requests.put(b"\x0a\xff\xff\xff\x0f\x01")  # not a protobuf message
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "TrajectoryService/StreamBatches: the request is not a valid protobuf message" in err.value.details()
        wait_for(lambda: not trajectory.GetStats(trajectory_pb2.GetStatsRequest(), timeout=30).leased,
                 RELEASE_TIMEOUT, "the batch leased upstream to be released")
    finally:
        requests.put(None)
        upstream.close()
        channel.close()
        proc.stop()


def engine_version(replica: ServiceProcess) -> int:
    with grpc.insecure_channel(replica.address) as channel:
        return generation_pb2_grpc.GenerationServiceStub(channel).GetEngineStatus(
            generation_pb2.GetEngineStatusRequest(), timeout=30).policy_version


def test_replicas_join_and_leave_a_run_with_nothing_lost(backends, tmp_path, tiny_model_dir):
    """Membership from a file the collector re-reads: a replica that joins is re-synced to the committed
    version before it gets work; one that leaves with groups in flight finishes them; a replica started
    mid-run joins, then is SIGKILLed with groups in flight and leaves: every prompt's group arrives once."""
    first, second = backends["generation-0"], backends["generation-1"]
    members = tmp_path / "replicas.json"
    members.write_text(json.dumps([first.address]))
    proc, channel = start_collector(backends, tmp_path, "--generation-addresses-file", str(members),
                                    "--discovery-refresh-seconds", "0.3", "--mode", "async", "--max-staleness", "1000",
                                    "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 64, "ignore_eos": True}))
    reader = Reader(channel, batch_size=GROUP)
    third = None
    in_rotation = lambda: {r.address: r.policy_version for r in status(channel).replicas if r.healthy}  # noqa: E731
    try:
        assert [r.address for r in status(channel).replicas] == [first.address]
        version = push(channel, load_hf(tiny_model_dir).state_dict()).version  # the second replica misses it
        assert engine_version(second) < version
        members.write_text(json.dumps([first.address, second.address]))
        wait_for(lambda: in_rotation() == {first.address: version, second.address: version}, PIPELINE_TIMEOUT,
                 "the joining replica re-synced to the committed version and in rotation")
        assert engine_version(second) == version

        # The first leaves while its groups are generating: they finish there; new work goes elsewhere.
        prompt_ids = submit(channel, 8, "elastic")
        wait_for(lambda: any(r.address == first.address and r.in_flight > 0 for r in status(channel).replicas),
                 PIPELINE_TIMEOUT, "the first replica to be generating for us")
        members.write_text(json.dumps([second.address]))
        wait_for(lambda: [r.address for r in status(channel).replicas] == [second.address], PIPELINE_TIMEOUT,
                 "the first replica to leave")

        # A replica started now joins, then dies with groups in flight and leaves the list.
        third = ServiceProcess("generation", ["--model", str(tiny_model_dir), "--kv-cache-memory-bytes",
                                              str(128 << 20), "--max-model-len", "1024", "--max-num-seqs", "32",
                                              "--log-format", "text"])
        third.start(tmp_path / "third").wait_ready(600)
        members.write_text(json.dumps([second.address, third.address]))
        wait_for(lambda: third.address in in_rotation(), PIPELINE_TIMEOUT, "the new replica in rotation")
        prompt_ids += submit(channel, 12, "elastic-kill")
        wait_for(lambda: any(r.address == third.address and r.in_flight > 0 for r in status(channel).replicas),
                 PIPELINE_TIMEOUT, "the new replica to be generating for us")
        third.kill()
        members.write_text(json.dumps([second.address]))

        seen = read_groups(reader, prompt_ids)
        assert all(list(rows.values()) == [GROUP] for rows in seen.values()), seen  # one whole group each
        final = status(channel)
        assert final.failed_prompts == 0 and [r.address for r in final.replicas] == [second.address]
    finally:
        reader.close()
        channel.close()
        proc.stop()
        if third is not None:
            third.stop()


def test_replica_killed_mid_run_loses_and_duplicates_nothing(backends, tmp_path):
    proc, channel = start_collector(backends, tmp_path, "--mode", "async", "--max-staleness", "1000",
                                    "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 200,
                                                              "ignore_eos": True}))
    prompt_ids = submit(channel, 16, "kill")
    reader = Reader(channel, batch_size=GROUP)
    seen = collections.defaultdict(set)
    rows = collections.Counter()
    try:
        stub = collector_pb2_grpc.CollectorServiceStub(channel)
        victim = backends["generation-1"]
        wait_for(lambda: any(r.address == victim.address and r.in_flight > 0
                             for r in stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=10).replicas),
                 PIPELINE_TIMEOUT, "the second replica to be generating for us")
        victim.kill()  # SIGKILL mid-generation
        while sum(rows.values()) < len(prompt_ids) * GROUP:
            batch = reader.next()
            for pid, gid in zip(list(batch["prompt_id"]), batch["group_id"].tolist()):
                if pid not in prompt_ids:
                    continue  # left in the shared buffer by an earlier test's collector
                seen[pid].add(gid)
                rows[pid] += 1
        assert set(seen) == set(prompt_ids)
        assert all(len(groups) == 1 for groups in seen.values()), seen  # each prompt's group exactly once
        assert all(count == GROUP for count in rows.values())
        status = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=10)
        assert {r.address: r.healthy for r in status.replicas}[victim.address] is False
    finally:
        reader.close()
        channel.close()
        proc.stop()
