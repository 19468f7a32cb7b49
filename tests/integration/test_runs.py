"""Run identity through the real suite, as a user meets it: a run, the suite down and up again on its work
directory (it resumes), a fresh trainer refused with both runs named, the run resumed by its id, then the
suite up with ``--fresh``: a clean run at version 0, and the old run's trainer refused by it."""

from __future__ import annotations

import pytest
import torch

from rlfleet.client import FailedPreconditionError, Run, connect
from rlfleet.services.launch import free_port
from rlfleet.services.suite import SuiteOptions, describe_run, start_suite, stop_suite
from tests.hf_reference import load_hf

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
COLLECTOR_ARGS = ["--mode=sync", "--group-size=2", "--groups-per-step=2",
                  '--sampling={"temperature": 1.0, "max_tokens": 8}', "--reward-fn=char_fraction"]
PROMPTS = [{"prompt": "answer in digits: seven", "reward_fn": "char_fraction"}] * 2


def one_step(client, weights) -> int:
    """Read one step's batch (whole groups) and push: the version committed."""
    client.submit_prompts(PROMPTS)
    with client.batches(4, idle_timeout=300) as batches:
        batch = next(batches)
        assert len(batch) == 4
    return client.push_weights(weights, progress=False).version


@pytest.fixture(scope="module")
def suite_at(tiny_model_dir, tmp_path_factory):
    """``start(fresh)`` brings the suite up on one work directory (the previous one down first)."""
    workdir = tmp_path_factory.mktemp("runs-suite")
    running: list[dict] = []
    port = ["--port", str(free_port())]  # one collector address across starts, as a deployment keeps it

    def start(fresh: bool = False) -> dict:
        if running:
            stop_suite(running.pop())
        running.append(start_suite(SuiteOptions(model_dir=tiny_model_dir, collector_args=COLLECTOR_ARGS + port,
                                                fresh=fresh), workdir))
        return running[-1]

    yield start, workdir
    if running:
        stop_suite(running.pop())


def test_a_run_is_resumed_by_its_id_refused_to_a_new_trainer_and_started_anew_with_fresh(suite_at, tiny_model_dir):
    start, workdir = suite_at
    weights = load_hf(tiny_model_dir).state_dict()

    # Run 1: a trainer starts it and takes two steps.
    procs = start(fresh=True)
    with connect(procs["collector"].address, run="new") as trainer:
        first = trainer.join()
        assert first.version == 0 and not first.resumed and f"run {first.run_id}: new" == describe_run(
            procs["collector"].address, workdir, secure=False)
        for _ in range(2):
            one_step(trainer, weights)
        held = trainer.run
    assert held == Run(first.run_id, 2, first.created_at, first.resumed)

    # Down and up on the same work directory: the collector resumes run 1 and says so.
    procs = start()
    address = procs["collector"].address
    said = describe_run(address, workdir, secure=False)
    assert f"run {held.run_id}: resumed at version 2" in said and f"run {held})" in said
    with connect(address) as reader:
        status = reader.status()
        assert status.run.run_id == held.run_id and status.run.resumed and status.policy_version == 2

    # A freshly initialised trainer is refused, the message naming the run it would have been fed.
    with connect(address, run="new") as fresh_trainer:
        with pytest.raises(FailedPreconditionError) as refused:
            fresh_trainer.batches(4, idle_timeout=60).__next__()
        assert "starts a new run" in str(refused.value) and held.run_id in str(refused.value)
        with pytest.raises(FailedPreconditionError, match=held.run_id):
            fresh_trainer.push_weights(weights, progress=False)
        assert fresh_trainer.run is None
    # Resuming another run, or this run with other weights than committed: refused, naming both.
    for claim, named in ((Run("run-20200101-000000-000000", 2), "run-20200101-000000-000000"),
                         (Run(held.run_id, 1), "holding the weights of version 1")):
        with connect(address, run=claim) as wrong:
            with pytest.raises(FailedPreconditionError, match=named):
                wrong.join()
    with connect(address) as reader:
        assert reader.policy_version == 2  # nothing half-applied by the refused calls

    # Resumed by its id (as a checkpoint keeps it): the run goes on at its committed version.
    with connect(address, run=str(held)) as resumed:
        assert resumed.join().run_id == held.run_id
        assert one_step(resumed, weights) == 3
        assert resumed.run == Run(held.run_id, 3, held.created_at, True)

        # --fresh: a clean run at version 0, nothing of run 1 in it.
        procs = start(fresh=True)
        assert procs["collector"].address == address
        with connect(address) as reader:
            status = reader.status()
            stats = reader.buffer_stats()
        assert status.run.run_id != held.run_id and not status.run.resumed and status.policy_version == 0
        assert status.trajectories == status.pending_prompts == 0 and stats.ready == stats.leased == 0
        # The trainer still in run 1 is refused by every call, naming both runs, and changes nothing.
        both = f"joined run {held.run_id}.*now holds run {status.run.run_id}"
        with pytest.raises(FailedPreconditionError, match=both):
            resumed.push_weights(weights, progress=False)
        with pytest.raises(FailedPreconditionError, match=both):
            resumed.submit_prompts(PROMPTS)
        with pytest.raises(FailedPreconditionError, match=both):
            with resumed.batches(4, idle_timeout=60) as batches:
                next(batches)
    with connect(address, run=Run(held.run_id, 3)) as old_trainer:  # and resuming run 1 there is refused
        with pytest.raises(FailedPreconditionError, match=f"resumes run {held.run_id}.*{status.run.run_id}"):
            old_trainer.join()
    with connect(address, run="new") as trainer:
        assert trainer.join().run_id == status.run.run_id
        assert trainer.policy_version == 0 and one_step(trainer, weights) == 1
