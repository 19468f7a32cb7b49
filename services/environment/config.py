"""Configuration of the environment service.

Environments a request may name are the built-in ``tool_calling`` and the ones listed in
``environments``. Import paths are accepted **only** from this config: a remote request can never
make the service import code.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.environment.mcp_tools import MCPServerSpec
from rlfleet.services.environment.sandbox import SandboxLimits

TOOL_CALLING = "tool_calling"
"""The built-in environment's name: ``ToolCallingEnv`` over the service's sandbox and MCP tools."""


class EnvironmentServiceConfig(ServiceConfig):
    """The environment service: multi-turn episodes answered with token-exact observations.

    Env vars are ``RLFLEET_ENVIRONMENT_<FIELD>``; dict and list fields take JSON.
    """

    service_name = "environment"

    port: int = Field(50055, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""

    tokenizer_path: str
    """The policy model's directory (or hub id): its tokenizer and chat template render prompts and
    observations into token ids, so they must be the sampling model's own."""

    environments: dict[str, str] = Field(default_factory=dict)
    """Environments requests may name besides ``tool_calling``, as ``{name: "package.module:Class"}``;
    each class subclasses ``rlfleet.env.Environment`` and is built with no arguments, once per episode.
    Imported at startup: a bad path stops the service before it reports SERVING."""

    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    """``tool_calling``: what one python tool call may use (CPU, wall time, memory, output)."""

    sandbox_per_episode: bool = False
    """``tool_calling``: run an episode's python calls in one sandbox that stays up until the episode
    closes (``episode_sandbox.py``: one bwrap, a fresh process forked in it per call; no process, file
    or Python state of a call reaches the next) and that no other episode uses meanwhile. False: each
    call gets a sandbox of its own for that call alone. Either way the sandbox comes from the pool of
    ready ones (``reuse_sandboxes``). Needs bwrap; without it, or past ``max_episode_sandboxes``, calls
    get a fresh sandbox each (``PythonSandbox``: bwrap and an interpreter started and ended per call)."""

    reuse_sandboxes: bool = True
    """``tool_calling``: a sandbox whose call (or episode) ended is reset (every process in it killed,
    its scratch directory and /tmp emptied, checked clean in /proc) and parked for the next call or
    episode: reused, never shared (a few ms of CPU a call instead of ~25: see the sandbox benchmark
    page, docs/benchmarks/sandbox.md). False: every call (``sandbox_per_episode``: every episode)
    starts a sandbox of its own and ends it."""

    max_episode_sandboxes: int = Field(64, ge=1)
    """Most pooled sandboxes alive at once, held by calls or episodes or parked for the next ones
    (each holds a bwrap and an idle interpreter, ~8 MB); the calls past it get a fresh sandbox each."""

    idle_episode_sandbox_seconds: float = Field(60.0, gt=0)
    """A parked sandbox unused this long is ended."""

    max_tool_calls_in_flight: int | None = Field(None, ge=1)
    """Sandboxed python calls (``tool_calling``'s and every environment's in this process) that run at once;
    past it a call waits for one to end (``sandbox.CallGate``), so that the episodes that end a turn
    together do not start hundreds of sandboxes at once. None: ``sandbox.CALLS_PER_CPU`` (8) per CPU this
    process may run on. The wait does not count against a call's ``sandbox.wall_seconds``; it does count against
    ``step_timeout_seconds``."""

    allow_rlimits_only: bool = False
    """``tool_calling``: when the host has no bwrap sandbox, run snippets with rlimits and an
    unprivileged uid only (they see the host's files and network). False: refuse to start instead."""

    mcp_servers: list[MCPServerSpec] = Field(default_factory=list)
    """``tool_calling``: MCP servers whose tools the model may call, connected at startup and shared by
    every episode (a server that cannot be reached stops the service before it reports SERVING)."""

    max_turns: int = Field(8, ge=1)
    """Assistant turns per episode; an episode still going after this many is ``truncated``."""

    max_tool_calls_per_turn: int = Field(4, ge=1)
    """``tool_calling``: tool calls run per turn; past it the episode is ``truncated``."""

    max_open_episodes: int = Field(1024, ge=1)
    """Episodes open at once; OpenEpisode past it answers RESOURCE_EXHAUSTED (close or wait for the
    idle reaper)."""

    step_timeout_seconds: float = Field(120.0, gt=0)
    """How long an environment's reset or step (or close) may take; past it the episode is ended and the
    call answers DEADLINE_EXCEEDED naming the episode. Bounds the tool calls of a turn, run in sequence."""

    idle_episode_seconds: float = Field(600.0, gt=0)
    """Episodes not stepped (or opened) for this long are closed by a background reaper: a caller that
    died does not hold its slot forever."""

    max_prompt_messages: int = Field(256, ge=1)
    """Most messages in an OpenEpisode prompt."""

    max_message_chars: int = Field(256 * 1024, ge=1)
    """Longest message content, ground truth or metadata value (characters)."""

    max_metadata_entries: int = Field(64, ge=0)
    """Most entries in an OpenEpisode's ``metadata``."""

    max_episode_id_chars: int = Field(256, ge=1)
    """Longest episode id."""

    max_turn_tokens: int = Field(131072, ge=1)
    """Most tokens in one Step's ``token_ids``."""

    @field_validator("environments")
    @classmethod
    def _names_are_free(cls, environments: dict[str, str]) -> dict[str, str]:
        if TOOL_CALLING in environments:
            raise ValueError(f"{TOOL_CALLING!r} is the built-in environment; register yours under another name")
        for name, path in environments.items():
            module, _, attribute = path.partition(":")
            if not name or not module or not attribute:
                raise ValueError(f"environments[{name!r}] = {path!r}: give a name and a 'package.module:Class' path")
        return environments
