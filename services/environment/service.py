"""The environment service: ``Episodes`` behind gRPC, with the shared sandbox, MCP tools and idle reaper."""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Callable

import grpc

from rlfleet.env import Environment
from rlfleet.services.common.errors import StartupError, Unavailable
from rlfleet.services.common.server import Service
from rlfleet.services.environment.config import TOOL_CALLING, EnvironmentServiceConfig
from rlfleet.services.environment.episode_sandbox import EpisodeSandboxes
from rlfleet.services.environment.metrics import EPISODE_SANDBOXES, SANDBOX_ISOLATION
from rlfleet.services.environment.open_episodes import Episodes, OpenEpisodeLimits
from rlfleet.services.environment.mcp_tools import MCPTools, ToolNameCollision
from rlfleet.services.environment.rendering import ChatRenderer
from rlfleet.services.environment.sandbox import GATE, PythonSandbox, SandboxUnavailable
from rlfleet.services.environment.servicer import EnvironmentServicer
from rlfleet.services.environment.tool_env import ToolCallingEnv
from rlfleet.v1 import environment_pb2, environment_pb2_grpc

log = logging.getLogger("rlfleet.environment")


class EnvironmentService(Service[EnvironmentServiceConfig]):
    """Probes the sandbox, connects the MCP servers, imports the environments and loads the tokenizer
    in :meth:`start`; a setting that cannot work stops it there (``StartupError``)."""

    service_names = (environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name,)

    def __init__(self, config: EnvironmentServiceConfig):
        super().__init__(config)
        self.sandbox = PythonSandbox(config.sandbox, allow_rlimits_only=config.allow_rlimits_only)
        GATE.configure(config.max_tool_calls_in_flight)
        self.episode_sandboxes = pool = EpisodeSandboxes(self.sandbox, config.max_episode_sandboxes,
                                                         config.idle_episode_sandbox_seconds, config.reuse_sandboxes)
        EPISODE_SANDBOXES.labels(state="idle").set_function(lambda: len(pool.idle))
        EPISODE_SANDBOXES.labels(state="held").set_function(lambda: pool.live - len(pool.idle))
        self.mcp_tools: MCPTools | None = None
        self._episodes: Episodes | None = None

    def torch_threads(self) -> int:
        return 1  # tensors here are one turn's token ids

    def add_to_server(self, server: grpc.aio.Server) -> None:
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(
            EnvironmentServicer(self.episodes, self.config), server)

    def episodes(self) -> Episodes:
        """The open episodes; UNAVAILABLE until started, FAILED_PRECONDITION once the service failed."""
        self.check_working()
        if self._episodes is None:
            raise Unavailable("the environment service is starting")
        return self._episodes

    async def start(self) -> None:
        config = self.config
        factories = {name: _import_environment(name, path) for name, path in config.environments.items()}
        try:
            isolation = await self.sandbox.probe()
        except SandboxUnavailable as exc:
            raise StartupError(f"sandbox: the tool_calling environment's python tool cannot run: {exc}"
                               + ("" if config.allow_rlimits_only else
                                  " (allow_rlimits_only=true accepts rlimits without bwrap, a weaker isolation)"))
        SANDBOX_ISOLATION.labels(isolation=isolation).set(1)
        if config.mcp_servers:
            try:
                self.mcp_tools = await MCPTools.connect(config.mcp_servers)
            except Exception as exc:  # any server that cannot be reached or listed: refuse, naming it
                raise StartupError(f"mcp_servers: {type(exc).__name__}: {exc}") from exc
        factories[TOOL_CALLING] = self._tool_calling_factory()
        try:
            factories[TOOL_CALLING]()  # an MCP tool named "python" is refused here, not per episode
        except ToolNameCollision as exc:
            raise StartupError(f"mcp_servers: {exc}") from exc
        renderer = await asyncio.to_thread(_load_renderer, config.tokenizer_path)
        limits = OpenEpisodeLimits(config.max_turns, config.max_open_episodes, config.step_timeout_seconds,
                               config.idle_episode_seconds)
        self._episodes = Episodes(renderer, factories, limits)
        self.supervise(self._reap_idle_episodes(), "idle episode reaper")
        log.info("environments ready", extra={"environments": sorted(factories), "sandbox": isolation,
                                              "mcp_tools": [tool.name for tool in (self.mcp_tools.list()
                                                                                   if self.mcp_tools else [])]})

    def _tool_calling_factory(self) -> Callable[[], Environment]:
        config = self.config

        def build() -> Environment:
            if config.sandbox_per_episode:
                sandbox = self.episode_sandboxes.episode()
            else:  # each call a sandbox of its own: from the pool, or started for it alone
                sandbox = self.episode_sandboxes if config.reuse_sandboxes else self.sandbox
            return ToolCallingEnv(sandbox, self.mcp_tools, max_turns=config.max_turns,
                                  max_tool_calls_per_turn=config.max_tool_calls_per_turn)

        return build

    async def _reap_idle_episodes(self) -> None:
        # A quarter of the idle time: an idle episode lives at most 1.25x idle_episode_seconds.
        interval = min(max(self.config.idle_episode_seconds / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            await self._episodes.close_idle()

    async def stop(self) -> None:
        # The server has already drained in-flight RPCs (grace period).
        await self.stop_supervised()
        if self._episodes is not None:
            await self._episodes.close_all()
        await self.episode_sandboxes.close()
        if self.mcp_tools is not None:
            await self.mcp_tools.aclose()


def _import_environment(name: str, path: str) -> Callable[[], Environment]:
    """The class ``path`` names, checked to be an ``Environment``; ``StartupError`` naming the setting."""
    setting = f"environments[{name!r}] = {path!r}"
    module_name, _, attribute = path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raised at import
        raise StartupError(f"{setting}: cannot import it: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise StartupError(f"{setting}: not a subclass of rlfleet.env.Environment")
    return found


def _load_renderer(path: str) -> ChatRenderer:
    try:
        renderer = ChatRenderer.from_pretrained(path)
    except Exception as exc:  # OSError, ValueError ...: whatever transformers says about the directory
        raise StartupError(f"tokenizer_path {path!r}: cannot load a tokenizer: {type(exc).__name__}: {exc}") from exc
    if not renderer.tokenizer.chat_template:
        raise StartupError(f"tokenizer_path {path!r}: the tokenizer has no chat template")
    return renderer
