"""The reward service's domain object: reward functions, tokenizer and the KL controller.

``RewardEngine.compute`` runs one batch through :mod:`batch_rewards` with the
controller's current coefficient, then (if asked) feeds the batch KL to the
controller and persists its state. Synchronous and thread-safe: the service
calls it from worker threads, with a :class:`TimeBudget` it also watches from
the event loop. Knows nothing about gRPC.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.services.common.errors import InvalidArgument, Unavailable
from rlfleet.services.reward import batch_rewards, validation
from rlfleet.services.reward.budget import TimeBudget
from rlfleet.services.reward.config import RewardServiceConfig
from rlfleet.services.reward.controllers import KLController
from rlfleet.services.reward.functions import RewardFunctions, TaskSpec, expand_tasks
from rlfleet.services.reward.run_controllers import KLControllers
from rlfleet.services.reward.scores import ScoreInput
from torch import Tensor

log = logging.getLogger("rlfleet.reward")


@dataclass(frozen=True)
class RewardRequest:
    """One ComputeRewards call in domain terms."""

    inputs: batch_rewards.RewardInputs
    prompt_texts: Sequence[str] = ()
    """One per sample, or empty (reward functions then see an empty prompt)."""
    response_texts: Sequence[str] = ()
    """One per sample, or empty: the engine decodes ``inputs.response_token_ids``."""
    tasks: Sequence[TaskSpec] = ()
    """One per sample, exactly one for all, or none (the default function)."""
    kl_estimator: str | None = None
    """``k1``/``k2``/``k3``; ``None``: the configured default."""
    advantage_mode: str | None = None
    """``grpo``/``grpo_no_std``/``rloo``; ``None``: the configured default."""
    update_kl_controller: bool = False
    """Feed this batch's KL to the controller after computing."""
    run_id: str = ""
    """The run whose KL controller (``run_controllers``); "": the service's own."""


@dataclass(frozen=True)
class ControllerState:
    """What GetKLController reports."""

    kind: str
    coef: float
    target: float
    horizon: float
    updates: int
    steps: int


class RewardEngine:
    """Call :meth:`load` (slow: tokenizer, reward models, controller state) before :meth:`compute`."""

    def __init__(self, config: RewardServiceConfig) -> None:
        self.config = config
        self.functions = RewardFunctions(
            config.default_reward_fn, config.default_reward_params, config.reward_functions,
            max_cached=config.max_cached_scorers,
        )
        self.controllers = KLControllers(config)
        self.tokenizer: Any = None
        self._loaded = False
        # Serialises controller update + save, so the file always holds the latest state.
        self._controller_lock = threading.Lock()

    def load(self) -> None:
        if self.config.tokenizer_path:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path)
        self.functions.load()
        self.controllers.load()
        self._loaded = True

    @property
    def controller(self) -> KLController:
        """The service's own KL controller."""
        return self.controllers.own

    def check_tasks(self, tasks: list[TaskSpec]) -> None:
        """Resolve every task (unknown function: NotFound; bad arguments: InvalidArgument), scoring nothing."""
        for index, task in enumerate(tasks):
            self.functions.resolve(task, index)

    # ------------------------------------------------------------------ compute

    def compute(self, request: RewardRequest, budget: TimeBudget | None = None) -> batch_rewards.RewardOutputs:
        """Score one batch. ``budget`` (default: unbounded) is checked before each step; the
        controller is updated only if the budget lets the request commit."""
        if not self._loaded:
            raise Unavailable("reward service is still loading")
        budget = budget or TimeBudget()
        budget.enter("checking the inputs")
        inputs = request.inputs
        batch_size = inputs.batch_size
        for name, texts in (("prompt_texts", request.prompt_texts), ("response_texts", request.response_texts)):
            if texts and len(texts) != batch_size:
                raise InvalidArgument(f"{name} has {len(texts)} entries for {batch_size} samples")
        tasks = expand_tasks(request.tasks, batch_size)
        controller = self.controllers.get(request.run_id)
        kl_coef = controller.coef

        def score_batch() -> Tensor:
            responses = list(request.response_texts) or self._decode(inputs, budget)
            prompts = list(request.prompt_texts) or [""] * batch_size
            samples = [
                ScoreInput(prompt, response, response_length=row.numel())
                for prompt, response, row in zip(prompts, responses, inputs.behavior_log_probs)
            ]
            scores = self.functions.score(samples, tasks, budget)
            budget.enter("shaping rewards and computing advantages")
            return scores

        outputs = batch_rewards.compute_rewards(
            inputs, score_batch,
            kl_coef=kl_coef,
            kl_estimator=request.kl_estimator or self.config.default_kl_estimator,
            advantage_mode=request.advantage_mode or self.config.default_advantage_mode,
            score_clip=self.config.score_clip,
            grpo_eps=self.config.grpo_eps,
        )
        # After computing: this response carries the coefficient its rewards were shaped with.
        if request.update_kl_controller and batch_size:
            budget.commit()  # never update for a request already answered "time is up"
            self._update_controller(controller, self.controllers.state_path(request.run_id), outputs.batch_kl,
                                    batch_size)
        return outputs

    def _decode(self, inputs: batch_rewards.RewardInputs, budget: TimeBudget) -> list[str]:
        if inputs.response_token_ids is None:
            raise InvalidArgument("response_texts is empty and response_token_ids is absent: nothing to score")
        if self.tokenizer is None:
            raise InvalidArgument(
                "response_texts is empty and the service has no tokenizer_path to decode response_token_ids")
        vocab_size = len(self.tokenizer)
        rows = []
        for index, row in enumerate(inputs.response_token_ids):
            bad = ((row < 0) | (row >= vocab_size)).nonzero()
            if bad.numel():
                position = int(bad[0, 0])
                raise InvalidArgument(
                    f"sample {index}, token {position}: response_token_ids id {int(row[position])} is outside "
                    f"the tokenizer's vocabulary [0, {vocab_size})")
            rows.append(row.tolist())
        budget.enter("decoding response_token_ids")
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        validation.check_texts("response_texts (decoded from response_token_ids)", texts, self.config)
        return texts

    def _update_controller(self, controller: KLController, path: str | None, batch_kl: float,
                           batch_size: int) -> None:
        with self._controller_lock:
            before = controller.snapshot()
            controller.update(batch_kl, n_steps=batch_size)
            if path:
                try:
                    controller.save(path)
                except BaseException:
                    # Never a half-applied change: memory and file stay in step.
                    controller.restore(before)
                    raise

    def controller_state(self, run_id: str = "") -> ControllerState:
        if not self._loaded:
            # Before load() the persisted state is not restored yet: do not report the initial one.
            raise Unavailable("reward service is still loading")
        controller = self.controllers.get(run_id, create=False)
        return ControllerState(
            kind=controller.kind,
            coef=controller.coef,
            target=getattr(controller, "target", 0.0),
            horizon=getattr(controller, "horizon", 0.0),
            updates=controller.updates,
            steps=controller.steps,
        )
