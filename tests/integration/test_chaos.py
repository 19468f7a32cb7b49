"""Chaos: an SDK training loop while each service in turn is SIGKILLed and restarted on its port.

One trainer (``rlfleet.client.connect``) submits prompts in waves, reads one
group per batch, acks as the SDK does (when the next batch is asked for) and
pushes weights once. Between its steps, while it holds a leased, un-acked
batch and the pipeline has prompts queued and generating, one service is
killed (SIGKILL: nothing saved beyond what was durable) and started again on
the same port with the same state: a generation replica (the other carries on;
it comes back at the old version and must be re-synced), the trajectory
service (same database), the reward and reference services, and the collector
(same state directory). The trainer sees none of it beyond a pause. At the end:
every submitted prompt id is exactly one whole group (none a dead letter: an
outage costs a prompt one attempt of its five at most), no trajectory is in two
confirmed batches, and nothing is left pending or leased. While the reward
service is down the collector says so (``Status.serving`` False, the reason
naming it) and still takes prompts.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from rlfleet.client import connect
from rlfleet.client.errors import DeadlineExceededError, RlfleetClientError
from rlfleet.services.launch import ServiceProcess
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from tests.hf_reference import load_hf
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
GROUP = 4
WAVE = 4
"""Prompts submitted before the loop and before each kill (another wave whenever one ran through while
the chaos waited for a busy moment)."""
VICTIMS = ("generation-1", "trajectory", "reward", "reference", "collector")
STEPS_BETWEEN_KILLS = 3
RECOVERY_TIMEOUT = 180.0
"""Until the pipeline reaches a state the chaos waits for (a busy moment, an outage seen, a service back, the
ledger and buffer empty): a restarted service other than a replica loads in seconds, the collector notices
within a few health checks (--replica-check-seconds 0.5), a wave of prompts is generated in seconds; minutes
on a loaded 2-core machine."""
RESYNC_TIMEOUT = 300.0
"""Until a restarted replica is re-synced and back in rotation: its vLLM engine's start (the longest wait
here), then one health check and one re-sync push of the tiny model."""


class Fleet:
    """The suite's processes; a killed service is replaced by a new process on the same port and state."""

    def __init__(self, procs: dict[str, ServiceProcess], workdir: Path):
        self.procs = procs
        self.workdir = workdir
        self.restarted: list[str] = []

    def kill(self, key: str) -> None:
        self.procs[key].kill()
        self.procs[key].stop()  # reaps the process group, closes the log

    def kill_and_restart(self, key: str, *, killed: bool = False) -> ServiceProcess:
        """SIGKILL ``key`` (unless ``killed`` already) and start it again on its port (not waiting: the
        trainer goes on meanwhile)."""
        old = self.procs[key]
        if not killed:
            self.kill(key)
        args = list(old.args) if "--port" in old.args else [*old.args, "--port", str(old.port)]
        new = ServiceProcess(old.name, args, env=old.env).start(self.workdir / key)
        new.port = old.port
        self.procs[key] = new
        self.restarted.append(key)
        return new

    def wait_restarted(self, timeout: float = 300, replicas: bool = True) -> None:
        """Wait for the restarted services (a replica's engine takes long: ``replicas=False`` skips them)."""
        for key in self.restarted:
            if replicas or not key.startswith("generation"):
                self.procs[key].wait_ready(timeout)

    def error_lines(self) -> list[str]:
        """ERROR lines and tracebacks (whole, to their exception) in every service log (restarts append
        to the same file)."""
        lines = []
        for key, proc in self.procs.items():
            text = Path(proc.log_path).read_text(errors="replace") if proc.log_path else ""
            in_traceback = False
            for line in text.splitlines():
                if " ERROR " in line or "Traceback" in line or in_traceback:
                    lines.append(f"{key}: {line}")
                in_traceback = "Traceback" in line or (in_traceback and line[:1] in (" ", ""))
        return lines


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """A suite of its own (services are killed): two replicas and a collector with the default retry
    budget (``prompt_attempts`` 5): no prompt is drawn while an upstream service is down, so an outage
    costs a prompt one attempt at most and none may end as a dead letter."""
    workdir = tmp_path_factory.mktemp("chaos")
    options = SuiteOptions(model_dir=tiny_model_dir, generation_replicas=2, kv_cache_bytes=128 << 20,
                           generation_args=["--max-num-seqs", "32"])
    procs = start_suite(options, workdir, without_collector=True)
    try:
        replicas = [procs["generation-0"].address, procs["generation-1"].address]
        procs["collector"] = ServiceProcess("collector", [
            "--generation-addresses", json.dumps(replicas),
            "--reference-address", procs["reference"].address, "--reward-address", procs["reward"].address,
            "--trajectory-address", procs["trajectory"].address, "--state-dir", str(workdir / "collector-state"),
            "--group-size", str(GROUP), "--reward-fn", "char_fraction", "--mode", "async", "--max-staleness", "1000", "--mismatch-kl-target", "null",
            "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}),
            "--max-groups-in-flight", "2",
            "--replica-check-seconds", "0.5", "--replica-startup-seconds", "5", "--log-format", "text",
        ]).start(workdir / "collector").wait_ready(120)
    except BaseException:
        stop_suite(procs)
        raise
    yield Fleet(procs, workdir)
    stop_suite(procs)


