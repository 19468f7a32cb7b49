"""The rollout pipeline: prompt -> generation (n samples) -> reference -> reward -> trajectory.

A prompt whose environment is set (its own, or the collector's default) is generated as n
multi-turn episodes instead of n samples (``episode_runner.py``); the stages after generation are the
same for both.

Each admitted prompt runs as its own task through bounded stages, so many
groups are in different stages at once and generation never waits on
reference or reward scoring. A group is appended whole, once (idempotency
key = its prompt's ledger row), so a replica dying mid-generation (its partial
group is dropped and regenerated elsewhere), or the collector dying after the
Append, can neither lose nor duplicate it.

Every prompt ends as one group or one dead letter (``failures.py`` says which
failure ends how; the retry budget is counted in the ledger, so it survives
restarts). What nobody expected is not a failure of the prompt but a bug: it is
re-raised and reported to ``on_fatal`` (the service stops serving, with the
traceback in its log), never retried into dead letters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from rlfleet.client.channel import ChannelSettings, backoff, call_with_retry
from rlfleet.client.errors import (AbortedError, InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                                   from_rpc_error)
from rlfleet.services.collector import batched_calls, failures
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.collector.episode_runner import EpisodeRunner, GenerateTurns, GroupSlot, group_of_episodes
from rlfleet.services.collector.failures import Discard, GenerationFailed
from rlfleet.services.collector.filtering import FilterRate, FilterRule
from rlfleet.services.collector.prompt_item import PromptItem, sampling_fields
from rlfleet.services.collector.replicas import Replica, ReplicaPool, VersionRetired
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.trajectories import GroupSamples, group_message
from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.v1 import (generation_pb2, reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc,
                        sampling_pb2, tensor_pb2, trajectory_pb2_grpc)
from rlfleet.wire import WireError, decode_tensor, encode_tensor

log = logging.getLogger("rlfleet.collector.rollout")


@dataclass
class StageStats:
    """Counters of one stage, for GetStatus: groups waiting for the stage's limit (``queued``), in
    it (``in_flight``), done, and the completions of the last ``HORIZON_SECONDS`` (for the rate)."""

    HORIZON_SECONDS = 30.0

    name: str
    queued: int = 0
    in_flight: int = 0
    done: int = 0
    window: collections.deque = field(default_factory=collections.deque)

    def rate(self) -> float:
        self._forget(time.monotonic())
        return len(self.window) / self.HORIZON_SECONDS

    def _forget(self, now: float) -> None:
        while self.window and self.window[0] <= now - self.HORIZON_SECONDS:
            self.window.popleft()

    @contextlib.asynccontextmanager
    async def track(self, limit: asyncio.Semaphore | None = None):
        """Queued until ``limit`` lets the group in, then in flight until the block ends."""
        self.queued += 1
        try:
            if limit is not None:
                await limit.acquire()
        finally:
            self.queued -= 1
        self.in_flight += 1
        try:
            yield
            self.done += 1
            now = time.monotonic()
            self.window.append(now)
            self._forget(now)
        finally:
            self.in_flight -= 1
            if limit is not None:
                limit.release()


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
    filter_rule: FilterRule = FilterRule()
    """Dynamic sampling and pass rates (``filtering.py``)."""
    max_oversampling: float = 4.0
    """Dynamic sampling starts at most this many groups per group it expects to deliver."""
    filter_window: int = 32
    """Recent groups the filter rate is measured over."""
    generation_attempts: int = 5
    prompt_attempts: int = 5
    retry_backoff_seconds: float = 1.0


@dataclass
class Placement:
    """Where a group's requests go: its home replica (an episode's later turns stay where its prefix is
    cached; None: the least loaded), and the version they are pinned to (None: none). A group whose first
    request is placed while a rolling update runs is pinned to the version of that request's replica:
    every request of the group then runs on that version, on a replica serving it (``rolling.py``)."""

    home: Replica | None = None
    version: int | None = None


def off_pin(samples: list[generation_pb2.GenerateResponse], version: int) -> bool:
    """Whether a sample that finished ran on another version than its pin (the replica's promise broken)."""
    return any(s.policy_version_start != version or s.policy_version_end != version
               or any(span.version != version for span in s.policy_version_spans)
               for s in samples if s.finish_reason != sampling_pb2.FINISH_REASON_ABORT)


def sampled_tokens(samples: list[generation_pb2.GenerateResponse]) -> int:
    """Response tokens of ``samples`` (each sample's 1-D token tensor)."""
    return sum(sample.response_token_ids.shape[0] if sample.response_token_ids.shape else 0 for sample in samples)


def _one_group_may_be_why(exc: BaseException) -> bool:
    """A call for several groups failed for something one of them may carry (a refused input, a
    reply that does not decode, too many rows for the buffer): made again group by group."""
    return failures.verdict(exc) == "dead" or isinstance(exc, ResourceExhaustedError)


class Pipeline:
    def __init__(self, options: PipelineOptions, gate: VersionGate, pool: ReplicaPool, source: PromptSource,
                 reference: reference_pb2_grpc.ReferenceServiceStub, reward: reward_pb2_grpc.RewardServiceStub,
                 trajectory: trajectory_pb2_grpc.TrajectoryServiceStub, settings: ChannelSettings,
                 on_fatal: Callable[[str, BaseException], None], episodes: EpisodeRunner | None = None):
        self.options = options
        self.episodes = episodes
        """Runs multi-turn prompts; None: the collector has no environment service."""
        self.on_fatal = on_fatal
        """Told of a group task that raised what nobody expected (a bug): the service fails."""
        self.gate = gate
        self.pool = pool
        self.source = source
        self.reference = reference
        self.reward = reward
        self.trajectory = trajectory
        self.settings = settings
        self.stages = {name: StageStats(name) for name in ("generation", "reference", "reward", "trajectory")}
        self.staleness = Counter()
        self.appended = 0
        self.episodes_appended = 0
        """Multi-turn episodes appended (each also counted in ``appended``), and their turns."""
        self.episode_turns = 0
        self.discarded_samples = 0
        self.discarded_tokens = 0
        """Sampled tokens thrown away: of discarded samples, and of turns aborted by a weight update."""
        self.filter_rate = FilterRate(window=options.filter_window, max_oversampling=options.max_oversampling)
        self.failed_prompts = 0
        """Dead letters since the state directory was created (seeded from the ledger at start)."""
        self.pin_violations = 0
        """Pinned requests whose samples ran on another version (their groups generated again; must stay 0)."""
        self.pins_retired = 0
        """Pinned groups generated again because no replica serves their version any more."""
        self.pinned_groups = 0
        """Groups pinned to a version (started while a rolling update ran)."""
        self._groups = asyncio.Semaphore(options.max_groups_in_flight)
        self._generation = asyncio.Semaphore(options.max_generations_in_flight)
        self._scoring = asyncio.Semaphore(options.max_scoring_in_flight)
        # Groups that queue for the reference, reward or trajectory service while its calls are in
        # flight go out together in its next call (a refused call is made again group by group: see
        # coalescer.py). Two calls in flight per service keep it busy while the next one gathers;
        # with one group per call, as many calls as groups may be scored or appended at once.
        per_call = options.max_groups_per_call
        scoring_calls = 2 if per_call > 1 else options.max_scoring_in_flight
        self._references = Coalescer(self._reference_call, split_on=_one_group_may_be_why, max_items=per_call,
                                     concurrency=scoring_calls, name="ScoreLogProbs call")
        self._rewards = Coalescer(self._reward_call, split_on=_one_group_may_be_why, max_items=per_call,
                                  concurrency=scoring_calls, name="ComputeRewards call")
        self._appends = Coalescer(self._append_call, split_on=_one_group_may_be_why, max_items=per_call,
                                  concurrency=2 if per_call > 1 else options.max_groups_in_flight,
                                  name="Append call")
        self._tasks: set[asyncio.Task] = set()
        self._rng = random.Random()
        self.upstream_up = asyncio.Event()
        """Set while reference, reward and trajectory answer; while clear no prompt is drawn, so an outage
        costs a prompt at most the attempt it was in. Cleared by a stage found UNAVAILABLE, set again by
        the collector's upstream watch once every one answers its health check."""
        self.upstream_up.set()

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
        stage = "generation"
        holds_slot = True
        try:
            environment = item.environment or self.options.default_environment
            if environment:
                group = await self._run_episodes(item, environment, group_id)
            else:
                group = GroupSamples.decode(await self._generate(item, group_id))
            tracing.set_attributes({"rlfleet.policy_version": group.start_version, "rlfleet.samples": len(group)})
            stage = "reference"
            ref_log_probs = await self._score_reference(group)
            stage = "reward"
            rewards = await self._compute_rewards(item, group, ref_log_probs, group_id)
            stage = "trajectory"
            outcome = self.options.filter_rule.outcome(item.pass_key, decode_tensor(rewards.scores, "scores"))
            if group.end_version > self.gate.version:
                # It ran on a version being pushed (a rolling update's switched replicas): it reaches the
                # trainer only once that version commits. Parked, it gives its slot to a group that generates
                # meanwhile (how many park is bounded by the update's window, rolling_max_seconds).
                holds_slot = False
                self._groups.release()
                await self._until_committed(group)
            version, filtered = await self._append(item, group, ref_log_probs, rewards, group_id, outcome.filtered)
            outcome = dataclasses.replace(outcome, filtered=filtered)  # as stored, should it be from before a restart
            # Sync mode keeps the prompt's row a while: a group that goes stale unread is generated again.
            await self.source.done(item, retain_at_version=version if self.gate.sync and not filtered else None,
                                   outcome=outcome)
            if self.options.filter_rule.enabled:
                self.filter_rate.record(filtered)
            await self.gate.settle(delivered=not filtered, expected_loss=self.filter_rate.expected_loss)
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

    async def _until_committed(self, group: GroupSamples) -> None:
        """Wait for the push of the version ``group`` ended on; Discard if it did not commit."""
        if not await self.gate.committed(group.end_version):
            self.discarded_samples += len(group)
            self.discarded_tokens += int(group.responses.lengths.sum())
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

    # --- stages ----------------------------------------------------------------
    def _request(self, item: PromptItem, group_id: int) -> generation_pb2.GenerateRequest:
        sampling = sampling_fields(self.options.sampling, item.sampling, self.options.group_size)
        request = generation_pb2.GenerateRequest(request_id=f"{group_id:x}",
                                                 sampling=sampling_pb2.SamplingParams(**sampling))
        if item.token_ids is not None:
            encode_tensor(torch.tensor(item.token_ids, dtype=torch.int64), out=request.prompt.token_ids)
        elif item.chat is not None:
            request.prompt.chat.messages.extend(sampling_pb2.ChatMessage(**m) for m in item.chat)
        else:
            request.prompt.text = item.text or ""
        return request

    async def _generate(self, item: PromptItem, group_id: int) -> list[generation_pb2.GenerateResponse]:
        request = self._request(item, group_id)
        async with self.stages["generation"].track(self._generation), self._placed() as place:
            with tracing.span("generate", {"rlfleet.samples": request.sampling.n}):
                samples = await self._on_a_replica(request, place)
        if any(s.finish_reason == sampling_pb2.FINISH_REASON_ABORT for s in samples):
            self.discarded_samples += len(samples)
            self.discarded_tokens += sampled_tokens(samples)
            raise Discard("generation aborted by a weight update")
        return sorted(samples, key=lambda s: s.sample_index)

    @contextlib.asynccontextmanager
    async def _placed(self):
        """A group's ``Placement``; a pin it took is let go when its generation ends."""
        place = Placement()
        try:
            yield place
        finally:
            if place.version is not None:
                await self.pool.release_pin(place.version)

    async def _on_a_replica(self, request: generation_pb2.GenerateRequest,
                            place: Placement) -> list[generation_pb2.GenerateResponse]:
        """``request``'s samples from a healthy replica (``place.home`` while it is healthy, which becomes
        the one that answered; only replicas serving ``place.version`` when it is pinned), failing over to
        others: GenerationFailed after the attempts, Discard when its pinned version is served no more."""
        tried: set[str] = set()
        samples_asked = max(1, request.sampling.n)
        for attempt in range(self.options.generation_attempts):
            try:
                replica = await self.pool.acquire(exclude=tried, prefer=place.home, samples=samples_asked,
                                                  version=place.version)
            except VersionRetired as retired:
                self.pins_retired += 1
                raise Discard(str(retired)) from None
            if place.version is None and self.gate.rolling:
                place.version = replica.policy_version
                self.pool.hold_pin(place.version)
                self.pinned_groups += 1
            if place.version is not None:
                request.policy_version = place.version
            try:
                call = replica.stub.Generate(request, metadata=self.settings.metadata())
                samples = [s async for s in call]
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, "Generate")
                if isinstance(error, (InvalidArgumentError, NotFoundError)):
                    raise error from None
                if place.version is not None and isinstance(error, AbortedError):
                    self.pins_retired += 1  # it switched (or restarted) before our routing knew
                    raise Discard(f"{replica.address} no longer serves version {place.version}") from None
                if not isinstance(error, ResourceExhaustedError):
                    tried.add(replica.address)
                    await self.pool.mark_failed(replica, str(error))
                await asyncio.sleep(backoff(attempt, self.settings.backoff_seconds))
                continue
            finally:
                self.pool.release(replica, samples_asked)
            if place.version is not None and off_pin(samples, place.version):
                self.pin_violations += 1
                log.error("replica %s ran a request pinned to version %d on another one: its group is generated "
                          "again", replica.address, place.version)
                raise Discard(f"{replica.address} did not keep request {request.request_id} on version {place.version}")
            place.home = replica
            return samples
        raise GenerationFailed(f"generation failed on {self.options.generation_attempts} attempts "
                               f"(replicas tried: {', '.join(sorted(tried)) or 'none'})")

    async def _run_episodes(self, item: PromptItem, environment: str, group_id: int) -> GroupSamples:
        """The group as ``group_size`` episodes of ``environment`` (``episode_runner.py``), every turn generated
        on the group's replica while it is healthy."""
        if self.episodes is None:
            raise InvalidArgument(f"prompt {item.prompt_id!r}: environment {environment!r} needs a collector "
                                  "with an environment_address")
        slot = GroupSlot(self._generation)  # the group's turns share one slot, as its samples would
        async with self.stages["generation"].track(), self._placed() as place:
            place.home = self.pool.least_loaded()  # every episode's first turn goes there too
            episodes = await self.episodes.run_group(
                item, environment, group_id, self.options.group_size,
                lambda index: self._turn_generator(item, group_id, index, place, slot))
        return group_of_episodes(episodes)

    def _turn_generator(self, item: PromptItem, group_id: int, index: int, place: Placement,
                        slot: GroupSlot) -> GenerateTurns:
        """Generates the turns of episode ``index`` (``n`` samples from its token history, at most the
        tokens its budget leaves; n > 1 for the group's shared first turn). A turn aborted by a weight
        update is generated again (on the new weights: each turn records its versions)."""
        fields = sampling_fields(self.options.sampling, item.sampling, 1)
        if fields.get("seed"):
            fields["seed"] += index  # one seed per episode, or the group's episodes would be one
        max_tokens = fields.get("max_tokens") or SamplingSpec.max_tokens
        requests = itertools.count()

        async def generate(history: torch.Tensor, room: int, n: int) -> list[generation_pb2.GenerateResponse]:
            sampling = sampling_pb2.SamplingParams(**{**fields, "max_tokens": min(max_tokens, room), "n": n})
            for _ in range(self.options.generation_attempts):
                request = generation_pb2.GenerateRequest(request_id=f"{group_id:x}-{index}-{next(requests)}",
                                                         sampling=sampling)
                encode_tensor(history, out=request.prompt.token_ids)
                async with slot.held():
                    with tracing.span("generate", {"rlfleet.episode": index, "rlfleet.samples": n}):
                        samples = await self._on_a_replica(request, place)
                if all(s.finish_reason != sampling_pb2.FINISH_REASON_ABORT for s in samples):
                    return sorted(samples, key=lambda s: s.sample_index)
                self.discarded_tokens += sampled_tokens(samples)
            raise Discard(f"a turn was aborted by weight updates {self.options.generation_attempts} times")
        return generate

    async def _score_reference(self, group: GroupSamples) -> tensor_pb2.RaggedTensor:
        """The reference log-probs of each response, as the reference service sent them."""
        request = reference_pb2.ScoreLogProbsRequest(token_ids=group.full_message,
                                                     response_starts=group.prompts.lengths.tolist())
        async with self.stages["reference"].track(self._scoring):
            with tracing.span("reference"):
                ref_log_probs = await self._references.submit(request, request.ByteSize())
        if list(ref_log_probs.lengths) != group.responses.lengths.tolist():
            raise WireError("ref_log_probs.lengths", f"{list(ref_log_probs.lengths)} do not match the "
                            f"response lengths {group.responses.lengths.tolist()}")
        return ref_log_probs

    async def _reference_call(self, requests: list[reference_pb2.ScoreLogProbsRequest]
                              ) -> list[tensor_pb2.RaggedTensor]:
        """One ScoreLogProbs for the groups that queued (``_references``)."""
        request = requests[0] if len(requests) == 1 else batched_calls.merge_reference_requests(requests)
        reply = await call_with_retry(self.reference.ScoreLogProbs, request, method="ScoreLogProbs",
                                      settings=self.settings)
        return batched_calls.split_reference_response(reply, [len(r.response_starts) for r in requests])

    async def _compute_rewards(self, item: PromptItem, group: GroupSamples, ref_log_probs: tensor_pb2.RaggedTensor,
                               group_id: int) -> reward_pb2.ComputeRewardsResponse:
        n = len(group)
        request = reward_pb2.ComputeRewardsRequest(
            response_token_ids=group.responses_message,
            behavior_log_probs=group.behavior_message,
            ref_log_probs=ref_log_probs,
            response_mask=group.response_mask_message,
            environment_rewards=group.environment_rewards,
            prompt_texts=[item.prompt_text()] * n,
            tasks=[reward_pb2.Task(reward_fn=item.reward_fn or self.options.default_reward_fn,
                                   ground_truth=item.ground_truth, args=item.reward_args)],
            group_ids=[group_id] * n,
            kl_estimator=self.options.kl_estimator,
            advantage_mode=self.options.advantage_mode,
            update_kl_controller=self.options.update_kl_controller,
        )
        async with self.stages["reward"].track(self._scoring):
            with tracing.span("reward"):
                return await self._rewards.submit(request, request.ByteSize())

    async def _reward_call(self, requests: list[reward_pb2.ComputeRewardsRequest]
                           ) -> list[reward_pb2.ComputeRewardsResponse]:
        """One ComputeRewards for the groups that queued (``_rewards``)."""
        request = requests[0] if len(requests) == 1 else batched_calls.merge_reward_requests(requests)
        reply = await call_with_retry(self.reward.ComputeRewards, request, method="ComputeRewards",
                                      settings=self.settings)
        return batched_calls.split_reward_response(reply, [len(r.group_ids) for r in requests])

    async def _append(self, item: PromptItem, group: GroupSamples, ref_log_probs: tensor_pb2.RaggedTensor,
                      rewards: reward_pb2.ComputeRewardsResponse, group_id: int, filtered: bool) -> tuple[int, bool]:
        """Append the group, or store it as ``filtered`` (or find it stored before a restart); returns its
        start version and whether it is stored as filtered (as it was then, for one stored before)."""
        start_version = group.start_version
        now = max(self.gate.version, group.end_version)
        if not filtered and self.gate.too_stale_to_append(start_version, now):
            # Its prompt is generated again on the current weights; counted.
            self.discarded_samples += len(group)
            self.discarded_tokens += int(group.responses.lengths.sum())
            raise Discard(f"too stale: started at v{start_version}, now v{now}, "
                          f"max_staleness {self.gate.max_staleness}")
        rows = group_message(group=group, ref_log_probs=ref_log_probs, rewards=rewards, group_id=group_id,
                             prompt_id=item.prompt_id, query=item.query)
        trace = tracing.traceparent()  # the group's: the trajectory service puts lease and ack spans in it
        async with self.stages["trajectory"].track():
            attempt = 0
            while True:
                try:
                    with tracing.span("append", {"rlfleet.filtered": filtered}):
                        appended, filtered = await self._appends.submit((item.append_key, rows, filtered, trace),
                                                                        rows.ByteSize())
                    break
                except ResourceExhaustedError:
                    # Backpressure: the buffer is full until the trainer catches up.
                    await asyncio.sleep(min(2.0, 0.05 * 2 ** min(attempt, 6)))
                    attempt += 1
        if not appended:  # appended before a restart: the earlier group stands
            log.info("group already appended", extra={"prompt_id": item.prompt_id, "key": item.append_key})
            return start_version, filtered
        if filtered:
            return start_version, True
        self.appended += len(group)
        if group.environment_rewards is not None:
            self.episodes_appended += len(group)
            self.episode_turns += int(group.turn_versions.lengths.sum())
        self.staleness[now - start_version] += len(group)  # staleness when it became visible
        return start_version, False

    async def _append_call(self, groups: list[tuple[str, tensor_pb2.TensorDict, bool, str]]
                           ) -> list[tuple[bool, bool]]:
        """One Append for the groups that queued (``_appends``: key, rows, filtered, traceparent); for each,
        whether it was stored (False: it was appended before, under its key) and whether it is stored as
        filtered."""
        request = batched_calls.append_request([group[:3] for group in groups], self.gate.version,
                                               [group[3] for group in groups])
        reply = await call_with_retry(self.trajectory.Append, request, method="Append", settings=self.settings)
        for field in ("duplicate_groups", "filtered_groups"):
            if len(getattr(reply, field)) != len(groups):
                raise WireError(field, f"the trajectory service answered {len(getattr(reply, field))} "
                                       f"for {len(groups)} groups")
        return [(not duplicate, filtered) for duplicate, filtered in zip(reply.duplicate_groups, reply.filtered_groups)]

    def staleness_histogram(self) -> list[int]:
        if not self.staleness:
            return []
        return [self.staleness.get(i, 0) for i in range(max(self.staleness) + 1)]
