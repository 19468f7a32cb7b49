"""LOAD GENERATOR for benches: a GenerationService replica that answers at once, with no model.

    python bench/loadgen_generation.py --port 0 --port-file /tmp/loadgen.port [--vocab-size 512]
        [--sample-seconds S --max-running R] [--swap-seconds W]

For finding the throughput ceilings of the rest of the data plane (collector, reference, reward,
trajectory, the SDK) in ``bench/`` only — ``bench/dataplane.py`` drives the real services with it.
It is NEVER a stand-in for the generation service in tests: nothing here samples, its "log-probs"
are made up, and its weight pushes change nothing but a counter (and, with ``--swap-seconds``,
take time).

By default it answers at once and a push applies at once. Two flags give it a replica's timing
(``bench/fleet.py``'s "update" part uses them to make the replicas, not the collector, the
bottleneck, and to compare rolling with pause-all weight updates):

* ``--sample-seconds S``: a ``Generate`` call takes S s of simulated service time before its
  samples are sent, at most ``--max-running R`` calls at once (0: no limit); the others queue,
  first come first served. A call is in flight from the moment it is admitted, queued or running.
* ``--swap-seconds W``: applying a push (after its commit message) takes W s, modelled on the
  real engine (``services/generation/vllm_engine.py``, ``apply``/``_swap``/``open_stream``): while
  a swap runs, new calls wait for it to end before they are admitted. The manifest's mode decides
  what happens to the calls in flight: ``WAIT``: they finish first, then the swap; ``ABORT``: they
  end at once, every sample with finish reason ABORT (the tokens done so far); ``KEEP``/``RESUME``
  (and unspecified): they pause and continue after the swap, their samples reporting
  ``policy_version_start`` old and ``policy_version_end`` new, except that a pinned call
  (``policy_version != 0``) is aborted instead, never continued.

It speaks the ``rlfleet.v1.GenerationService`` contract the collector relies on:

* ``Generate``: one ``GenerateResponse`` per sample (``sampling.n`` of them), each
  ``sampling.max_tokens`` long (finish reason LENGTH), built from pre-made token ids and
  behaviour log-probs (a pool drawn once at start), with the request's id, ``sample_index``,
  the sampling parameters echoed, policy versions and (zero) timing. Prompt token ids are
  echoed when the prompt is token ids; a text or chat prompt gets a pre-made prompt of
  ``--prompt-tokens`` ids picked by its hash (no tokenizer: answering costs no model work).
  A request pinned to a version (``policy_version != 0``) that is not the one served when it
  would start (after any swap) fails with ABORTED, naming both versions, as the real engine's.
* ``GetEngineStatus``: version, transports, push limit.
* ``UpdateWeights``: the two-phase push protocol (manifest, grpc chunks or a shm segment that
  must exist, STAGED, commit, APPLIED); the bytes are counted, never loaded. NCCL is refused.
* standard ``grpc.health.v1`` health: SERVING once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import time
import uuid
import zlib
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from rlfleet.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, tensor_pb2, weights_pb2
from rlfleet.wire import encode_tensor

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 64 << 20
SPECIAL_TOKENS = 3
"""Ids below this are the tiny tokenizer's special tokens: never sampled here, so no EOS mid-response."""


