"""The rollout pipeline: prompt -> generation (n samples) -> reference -> reward -> trajectory.

Each admitted prompt runs as its own task through bounded stages, so many
groups are in different stages at once and generation never waits on
reference or reward scoring. A group is appended whole, once (idempotency
key = group id), so a replica dying mid-generation (its partial group is
dropped and regenerated elsewhere) can neither lose nor duplicate it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch

from rlfleet.client.channel import ChannelSettings, backoff, call_with_retry
from rlfleet.client.errors import (InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                                   RlfleetClientError, from_rpc_error)
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.prompts import PromptItem, PromptSource
from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.trajectories import group_tensordict
from rlfleet.v1 import (generation_pb2, reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc,
                        sampling_pb2, trajectory_pb2, trajectory_pb2_grpc)
from rlfleet.wire import Ragged, decode_ragged, decode_tensor, encode_ragged, encode_tensor, encode_tensordict

log = logging.getLogger("rlfleet.collector.pipeline")


@dataclass
class StageStats:
    """Counters of one stage, for GetStatus."""

    name: str
    queued: int = 0
    in_flight: int = 0
    done: int = 0
    window: list[float] = field(default_factory=list)

    def rate(self, horizon: float = 30.0) -> float:
        now = time.monotonic()
        self.window = [t for t in self.window if t > now - horizon]
        return len(self.window) / horizon

    def track(self):
        stage = self

        class _Track:
            async def __aenter__(self):
                stage.queued -= 1
                stage.in_flight += 1

            async def __aexit__(self, exc_type, exc, tb):
                stage.in_flight -= 1
                if exc_type is None:
                    stage.done += 1
                    stage.window.append(time.monotonic())

        stage.queued += 1
        return _Track()


@dataclass
class PipelineOptions:
    group_size: int
    sampling: dict
    mode: str
    default_reward_fn: str
    kl_estimator: int
    advantage_mode: int
    update_kl_controller: bool
    max_groups_in_flight: int
    max_generations_in_flight: int
    max_scoring_in_flight: int
    generation_attempts: int = 5


class _Discard(Exception):
    """The group cannot become a trajectory (aborted / stale): requeue its prompt."""


class Pipeline:
    def __init__(self, options: PipelineOptions, gate: VersionGate, pool: ReplicaPool, source: PromptSource,
                 reference: reference_pb2_grpc.ReferenceServiceStub, reward: reward_pb2_grpc.RewardServiceStub,
                 trajectory: trajectory_pb2_grpc.TrajectoryServiceStub, settings: ChannelSettings):
        self.options = options
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
        self.discarded_samples = 0
        self.failed_groups = 0
        self._groups = asyncio.Semaphore(options.max_groups_in_flight)
        self._generation = asyncio.Semaphore(options.max_generations_in_flight)
        self._scoring = asyncio.Semaphore(options.max_scoring_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self._rng = random.Random()

    async def run(self) -> None:
        """Feed admitted prompts into group tasks until cancelled or the source is exhausted."""
        try:
            while not self.source.exhausted:
                await self._groups.acquire()
                item = await self.source.next()
                group_index, start_version = await self.gate.admit()
                task = asyncio.create_task(self._run_group(item, group_index))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_group(self, item: PromptItem, group_index: int) -> None:
        group_id = self._rng.getrandbits(62)
        try:
            samples = await self._generate(item, group_id)
            ref_log_probs = await self._score_reference(samples)
            rewards = await self._compute_rewards(item, samples, ref_log_probs, group_id)
            await self._append(item, samples, ref_log_probs, rewards, group_id)
        except _Discard as reason:
            log.info("group discarded, prompt requeued", extra={"prompt_id": item.prompt_id, "reason": str(reason)})
            self.source.requeue(item)
            await self.gate.give_back()
        except (InvalidArgumentError, NotFoundError) as exc:
            # Retrying a rejected prompt would fail forever: count it loudly and move on.
            self.failed_groups += 1
            log.error("group failed permanently", extra={"prompt_id": item.prompt_id, "error": str(exc)})
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a task's failure must be logged, never lost
            self.failed_groups += 1
            log.exception("group failed", extra={"prompt_id": item.prompt_id})
            self.source.requeue(item)
            await self.gate.give_back()
        finally:
            self._groups.release()

    # --- stages ----------------------------------------------------------------
    def _request(self, item: PromptItem, group_id: int) -> generation_pb2.GenerateRequest:
        sampling = {**self.options.sampling, **(item.sampling or {})}
        sampling["n"] = self.options.group_size
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
        tried: set[str] = set()
        async with self.stages["generation"].track():
            for attempt in range(self.options.generation_attempts):
                replica = await self.pool.acquire(exclude=tried)
                try:
                    async with self._generation:
                        call = replica.stub.Generate(request, metadata=self.settings.metadata())
                        samples = [s async for s in call]
                except grpc.RpcError as exc:
                    error = from_rpc_error(exc, "Generate")
                    if isinstance(error, (InvalidArgumentError, NotFoundError)):
                        raise error from None
                    if not isinstance(error, ResourceExhaustedError):
                        tried.add(replica.address)
                        await self.pool.mark_failed(replica, str(error))
                    await asyncio.sleep(backoff(attempt, self.settings.backoff_seconds))
                    continue
                finally:
                    self.pool.release(replica)
                if any(s.finish_reason == sampling_pb2.FINISH_REASON_ABORT for s in samples):
                    self.discarded_samples += len(samples)
                    raise _Discard("generation aborted by a weight update")
                return sorted(samples, key=lambda s: s.sample_index)
        raise RuntimeError(f"generation failed on {self.options.generation_attempts} attempts")

    async def _score_reference(self, samples) -> list[torch.Tensor]:
        full = [torch.cat([decode_tensor(s.prompt_token_ids), decode_tensor(s.response_token_ids)]) for s in samples]
        request = reference_pb2.ScoreLogProbsRequest(
            token_ids=encode_ragged(full),
            response_starts=[len(decode_tensor(s.prompt_token_ids)) for s in samples])
        async with self.stages["reference"].track(), self._scoring:
            reply = await call_with_retry(self.reference.ScoreLogProbs, request, method="ScoreLogProbs",
                                          settings=self.settings)
        return decode_ragged(reply.ref_log_probs, "ref_log_probs").to_list()

    async def _compute_rewards(self, item: PromptItem, samples, ref_log_probs, group_id: int):
        n = len(samples)
        request = reward_pb2.ComputeRewardsRequest(
            response_token_ids=encode_ragged([decode_tensor(s.response_token_ids) for s in samples]),
            behavior_log_probs=encode_ragged([decode_tensor(s.behavior_log_probs) for s in samples]),
            ref_log_probs=encode_ragged(ref_log_probs),
            prompt_texts=[item.prompt_text()] * n,
            tasks=[reward_pb2.Task(reward_fn=item.reward_fn or self.options.default_reward_fn,
                                   ground_truth=item.ground_truth, args=item.reward_args)],
            group_ids=[group_id] * n,
            kl_estimator=self.options.kl_estimator,
            advantage_mode=self.options.advantage_mode,
            update_kl_controller=self.options.update_kl_controller,
        )
        async with self.stages["reward"].track(), self._scoring:
            return await call_with_retry(self.reward.ComputeRewards, request, method="ComputeRewards",
                                         settings=self.settings)

    async def _append(self, item, samples, ref_log_probs, rewards, group_id: int) -> None:
        start_version = min(s.policy_version_start for s in samples)
        now = max(self.gate.version, *(s.policy_version_end for s in samples))
        if now - start_version > self.gate.max_staleness:
            # Admission bounds how far ahead a group starts; a group that finished too late (pushes
            # landed while it generated) would reach the trainer staler than allowed — in sync mode
            # any push does that. Its prompt is generated again on the current weights; counted.
            self.discarded_samples += len(samples)
            raise _Discard(f"too stale: started at v{start_version}, now v{now}, "
                           f"max_staleness {self.gate.max_staleness}")
        td = group_tensordict(samples=samples, ref_log_probs=ref_log_probs, rewards=rewards,
                              group_id=group_id, prompt_id=item.prompt_id, kl_coef=rewards.kl_coef,
                              query=item.query)
        request = trajectory_pb2.AppendRequest(trajectories=encode_tensordict(td), idempotency_key=f"{group_id:x}")
        async with self.stages["trajectory"].track():
            attempt = 0
            while True:
                try:
                    await call_with_retry(self.trajectory.Append, request, method="Append", settings=self.settings)
                    break
                except ResourceExhaustedError:
                    # Backpressure: the buffer is full until the trainer catches up.
                    await asyncio.sleep(min(2.0, 0.05 * 2 ** min(attempt, 6)))
                    attempt += 1
        self.appended += len(samples)
        self.staleness[now - start_version] += len(samples)  # staleness when it became visible

    def staleness_histogram(self) -> list[int]:
        if not self.staleness:
            return []
        return [self.staleness.get(i, 0) for i in range(max(self.staleness) + 1)]
