"""Many runs on one replica: K LoRA runs sharing one generation replica, against one run alone.

    .venv/bin/python bench/multitenant.py [--rounds 5] [--calls 12] [--n 4] [--max-tokens 32]

One real generation service process (the tiny model, LoRA up to rank 8, ``max_runs`` 8) serves runs
``run-0`` ... ``run-7``, each with an adapter of its own (seeded random rank-8 factors on every linear
layer, pushed as version 1). Every round runs each arm once, in turn, so that load from elsewhere on a
shared machine hits them alike; the table shows medians over rounds.

* **K runs** (K = 1, 2, 4, 8): each run sends the same ``--calls`` Generate calls at once (GRPO groups
  of ``--n`` samples of exactly ``--max-tokens`` tokens from the same prompts), so every run has work
  waiting from start to end. ``aggregate_over_single_run``: the K runs' samples per second over one run's
  alone, in the same round. The calls are sent in turn (one of each run, then the next of each).
  ``jain_fairness``: Jain's index of the runs' sampled tokens (the replica's count per run,
  ``GetEngineStatus.runs``) from the first call done anywhere (the batch's first fill is over) to the
  first run done (every run had calls waiting all along); 1 is an even split.
* **Weights 1:2:4**: three runs, the same work, ``share_weight`` 1, 2 and 4. Each run's share of the
  sampled tokens in the same window, over its weight's share (1/7, 2/7, 4/7);
  ``weighted_share_error`` is the largest distance of those from 1.
* **Push impact**: run B keeps ``--concurrency`` calls in flight for ``--phase-seconds``, once alone and
  once while run A pushes a new adapter version (``keep`` mode) every ``--push-interval`` seconds, from a
  process of its own as a trainer would (not from the event loop that times run B's calls);
  ``push_impact_p99``: B's 99th-percentile call latency with the pushes over without.
* **Memory** (``--memory-model-hidden``): a second replica on a larger model (float32) so that a copy of
  its weights would show. Its processes' memory (USS: what is theirs alone) with no run, then after 1 and
  after 8 runs' adapters were pushed and sampled; ``base_copies`` = 1 + (growth from 1 to 8 runs, less the
  7 adapters' bytes) / the checkpoint's bytes: 1 when the base weights are held once whatever K.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
import torch

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.models.tiny import build_tiny_model
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, weights_pb2
from rlfleet.wire import encode_tensor
from rlfleet.wire.push_messages import iter_push_messages

MAX_RUNS = 8
KS = (1, 2, 4, 8)
WEIGHTS = (1.0, 2.0, 4.0)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8


# ---------------------------------------------------------------- adapters


def adapter_factors(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A rank-8 adapter on every linear layer of ``model_dir``'s model, peft's names, seeded values."""
    from safetensors import safe_open

    generator = torch.Generator().manual_seed(seed)
    pairs = []
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        for name in checkpoint.keys():
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
                continue
            out_features, in_features = checkpoint.get_slice(name).get_shape()
            pairs.append((f"base_model.model.{module}.lora_A.weight",
                          torch.randn(RANK, in_features, generator=generator) * 0.1))
            pairs.append((f"base_model.model.{module}.lora_B.weight",
                          torch.randn(out_features, RANK, generator=generator) * 0.05))
    return pairs


async def push(stub, pairs, version: int, run_id: str) -> None:
    lora = weights_pb2.LoraAdapter(rank=RANK, alpha=2 * RANK, target_modules=sorted(TARGETS))

    async def requests():
        for kind, msg in iter_push_messages(pairs, version=version, mode=weights_pb2.UPDATE_MODE_KEEP, lora=lora):
            if kind == "manifest":
                msg.run_id = run_id
            yield generation_pb2.UpdateWeightsRequest(**{kind: msg})
    async for _ in stub.UpdateWeights(requests(), timeout=600):
        pass


# ---------------------------------------------------------------- calls


