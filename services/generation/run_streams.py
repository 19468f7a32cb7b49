"""What a ``Rollout`` of a named run sees of its engine (``rollout.RolloutHost``): the run's version, its
vLLM requests on the run's adapter, its pushes' resumes, and its tokens counted (``served_runs``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from rlfleet.services.common.errors import Aborted
from rlfleet.services.generation.served_adapters import held_while_read
from rlfleet.services.generation.served_runs import ServedRun

if TYPE_CHECKING:
    from rlfleet.services.generation.vllm_engine import GenerationEngine


class RunHost:
    """A named run's face of the engine, for its rollouts."""

    def __init__(self, engine: GenerationEngine, run: ServedRun) -> None:
        self._engine = engine
        self._run = run

    @property
    def policy_version(self) -> int:
        return self._run.version

    async def open_stream(self, prompt_token_ids: list[int], params: Any, request_id: str,
                          required_version: int | None = None) -> tuple[AsyncGenerator[Any, None], int, int]:
        """``GenerationEngine.open_stream`` for the run: on its adapter (none at its version 0: the base
        weights), admitted once no push of the run (and no swap of the replica) holds admission, and pinned
        to the run's version then."""
        run, replica = self._run, self._engine.replica
        swap_serial = run.serial
        await run.admission_open.wait()
        await replica.admission_open.wait()
        engine = replica.require()
        if required_version is not None and required_version != run.version:
            raise Aborted(f"request {request_id} is pinned to run {run.run_id}'s policy version {required_version}; "
                          f"this replica serves the run's version {run.version}")
        adapter = run.adapters.pin()
        version = run.version if adapter is None else adapter.version
        stream = engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id,
                                 lora_request=None if adapter is None else adapter.request)

        def closed() -> None:
            run.closed(request_id)
            if adapter is not None:
                run.adapters.unpin(engine, adapter)

        # Counted as the run's (what its ``wait`` and ``abort`` pushes act on) from its first read to its
        # end, and as a user of ``adapter`` until then.
        return held_while_read(stream, closed, lambda: run.opened(request_id)), swap_serial, version

    def resumes(self, swap_serial: int) -> bool:
        return self._run.resumes(swap_serial)

    def count_tokens(self, num_tokens: int, now: float, first: bool) -> None:
        self._run.generated_tokens += num_tokens
        self._engine.count_tokens(num_tokens, now, first)

    def count_resume(self, carried_tokens: int) -> None:
        self._engine.count_resume(carried_tokens)
