"""Multi-turn episodes: generate -> environment step -> append the observation's tokens -> generate,
token in, token out.

A sample of a multi-turn prompt is one episode of its environment (served by the environment
service). The episode's sequence is exactly what the model saw and produced: the opening prompt's
tokens as the environment service rendered them, then each turn's sampled tokens as the replica
returned them and the observation tokens the environment service rendered after them; every turn
is generated from that token history, never from re-tokenized text. So a turn can be generated on
any replica: one that dies mid-episode costs the turn, not the episode (the next attempt continues
from the history elsewhere).

Several policies may play one episode (self-play, a teacher): the environment names the player of the
next turn (``StepResponse.next_player``; the first turn is always the episode's own policy's), and that
turn is sampled by the policy of the run the collector's ``players`` maps it to. Such a turn is context
to the episode's run, as an observation is: in its group it has ``response_mask`` false, no behaviour
log-probs and no version of this run's (``NOT_SAMPLED``), and its versions are left out of the
episode's (they are the other run's).

An episode ends when its environment says done or truncated, after ``max_turns`` assistant turns,
or when ``max_episode_tokens`` leaves no room for another turn; it always ends on sampled tokens
(an observation with nothing sampled after it is not kept). Its reward is the sum of the per-turn
rewards and the final reward the environment gave.

What fails here fails the group, as in ``failures.py``: an unknown environment (NOT_FOUND) or a
prompt it refuses (INVALID_ARGUMENT) dead-letters the prompt; an environment that raised or hung
(FAILED_PRECONDITION / DEADLINE_EXCEEDED), or that lost the episode (restarted: NOT_FOUND on a
step), is a transient failure: the group is generated again, with new episodes, after a backoff.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from rlfleet.rpc.channel import ChannelSettings, call_with_retry
from rlfleet.rpc.errors import NotFoundError
from rlfleet.services.collector.failures import EpisodeLost
from rlfleet.services.collector.metrics import EPISODE_CACHED_TOKENS, EPISODE_PROMPT_TOKENS
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.trajectories import NOT_SAMPLED, GroupSamples, response_versions
from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import environment_pb2, environment_pb2_grpc, generation_pb2, sampling_pb2
from rlfleet.wire import Ragged, decode_tensor, encode_tensor

GenerateTurns = Callable[..., Awaitable[list[generation_pb2.GenerateResponse]]]
"""Samples the next turn of an episode: (token history, most tokens to sample, n[, player]) -> n samples
(by sample_index); n > 1 only for a group's shared first turn; ``player`` (given when not ""): another
player's turn, sampled by the policy ``players`` maps it to."""


@dataclass
class EpisodeBudget:
    max_turns: int
    max_episode_tokens: int


@dataclass
class SampledTurn:
    """One assistant turn: what was sampled, and the observation appended after it."""

    token_ids: torch.Tensor
    log_probs: torch.Tensor
    versions: torch.Tensor
    """The policy version that sampled each of ``token_ids``."""
    policy_version_start: int
    policy_version_end: int
    seconds: float
    sampling: sampling_pb2.SamplingParams
    observation: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    player: str = ""
    """Who sampled it: "" the episode's own policy, else the player (another run's policy): context."""


@dataclass
class Episode:
    prompt: torch.Tensor
    turns: list[SampledTurn] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    """Ended on its own (the environment said done); otherwise cut by a limit."""

    def history(self) -> torch.Tensor:
        """The tokens the next turn is sampled from."""
        pieces = [self.prompt]
        for turn in self.turns:
            pieces += [turn.token_ids, turn.observation]
        return torch.cat(pieces)