class Work:
    def __init__(self, args, vocab: int = 512):
        generator = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(3, vocab, (16,), generator=generator) for _ in range(args.calls)]
        self.n, self.max_tokens = args.n, args.max_tokens

    def request(self, run_id: str, index: int, weight: float = 0.0) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            prompt=sampling_pb2.Prompt(token_ids=encode_tensor(self.prompts[index % len(self.prompts)])),
            run_id=run_id, share_weight=weight,
            sampling=sampling_pb2.SamplingParams(n=self.n, temperature=1.0, max_tokens=self.max_tokens,
                                                 ignore_eos=True))


async def call(stub, request) -> int:
    samples = 0
    async for _ in stub.Generate(request, timeout=600):
        samples += 1
    return samples


async def tokens_by_run(stub) -> dict[str, int]:
    status = await stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest())
    return {run.run_id: run.generated_tokens for run in status.runs}


async def shared_arm(stub, work: Work, runs: list[str], weights: list[float]) -> tuple[float, dict[str, int]]:
    """Every run's calls at once, sent in turn (a call of each run, then the next of each): (samples per
    second over all, each run's sampled tokens between the first call done anywhere, once the batch's first
    fill is over, and the first run done, while every run still had calls waiting)."""
    loop = asyncio.get_running_loop()
    first_call, first_run = loop.create_future(), loop.create_future()
    left = {run_id: len(work.prompts) for run_id in runs}
    snapshots: list[asyncio.Task] = []

    async def one_call(run_id: str, index: int, weight: float) -> int:
        samples = await call(stub, work.request(run_id, index, weight))
        left[run_id] -= 1
        for event, done in ((first_call, True), (first_run, left[run_id] == 0)):
            if done and not event.done():
                event.set_result(None)
                snapshots.append(asyncio.create_task(tokens_by_run(stub)))
        return samples

    started = time.perf_counter()
    calls = [asyncio.create_task(one_call(run_id, index, weight))
             for index in range(len(work.prompts)) for run_id, weight in zip(runs, weights)]
    samples = sum(await asyncio.gather(*calls))
    seconds = time.perf_counter() - started
    start, end = [await snapshot for snapshot in snapshots]
    return samples / seconds, {run_id: end.get(run_id, 0) - start.get(run_id, 0) for run_id in runs}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


async def latency_phase(stub, work: Work, args, pusher: dict | None = None) -> list[float]:
    """Run B's call latencies over ``--phase-seconds`` with ``--concurrency`` calls in flight; ``pusher``
    set: run A pushes meanwhile, from a process of its own (as a trainer would, from elsewhere: in this
    process its chunking and checksums would hold up the event loop that times run B's calls)."""
    latencies: list[float] = []
    process = None
    if pusher is not None:
        process = pusher["context"].Process(target=push_loop, args=(
            pusher["address"], str(pusher["model_dir"]), pusher["version"], args.phase_seconds, args.push_interval,
            pusher["pushes"]))
        process.start()
        assert pusher["pushes"].get() == "started"
    deadline = time.perf_counter() + args.phase_seconds

    async def lane(lane_index: int) -> None:
        index = lane_index
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await call(stub, work.request("run-1", index))
            latencies.append(time.perf_counter() - started)
            index += args.concurrency
    await asyncio.gather(*(lane(i) for i in range(args.concurrency)))
    if process is not None:
        await asyncio.to_thread(process.join)
        pusher["version"] = pusher["pushes"].get()
    return latencies


def push_loop(address: str, model_dir: str, version: int, seconds: float, interval: float, out) -> None:
    """Run A's trainer: an adapter push (keep mode) every ``interval`` seconds for ``seconds``; the last
    version pushed goes to ``out``."""
    pairs = [adapter_factors(Path(model_dir), seed=50 + i) for i in range(2)]

    async def pushing() -> int:
        nonlocal version
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            out.put("started")
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                version += 1
                await push(stub, pairs[version % 2], version, "run-0")
                await asyncio.sleep(interval)
        return version
    out.put(asyncio.run(pushing()))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


