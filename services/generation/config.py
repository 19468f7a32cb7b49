"""Configuration of the generation engine (the vLLM-backed domain object).

The service-level config (ports, metrics, logging) embeds this model; this
one only says how to build and drive the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.choices import MODEL_DTYPE_NAMES
from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.common.upstream import UpstreamConfig

# Keys of engine_kwargs the engine sets itself: overriding them would silently
# break behaviour log-probs or weight updates.
OWNED_ENGINE_KWARGS = frozenset({"logprobs_mode", "weight_transfer_config", "model"})
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's ``MaxLoRARanks`` (checked against it in tests/integration/test_generation_engine.py)."""


class GenerationEngineConfig(BaseModel):
    """How to build the vLLM engine and how hard to drive it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str
    """Path to a Hugging Face model directory (config, tokenizer, safetensors).

    A local directory is required: weight pushes are validated against the
    parameter names and shapes in its safetensors headers."""

    tokenizer: str | None = None
    """Tokenizer directory; defaults to ``model``."""

    dtype: Literal[(*MODEL_DTYPE_NAMES, "auto")] = "float32"
    """Compute dtype of the engine. float32 keeps behaviour log-probs
    bit-comparable with a float32 trainer; bfloat16 is the usual GPU choice."""

    max_model_len: int = Field(2048, gt=0)
    """Maximum prompt + response length in tokens."""

    seed: int = 0
    """Engine-wide random seed (per-request seeds override it)."""

    max_num_seqs: int = Field(64, gt=0)
    """Maximum number of sequences vLLM schedules in one batch."""

    max_n: int = Field(64, ge=1)
    """Most samples one ``Generate`` call may ask for (``sampling.n``, a GRPO group).
    Checked before anything is allocated; larger is INVALID_ARGUMENT."""

    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt accepted, in tokens. ``None``: ``max_model_len - 1`` (a prompt
    needs room for one response token). Longer is INVALID_ARGUMENT. Text and chat
    prompts are refused untokenized beyond ``PROMPT_CHARS_PER_TOKEN`` (32)
    characters per allowed token, so tokenizing stays cheap."""

    max_queued_requests: int = Field(256, gt=0)
    """Admission bound: ``generate`` calls in flight (waiting or running, one per
    prompt regardless of ``n``). Beyond it new calls fail with ResourceExhausted
    so the caller can back off or try another replica."""

    enforce_eager: bool = True
    """Disable graph capture / torch.compile. Faster start-up; on CPU and for
    small models there is little to gain from compilation."""

    enable_prefix_caching: bool = True
    """Share KV blocks between requests with a common prefix (a GRPO group
    shares its prompt). The cache is reset after every weight swap."""

    block_size: int | None = Field(32, gt=0)
    """Tokens per KV-cache block. The prefix cache reuses whole blocks only, so a multi-turn
    episode's next turn finds the KV of its history (computed by the turn before) only up to the
    last full block: vLLM's CPU default of 128 cached none of a short turn's history (a 64-token
    turn after a 19-token prompt). ``None``: vLLM's default for the platform (128 on CPU, 16 on
    most GPUs). The attention backend must support it (CPU: a multiple of 32; vLLM refuses
    others when the engine starts)."""

    queue_poll_us: int | None = Field(None, ge=0)
    """Microseconds vLLM's engine-core and worker processes sleep between checks of the
    shared-memory queues they hand each step through. vLLM itself spins there (``sched_yield``),
    a full core per process while generating: on a CPU host that core is taken from the model's
    own worker and from the services beside it (the effect on a 2-core host: see the pipeline
    benchmark page, docs/benchmarks/pipeline.md, part (c)). ``None``: 20 when the engine runs on
    CPU, vLLM's spin on a GPU host; 0: vLLM's spin. On a CPU host of at most 2 CPUs the model runs in
    the engine core, with no worker process and no such queue between them. See
    ``rlfleet.services.generation.queue_poll``."""

    stream_interval: int = Field(16, gt=0)
    """Sampled tokens vLLM gathers per sample before it hands them to the service (vLLM's
    ``stream_interval``); a sample's first token and its end are handed over at once whatever this
    says. The service reads each sample's tokens as deltas (to report a sample the moment it ends,
    not when its group does); at 1, vLLM's default, every engine step builds, queues and hands over an
    output per sequence, CPU per sampled token taken from the engine's host (the generation benchmark's
    page has the measurement). 1: every token as it is sampled."""

    kv_cache_memory_bytes: int | None = None
    """Explicit KV-cache size in bytes; ``None`` lets vLLM size it."""

    initial_policy_version: int = Field(0, ge=0)
    """Policy version of the weights loaded from ``model`` at start."""

    tokens_per_second_window_s: float = Field(10.0, gt=0)
    """Window over which ``status()`` measures generated tokens per second."""

    max_push_bytes: int | None = Field(None, gt=0)
    """Largest weight push accepted, in bytes. ``None``: ``max_push_factor`` times the
    bytes of the served checkpoint. A push is staged in a shared-memory segment
    (``/dev/shm``) of its size until applied; its manifest is checked against the
    served model (names, dtypes, shapes) and this bound before that is allocated."""

    max_push_factor: float = Field(4.0, ge=1.0)
    """With ``max_push_bytes`` unset: the largest push, as a multiple of the served
    checkpoint's bytes. Shapes must match the checkpoint exactly, so only a wider
    dtype makes a push bigger: 4 admits float32 pushes onto an 8-bit checkpoint."""

    delta_pushes: bool = True
    """Keep the weights this replica serves (the bytes of the pushes it applied: one more copy of the
    model in ``/dev/shm``), so that a delta push (only the tensors that changed since the version it
    serves) can patch them; only the layers it touches are reloaded. False saves that memory: delta
    pushes are refused with FAILED_PRECONDITION and the collector re-syncs this replica with a full push
    instead. The checkpoint's own weights are not kept: a replica takes deltas after its first push."""

    verify_weights: bool = True
    """Check every push against its manifest's fingerprints (``rlfleet.wire.fingerprint``: one read of the
    weights, ~0.1 s per GB on one core): at the commit, the staged bytes of each tensor (INVALID_ARGUMENT
    naming the tensors that differ, nothing applied, the old weights serve on); after the load, each of
    the engine's parameters against the tensors loaded into it (a mismatch leaves the replica failed, out
    of rotation until a push re-syncs it). False skips both (docs/guides/weight-sync.md)."""

    streamed_apply: Literal["auto", "on", "off"] = "auto"
    """Load a full push into vLLM while its bytes still arrive over the network (grpc chunks or a relay),
    rather than after the last one: the transfer and the load overlap. The engine pauses at the push's
    first tensor instead of at its commit and serves the new weights only once the commit comes; a push
    cut before the commit is rolled back (the weights this replica keeps are loaded again). Needs
    ``delta_pushes`` (the rollback loads the kept weights): a replica that keeps none loads at the commit.
    ``auto``: pushes in ``wait`` and ``abort`` mode (those pause the engine anyway), and those of any mode
    that find nothing running (a trainer that waits for its pushes: requests sent during the transfer
    wait for the commit); ``on``: every push (``keep`` and ``resume`` requests then wait out the
    transfer); ``off``: never (docs/guides/weight-sync.md)."""

    max_lora_rank: int | None = Field(None, ge=1)
    """Serve LoRA adapter pushes (``WeightManifest.lora``) of up to this rank: vLLM's LoRA support is
    switched on (``enable_lora``; on CPU it also switches vLLM's compilation off). One of vLLM's
    allowed values (1, 8, 16, 32, 64, 128, 256, 320, 512). ``None``: adapter pushes are refused
    (FAILED_PRECONDITION)."""

    max_loras: int = Field(2, ge=2)
    """With ``max_lora_rank``: adapter versions vLLM may run in one batch. At least 2, so requests that
    started on the previous adapter finish on it while new ones run on the pushed one."""

    max_runs: int = Field(0, ge=0, le=64)
    """With ``max_lora_rank``: named runs this replica serves at once (``GenerateRequest.run_id``), each
    on the base weights with its own LoRA adapter (docs/concepts/many-runs.md). vLLM then runs up to
    ``max_runs + max_loras`` adapters in one batch, so that every run's current adapter fits with older
    versions requests still finish on. 0: the replica serves its own run only."""

    run_idle_seconds: float = Field(600.0, ge=0)
    """With ``max_runs``: a named run with no call in flight and none (nor a push) for this long gives its
    slot to a new run that finds every slot taken; its collector re-syncs it from its spool should it come
    back. A run with a request running is never ended so."""

    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed verbatim to ``vllm.AsyncEngineArgs``
    (e.g. ``tensor_parallel_size``, ``gpu_memory_utilization``). They override
    the fields above; ``logprobs_mode`` and ``weight_transfer_config`` are
    owned by the engine and may not be set here."""

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_allows(cls, rank: int | None) -> int | None:
        if rank is not None and rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(MAX_LORA_RANKS)} (vLLM's), got {rank}")
        return rank

    @model_validator(mode="after")
    def _runs_need_lora(self) -> "GenerationEngineConfig":
        if self.max_runs and self.max_lora_rank is None:
            raise ValueError("max_runs needs max_lora_rank: the runs sharing a replica are LoRA adapters")
        return self

    @field_validator("engine_kwargs")
    @classmethod
    def _no_owned_engine_kwargs(cls, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(OWNED_ENGINE_KWARGS & engine_kwargs.keys())
        if owned:
            raise ValueError(f"engine_kwargs may not set {owned}: the engine owns them")
        return engine_kwargs

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer directory actually used."""
        return self.tokenizer or self.model


class GenerationConfig(ServiceConfig, GenerationEngineConfig, UpstreamConfig):
    """The generation service: a vLLM engine behind gRPC (engine fields plus the common ones). The
    ``upstream_*`` settings are what a replica presents to its peers when it relays a push to them
    (``GenerationService.RelayWeights``: they take the ``service`` role)."""

    service_name = "generation"

    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """grpc.max_send/receive_message_length; weight pushes arrive in ~1 MiB chunks, so this only bounds prompts."""
