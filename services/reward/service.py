"""The reward service: RewardEngine behind gRPC, heavy work in a thread pool."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import grpc

from rlfleet.services.common.server import Service
from rlfleet.services.reward.budget import TimeBudget
from rlfleet.services.reward.config import RewardServiceConfig
from rlfleet.services.reward.reward_engine import RewardEngine, RewardRequest
from rlfleet.services.reward.batch_rewards import RewardOutputs
from rlfleet.services.reward.servicer import RewardServicer
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger("rlfleet.reward")
T = TypeVar("T")


class RewardService(Service[RewardServiceConfig]):
    """Loads tokenizer, reward functions/models and controller state in :meth:`start`."""

    service_names = (reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,)

    def __init__(self, config: RewardServiceConfig):
        super().__init__(config)
        self.engine = RewardEngine(config)
        # Reward functions and reward models may be slow: never on the event loop.
        self._executor = ThreadPoolExecutor(max_workers=config.compute_threads, thread_name_prefix="reward")

    def torch_threads(self) -> int:
        return self.config.torch_threads

    def add_to_server(self, server: grpc.aio.Server) -> None:
        reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(self), server)

    async def run_blocking(self, function: Callable[..., T], *args) -> T:
        """Run ``function(*args)`` in the worker pool."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(function, *args))

    async def compute(self, request: RewardRequest) -> RewardOutputs:
        """``engine.compute`` in the worker pool, answered within ``reward_time_limit_seconds``
        (the wait for a free worker included): the event loop never runs a reward function."""
        budget = TimeBudget(self.config.reward_time_limit_seconds)
        job = asyncio.get_running_loop().run_in_executor(self._executor, self.engine.compute, request, budget)
        try:
            done, _ = await asyncio.wait({job}, timeout=budget.remaining())
        except asyncio.CancelledError:  # the caller went away: stop at the next checkpoint
            budget.expire()
            job.cancel()
            raise
        if not done and budget.expire():
            job.cancel()  # drops it if still queued; a running function finishes, its result unused
            raise budget.exceeded()
        return await job  # done, or the worker committed a controller update: its short rest

    async def start(self) -> None:
        await self.run_blocking(self.engine.load)
        state = self.engine.controller_state()
        log.info("reward functions loaded", extra={
            "default_reward_fn": self.config.default_reward_fn,
            "reward_functions": sorted(self.config.reward_functions),
            "kl_controller": state.kind, "kl_coef": state.coef, "kl_updates": state.updates})

    async def stop(self) -> None:
        # The server has already drained in-flight RPCs (grace period).
        self._executor.shutdown(wait=False, cancel_futures=True)
