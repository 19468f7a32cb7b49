"""Configuration of the reward service.

Reward functions a request may name are the built-ins (see
:mod:`rlfleet.services.reward.scores`) and the ones listed here. Import paths
(``package.module:function``) and reward models are accepted **only** from this
config: a remote request can never make the service import code or load a model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.choices import AdvantageModeName, KLEstimatorName
from rlfleet.services.common.config import ServiceConfig


class RewardFunctionConfig(BaseModel):
    """One reward function the service offers under a name of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    function: str
    """A built-in name (``numeric_match``, ``reward_model`` ...) or an import path
    ``package.module:function`` called as ``function(sample: ScoreInput, **params) -> float``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments: for a built-in, its factory's parameters (``reward_model`` takes
    ``path``, ``batch_size``, ``device`` ...); for an import path, passed on every call."""


class RewardServiceConfig(ServiceConfig):
    """The reward service: KL estimators, the KL controller, reward functions, advantages.

    Env vars are ``RLFLEET_REWARD_<FIELD>``; dict fields take JSON.
    """

    service_name = "reward"

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""

    tokenizer_path: str | None = None
    """HF tokenizer directory used to decode ``response_token_ids`` (special tokens skipped)
    when a request sends no ``response_texts``. ``None``: such requests are refused (INVALID_ARGUMENT)."""

    default_reward_fn: str = "numeric_match"
    """Reward function for tasks that name none: a built-in, a key of ``reward_functions``,
    or an import path ``package.module:function``."""

    default_reward_params: dict[str, Any] = Field(default_factory=dict)
    """Parameters of ``default_reward_fn`` (whether a task names it or names nothing) when it
    is a built-in or an import path; a ``reward_functions`` entry carries its own."""

    reward_functions: dict[str, RewardFunctionConfig] = Field(default_factory=dict)
    """Extra reward functions requests may name, as ``{name: {"function": ..., "params": {...}}}``.
    The only place import paths and reward models are accepted. Built at startup:
    a bad entry stops the service before it reports SERVING."""

    score_clip: float | None = Field(None, gt=0)
    """Task scores are clipped to ``[-score_clip, score_clip]`` before shaping and
    advantages; ``None`` disables clipping."""

    kl_controller: Literal["constant", "adaptive"] = "constant"
    """KL-coefficient controller: a fixed coefficient, or Ziegler et al.'s adaptive
    controller steering the KL towards ``kl_target``."""

    init_kl_coef: float = Field(0.05, ge=0)
    """Initial KL coefficient (beta in ``reward = score - beta * KL``)."""

    kl_target: float = Field(6.0, gt=0)
    """Adaptive controller: target of the batch mean of the per-sequence KL (summed over
    response tokens, as in Ziegler et al. and TRL)."""

    kl_horizon: float = Field(10000.0, gt=0)
    """Adaptive controller: horizon in samples; each update accounts for the batch size."""

    kl_state_path: str | None = None
    """JSON file the controller state is written to after every update (atomically) and
    restored from at startup, so the coefficient survives restarts. ``None``: in memory only."""
    fresh: bool = False
    """Start a new run: delete ``kl_state_path`` (and the runs' files beside it) before restoring from it
    (the coefficient starts at ``kl_coef``). A start-once switch, given with the collector's ``fresh``."""
    max_runs: int = Field(64, ge=0)
    """Runs sharing this service that get a KL controller of their own (``ComputeRewardsRequest.run_id``;
    docs/concepts/many-runs.md); a batch of a run beyond them is RESOURCE_EXHAUSTED."""

    grpo_eps: float = Field(1e-6, gt=0)
    """GRPO: ``eps`` in ``(score - mean) / (std + eps)``."""

    default_kl_estimator: KLEstimatorName = "k1"
    """KL estimator for requests that leave ``kl_estimator`` unspecified."""

    default_advantage_mode: AdvantageModeName = "grpo"
    """Advantage mode for requests that leave ``advantage_mode`` unspecified."""

    compute_threads: int = Field(2, ge=1)
    """Worker threads for ComputeRewards (decoding, reward functions, reward models),
    so the event loop never runs the heavy part."""

    max_cached_scorers: int = Field(128, ge=1)
    """Built-in scorers built for per-request ``Task.args`` are cached, at most this many."""

    torch_threads: int = Field(1, ge=0)
    """Torch intra-op threads (0: one per core). 1 suits KL and advantage math on a few hundred
    tokens per sample (parallelism comes from concurrent requests); a CPU reward model may want more."""
    reward_time_limit_seconds: float = Field(30.0, gt=0)
    """Time one ComputeRewards call may take from arrival to answer (waiting for a worker thread,
    decoding, reward functions, reward models). Past it the call is answered RESOURCE_EXHAUSTED
    naming the reward function that was running (or the wait for a free worker): a slow function
    is not retried by the SDK, since it would be as slow again. A Python thread cannot be stopped
    mid-call: the function finishes in its worker thread and its result is dropped; the request
    stops before its next reward function and never updates the KL controller. Below the SDK's
    default 60 s deadline, so callers get this precise status rather than DEADLINE_EXCEEDED."""

    # Request size bounds: checked on the message before anything is decoded or allocated.
    # Over a bound: RESOURCE_EXHAUSTED naming the field and the limit (well-formed, too large here).
    max_samples_per_request: int = Field(4096, ge=1)
    """Most samples one ComputeRewards request may hold; also bounds ``tasks``, ``group_ids``,
    ``prompt_texts`` and ``response_texts``. Split larger batches."""

    max_tokens_per_sample: int = Field(131072, ge=1)
    """Most response tokens one sample may have (each ragged field: token ids, log-probs, mask)."""

    max_tokens_per_request: int = Field(2 * 1024 * 1024, ge=1)
    """Most response tokens one request may hold, summed over its samples. Rewards are computed on
    the concatenated tokens (never padded to batch x longest), so memory grows with this number:
    roughly 100 bytes per token at the peak."""

    max_text_chars: int = Field(512 * 1024, ge=0)
    """Longest prompt or response text (characters), sent or decoded from token ids. Reward
    functions run on these texts: this bounds their work per sample."""

    max_ground_truth_chars: int = Field(64 * 1024, ge=0)
    """Longest ``Task.ground_truth`` (characters); ``regex_match`` compiles it as a pattern."""

    max_args_per_task: int = Field(16, ge=0)
    """Most entries in one task's ``Task.args``."""

    max_arg_chars: int = Field(4096, ge=1)
    """Longest ``Task.args`` key or value (characters), patterns included."""

    @model_validator(mode="after")
    def _default_params_belong_to_the_default(self) -> RewardServiceConfig:
        if self.default_reward_fn in self.reward_functions and self.default_reward_params:
            raise ValueError(
                f"default_reward_fn {self.default_reward_fn!r} is a reward_functions entry: "
                "give its params there, not in default_reward_params"
            )
        return self
