"""The collector's episode loop (``services/collector/episode_runner.py``) against a scripted environment
stub and a scripted generator: when an episode ends, what it keeps, how failures surface, and the
group it becomes. The real services run it in tests/integration/test_episodes.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rlfleet.client.channel import ChannelSettings
from rlfleet.client.errors import FailedPreconditionError
from rlfleet.services.collector import failures
from rlfleet.services.collector.episode_runner import EpisodeBudget, EpisodeRunner, group_of_episodes
from rlfleet.services.collector.failures import EpisodeLost
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import environment_pb2, generation_pb2, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor

PROMPT = [100, 101, 102]
SETTINGS = ChannelSettings(timeout=5, retries=0, backoff_seconds=0.01)


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class ScriptedEnvironment:
    """An EnvironmentService stub: each step answers observation [7, 8] (or what ``steps`` says), reward 1."""

    def __init__(self, done_after: int = 3, truncate: bool = False, fail_step: Exception | None = None,
                 final_reward: float | None = 5.0, varied_openings: bool = False, players: tuple[str, ...] = ()):
        self.done_after, self.truncate, self.fail_step, self.final_reward = done_after, truncate, fail_step, final_reward
        self.varied_openings = varied_openings
        self.players = players
        """Who plays each turn after the first ("" the episode's own policy), in order."""
        self.played: dict[str, list[str]] = {}
        """Per episode, the player each Step said sampled its turn."""
        self.steps: dict[str, list[list[int]]] = {}
        self.opened: list[str] = []
        self.closed: list[str] = []

    async def OpenEpisode(self, request, timeout=None, metadata=None):
        self.opened.append(request.episode_id)
        self.steps[request.episode_id] = []
        reply = environment_pb2.OpenEpisodeResponse()
        opening = PROMPT + ([len(self.opened)] if self.varied_openings else [])
        encode_tensor(torch.tensor(opening), out=reply.prompt_token_ids)
        return reply

    async def Step(self, request, timeout=None, metadata=None):
        if self.fail_step is not None:
            raise self.fail_step
        turns = self.steps[request.episode_id]
        turns.append(decode_tensor(request.token_ids).tolist())
        self.played.setdefault(request.episode_id, []).append(request.player)
        done = len(turns) >= self.done_after
        reply = environment_pb2.StepResponse(reward=1.0, has_reward=True, done=done and not self.truncate,
                                             truncated=done and self.truncate)
        if not done and len(turns) <= len(self.players):
            reply.next_player = self.players[len(turns) - 1]
        if not done:
            encode_tensor(torch.tensor([7, 8]), out=reply.observation_token_ids)
        return reply

    async def CloseEpisode(self, request, timeout=None, metadata=None):
        self.closed.append(request.episode_id)
        if self.final_reward is None:
            return environment_pb2.CloseEpisodeResponse()
        return environment_pb2.CloseEpisodeResponse(final_reward=self.final_reward, has_final_reward=True)


def generator(histories: list[list[int]], tokens: int = 4, version=lambda turn: (turn, turn), calls=None):
    """Samples ``tokens`` tokens (or what the room allows) per turn, recording each history it is given
    (and each call's n in ``calls``); sample s of episode i's call holds 10 * (i + s + 1) + 0, 1, ..."""
    def generate(index: int):
        async def turn(history: torch.Tensor, room: int, n: int, player: str = "") -> list[generation_pb2.GenerateResponse]:
            histories.append(history.tolist())
            if calls is not None:
                calls.append((n, player) if player else n)
            count = min(tokens, room)
            start, end = version(len(histories) - 1)
            samples = []
            for s in range(n):
                sample = generation_pb2.GenerateResponse(
                    sample_index=s, policy_version_start=start, policy_version_end=end,
                    finish_reason=(sampling_pb2.FINISH_REASON_LENGTH if count == room
                                   else sampling_pb2.FINISH_REASON_STOP),
                    sampling=sampling_pb2.SamplingParams(temperature=1.0, max_tokens=room))
                if start != end:  # a keep-mode swap halfway through the turn
                    sample.policy_version_spans.add(version=start, start=0, end=count // 2)
                    sample.policy_version_spans.add(version=end, start=count // 2, end=count)
                encode_tensor(torch.arange(count) + 10 * (index + s + 1), out=sample.response_token_ids)
                encode_tensor(torch.full((count,), -0.5), out=sample.behavior_log_probs)
                samples.append(sample)
            return samples
        return turn
    return generate


def run(environment, limits=EpisodeBudget(8, 1024), group_size=2, **generator_args):
    histories: list[list[int]] = []
    generator_args.setdefault("calls", [])
    runner = EpisodeRunner(environment, SETTINGS, limits)
    item = PromptItem(prompt_id="p", chat=[{"role": "user", "content": "hi"}], ledger_seq=1)
    episodes = asyncio.run(runner.run_group(item, "counter", 0xab, group_size, generator(histories, **generator_args)))
    return episodes, histories


def test_each_turn_is_generated_from_the_token_history_and_the_group_keeps_it_exactly():
    environment = ScriptedEnvironment(done_after=3)
    episodes, histories = run(environment)
    assert sorted(environment.opened) == sorted(environment.closed) == ["ab-0", "ab-1"]
    for index, episode in enumerate(episodes):
        sampled = (torch.arange(4) + 10 * (index + 1)).tolist()
        assert [turn.token_ids.tolist() for turn in episode.turns] == [sampled] * 3
        assert episode.done and episode.reward == 3 * 1.0 + 5.0
        assert episode.history().tolist() == PROMPT + sampled + [7, 8] + sampled + [7, 8] + sampled
    assert PROMPT + [10, 11, 12, 13, 7, 8] in histories
    group = group_of_episodes(episodes)
    assert group.prompts.to_list()[0].tolist() == PROMPT
    assert group.responses.to_list()[1].tolist() == [20, 21, 22, 23, 7, 8] * 2 + [20, 21, 22, 23]
    assert group.response_mask.to_list()[0].tolist() == ([True] * 4 + [False] * 2) * 2 + [True] * 4
    assert group.behavior_log_probs.to_list()[0].tolist() == ([-0.5] * 4 + [0.0] * 2) * 2 + [-0.5] * 4
    assert group.environment_rewards == [8.0, 8.0] and group.terminated == [True, True]
    assert group.turn_versions.lengths.tolist() == [3, 3]


def test_max_turns_cuts_the_episode_on_sampled_tokens():
    episodes, _ = run(ScriptedEnvironment(done_after=10), limits=EpisodeBudget(max_turns=2, max_episode_tokens=1024))
    for episode in episodes:
        assert len(episode.turns) == 2 and not episode.done
        assert episode.turns[-1].observation.numel() == 0  # the last observation is not kept
    assert group_of_episodes(episodes).truncated == [True, True]


def test_the_token_budget_caps_each_turn_and_ends_the_episode():
    # 3 prompt + 4 sampled + 2 observation = 9; then 3 tokens of room: the turn is cut there.
    episodes, histories = run(ScriptedEnvironment(done_after=10), limits=EpisodeBudget(8, 12), group_size=1)
    (episode,) = episodes
    assert [len(t.token_ids) for t in episode.turns] == [4, 3]
    assert len(episode.history()) == 12 and not episode.done
    # Room for sampling but not for an observation and a token after it: the observation is dropped.
    episodes, _ = run(ScriptedEnvironment(done_after=10), limits=EpisodeBudget(8, 9), group_size=1)
    assert [len(t.token_ids) for t in episodes[0].turns] == [4] and len(episodes[0].history()) == 7


def test_the_environment_truncating_ends_the_episode_not_done():
    episodes, _ = run(ScriptedEnvironment(done_after=2, truncate=True, final_reward=None))
    assert all(not e.done and len(e.turns) == 2 and e.reward == 2.0 for e in episodes)


def test_per_turn_versions_are_recorded():
    episodes, _ = run(ScriptedEnvironment(done_after=3), group_size=1, version=lambda turn: (turn, turn + 1))
    group = group_of_episodes(episodes)
    assert group.turn_versions.values.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert (group.version_start, group.version_end) == ([0], [3])
    # Per response token: each turn's 4 sampled tokens split at the swap, -1 over the 2 observation tokens.
    assert group.versions.to_list()[0].tolist() == [0, 0, 1, 1, -1, -1, 1, 1, 2, 2, -1, -1, 2, 2, 3, 3]


def test_a_prompt_longer_than_the_budget_is_refused_and_the_episodes_closed():
    environment = ScriptedEnvironment()
    with pytest.raises(InvalidArgument, match="max_episode_tokens"):
        run(environment, limits=EpisodeBudget(8, 3))
    assert sorted(environment.closed) == ["ab-0", "ab-1"]
    assert failures.verdict(InvalidArgument("x")) == "dead"


def test_a_lost_episode_is_a_transient_failure():
    environment = ScriptedEnvironment(fail_step=RpcError(grpc.StatusCode.NOT_FOUND, "no episode 'ab-0'"))
    with pytest.raises(EpisodeLost, match="ab-"):
        run(environment)
    assert failures.verdict(EpisodeLost("x")) == "retry"


def test_an_environment_that_raised_fails_the_group_and_every_episode_is_closed():
    environment = ScriptedEnvironment(fail_step=RpcError(grpc.StatusCode.FAILED_PRECONDITION, "env broke"))
    with pytest.raises(FailedPreconditionError, match="env broke") as raised:
        run(environment, group_size=3)
    assert failures.verdict(raised.value) == "retry"
    assert sorted(environment.closed) == ["ab-0", "ab-1", "ab-2"]


def test_token_id_prompts_cannot_open_an_episode():
    item = PromptItem(prompt_id="p", token_ids=[1, 2])
    with pytest.raises(InvalidArgument, match="text or chat"):
        item.episode_prompt("prompts[0].prompt")
    assert PromptItem(prompt_id="p", text="hi").episode_prompt("x") == [{"role": "user", "content": "hi"}]


def test_a_groups_turns_stay_on_its_replica_while_it_is_healthy():
    from rlfleet.services.collector.discovery import Endpoint
    from rlfleet.services.collector.replicas import ReplicaPool

    async def scenario():
        pool = ReplicaPool(SETTINGS)
        await pool.update([Endpoint("127.0.0.1:1"), Endpoint("127.0.0.1:2")])
        first, second = pool.replicas
        for replica in pool.replicas:
            await pool.mark_healthy(replica, 0)
        second.in_flight = 5  # busier, yet preferred: its prefix cache holds the episode
        assert await pool.acquire(prefer=second) is second and second.in_flight == 6
        assert await pool.acquire(prefer=second, exclude={second.address}) is first
        await pool.mark_failed(second, "gone")
        assert await pool.acquire(prefer=second) is first  # failover: the token history goes elsewhere
        assert pool.least_loaded() is first
        await pool.close()

    asyncio.run(scenario())


def test_a_groups_first_turns_are_one_call_when_the_openings_are_the_same():
    calls = []
    episodes, _ = run(ScriptedEnvironment(done_after=2), group_size=3, calls=calls)
    assert calls == [3, 1, 1, 1]  # the first turns together (n = 3), then each episode's own
    assert [e.turns[0].token_ids.tolist() for e in episodes] == [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    calls = []
    episodes, _ = run(ScriptedEnvironment(done_after=2, varied_openings=True), group_size=3, calls=calls)
    assert calls == [1] * 6  # an environment that varies its openings: each episode alone
    assert sorted(len(e.prompt) for e in episodes) == [4, 4, 4]


def test_a_groups_episodes_share_one_generation_slot_while_any_of_them_generates():
    from rlfleet.services.collector.episode_runner import GroupSlot

    async def scenario():
        slots = asyncio.Semaphore(1)
        group, other = GroupSlot(slots), GroupSlot(slots)
        entered = asyncio.Event()
        release = asyncio.Event()
        inside = []

        async def turn(slot: GroupSlot, name: str):
            async with slot.held():
                inside.append(name)
                if len(inside) == 3:
                    entered.set()
                await release.wait()

        tasks = [asyncio.create_task(turn(group, f"episode {i}")) for i in range(3)]
        await asyncio.wait_for(entered.wait(), 5)  # all three turns of one group in one slot
        assert slots.locked() and group.generating == 3
        waiting = asyncio.create_task(turn(other, "other group"))
        await asyncio.sleep(0)
        assert "other group" not in inside  # another group waits for the slot
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks, waiting), 5)
        assert inside[-1] == "other group" and group.generating == other.generating == 0
        assert not slots.locked()  # given back once no episode generates

    asyncio.run(scenario())


def test_a_turn_of_another_player_is_sampled_by_its_policy_and_kept_as_context():
    """Own turn, the opponent's, own: the opponent's turn is generated for its player and stepped as its,
    and in the group it is context (mask false, log-probs 0, no version of this run's) while the own
    turns keep theirs; the episode's versions are the own turns' alone."""
    environment = ScriptedEnvironment(done_after=3, players=("opponent", ""))
    calls = []
    episodes, _ = run(environment, group_size=1, calls=calls, version=lambda turn: (turn * 10, turn * 10))
    assert calls == [1, (1, "opponent"), 1]
    assert environment.played["ab-0"] == ["", "opponent", ""]
    (episode,) = episodes
    assert [turn.player for turn in episode.turns] == ["", "opponent", ""]
    group = group_of_episodes(episodes)
    assert group.response_mask.to_list()[0].tolist() == [True] * 4 + [False] * 2 + [False] * 6 + [True] * 4
    assert group.behavior_log_probs.to_list()[0].tolist() == [-0.5] * 4 + [0.0] * 8 + [-0.5] * 4
    assert group.versions.to_list()[0].tolist() == [0] * 4 + [-1] * 8 + [20] * 4
    assert group.turn_versions.values.tolist() == [[0, 0], [20, 20]]  # the opponent's version 10 left out
    assert (group.version_start, group.version_end) == ([0], [20])
