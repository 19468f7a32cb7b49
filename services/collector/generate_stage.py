"""The pipeline's first stage: a group's samples from the generation replicas.

In: an admitted prompt and its group id. Out: the group's samples decoded once (``GroupSamples``): ``n``
samples of one request, or, for a prompt with an environment, ``group_size`` multi-turn episodes
(``episode_runner.py``) whose every turn is generated here. A request goes to a healthy replica (the
group's home while it stays healthy: an episode's later turns find their prefix cached there) and fails
over to others; a group started while a rolling update runs is pinned to one version (``Placement``).
A group aborted by a weight update is ``Discard``ed (its prompt generated again); one that failed on
every attempt is ``GenerationFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass

import grpc
import torch

from rlfleet.rpc.channel import ChannelSettings, backoff
from rlfleet.rpc.errors import (AbortedError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                                ResourceExhaustedError, from_rpc_error)
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.episode_runner import EpisodeRunner, GenerateTurns, GroupSlot, group_of_episodes
from rlfleet.services.collector.failures import Discard, GenerationFailed
from rlfleet.services.collector.prompt_item import PromptItem, sampling_fields
from rlfleet.services.collector.replicas import Replica, ReplicaPool, VersionRetired
from rlfleet.services.collector.stage_stats import Discards, StageStats
from rlfleet.services.collector.trajectories import GroupSamples
from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.v1 import generation_pb2, sampling_pb2
from rlfleet.wire import encode_tensor

log = logging.getLogger("rlfleet.collector.rollout")


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


class GenerateStage:
    def __init__(self, gate: VersionGate, pool: ReplicaPool, settings: ChannelSettings,
                 episodes: EpisodeRunner | None, discards: Discards, *, sampling: dict, group_size: int,
                 default_environment: str, generation_attempts: int, max_generations_in_flight: int,
                 players: dict[str, str] | None = None):
        self.gate = gate
        self.pool = pool
        self.settings = settings
        self.episodes = episodes
        """Runs multi-turn prompts; None: the collector has no environment service."""
        self.discards = discards
        self.sampling = sampling
        self.group_size = group_size
        self.default_environment = default_environment
        """Environment of the prompts that name none ("": single-turn)."""
        self.players = dict(players or {})
        """An environment's player -> the run (its name on the shared replicas) whose policy plays its turns."""
        self.generation_attempts = generation_attempts
        self.stats = StageStats("generation")
        self.pin_violations = 0
        """Pinned requests whose samples ran on another version (their groups generated again; must stay 0)."""
        self.pins_retired = 0
        """Pinned groups generated again because no replica serves their version any more."""
        self.pinned_groups = 0
        """Groups pinned to a version (started while a rolling update ran)."""
        self._generation = asyncio.Semaphore(max_generations_in_flight)

    async def run(self, item: PromptItem, group_id: int) -> GroupSamples:
        """The group of ``item``: ``n`` samples, or ``group_size`` episodes of its environment."""
        environment = item.environment or self.default_environment
        if environment:
            return await self._run_episodes(item, environment, group_id)
        return GroupSamples.decode(await self._generate(item, group_id))

    def _request(self, item: PromptItem, group_id: int) -> generation_pb2.GenerateRequest:
        sampling = sampling_fields(self.sampling, item.sampling, self.group_size)
        request = self.pool.run.generate_request(request_id=f"{group_id:x}",
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
        async with self.stats.track(self._generation), self._placed() as place:
            with tracing.span("generate", {"rlfleet.samples": request.sampling.n}):
                samples = await self._on_a_replica(request, place)
        if any(s.finish_reason == sampling_pb2.FINISH_REASON_ABORT for s in samples):
            self.discards.add(len(samples), sampled_tokens(samples))
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
        for attempt in range(self.generation_attempts):
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
                if request.policy_run and isinstance(error, FailedPreconditionError):
                    raise error from None  # the other run is not on the replicas yet: the group is retried
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
        raise GenerationFailed(f"generation failed on {self.generation_attempts} attempts "
                               f"(replicas tried: {', '.join(sorted(tried)) or 'none'})")

    async def _run_episodes(self, item: PromptItem, environment: str, group_id: int) -> GroupSamples:
        """The group as ``group_size`` episodes of ``environment`` (``episode_runner.py``), every turn generated
        on the group's replica while it is healthy."""
        if self.episodes is None:
            raise InvalidArgument(f"prompt {item.prompt_id!r}: environment {environment!r} needs a collector "
                                  "with an environment_address")
        slot = GroupSlot(self._generation)  # the group's turns share one slot, as its samples would
        async with self.stats.track(), self._placed() as place:
            place.home = self.pool.least_loaded()  # every episode's first turn goes there too
            episodes = await self.episodes.run_group(
                item, environment, group_id, self.group_size,
                lambda index: self._turn_generator(item, group_id, index, place, slot))
        return group_of_episodes(episodes)

    def _turn_generator(self, item: PromptItem, group_id: int, index: int, place: Placement,
                        slot: GroupSlot) -> GenerateTurns:
        """Generates the turns of episode ``index`` (``n`` samples from its token history, at most the
        tokens its budget leaves; n > 1 for the group's shared first turn), by this run's policy or, for a
        turn of another ``player``, by the policy of the run ``players`` maps it to. A turn aborted by a
        weight update is generated again (on the new weights: each turn records its versions)."""
        fields = sampling_fields(self.sampling, item.sampling, 1)
        if fields.get("seed"):
            fields["seed"] += index  # one seed per episode, or the group's episodes would be one
        max_tokens = fields.get("max_tokens") or SamplingSpec.max_tokens
        requests = itertools.count()

        async def generate(history: torch.Tensor, room: int, n: int,
                           player: str = "") -> list[generation_pb2.GenerateResponse]:
            sampling = sampling_pb2.SamplingParams(**{**fields, "max_tokens": min(max_tokens, room), "n": n})
            policy_run = self._policy_of(player, item) if player else ""
            for _ in range(self.generation_attempts):
                request = self.pool.run.generate_request(request_id=f"{group_id:x}-{index}-{next(requests)}",
                                                         sampling=sampling, policy_run=policy_run)
                encode_tensor(history, out=request.prompt.token_ids)
                async with slot.held():
                    with tracing.span("generate", {"rlfleet.episode": index, "rlfleet.samples": n}):
                        samples = await self._on_a_replica(request, place)
                if all(s.finish_reason != sampling_pb2.FINISH_REASON_ABORT for s in samples):
                    return sorted(samples, key=lambda s: s.sample_index)
                self.discards.add(0, sampled_tokens(samples))
            raise Discard(f"a turn was aborted by weight updates {self.generation_attempts} times")
        return generate

    def _policy_of(self, player: str, item: PromptItem) -> str:
        """The run whose policy plays ``player``'s turns (INVALID_ARGUMENT, dead-lettering the prompt, for
        a player the collector's ``players`` does not map)."""
        run = self.players.get(player)
        if run is None:
            mapped = ", ".join(f"{name!r}" for name in sorted(self.players)) or "none"
            raise InvalidArgument(f"prompt {item.prompt_id!r}: its environment named player {player[:160]!r} for a "
                                  f"turn; the collector's players setting maps {mapped}")
        return run