class EpisodeRunner:
    """Runs the episodes of a group against the environment service."""

    def __init__(self, environment: environment_pb2_grpc.EnvironmentServiceStub, settings: ChannelSettings,
                 limits: EpisodeBudget):
        self.environment = environment
        self.settings = settings
        self.limits = limits

    async def _call(self, method: str, request):
        return await call_with_retry(getattr(self.environment, method), request, method=method,
                                     settings=self.settings)

    async def run_group(self, item: PromptItem, environment: str, group_id: int, group_size: int,
                        generate: Callable[[int], GenerateTurns]) -> list[Episode]:
        """``group_size`` episodes of ``item`` on ``environment``, run at once; ``generate(i)`` samples
        episode ``i``'s turns. One that fails fails the group (the others are cancelled and closed)."""
        prompt = item.episode_prompt(f"prompt {item.prompt_id!r}")
        first_turns = _FirstTurns(group_size, generate(0))
        tasks = [asyncio.create_task(self._run(item, environment, prompt, f"{group_id:x}-{i}", i, generate(i),
                                               first_turns))
                 for i in range(group_size)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in [*tasks, *([first_turns.joint] if first_turns.joint else [])]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _run(self, item: PromptItem, environment: str, prompt: list[dict[str, str]], episode_id: str,
                   index: int, generate: GenerateTurns, first_turns: "_FirstTurns") -> Episode:
        # Traced, the episode's turns (generate) and the environment's OpenEpisode, Step (its tool
        # calls) and CloseEpisode spans nest under one span per episode.
        with tracing.span("episode", {"rlfleet.episode_id": episode_id, "rlfleet.environment": environment}):
            return await self._episode(item, environment, prompt, episode_id, index, generate, first_turns)

    async def _episode(self, item: PromptItem, environment: str, prompt: list[dict[str, str]], episode_id: str,
                       index: int, generate: GenerateTurns, first_turns: "_FirstTurns") -> Episode:
        opened = await self._call("OpenEpisode", environment_pb2.OpenEpisodeRequest(
            environment=environment, prompt=[sampling_pb2.ChatMessage(**m) for m in prompt],
            ground_truth=item.ground_truth, metadata={"prompt_id": item.prompt_id}, episode_id=episode_id))
        episode = Episode(decode_tensor(opened.prompt_token_ids, "prompt_token_ids").to(torch.int64))
        try:
            await self._turns(episode, episode_id, index, generate, first_turns)
            closed = await self._close(episode_id)
        except BaseException:
            await asyncio.shield(self._close_quietly(episode_id))
            raise
        if closed.has_final_reward:
            episode.reward += closed.final_reward
        return episode

    async def _turns(self, episode: Episode, episode_id: str, index: int, generate: GenerateTurns,
                     first_turns: "_FirstTurns") -> None:
        limits = self.limits
        length = len(episode.prompt)
        if length >= limits.max_episode_tokens:
            raise InvalidArgument(f"episode {episode_id}: its prompt has {length} tokens, the collector's "
                                  f"max_episode_tokens ({limits.max_episode_tokens}) leaves none to sample")
        player = ""  # the first turn is the episode's own policy's
        while length < limits.max_episode_tokens:
            room = limits.max_episode_tokens - length
            turn_label = "later" if episode.turns else "first"
            if player:
                sample, = await generate(episode.history(), room, 1, player)
            elif episode.turns:
                sample, = await generate(episode.history(), room, 1)
            else:
                sample = await first_turns.sample(index, episode.prompt, room, generate)
            EPISODE_PROMPT_TOKENS.labels(turn_label).inc(length)
            EPISODE_CACHED_TOKENS.labels(turn_label).inc(sample.cached_prompt_tokens)
            token_ids = decode_tensor(sample.response_token_ids, "response_token_ids").to(torch.int64)
            log_probs = decode_tensor(sample.behavior_log_probs, "behavior_log_probs").to(torch.float32)
            turn = SampledTurn(token_ids, log_probs, response_versions(sample, len(token_ids)), sample.policy_version_start,
                               sample.policy_version_end, sample.timing.total_seconds, sample.sampling, player=player)
            episode.turns.append(turn)
            length += len(turn.token_ids)
            request = environment_pb2.StepRequest(
                episode_id=episode_id, turn=len(episode.turns), player=player,
                finish_reason="length" if sample.finish_reason == sampling_pb2.FINISH_REASON_LENGTH else "stop")
            encode_tensor(turn.token_ids, out=request.token_ids)
            step = await self._step(request)
            if step.has_reward:
                episode.reward += step.reward
            if step.done or step.truncated:
                episode.done = step.done
                return
            observation = decode_tensor(step.observation_token_ids, "observation_token_ids").to(torch.int64)
            if len(episode.turns) >= limits.max_turns or length + len(observation) >= limits.max_episode_tokens:
                return  # cut: the observation is not kept, nothing would be sampled after it
            turn.observation = observation
            length += len(observation)
            player = step.next_player

    async def _step(self, request: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        try:
            return await self._call("Step", request)  # numbered: a retry gets the first answer
        except NotFoundError as exc:  # opened by us: the environment service restarted and lost it
            raise EpisodeLost(f"episode {request.episode_id}: {exc.details}") from None

    async def _close(self, episode_id: str) -> environment_pb2.CloseEpisodeResponse:
        try:
            return await self._call("CloseEpisode", environment_pb2.CloseEpisodeRequest(episode_id=episode_id))
        except NotFoundError as exc:
            raise EpisodeLost(f"episode {episode_id}: {exc.details}") from None

    async def _close_quietly(self, episode_id: str) -> None:
        """An episode given up is closed if the service still answers (it would expire idle anyway)."""
        try:
            await self.environment.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id=episode_id),
                                                timeout=5, metadata=self.settings.metadata())
        except Exception:  # noqa: BLE001 - best effort: the episode is being given up already
            pass