class Pool:
    """Pre-made prompts, responses and log-probs, encoded once (answering only copies messages)."""

    def __init__(self, vocab_size: int, prompt_tokens: int, size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size, self.size = vocab_size, size
        self.prompts = [encode_tensor(torch.randint(SPECIAL_TOKENS, vocab_size, (prompt_tokens,),
                                                    generator=generator)) for _ in range(size)]
        self._raw = [(torch.randint(SPECIAL_TOKENS, vocab_size, (4096,), generator=generator),
                      -torch.rand(4096, generator=generator) * 5) for _ in range(size)]
        self._responses: dict[tuple[int, int], tuple[tensor_pb2.Tensor, tensor_pb2.Tensor]] = {}

    def response(self, slot: int, length: int) -> tuple[tensor_pb2.Tensor, tensor_pb2.Tensor]:
        """(token ids, behaviour log-probs) of ``length`` tokens, cached per (slot, length)."""
        key = (slot % self.size, length)
        if key not in self._responses:
            ids, log_probs = self._raw[key[0]]
            reps = -(-length // ids.numel())  # lengths past the raw pool repeat it
            self._responses[key] = (encode_tensor(ids.repeat(reps)[:length].clone()),
                                    encode_tensor(log_probs.repeat(reps)[:length].clone().float()))
        return self._responses[key]


class Call:
    """A ``Generate`` call in flight: admitted (past any swap), queued for a running slot or running."""

    __slots__ = ("pinned", "version_start", "aborted", "wake", "waiter")

    def __init__(self, pinned: bool, version: int):
        self.pinned, self.version_start = pinned, version
        self.aborted = False
        self.wake = asyncio.Event()
        """Set by a swap: a running call looks again at whether it is paused or aborted."""
        self.waiter: asyncio.Future | None = None
        """While queued for a running slot: resolved True (the slot is its) or False (aborted)."""


class RunningSlots:
    """At most ``limit`` calls running (0: no limit); the others wait, first come first served."""

    def __init__(self, limit: int):
        self.limit, self.running = limit, 0
        self.queue: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self, call: Call) -> bool:
        """True once ``call`` runs; False if it was aborted while queued."""
        while self.queue and self.queue[0].done():
            self.queue.popleft()  # aborted or cancelled while queued
        if not self.limit or (self.running < self.limit and not self.queue):
            self.running += 1
            return True
        call.waiter = asyncio.get_running_loop().create_future()
        self.queue.append(call.waiter)
        try:
            return await call.waiter
        except asyncio.CancelledError:
            waiter = call.waiter
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release()  # handed a slot as the caller went away
            raise
        finally:
            call.waiter = None

    def release(self) -> None:
        """A running call ended: its slot goes to the first call still queued."""
        while self.queue:
            waiter = self.queue.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self.running -= 1


class LoadgenServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Answers every RPC from the pool, at once unless ``sample_seconds``/``swap_seconds``; see the module
    docstring."""

    def __init__(self, pool: Pool, max_model_len: int, sample_seconds: float = 0.0, max_running: int = 0,
                 swap_seconds: float = 0.0):
        self.pool, self.max_model_len = pool, max_model_len
        self.sample_seconds, self.swap_seconds = sample_seconds, swap_seconds
        self.version = 0
        self.in_flight = 0
        self.calls: set[Call] = set()
        self.slots = RunningSlots(max_running)
        self.admission = asyncio.Event()
        """Set while no swap runs: a call waits for it before it is admitted (``open_stream``)."""
        self.admission.set()
        self.unpaused = asyncio.Event()
        """Cleared while a keep/resume swap pauses the calls in flight."""
        self.unpaused.set()
        self.call_ended = asyncio.Event()
        self.swap_lock = asyncio.Lock()

    def _prompt(self, prompt: sampling_pb2.Prompt) -> tuple[tensor_pb2.Tensor, int]:
        """The prompt's token ids as a message, and a hash that picks the pre-made response."""
        if prompt.WhichOneof("kind") == "token_ids":
            return prompt.token_ids, zlib.crc32(prompt.token_ids.data)
        key = zlib.crc32(prompt.SerializeToString(deterministic=True))
        return self.pool.prompts[key % self.pool.size], key

    async def Generate(self, request, context):
        params = request.sampling
        n, length = params.n or 1, params.max_tokens or 16
        if not 1 <= length < self.max_model_len or n > 1024:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"sampling: n={n}, max_tokens={length} outside the load generator's limits")
        prompt, key = self._prompt(request.prompt)
        echoed = sampling_pb2.SamplingParams()
        echoed.CopyFrom(params)
        echoed.n = n
        request_id = request.request_id or uuid.uuid4().hex
        while not self.admission.is_set():  # a swap runs: the call starts on the weights it brings
            await self.admission.wait()
        if request.policy_version and request.policy_version != self.version:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"request {request_id} is pinned to policy version {request.policy_version}; "
                                f"this replica serves version {self.version}")
        call = Call(bool(request.policy_version), self.version)
        self.calls.add(call)
        self.in_flight += 1
        try:
            done = await self._serve(call) if self.sample_seconds > 0 else 1.0
            for index in range(n):
                if not call.aborted and not self.unpaused.is_set():
                    await self.unpaused.wait()  # a keep swap while the samples are being sent
                if call.aborted:
                    finish, tokens = sampling_pb2.FINISH_REASON_ABORT, int(length * done)
                else:
                    finish, tokens = sampling_pb2.FINISH_REASON_LENGTH, length
                ids, log_probs = self.pool.response(key + index, tokens)
                yield generation_pb2.GenerateResponse(
                    request_id=request_id, sample_index=index, prompt_token_ids=prompt, response_token_ids=ids,
                    behavior_log_probs=log_probs, finish_reason=finish,
                    policy_version_start=call.version_start, policy_version_end=self.version, sampling=echoed,
                    timing=generation_pb2.SampleTiming())
        finally:
            self.calls.discard(call)
            self.in_flight -= 1
            self.call_ended.set()

    async def _serve(self, call: Call) -> float:
        """``sample_seconds`` of service time on a running slot, paused while a keep swap runs: the
        fraction of it done (1.0: all; less: the call was aborted)."""
        if not await self.slots.acquire(call):
            return 0.0
        loop = asyncio.get_running_loop()
        remaining = self.sample_seconds
        try:
            while True:
                if call.aborted:
                    return 1.0 - remaining / self.sample_seconds
                if not self.unpaused.is_set():
                    await self.unpaused.wait()
                    continue
                call.wake.clear()
                started = loop.time()
                try:
                    await asyncio.wait_for(call.wake.wait(), remaining)
                except asyncio.TimeoutError:
                    return 1.0
                remaining = max(remaining - (loop.time() - started), 0.0)
        finally:
            self.slots.release()

    def _abort(self, call: Call) -> None:
        call.aborted = True
        call.wake.set()
        if call.waiter is not None and not call.waiter.done():
            call.waiter.set_result(False)

    async def _swap(self, version: int, mode: int) -> None:
        """Apply ``version`` (after its commit): admission held, the calls in flight as ``mode`` says,
        ``swap_seconds``, the version moves, admission reopens (``vllm_engine.py``'s ``_swap``)."""
        async with self.swap_lock:
            self.admission.clear()
            try:
                if mode == weights_pb2.UPDATE_MODE_WAIT:
                    while self.calls:
                        self.call_ended.clear()
                        await self.call_ended.wait()
                elif mode == weights_pb2.UPDATE_MODE_ABORT:
                    for call in self.calls:
                        self._abort(call)
                else:  # keep (the default) and resume: paused, continued after the swap; pinned ones aborted
                    self.unpaused.clear()
                    for call in self.calls:
                        if call.pinned:
                            self._abort(call)
                        else:
                            call.wake.set()
                if self.swap_seconds > 0:
                    await asyncio.sleep(self.swap_seconds)
                self.version = version
            finally:
                self.unpaused.set()
                self.admission.set()

    async def GetEngineStatus(self, request, context):
        return generation_pb2.GetEngineStatusResponse(
            model="loadgen", policy_version=self.version, running_requests=self.in_flight,
            max_queued_requests=1 << 20, weight_transports=["grpc", "shm"], weight_transfer_world_size=1,
            max_push_bytes=1 << 40)

    async def UpdateWeights(self, request_iterator, context):
        """Manifest, bytes (counted, not loaded), STAGED + commit when two-phase, the swap, APPLIED."""
        started = time.monotonic()
        requests = request_iterator.__aiter__()
        manifest = (await anext(requests)).manifest
        if not manifest.resync and manifest.version <= self.version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"version {manifest.version} is not greater than {self.version}")
        source = manifest.WhichOneof("source")
        if source == "nccl":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the load generator takes no NCCL pushes")
        if source == "shm" and not os.path.exists(manifest.shm.path):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "shm transport: segment not openable here")
        received = manifest.total_bytes if source == "shm" else 0
        while received < manifest.total_bytes:
            received += len((await anext(requests)).chunk.data)
        receive_seconds = time.monotonic() - started
        if manifest.two_phase:
            yield generation_pb2.UpdateWeightsResponse(version=manifest.version, received_bytes=received,
                                                       receive_seconds=receive_seconds,
                                                       phase=weights_pb2.WEIGHT_PHASE_STAGED)
            commit = await anext(requests)
            if commit.WhichOneof("payload") != "commit" or commit.commit.version != manifest.version:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected the commit of the staged version")
        # Once started, the swap runs to its end even if the caller goes away (as the engine's).
        await asyncio.shield(asyncio.ensure_future(self._swap(manifest.version, manifest.mode)))
        yield generation_pb2.UpdateWeightsResponse(version=self.version, received_bytes=received,
                                                   receive_seconds=receive_seconds,
                                                   phase=weights_pb2.WEIGHT_PHASE_APPLIED,
                                                   engine_weight_version=str(self.version))