# ---------------------------------------------------------------- replicas


def start_replica(model_dir: Path, workdir: Path, args) -> ServiceProcess:
    proc = ServiceProcess("generation", [
        "--model", str(model_dir), "--max-model-len", "256", "--max-num-seqs", str(args.max_num_seqs),
        "--max-queued-requests", "1024", "--kv-cache-memory-bytes", str(256 << 20),
        "--max-lora-rank", str(RANK), "--max-runs", str(MAX_RUNS), "--log-format", "text"])
    proc.start(workdir)
    proc.wait_ready(900)
    return proc


def uss_bytes(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_full_info().uss for p in [root, *root.children(recursive=True)])


async def memory_part(args, workdir: Path) -> dict:
    model_dir = build_tiny_model(workdir / "memory-model", hidden_size=args.memory_model_hidden,
                                 intermediate_size=2 * args.memory_model_hidden, num_layers=4, num_heads=8)
    checkpoint = (model_dir / "model.safetensors").stat().st_size
    proc = start_replica(model_dir, workdir / "memory-replica", args)
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            work = Work(argparse.Namespace(calls=2, n=2, max_tokens=8))
            await asyncio.gather(*(call(stub, work.request("", i)) for i in range(2)))
            memory = {0: uss_bytes(proc.process.pid)}
            adapter_bytes = 0
            for k in range(MAX_RUNS):
                pairs = adapter_factors(model_dir, seed=100 + k)
                adapter_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
                await push(stub, pairs, 1, f"run-{k}")
                await asyncio.gather(*(call(stub, work.request(f"run-{k}", i)) for i in range(2)))
                if k + 1 in (1, MAX_RUNS):
                    memory[k + 1] = uss_bytes(proc.process.pid)
    finally:
        proc.stop()
    growth = memory[MAX_RUNS] - memory[1]
    return dict(checkpoint_bytes=checkpoint, adapter_bytes=adapter_bytes, uss_bytes=memory,
                base_copies=1 + (growth - (MAX_RUNS - 1) * adapter_bytes) / checkpoint)


# ---------------------------------------------------------------- the run


async def shared_fleet_parts(args, workdir: Path) -> dict:
    model_dir = build_tiny_model(workdir / "tiny-model")
    proc = start_replica(model_dir, workdir / "replica", args)
    work = Work(args)
    rows: dict[str, list] = {f"k{k}": [] for k in KS}
    fairness: dict[int, list[float]] = {k: [] for k in KS if k > 1}
    weighted: list[list[float]] = []
    latency: dict[str, list[float]] = {"alone": [], "pushing": []}
    pushes = 0
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for k in range(MAX_RUNS):
                await push(stub, adapter_factors(model_dir, seed=k), 1, f"run-{k}")
            context = multiprocessing.get_context("spawn")
            pusher = dict(context=context, address=proc.address, model_dir=model_dir, version=1,
                          pushes=context.Queue())

            await shared_arm(stub, work, ["run-0"], [1.0])  # warm-up
            for round_index in range(args.rounds):
                for k in KS:
                    rate, tokens = await shared_arm(stub, work, [f"run-{i}" for i in range(k)], [1.0] * k)
                    rows[f"k{k}"].append(rate)
                    if k > 1:
                        fairness[k].append(jain(list(tokens.values())))
                _, tokens = await shared_arm(stub, work, ["run-5", "run-6", "run-7"], list(WEIGHTS))
                total = sum(tokens.values())
                weighted.append([tokens[f"run-{5 + i}"] / total / (w / sum(WEIGHTS)) for i, w in enumerate(WEIGHTS)])
                latency["alone"].append(p99(await latency_phase(stub, work, args)))
                before = pusher["version"]
                latency["pushing"].append(p99(await latency_phase(stub, work, args, pusher)))
                pushes += pusher["version"] - before
                print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"K={k} {rows[f'k{k}'][-1]:.1f}/s" for k in KS) + f"; p99 {latency['alone'][-1]:.3f} s alone, "
                    f"{latency['pushing'][-1]:.3f} s pushing", file=sys.stderr, flush=True)
    finally:
        proc.stop()
    median = statistics.median
    aggregate = {k: median([rows[f"k{k}"][r] / rows["k1"][r] for r in range(args.rounds)]) for k in KS}
    return dict(rates={k: median(rows[f"k{k}"]) for k in KS}, aggregate=aggregate,
                jain={k: median(v) for k, v in fairness.items()},
                weighted=[median([row[i] for row in weighted]) for i in range(len(WEIGHTS))],
                p99={side: median(v) for side, v in latency.items()},
                push_impact=median([p / a for a, p in zip(latency["alone"], latency["pushing"])]),
                pushes=pushes)


