"""WeightSwaps: a replica's weight pushes, staged then swapped into vLLM as a new policy version.

A push is staged first (``stage``: version, manifest and the served model checked, memory
given only to a push that passes), its bytes arrive (grpc chunks or an shm segment by the
servicer, an NCCL broadcast by ``receive_nccl``), then ``apply`` swaps it in under the swap
lock: full weights and deltas are loaded by vLLM's weight transfer, a LoRA adapter is added and
made current. Deltas patch the weights this replica keeps (``kept_weights``); adapters are
served by ``served_adapters``. Knows nothing of gRPC; errors are domain exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING

from rlfleet.choices import SWAP_MODES, SwapModeName
from rlfleet.services.common.background import BackgroundTasks
from rlfleet.services.common.errors import Aborted, DataLoss, FailedPrecondition, InvalidArgument
from rlfleet.services.common.watermark import Watermark
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.kept_weights import WeightKeeper
from rlfleet.services.generation.metrics import STREAMED_PUSH_BYTES, WEIGHT_CHECK_SECONDS, WEIGHT_CHECKS
from rlfleet.services.generation.push_validation import TensorSpec, checkpoint_bytes
from rlfleet.services.generation.served_adapters import AdapterSet, ServedAdapter
from rlfleet.services.generation.served_runs import ServedRun, ServedRuns
from rlfleet.services.generation.staging import StagedPush, StreamedLoad
from rlfleet.services.generation.status import EngineState, ReplicaState
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError, shm, weight_delta
from rlfleet.wire.push_rules import check_manifest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class WeightSwaps:
    """Stages weight pushes and swaps them into the replica's vLLM engine, one at a time."""

    def __init__(self, config: GenerationEngineConfig, replica: ReplicaState) -> None:
        self.config = config
        self.replica = replica
        self.checkpoint_specs: dict[str, TensorSpec] = {}
        """The served checkpoint's tensors, read at start: what a full push must match."""
        self.runs = ServedRuns(config.max_runs, config.run_idle_seconds)
        """The named runs sharing this replica, each with its adapters (``served_runs``)."""
        self.adapters = AdapterSet(serials=self.runs.adapter_serials)  # the own run's adapters (max_lora_rank)
        self._kept = WeightKeeper(config.delta_pushes)  # the served weights, for delta pushes
        self._lock = asyncio.Lock()
        self._background = BackgroundTasks()  # rollbacks of streamed pushes whose call ended
        self._streaming: StreamedLoad | None = None  # the streamed push holding the swap lock
        for stage in ("arrived", "loaded"):
            STREAMED_PUSH_BYTES.labels(stage).set_function(lambda stage=stage: self._streamed_bytes(stage))
        self.serial = 0
        """Swaps started; with ``mode``, the latest's, tells a resume swap's aborts from others (``resumes``)."""
        self.mode: SwapModeName | None = None

    def _streamed_bytes(self, stage: str) -> int:
        streamed = self._streaming
        if streamed is None or streamed.ended:
            return 0
        return streamed.watermark.arrived if stage == "arrived" else streamed.watermark.loaded

    def close(self) -> None:
        """Let go of the kept weights and the adapters' directories (the engine is stopping)."""
        self._kept.drop()
        self.adapters.close()
        self.runs.close()

    def resumes(self, swap_serial: int) -> bool:
        """Whether an abort of a vLLM request opened at ``swap_serial`` is a ``resume`` swap's (one
        started since, and it is the latest swap; should an ``abort`` swap start before the abort is
        read, the sample finishes with "abort"): its unfinished samples are continued."""
        return self.serial > swap_serial and self.mode == "resume"

    @property
    def max_push_bytes(self) -> int:
        """Largest weight push accepted: ``max_push_bytes``, or ``max_push_factor`` x the checkpoint's bytes."""
        if self.config.max_push_bytes is not None:
            return self.config.max_push_bytes
        return int(self.config.max_push_factor * checkpoint_bytes(self.checkpoint_specs))

    @property
    def transfer_world_size(self) -> int:
        """Inference workers of this engine (NCCL ranks it takes in an nccl push)."""
        if self.replica.vllm is None:
            return 0
        parallel = self.replica.vllm.vllm_config.parallel_config
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    def shared(self, version: int):
        """The weights this replica serves and keeps, of ``version``, held while a peer is sent them
        (``WeightKeeper.shared``; an async context manager)."""
        return self._kept.shared(version)

    async def vllm_version(self) -> str:
        """The weight version vLLM itself reports (``get_weight_version``)."""
        return await self.replica.require().get_weight_version()

    # ------------------------------------------------------------------ staging

    def stage(self, manifest: weights_pb2.WeightManifest, max_bytes: int | None = None) -> StagedPush:
        """First phase of a push: check version and manifest, prepare where the bytes go.

        The manifest is checked against the served model and ``max_bytes``
        (default ``max_push_bytes``) before any memory is given to it. Nothing
        touches the engine; the caller fills a grpc push's segment, then
        ``apply``s or ``close``s the staged push."""
        self.replica.takes_pushes()
        if manifest.run_id:
            self._check_run_push(manifest)
        else:
            self._check_own_push(manifest)
        check_manifest(manifest, "collector")
        kept = None
        if manifest.HasField("lora"):
            self._check_adapter(manifest)
        elif weight_delta.is_delta(manifest):
            kept = self._delta_base(manifest)
        return StagedPush.begin(manifest, self.checkpoint_specs,
                                self.max_push_bytes if max_bytes is None else max_bytes, kept)

    def _check_run_push(self, manifest: weights_pb2.WeightManifest) -> None:
        """A named run's push: an adapter (its base weights are the replica's, shared), newer than the run's
        version (unless a re-sync)."""
        if not manifest.HasField("lora"):
            raise FailedPrecondition(f"run {manifest.run_id}: a push of a run sharing this replica must be a LoRA "
                                     f"adapter push; a run that trains full weights gets replicas of its own")
        self._check_adapter(manifest)
        run = self.runs.take(manifest.run_id, self.replica.vllm, manifest.run_name)
        if not manifest.resync:
            run.check_version(manifest.version)

    def _check_own_push(self, manifest: weights_pb2.WeightManifest) -> None:
        """The replica's own run: newer than its version (unless a re-sync); while named runs share the
        replica, only an adapter push in ``keep`` mode (nothing of theirs changes or pauses)."""
        if not manifest.resync:
            self.replica.check_version(manifest.version)
        if self.runs and not (manifest.HasField("lora") and manifest.mode == weights_pb2.UPDATE_MODE_KEEP):
            raise FailedPrecondition(f"runs {', '.join(self.runs.names())} share this replica: a push of its own "
                                     f"run may not replace the base weights their adapters sit on, nor pause "
                                     f"them (only a keep-mode adapter push)")

    def _check_adapter(self, manifest: weights_pb2.WeightManifest) -> None:
        """FAILED_PRECONDITION for an adapter push this replica cannot serve (started without LoRA, or
        with a smaller ``max_lora_rank``)."""
        if self.config.max_lora_rank is None:
            raise FailedPrecondition("adapter push refused: this replica serves no LoRA adapters (start it with "
                                     "max_lora_rank)")
        if manifest.lora.rank > self.config.max_lora_rank:
            raise FailedPrecondition(f"adapter push refused: its rank {manifest.lora.rank} is above this replica's "
                                     f"max_lora_rank {self.config.max_lora_rank}")

    def _delta_base(self, manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
        """The full manifest of the kept weights a delta push patches; FAILED_PRECONDITION (the
        collector then re-syncs this replica with a full push) unless they are its base version's."""
        base = manifest.delta.base_version
        if not self.config.delta_pushes:
            raise FailedPrecondition(f"delta push on version {base} refused: this replica keeps no weights to "
                                     f"patch (delta_pushes is off); it takes full pushes")
        kept = self._kept.manifest
        if base != self.replica.policy_version or kept is None or kept.version != base:
            held = f"keeps the weights of version {kept.version}" if kept is not None else "keeps no weights"
            raise FailedPrecondition(f"delta push on version {base}: this replica serves version "
                                     f"{self.replica.policy_version} and {held}; it needs a full push")
        return kept

    async def receive_nccl(self, staged: StagedPush) -> None:
        """Stage an nccl push: join the trainer's NCCL group (a collective: the trainer and every
        other replica join at the same time), receive its broadcast into the staged segment, leave.

        One group per push: a replica that went away never wedges the next one. Unverified: no
        GPU vLLM runs where this was written (see docs/guides/weight-sync.md)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        engine = self.replica.require()
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"nccl": staged.nccl}))
        try:
            written = await engine.collective_rpc("rlfleet_stage_nccl_push", args=(staged.update_info(),))
        finally:
            await engine.shutdown_weight_transfer_engine()
        if max(written, default=0) != staged.push.total_bytes:
            raise Aborted(f"nccl push: {max(written, default=0)} of {staged.push.total_bytes} bytes staged; "
                          f"nothing applied")
        staged.push.received = staged.push.total_bytes

    # ------------------------------------------------------------------ swapping

    async def apply(self, staged: StagedPush) -> None:
        """Second phase: swap the staged weights in as policy ``staged.version``.

        - ``wait``: hold new requests, let in-flight ones finish, swap, resume.
        - ``abort``: abort in-flight requests (they finish with "abort"), swap.
        - ``keep``: freeze in-flight requests, swap, resume them; their KV is
          recomputed with the new weights (vLLM preempts them:
          ``clear_cache=True``) and their samples report
          ``policy_version_start != policy_version_end``.
        - ``resume``: abort in-flight requests, swap, and let each ``generate``
          call continue its unfinished samples as new requests (prompt + the
          tokens sampled so far, the budget left) on the new weights; callers
          see them finish normally with spans split at the swap. Requests with
          stop strings finish with "abort" instead (see ``resume.py``).

        ``keep`` and ``resume`` swaps leave the engine SERVING (new requests
        wait for the swap); ``wait`` and ``abort`` ones report SWAPPING.

        Once started the swap runs to completion even if the caller goes away
        (a half-done pause/load/resume would wedge the engine). The version
        moves only after vLLM loaded the weights and reports their version; if
        loading fails inside vLLM the engine turns FAILED (not serving) until
        a later push succeeds.
        """
        engine = self.replica.takes_pushes()
        if staged.streamed is not None:
            await self._commit_streamed(engine, staged)
            return
        staged.push.finish()
        if self.config.verify_weights:
            await self._verify_staged(staged)
        if staged.manifest.run_id:
            await self._apply_run_adapter(engine, staged, self.runs.take(staged.manifest.run_id, engine, staged.manifest.run_name))
            return
        await self._lock.acquire()
        try:
            if not staged.resync:
                self.replica.check_version(staged.version)
        except BaseException:
            self._lock.release()
            raise
        await _to_its_end(staged, self._apply_locked(engine, staged))

    async def _apply_locked(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """``apply``'s part under the swap lock, which it holds on entry and lets go of at the end."""
        try:
            if staged.adapter is not None:
                await self._apply_adapter(engine, staged)
                return
            if staged.delta is not None:
                await self._patch_kept(staged)
            # Requests pinned to an adapter cannot go on with other weights under it: "keep" resumes them;
            # requests bound to a version are never continued (resume ends them with "abort").
            bound = self.adapters.current is not None or self.replica.version_bound_requests
            mode = "resume" if staged.mode == "keep" and bound else staged.mode
            await self._swap(engine, staged.version, mode, staged.transport, lambda: self._load_weights(engine, staged))
            if staged.delta is None:
                segment, staged.segment = staged.segment, None
                self._kept.keep(staged.version, staged.manifest, segment)
        finally:
            self._lock.release()

    @staticmethod
    async def _verify_staged(staged: StagedPush) -> None:
        """The commit's check: the staged bytes against the manifest's fingerprints, before anything is
        applied (a mismatch refuses the commit; the old weights serve on)."""
        started = time.perf_counter()
        try:
            await asyncio.to_thread(staged.verify)
        except InvalidArgument as err:
            WEIGHT_CHECKS.labels("staged", "mismatch").inc()
            logger.error("weight push of version %d refused at the commit: %s", staged.version, err)
            raise
        finally:
            WEIGHT_CHECK_SECONDS.labels("staged").observe(time.perf_counter() - started)
        WEIGHT_CHECKS.labels("staged", "ok").inc()

    async def update(self, version: int, named_tensors, mode: SwapModeName = "wait",
                     base_version: int | None = None, lora: weights_pb2.LoraAdapter | None = None) -> None:
        """Stage ``(name, tensor)`` pairs in a segment and apply them (in-process callers and tests);
        ``base_version`` set: a delta push on that version (only the tensors that changed); ``lora``: an
        adapter push (the pairs are its factors)."""
        if mode not in SWAP_MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(SWAP_MODES)}, got {mode!r}")
        from rlfleet.wire.push_messages import iter_push_messages

        pairs = list(named_tensors)
        _, manifest = next(iter_push_messages(pairs, version=version, checksum_algo=None,
                                              mode=SWAP_MODES[mode]))
        if base_version is not None:
            manifest.delta.base_version = base_version
        if lora is not None:
            manifest.lora.CopyFrom(lora)
        staged = self.stage(manifest)
        try:
            shm.write_tensors(staged.segment, [tensor for _, tensor in pairs])
            staged.push.received = staged.push.total_bytes
            await self.apply(staged)
        finally:
            staged.close()

    async def _apply_adapter(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """An adapter push's commit: added to vLLM, then current. ``keep``: nothing pauses (requests
        running go on with the adapter they started on); other modes as for weights."""
        config, _ = staged.adapter
        adapter = await _load_adapter(self.adapters, engine, staged, "the")
        if staged.mode == "keep":
            self.adapters.switch(engine, adapter)
            self.replica.policy_version = staged.version
            logger.info("serving adapter version %d (rank %d, keep: nothing paused)", staged.version, config.rank)
            return

        async def switch() -> None:
            self.adapters.switch(engine, adapter)
        try:
            await self._swap(engine, staged.version, staged.mode, staged.transport, switch)
        except BaseException:
            if self.adapters.current is not adapter:
                await self.adapters.discard(adapter, engine)
            raise

    async def _apply_run_adapter(self, engine: AsyncLLM, staged: StagedPush, run: ServedRun) -> None:
        """A named run's adapter push: loaded, then made the run's current one; its mode acts on the run's
        requests alone and vLLM is not paused (``served_runs``)."""
        config, _ = staged.adapter
        async with run.lock:
            if not staged.resync:
                run.check_version(staged.version)
            adapter = await _load_adapter(run.adapters, engine, staged, f"run {run.run_id}'s")
            await asyncio.shield(self._switch_run(engine, run, adapter, staged.mode))
        logger.info("run %s serves adapter version %d (rank %d, %s)", run.run_id, staged.version, config.rank,
                    staged.mode)

    @staticmethod
    async def _switch_run(engine: AsyncLLM, run: ServedRun, adapter, mode: SwapModeName) -> None:
        if mode == "keep":
            run.adapters.switch(engine, adapter)
            return
        run.admission_open.clear()
        try:
            run.serial += 1
            run.mode = mode
            if mode == "wait":
                await run.drained()
            else:  # abort; resume: the rollouts continue what was aborted once admission opens
                await engine.abort(list(run.requests))
            run.adapters.switch(engine, adapter)
        finally:
            run.admission_open.set()

    async def _patch_kept(self, staged: StagedPush) -> None:
        """A delta's commit: its bytes into the kept weights, which the swap then loads from."""
        kept = await self._kept.current()
        base = staged.manifest.delta.base_version
        if kept is None or kept.version != base or self.replica.policy_version != base:
            raise FailedPrecondition(f"delta push on version {base}: this replica now serves version "
                                     f"{self.replica.policy_version}; it needs a full push")
        await asyncio.to_thread(self._kept.patch, kept, staged.manifest, staged.delta, staged.segment.buffer)
        staged.loads_from = kept

    async def _load_weights(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """A weight push's part of a swap: vLLM loads it, and reports its version; any adapter goes."""
        await self._load(engine, staged.update_info(self.config.verify_weights), staged.version)
        await self._serve_loaded(engine, staged.version)

    async def _load(self, engine: AsyncLLM, info: dict, version: int) -> None:
        """vLLM loads the weights ``info`` names (``transfer.RlfleetUpdateInfo``) as ``version``, then its
        workers' check of what they loaded (``verify_weights``)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        await engine.finish_weight_update(weight_version=str(version))
        if info.get("verify"):
            await self._check_loaded(engine, version)

    async def _serve_loaded(self, engine: AsyncLLM, version: int) -> None:
        """New weights loaded as ``version``: the prefix cache emptied (computed with others), vLLM's own
        version checked, no adapter left over them."""
        if not await engine.reset_prefix_cache():
            raise RuntimeError("prefix cache reset failed after the swap")
        engine_version = await engine.get_weight_version()
        if engine_version != str(version):
            raise RuntimeError(f"engine reports weight version {engine_version!r} after applying {version}")
        self.adapters.switch(engine, None)

    @staticmethod
    async def _check_loaded(engine: AsyncLLM, version: int) -> None:
        """What each worker's load check found (``transfer.LoadCheck``): DATA_LOSS naming the parameters whose
        values in the engine differ from the tensors loaded into them (the swap then leaves the replica
        failed: it serves nothing until a push re-syncs it)."""
        found = [result for result in await engine.collective_rpc("rlfleet_load_check") if result is not None]
        WEIGHT_CHECK_SECONDS.labels("engine").observe(max((result["seconds"] for result in found), default=0.0))
        wrong = "; ".join(result["wrong"] for result in found if result["wrong"])
        if wrong:
            WEIGHT_CHECKS.labels("engine", "mismatch").inc()
            raise DataLoss(f"version {version}: weights not as pushed: {wrong}")
        WEIGHT_CHECKS.labels("engine", "ok").inc()
        logger.debug("version %d: %d parameters in the engine as pushed", version,
                     sum(result["checked"] for result in found))

    async def _swap(self, engine: AsyncLLM, version: int, mode: SwapModeName, transport: str,
                    load: Callable[[], Awaitable[None]]) -> None:
        """Pause, ``load()`` (weights or an adapter), move the version, resume (see ``apply``)."""
        started = time.monotonic()
        async with self._swapping(engine, version):
            await self._pause(engine, mode)
            await load()
        logger.info("swapped to policy version %d (%s, %s) in %.3fs",
                    version, mode, transport, time.monotonic() - started)

    @contextlib.asynccontextmanager
    async def _swapping(self, engine: AsyncLLM, version: int):
        """Around a swap's pause and load: then the version moves and generation resumes; on any failure the
        replica turns failed (``_failed``); admission reopens either way."""
        try:
            yield
            self.replica.policy_version = version
            await engine.resume_generation()
        except BaseException:
            self._failed(version)
            raise
        finally:
            self.replica.admission_open.set()
        self.replica.move_to(EngineState.SERVING)

    async def _pause(self, engine: AsyncLLM, mode: SwapModeName) -> None:
        """A swap's start: admission closed, what runs paused as ``mode`` says (see ``apply``)."""
        self.replica.admission_open.clear()
        self.serial += 1
        self.mode = mode
        if mode not in ("keep", "resume"):
            self.replica.move_to(EngineState.SWAPPING)
        # clear_cache=True also preempts kept requests so their KV is
        # rebuilt with the new weights when they resume. A resume swap
        # aborts in vLLM; the generate calls continue their samples.
        await engine.pause_generation(mode="abort" if mode == "resume" else mode, clear_cache=True)

    def _failed(self, version: int) -> None:
        """A swap that failed: the weights may be half-written, never serve from them (nor patch what was kept)."""
        self._kept.drop()
        self.replica.move_to(EngineState.FAILED)
        logger.exception("weight swap to version %d failed; engine marked failed", version)

    # ------------------------------------------------------------------ streamed apply

    def _streamable(self, staged: StagedPush) -> bool:
        """Whether ``streamed_apply`` loads ``staged`` as its bytes arrive: a full push of the replica's own
        run whose bytes are still coming (grpc chunks, a relay, or a segment its sender still writes), which
        the setting streams (``auto``: a mode that pauses what runs anyway, or nothing runs)."""
        setting = self.config.streamed_apply
        arrives = staged.arriving is not None or (staged.transport in ("grpc", "relay") and staged.push.sink is not None)
        if setting == "off" or not arrives or staged.delta is not None or staged.adapter is not None \
                or staged.manifest.run_id:
            return False
        return setting == "on" or staged.mode in ("wait", "abort") or not self.replica.requests_in_flight

    async def stream(self, staged: StagedPush) -> StreamedLoad | None:
        """Start loading ``staged`` into vLLM as its bytes arrive, if it is streamed (``_streamable``, and
        this replica keeps the weights its engine holds, to roll back to; an adapter served on them stays
        served): the engine pauses, each worker loads a tensor once its bytes are in (``Watermark``).
        ``loaded`` then waits for the load and checks the bytes; the commit (``apply``) resumes on the new
        weights, ``roll_back`` on the kept ones. None: the push loads at its commit, as any other."""
        if not self._streamable(staged):
            return None
        kept = await self._kept.current()  # what the engine holds: the last full push, deltas patched in
        if kept is None or kept.dropped or staged.push.received:
            return None
        streamed = StreamedLoad(Watermark.create(), kept)
        staged.streamed = streamed
        staged.push.progress = streamed.watermark.advance
        streamed.task = asyncio.ensure_future(self._load_streamed(staged))
        return streamed

    async def _load_streamed(self, staged: StagedPush) -> None:
        """Under the swap lock (held until the commit or the rollback): pause, load what arrives."""
        streamed, engine = staged.streamed, self.replica.takes_pushes()
        await self._lock.acquire()
        streamed.locked = True
        self._streaming = streamed
        if streamed.watermark.cut:  # the push ended while it waited for the lock: nothing to pause for
            raise Aborted(f"version {staged.version}: the push ended before its streamed load began; nothing applied")
        if streamed.kept.dropped or self._kept.kept is not streamed.kept:
            raise FailedPrecondition(f"version {staged.version}: the weights this replica kept to roll back to "
                                     f"went while the push waited for the swap; push it again")
        streamed.kept.shares += 1  # the rollback loads it: not closed under it (a full push replaces it at the commit)
        streamed.shares_kept = True
        if not staged.resync:
            self.replica.check_version(staged.version)
        bound = self.adapters.current is not None or self.replica.version_bound_requests
        mode = "resume" if staged.mode == "keep" and bound else staged.mode
        streamed.mode = mode
        streamed.paused = True  # from the pause's first step (admission closed): a rollback resumes
        await self._pause(engine, mode)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = staged.update_info(self.config.verify_weights)
        info["watermark_path"] = streamed.watermark.path
        await engine.start_weight_update()
        try:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        finally:
            streamed.touched = True
            complete = staged.push.complete and not streamed.watermark.cut
            await engine.finish_weight_update(
                weight_version=str(staged.version if complete else self.replica.policy_version))
        if not complete:
            raise Aborted(f"version {staged.version}: the push was cut after {staged.push.received} of "
                          f"{staged.push.total_bytes} bytes; nothing applied")
        if self.config.verify_weights:
            await self._check_loaded(engine, staged.version)

    async def loaded(self, staged: StagedPush) -> None:
        """A streamed push, every byte arrived: its checksum and fingerprints checked (beside the load's
        end), the load finished. The engine then holds the new weights, paused until the commit; on any
        error the call's ``end`` rolls back."""
        streamed = staged.streamed
        staged.push.finish()
        streamed.watermark.advance(staged.push.received)
        # Shielded: the call's cancel must not cancel the load mid-way (the rollback waits for it to stop).
        checks = [asyncio.shield(streamed.task)]
        if self.config.verify_weights:
            checks.append(asyncio.ensure_future(self._verify_staged(staged)))
        results = await asyncio.gather(*checks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _commit_streamed(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """A streamed push's commit: vLLM holds its weights already; the version moves, generation resumes.
        Once begun it runs to its end even if the call goes (as ``apply``'s swap does): no rollback then."""
        streamed, task = staged.streamed, staged.streamed.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            raise FailedPrecondition(f"version {staged.version}: committed before its streamed load ended")
        streamed.committed = True
        await _to_its_end(staged, self._serve_streamed(engine, staged))

    async def _serve_streamed(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """The commit's swap: the version moves, generation resumes, the push's segment is kept."""
        streamed, version = staged.streamed, staged.version
        try:
            async with self._swapping(engine, version):
                await self._serve_loaded(engine, version)
        finally:
            streamed.end(self._lock)
        segment, staged.segment = staged.segment, None
        self._kept.keep(version, staged.manifest, segment)
        logger.info("swapped to policy version %d (%s, %s, streamed: loaded as it arrived) in %.3fs",
                    version, streamed.mode, staged.transport, time.monotonic() - streamed.started)

    def end(self, staged: StagedPush) -> None:
        """A push's call ends (committed or not): a streamed load not committed is rolled back, in the
        background (the call may be gone; the swap lock orders the rollback before the next push)."""
        if staged.streamed is not None and not staged.streamed.committed:
            staged.streamed.watermark.cut_off()  # now: a load still waiting for the lock must not begin
            self._background.start(self.roll_back(staged), f"rollback of weight version {staged.version}")

    async def roll_back(self, staged: StagedPush) -> None:
        """A streamed push that ends without its commit (cut, refused by a check, or decided against):
        the worker stops loading, the kept weights are loaded again, generation resumes on them. A
        rollback that fails leaves the replica failed (the collector re-syncs it)."""
        streamed = staged.streamed
        if streamed is None or streamed.committed:
            return
        streamed.watermark.cut_off()
        try:
            await asyncio.wait({streamed.task})
            error = None if streamed.task.cancelled() else streamed.task.exception()
            if error is not None and not isinstance(error, Aborted):
                logger.warning("streamed load of version %d failed: %s", staged.version, error)
            if not streamed.paused:
                return
            engine = self.replica.takes_pushes()
            version = self.replica.policy_version
            async with self._swapping(engine, version):  # the version it served, resumed
                if streamed.touched:  # the kept weights again; an adapter served over them stays
                    await self._load(engine, streamed.kept.update_info(verify=self.config.verify_weights), version)
                    if not await engine.reset_prefix_cache():
                        raise RuntimeError("prefix cache reset failed after the rollback")
            loaded = streamed.watermark.loaded
            logger.info("version %d not committed: rolled back to version %d in %.3fs (%s of its %d bytes; the "
                        "kept weights loaded again)", staged.version, version, time.monotonic() - streamed.started,
                        f"{loaded} loaded" if loaded else "none loaded", staged.push.total_bytes)
        finally:
            streamed.end(self._lock)


async def _to_its_end(staged: StagedPush, work: Coroutine) -> None:
    """``work``, a push's apply once begun, runs to its end even if the call goes: a half-done pause, load or
    resume would wedge the engine, and the kept weights must follow what the engine holds (a streamed push's
    rollback loads them). The call's ``close`` of ``staged`` waits for it (``StagedPush.applying``: the
    apply reads the segment); its failures are logged where they happen."""
    staged.applying = asyncio.ensure_future(work)
    staged.applying.add_done_callback(lambda task: task.cancelled() or task.exception())
    await asyncio.shield(staged.applying)


async def _load_adapter(adapters: AdapterSet, engine: AsyncLLM, staged: StagedPush, whose: str) -> ServedAdapter:
    """``staged``'s adapter added to vLLM in ``adapters`` (not current yet). InvalidArgument naming ``whose``
    adapter when vLLM refuses it: nothing changed, the replica (or the run) serves on."""
    config, names = staged.adapter
    try:
        return await adapters.load(engine, staged.version, config, names, staged.push.dtypes, staged.push.shapes,
                                   staged.segment.buffer)
    except (InvalidArgument, FailedPrecondition, WireError):
        raise
    except Exception as err:
        raise InvalidArgument(f"vLLM refused {whose} adapter of version {staged.version}: {err}") from None