async def serve(ns: argparse.Namespace) -> None:
    """Listen, report SERVING, write the port file, run until SIGTERM/SIGINT."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        LoadgenServicer(Pool(ns.vocab_size, ns.prompt_tokens, ns.pool_size), ns.max_model_len,
                        ns.sample_seconds, ns.max_running, ns.swap_seconds), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{ns.host}:{ns.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if ns.port_file:
        tmp = Path(ns.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(ns.port_file)  # readers never see a partial file
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    """Entry point; flags as ``ServiceProcess`` passes them (``--port``, ``--port-file``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--vocab-size", type=int, default=512, help="ids are drawn below this (the tiny model's)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="length of the pre-made prompts")
    parser.add_argument("--pool-size", type=int, default=64, help="distinct pre-made prompts and responses")
    parser.add_argument("--max-model-len", type=int, default=4096, help="max_tokens must stay below this")
    parser.add_argument("--sample-seconds", type=float, default=0.0,
                        help="simulated service time of one Generate call before its samples are sent (0: at once)")
    parser.add_argument("--max-running", type=int, default=0,
                        help="Generate calls running at once; the others queue, FIFO (0: no limit)")
    parser.add_argument("--swap-seconds", type=float, default=0.0,
                        help="time a push takes to apply after its commit; new calls wait for it (0: at once)")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