def report(shared: dict, memory: dict | None, args) -> dict:
    print(f"\n### K LoRA runs on one replica ({args.calls} calls x n={args.n} x {args.max_tokens} tokens per run, "
          f"max_num_seqs {args.max_num_seqs}; medians of {args.rounds} rounds)\n")
    print("| runs K | samples/s | over one run alone | Jain fairness |")
    print("|---|---|---|---|")
    for k in KS:
        fair = f"{shared['jain'][k]:.3f}" if k in shared["jain"] else "-"
        print(f"| {k} | {shared['rates'][k]:.1f} | {shared['aggregate'][k]:.3f} | {fair} |")
    print("\n### Weights 1:2:4 (share of sampled tokens over the weight's share)\n")
    print("| weight | share / weight's share |")
    print("|---|---|")
    for weight, ratio in zip(WEIGHTS, shared["weighted"]):
        print(f"| {weight:g} | {ratio:.3f} |")
    print(f"\n### Run B's call latency while run A pushes (keep mode, every {args.push_interval:g} s; "
          f"{shared['pushes']} pushes)\n")
    print("| | p99 seconds |")
    print("|---|---|")
    print(f"| alone | {shared['p99']['alone']:.3f} |")
    print(f"| run A pushing | {shared['p99']['pushing']:.3f} |")
    print(f"| ratio (median of rounds) | {shared['push_impact']:.3f} |")
    result = dict(aggregate_over_single_run={str(k): round(v, 3) for k, v in shared["aggregate"].items()},
                  jain_fairness=round(min(shared["jain"].values()), 4),
                  weighted_share_error=round(max(abs(r - 1) for r in shared["weighted"]), 4),
                  push_impact_p99=round(shared["push_impact"], 3))
    if memory is not None:
        mib = 1 << 20
        print(f"\n### Memory: one replica of a {memory['checkpoint_bytes'] / mib:.0f} MiB float32 checkpoint "
              f"(adapter {memory['adapter_bytes'] / mib:.2f} MiB)\n")
        print("| runs | replica USS MiB |")
        print("|---|---|")
        for k, value in memory["uss_bytes"].items():
            print(f"| {k} | {value / mib:.0f} |")
        print(f"\nbase copies held: {memory['base_copies']:.2f}")
        result.update(base_copies=round(memory["base_copies"], 2), checkpoint_mib=round(memory["checkpoint_bytes"] / mib, 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=12, help="Generate calls per run and arm")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4, help="run B's calls in flight (push impact)")
    parser.add_argument("--phase-seconds", type=float, default=12.0)
    parser.add_argument("--push-interval", type=float, default=1.0)
    parser.add_argument("--memory-model-hidden", type=int, default=1024, help="0: no memory part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-multitenant-") as tmp:
        workdir = Path(tmp)
        shared = asyncio.run(shared_fleet_parts(args, workdir))
        memory = asyncio.run(memory_part(args, workdir)) if args.memory_model_hidden else None
    print("RESULT " + json.dumps(report(shared, memory, args)))


if __name__ == "__main__":
    main()