def quietly(call):
    """``call()``, or None while the service it reaches is restarting."""
    try:
        return call()
    except RlfleetClientError as err:
        if err.retryable:
            return None
        raise


def strings(batch, key: str) -> list[str]:
    values = batch[key]
    assert isinstance(values, list), type(values)  # a batch's string entry is a plain list of str
    return values


def generating(status) -> int:
    """Groups generating: replicas count the samples outstanding, GROUP per group."""
    return sum(r.in_flight for r in status.replicas) // GROUP


class Trainer:
    """What the trainer saw: every delivered batch, the groups per prompt, the prompts it submitted."""

    def __init__(self, client, weights: dict):
        self.client = client
        self.weights = weights
        self.submitted: list[str] = []
        self.waves = 0
        self.batches = []
        self.rows: dict[str, dict[int, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
        self.held_at_kill: dict[str, object] = {}  # victim -> the batch leased, un-acked when it was killed

    def submit(self) -> None:
        wave, self.waves = self.waves, self.waves + 1
        self.submitted += self.client.submit_prompts(
            [{"prompt": f"what is {wave} plus {i}", "prompt_id": f"wave{wave}-{i}"} for i in range(WAVE)])

    def record(self, batch) -> None:
        self.batches.append(batch)
        for pid, gid, tid in zip(strings(batch, "prompt_id"), batch["group_id"].tolist(),
                                 strings(batch, "trajectory_id")):
            self.rows[pid][gid].add(tid)

    def busy_status(self):
        """The collector's status (None while it restarts), after submitting another wave if the last
        one ran through: a moment the chaos waits for needs work in the pipeline."""
        status = quietly(self.client.status)
        if status is not None and status.pending_prompts == 0:
            self.submit()
        return status

    def dead_letters(self) -> list[str]:
        failures, _ = self.client.failures(limit=1000)
        return [f.prompt_id for f in failures]

    def done(self) -> bool:
        """Every prompt accounted for, nothing pending, nothing left to deliver (a redelivery included)."""
        def check():
            if set(self.submitted) - set(self.rows) - set(self.dead_letters()):
                return False
            return self.client.status().pending_prompts == 0 and self.client.buffer_stats().ready == 0
        return bool(quietly(check))


def kill_at_a_busy_moment(fleet: Fleet, trainer: Trainer, victim: str, batch) -> None:
    """With a batch held (leased, not acked) and prompts queued and generating: SIGKILL, restart."""
    fleet.wait_restarted(replicas=False)  # the previous victim is back (the replica may still be loading)
    trainer.submit()
    client = trainer.client
    if victim.startswith("generation"):
        address = fleet.procs[victim].address
        busy = lambda s: any(r.address == address and r.in_flight > 0 for r in s.replicas)  # noqa: E731
    else:
        busy = lambda s: s.pending_prompts > generating(s) > 0  # noqa: E731

    wait_for(lambda: (status := trainer.busy_status()) is not None and busy(status), RECOVERY_TIMEOUT,
             f"a busy moment to kill {victim}")
    trainer.held_at_kill[victim] = batch
    if victim == "reward":
        # Down for a while: the collector says so in its status, and still takes prompts (unchecked).
        fleet.kill(victim)
        down = f"reward at {fleet.procs[victim].address} is down"
        status = wait_for(lambda: (s := quietly(client.status)) is not None and not s.serving and s, RECOVERY_TIMEOUT,
                          "the collector to say it is NOT serving")
        assert down in status.not_serving_reason, status.not_serving_reason
        trainer.submit()
        fleet.kill_and_restart(victim, killed=True).wait_ready(120)
        wait_for(lambda: (s := quietly(client.status)) is not None and s.serving, RECOVERY_TIMEOUT,
                 "the collector serving again")
        return
    fleet.kill_and_restart(victim)
    if victim.startswith("generation"):
        # Its calls failed: out of rotation. A push now commits on the survivor; the restarted
        # replica comes back at the old version and the collector must re-sync it from its spool.
        wait_for(lambda: not {r.address: r.healthy for r in trainer.busy_status().replicas}[address],
                 RECOVERY_TIMEOUT, "the killed replica out of rotation")
        pushed = client.push_weights(trainer.weights, progress=False)
        assert pushed.version == 1 and [r.address for r in pushed.replicas if r.applied] == [
            fleet.procs["generation-0"].address], pushed


def test_each_service_killed_during_an_sdk_training_loop_loses_and_duplicates_nothing(fleet, tiny_model_dir):
    client = connect(fleet.procs["collector"].address, timeout=30)
    trainer = Trainer(client, load_hf(tiny_model_dir).state_dict())
    victims = list(VICTIMS)
    trainer.submit()
    step = idle_timeouts = 0
    try:
        while not trainer.done():
            try:
                with client.batches(GROUP, idle_timeout=120, reconnect_seconds=300) as batches:
                    for batch in batches:
                        trainer.record(batch)
                        step += 1
                        if victims and step % STEPS_BETWEEN_KILLS == 0:
                            kill_at_a_busy_moment(fleet, trainer, victims.pop(0), batch)
                        elif not victims and trainer.done():
                            break  # leaving the block acks the last batch
            except DeadlineExceededError:  # no batch for idle_timeout: a prompt lost (asserted below)
                idle_timeouts += 1
        assert not victims, f"the loop ended before killing {victims}"
        fleet.wait_restarted()

        # Every submitted prompt id: exactly one whole group, none a dead letter.
        dead = trainer.dead_letters()
        assert (idle_timeouts, dead) == (0, []), "a transient outage cost prompts their retry budget"
        assert len(set(trainer.submitted)) == len(trainer.submitted) >= WAVE * (len(VICTIMS) + 2)
        assert set(trainer.rows) == set(trainer.submitted)
        bad = {pid: {gid: sorted(tids) for gid, tids in groups.items()} for pid, groups in trainer.rows.items()
               if len(groups) != 1 or [len(t) for t in groups.values()] != [GROUP]}
        assert not bad, f"prompts delivered as more or less than one whole group: {bad}"

        # No trajectory in two confirmed batches. Every ack was answered (applied) except those of the
        # batches held when the trajectory service or the collector died: their streams broke, the acks
        # were never applied, and those batches were delivered again.
        confirmed = collections.Counter(tid for b in trainer.batches if b.confirmed
                                        for tid in strings(b, "trajectory_id"))
        assert not [tid for tid, count in confirmed.items() if count > 1]
        broken = [trainer.held_at_kill[victim] for victim in ("trajectory", "collector")]
        unanswered = [(i, b.confirmed, b.settle_error) for i, b in enumerate(trainer.batches)
                      if not b.confirmed and not any(b is held for held in broken)]
        assert unanswered == []
        for victim in ("trajectory", "collector"):
            held = trainer.held_at_kill[victim]
            assert held.confirmed is False, (victim, held.settle_error)
            again = [b for b in trainer.batches[trainer.batches.index(held) + 1:]
                     if set(strings(b, "trajectory_id")) == set(strings(held, "trajectory_id"))]
            assert again and all(b.redelivered for b in again) and again[-1].confirmed, victim

        # Nothing lost or stuck: the ledger is empty, the buffer holds nothing, the replica is back.
        wait_for(lambda: client.status().pending_prompts == 0, RECOVERY_TIMEOUT, "the prompt ledger to empty")
        assert client.status().failed_prompts == 0
        wait_for(lambda: (stats := client.buffer_stats()).ready == 0 and stats.leased == 0, RECOVERY_TIMEOUT,
                 "the buffer to hold nothing ready or leased")
        wait_for(lambda: all(r.healthy and r.policy_version == 1 for r in client.status().replicas), RESYNC_TIMEOUT,
                 "the restarted replica re-synced to version 1 and back in rotation")
        # An outage is a WARNING in the logs, never an ERROR.
        assert fleet.error_lines() == []
    finally:
        client.close()