class GroupSlot:
    """The one generation slot of a group of episodes, held while any of its episodes generates a turn.

    A single-turn group is one Generate call of ``n`` samples: one of the collector's
    ``max_generations_in_flight`` slots carries the whole group. The episodes of a group generate their
    later turns as separate calls (``n = 1``, their histories differ); a slot per call put a quarter of
    the single turns' sequences into the engine at once (its cost: see the pipeline benchmark page,
    docs/benchmarks/pipeline.md, part (d) on 2026-11-26). So the group's calls share one
    slot, taken by the first of its episodes that generates and given back when none does (all of them
    in an environment step, or done)."""

    def __init__(self, slots: asyncio.Semaphore):
        self.slots = slots
        self.generating = 0
        self._taking = asyncio.Lock()

    @asynccontextmanager
    async def held(self):
        async with self._taking:  # the others wait for the one taking the slot, then share it
            if self.generating == 0:
                await self.slots.acquire()
            self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1
            if self.generating == 0:
                self.slots.release()


class _FirstTurns:
    """A group's first turns as one Generate call (n = the group size) when every episode opened with
    the same tokens, as single-turn groups are generated; each episode samples alone otherwise (an
    environment that varies its opening)."""

    def __init__(self, size: int, generate: GenerateTurns):
        self.size = size
        self.generate = generate
        self.prompts: dict[int, torch.Tensor] = {}
        self.all_opened = asyncio.Event()
        self.joint: asyncio.Future[list[generation_pb2.GenerateResponse]] | None = None

    async def sample(self, index: int, prompt: torch.Tensor, room: int, own: GenerateTurns
                     ) -> generation_pb2.GenerateResponse:
        self.prompts[index] = prompt
        if len(self.prompts) == self.size:
            self.all_opened.set()
        await self.all_opened.wait()
        first = self.prompts[0]
        if self.size == 1 or any(not torch.equal(other, first) for other in self.prompts.values()):
            sample, = await own(prompt, room, 1)
            return sample
        if self.joint is None:
            self.joint = asyncio.ensure_future(self.generate(first, room, self.size))
        return (await asyncio.shield(self.joint))[index]


def group_of_episodes(episodes: list[Episode]) -> GroupSamples:
    """The episodes as a group of samples: ``responses`` = every turn's sampled and observation tokens,
    behaviour log-probs 0 and ``response_mask`` false over the observation tokens and over the turns other
    players sampled, whose versions are left out (``turn_versions`` and the span hold the own turns')."""
    responses, behavior, masks, versions, token_versions = [], [], [], [], []
    for episode in episodes:
        tokens, log_probs, mask, sampled_by = [], [], [], []
        for turn in episode.turns:
            tokens += [turn.token_ids, turn.observation]
            # Another player's turn is context, as the observation after it is.
            own = 0 if turn.player else len(turn.token_ids)
            context = len(turn.token_ids) + len(turn.observation) - own
            log_probs += [turn.log_probs[:own], torch.zeros(context, dtype=torch.float32)]
            mask += [torch.ones(own, dtype=torch.bool), torch.zeros(context, dtype=torch.bool)]
            sampled_by += [turn.versions[:own], torch.full((context,), NOT_SAMPLED, dtype=torch.int64)]
        responses.append(torch.cat(tokens))
        behavior.append(torch.cat(log_probs))
        masks.append(torch.cat(mask))
        token_versions.append(torch.cat(sampled_by))
        versions.append(torch.tensor([[t.policy_version_start, t.policy_version_end] for t in own_turns(episode)],
                                     dtype=torch.int64).reshape(-1, 2))
    return GroupSamples(
        prompts=Ragged.from_list([e.prompt for e in episodes], torch.int64),
        responses=Ragged.from_list(responses, torch.int64),
        behavior_log_probs=Ragged.from_list(behavior, torch.float32),
        response_mask=Ragged.from_list(masks, torch.bool),
        version_start=[min(t.policy_version_start for t in own_turns(e)) for e in episodes],
        version_end=[max(t.policy_version_end for t in own_turns(e)) for e in episodes],
        sample_index=list(range(len(episodes))),
        seconds=[sum(t.seconds for t in e.turns) for e in episodes],
        terminated=[e.done for e in episodes],
        truncated=[not e.done for e in episodes],
        sampling=episodes[0].turns[0].sampling,
        turn_versions=Ragged(torch.cat(versions), torch.tensor([len(own_turns(e)) for e in episodes])),
        versions=Ragged.from_list(token_versions, torch.int64),
        environment_rewards=[e.reward for e in episodes],
    )


def own_turns(episode: Episode) -> list[SampledTurn]:
    """The turns the episode's own policy sampled (the first always is)."""
    return [turn for turn in episode.turns if not turn.player]
