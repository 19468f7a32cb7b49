"""The rollout pipeline: a group's journey, stage by stage.

    admit -> generate (n samples, or n multi-turn episodes) -> reference -> reward -> filter
          -> (wait for its version's commit) -> append -> confirm

Each admitted prompt runs as its own task (``_group``, which reads as the list above) through bounded
stages, so many groups are in different stages at once and generation never waits on reference or
reward scoring. Each stage is a unit with its inputs and outputs: ``generate_stage.py`` (the samples, from
the replicas; episodes through ``episode_runner.py``), ``score_stage.py`` (reference log-probs, then
rewards), ``append_stage.py`` (into the trajectory service, once). Admission is ``admission.py``'s,
where prompts come from ``source.py``'s, what they count ``stage_stats.py``'s.

A group is appended whole, once (idempotency key = its prompt's ledger row), so a replica dying
mid-generation (its partial group is dropped and regenerated elsewhere), or the collector dying after the
Append, can neither lose nor duplicate it.

Every prompt ends as one group or one dead letter (``failures.py`` says which failure ends how; the retry
budget is counted in the ledger, so it survives restarts). What nobody expected is not a failure of the
prompt but a bug: it is re-raised and reported to ``on_fatal`` (the service stops serving, with the
traceback in its log), never retried into dead letters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

from rlfleet.rpc.channel import ChannelSettings, backoff
from rlfleet.services.collector import failures
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.append_stage import AppendStage
from rlfleet.services.collector.episode_runner import EpisodeRunner
from rlfleet.services.collector.failures import Discard
from rlfleet.services.collector.filtering import FilterRate, FilterRule, GroupOutcome
from rlfleet.services.collector.generate_stage import GenerateStage
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.score_stage import ScoreStage
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.stage_stats import Discards, StageStats
from rlfleet.services.collector.trajectories import GroupSamples
from rlfleet.services.common import tracing
from rlfleet.v1 import reference_pb2_grpc, reward_pb2_grpc, trajectory_pb2_grpc
from rlfleet.wire import decode_tensor

log = logging.getLogger("rlfleet.collector.rollout")


@dataclass
class PipelineOptions:
    group_size: int
    sampling: dict
    default_reward_fn: str
    kl_estimator: int
    advantage_mode: int
    update_kl_controller: bool
    max_groups_in_flight: int
    max_generations_in_flight: int
    max_scoring_in_flight: int
    max_groups_per_call: int = 64
    default_environment: str = ""
    """Environment of the prompts that name none ("": single-turn)."""
    players: dict[str, str] = field(default_factory=dict)
    """An environment's player -> the run whose policy plays its turns (the collector's ``players``)."""
    filter_rule: FilterRule = FilterRule()
    """Dynamic sampling and pass rates (``filtering.py``)."""
    max_oversampling: float = 4.0
    """Dynamic sampling starts at most this many groups per group it expects to deliver."""
    filter_window: int = 32
    """Recent groups the filter rate is measured over."""
    generation_attempts: int = 5
    prompt_attempts: int = 5
    retry_backoff_seconds: float = 1.0


@dataclass(frozen=True)
class PipelineStatus:
    """What the pipeline's stages counted, for GetStatus: each stage's queue and rate, the trajectories
    appended (and episodes, turns), their staleness, the work thrown away, dead letters, the filter rate,
    and the groups pinned to a version during rolling updates."""

    stages: tuple[StageStats, ...]
    staleness_histogram: list[int]
    trajectories: int
    episodes: int
    episode_turns: int
    discarded_samples: int
    discarded_tokens: int
    failed_prompts: int
    filter_rate: float
    expected_filter_loss: float
    pinned_groups: int
    pin_violations: int
    pins_retired: int


class Pipeline:
    def __init__(self, options: PipelineOptions, gate: VersionGate, pool: ReplicaPool, source: PromptSource,
                 reference: reference_pb2_grpc.ReferenceServiceStub, reward: reward_pb2_grpc.RewardServiceStub,
                 trajectory: trajectory_pb2_grpc.TrajectoryServiceStub, settings: ChannelSettings,
                 on_fatal: Callable[[str, BaseException], None], episodes: EpisodeRunner | None = None):
        self.options = options
        self.on_fatal = on_fatal
        """Told of a group task that raised what nobody expected (a bug): the service fails."""
        self.gate = gate
        self.source = source
        self.discards = Discards()
        """Sampled work thrown away, by every stage (and the collector's deletions of stale groups)."""
        self.generate = GenerateStage(gate, pool, settings, episodes, self.discards, sampling=options.sampling,
                                      group_size=options.group_size, default_environment=options.default_environment,
                                      players=options.players, generation_attempts=options.generation_attempts,
                                      max_generations_in_flight=options.max_generations_in_flight)
        # Groups that queue for the reference, reward or trajectory service while its calls are in flight go
        # out together in its next call (a refused call is made again group by group: see coalescer.py).
        self.score = ScoreStage(reference, reward, settings, default_reward_fn=options.default_reward_fn,
                                kl_estimator=options.kl_estimator, advantage_mode=options.advantage_mode,
                                update_kl_controller=options.update_kl_controller,
                                max_scoring_in_flight=options.max_scoring_in_flight,
                                max_groups_per_call=options.max_groups_per_call, run_id=pool.run.run_id)
        self.append = AppendStage(gate, trajectory, settings, self.discards,
                                  max_groups_per_call=options.max_groups_per_call,
                                  max_groups_in_flight=options.max_groups_in_flight)
        self.stages: dict[str, StageStats] = {stats.name: stats for stats in (
            self.generate.stats, self.score.reference_stats, self.score.reward_stats, self.append.stats)}
        self.filter_rate = FilterRate(window=options.filter_window, max_oversampling=options.max_oversampling)
        self.failed_prompts = 0
        """Dead letters since the state directory was created (seeded from the ledger at start)."""
        self._groups = asyncio.Semaphore(options.max_groups_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self._unconfirmed: dict[int, PromptItem] = {}
        """Groups whose Append went out and whose prompt's end is not yet written, by group id."""
        self._rng = random.Random()
        self.upstream_up = asyncio.Event()
        """Set while reference, reward and trajectory answer; while clear no prompt is drawn, so an outage
        costs a prompt at most the attempt it was in. Cleared by a stage found UNAVAILABLE, set again by
        the collector's upstream watch once every one answers its health check."""
        self.upstream_up.set()

    def status(self) -> PipelineStatus:
        append, generate = self.append, self.generate
        return PipelineStatus(
            stages=tuple(self.stages.values()), staleness_histogram=append.staleness_histogram(),
            trajectories=append.appended, episodes=append.episodes_appended, episode_turns=append.episode_turns,
            discarded_samples=self.discards.samples, discarded_tokens=self.discards.tokens,
            failed_prompts=self.failed_prompts, filter_rate=self.filter_rate.rate,
            expected_filter_loss=self.filter_rate.expected_loss, pinned_groups=generate.pinned_groups,
            pin_violations=generate.pin_violations, pins_retired=generate.pins_retired)

    def unconfirmed(self, group_ids: list[int]) -> set[int]:
        """The ledger rows of those of ``group_ids`` appended (or being) whose prompts' ends are not yet
        written: a group dropped in that window is generated again under a new row (``PromptSource.regenerate``)."""
        return {self._unconfirmed[group_id].ledger_seq for group_id in group_ids if group_id in self._unconfirmed}

    def discard(self, samples: int) -> None:
        """Samples of stale groups the collector deleted unread, counted as discarded."""
        self.discards.add(samples)

    async def run(self) -> None:
        """Feed admitted prompts into group tasks until cancelled. A finished dataset (its epochs
        done) ends nothing: the groups in flight complete, and submitted or retried prompts are
        still generated (the source waits for them)."""
        try:
            while True:
                # Every free group slot at once: the dataset rows drawn together share one ledger
                # transaction (slots free in bursts, as the groups appended together end together).
                await self._groups.acquire()
                slots = 1
                while not self._groups.locked():
                    await self._groups.acquire()  # free: returns at once
                    slots += 1
                items = await self.source.take(slots)
                for _ in range(slots - len(items)):
                    self._groups.release()
                for item in items:
                    # After the draw: an outage found while waiting for a prompt holds this one too.
                    await self.upstream_up.wait()
                    group_index, start_version = await self.gate.admit()
                    task = asyncio.create_task(self._run_group(item, group_index),
                                               name=f"group of {item.prompt_id}")
                    self._tasks.add(task)
                    task.add_done_callback(self._group_done)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.on_fatal(f"the rollout task of prompt {task.get_name()[len('group of '):]!r}", task.exception())

    async def _run_group(self, item: PromptItem, group_index: int) -> None:
        group_id = self._rng.getrandbits(62)
        # One trace per group, from admission to append (the trajectory service adds lease and ack).
        with tracing.span("group", {"rlfleet.prompt_id": item.prompt_id, "rlfleet.group_id": f"{group_id:x}",
                                    "rlfleet.admitted_at_version": self.gate.version}):
            await self._group(item, group_id)

    async def _group(self, item: PromptItem, group_id: int) -> None:
        """One group's journey (admitted already): the stages in order, then its confirmation; a discarded
        group's prompt goes back to the source, a failed one is retried or dead-lettered (``_failed``)."""
        stage = "generation"
        holds_slot = True
        try:
            group = await self.generate.run(item, group_id)
            tracing.set_attributes({"rlfleet.policy_version": group.start_version, "rlfleet.samples": len(group)})
            stage = "reference"
            ref_log_probs = await self.score.reference_log_probs(group)
            stage = "reward"
            rewards = await self.score.rewards(item, group, ref_log_probs, group_id)
            stage = "trajectory"
            outcome = self.options.filter_rule.outcome(item.pass_key, decode_tensor(rewards.scores, "scores"))
            if group.end_version > self.gate.version:
                # It ran on a version being pushed (a rolling update's switched replicas): it reaches the
                # trainer only once that version commits. Parked, it gives its slot to a group that generates
                # meanwhile (how many park is bounded by the update's window, rolling_max_seconds).
                holds_slot = False
                self._groups.release()
                await self._until_committed(group)
            self._unconfirmed[group_id] = item
            try:
                version, filtered = await self.append.append(item, self.score.task_of(item), group, ref_log_probs,
                                                             rewards, group_id, outcome.filtered)
                await self._confirm(item, outcome, version, filtered)
            finally:
                del self._unconfirmed[group_id]
        except Discard as reason:
            tracing.set_attributes({"rlfleet.discarded": str(reason)})
            log.info("group discarded, prompt requeued", extra={"prompt_id": item.prompt_id, "reason": str(reason)})
            self.source.requeue(item)
            await self.gate.give_back()
        except Exception as exc:  # noqa: BLE001 - classified; what nobody expected is re-raised (on_fatal)
            verdict = failures.verdict(exc)
            if verdict is None:
                raise
            await self.gate.give_back()  # its slot goes to another prompt
            await self._failed(item, stage, exc, verdict)
        finally:
            if holds_slot:
                self._groups.release()

    async def _confirm(self, item: PromptItem, outcome: GroupOutcome, version: int, filtered: bool) -> None:
        """The group is stored: its prompt's row done (its pass rate), the filter rate and the admission's
        count of the step's groups told."""
        outcome = dataclasses.replace(outcome, filtered=filtered)  # as stored, should it be from before a restart
        # Sync mode keeps the prompt's row a while: a group that goes stale unread is generated again.
        await self.source.done(item, retain_at_version=version if self.gate.sync and not filtered else None,
                               outcome=outcome)
        if self.options.filter_rule.enabled:
            self.filter_rate.record(filtered)
        await self.gate.settle(delivered=not filtered, expected_loss=self.filter_rate.expected_loss)

    async def _until_committed(self, group: GroupSamples) -> None:
        """Wait for the push of the version ``group`` ended on; Discard if it did not commit."""
        if not await self.gate.committed(group.end_version):
            self.discards.add(len(group), int(group.responses.lengths.sum()))
            raise Discard(f"generated on version {group.end_version}, which did not commit")

    async def _failed(self, item: PromptItem, stage: str, exc: Exception, verdict: failures.Verdict) -> None:
        """Dead-letter the prompt (input refused, or retries used up), or retry it after a backoff."""
        code = failures.error_code(exc)
        if failures.pauses_admission(exc, stage):
            self.upstream_up.clear()
        if verdict == "retry":
            attempts = await self.source.ledger.attempted(item)
            if attempts < self.options.prompt_attempts:
                delay = backoff(attempts - 1, self.options.retry_backoff_seconds)
                log.warning("group failed in %s (attempt %d of %d), retrying in %.1f s: %s", stage, attempts,
                            self.options.prompt_attempts, delay, exc, extra={"prompt_id": item.prompt_id})
                asyncio.get_running_loop().call_later(delay, self.source.requeue, item)
                return
        dead = await self.source.dead(item, stage, code, str(exc))
        self.failed_prompts += 1
        log.error("prompt failed for good in %s: %s %s", stage, code, exc,
                  extra={"prompt_id": item.prompt_id, "attempts": dead.attempts, "dead_letter": dead.seq})
