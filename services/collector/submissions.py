"""Prompts a trainer submits: parsed, checked (an episode needs an environment service; the reward service
must take each task) and queued durably in the prompt source."""

from __future__ import annotations

import logging
from typing import Sequence

from rlfleet.rpc.channel import ChannelSettings, call_with_retry
from rlfleet.rpc.errors import RlfleetClientError
from rlfleet.services.collector import prompt_item
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.watchers import UpstreamWatch
from rlfleet.services.common.errors import InvalidArgument, Unavailable, UpstreamError
from rlfleet.v1 import collector_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger("rlfleet.collector")


class Submissions:
    def __init__(self, config: CollectorConfig, source: PromptSource, reward: reward_pb2_grpc.RewardServiceStub,
                 upstream: UpstreamWatch, settings: ChannelSettings):
        self._config, self._source, self._reward, self._upstream = config, source, reward, upstream
        self._settings = settings

    def check_open(self) -> None:
        """Submissions are taken from the moment the prompt ledger is read (before the replicas answer: the
        prompts wait durably)."""
        if not self._source.restored:
            raise Unavailable("the collector is starting: its prompt ledger is not read yet")

    def parse(self, specs: Sequence[collector_pb2.PromptSpec]) -> list[PromptItem]:
        config = self._config
        return [prompt_item.from_spec(spec, f"prompts[{i}]", max_prompt_bytes=config.max_prompt_bytes,
                                      sampling_defaults=config.sampling, group_size=config.group_size)
                for i, spec in enumerate(specs)]

    async def submit(self, items: list[PromptItem]) -> list[str]:
        """Queue validated prompts durably, once the reward service said it takes their tasks."""
        self._check_episodes(items)
        await self._check_tasks(items)
        return await self._source.submit(items)

    def _check_episodes(self, items: list[PromptItem]) -> None:
        """A prompt run as an episode needs an environment service and a text or chat prompt."""
        for index, item in enumerate(items):
            environment = item.environment or self._config.environment
            if not environment:
                continue
            if "environment" not in self._upstream.addresses:
                raise InvalidArgument(f"prompts[{index}].environment: {environment[:64]!r} needs a collector "
                                      "with an environment_address (this one has none)")
            item.episode_prompt(f"prompts[{index}].prompt")

    async def _check_tasks(self, items: list[PromptItem]) -> None:
        """Ask the reward service whether it has each prompt's reward function and takes its arguments:
        a prompt it would refuse is refused now (NOT_FOUND / INVALID_ARGUMENT naming the prompt).
        While the reward service is down the prompts are taken unchecked (a WARNING): taking them
        durably matters more, and the reward stage still dead-letters what it refuses."""
        if self._upstream.down("reward"):
            log.warning("reward service down: %d prompts taken without checking their reward functions",
                        len(items))
            return
        first: dict[tuple, int] = {}  # distinct task -> the first prompt carrying it
        for index, item in enumerate(items):
            key = (item.reward_fn or self._config.reward_fn, item.ground_truth,
                   tuple(sorted(item.reward_args.items())))
            first.setdefault(key, index)
        tasks = [reward_pb2.Task(reward_fn=fn, ground_truth=truth, args=dict(args)) for fn, truth, args in first]
        try:
            await call_with_retry(self._reward.CheckTasks, reward_pb2.CheckTasksRequest(tasks=tasks),
                                  method="CheckTasks", settings=self._settings, timeout=30)
        except RlfleetClientError as error:
            if error.code not in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"):
                log.warning("reward service unreachable (%s): %d prompts taken without checking their reward "
                            "functions", error.code, len(items))
                return
            # The refused task, typed (its index in ``tasks``): named as the first prompt carrying it.
            refused, carriers = error.sample_error, list(first.values())
            if refused is not None and 0 <= refused.sample < len(carriers):
                raise UpstreamError(error.code, f"prompts[{carriers[refused.sample]}]: {refused.description}") from None
            raise UpstreamError(error.code, f"prompts: {error.details}") from None
