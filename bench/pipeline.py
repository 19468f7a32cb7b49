"""End-to-end pipeline throughput against its baselines.

Ratios against generation alone (a), of async against sync mode (b), against plain in-process vLLM (c), of
multi-turn episodes against single turns of the same tokens (d), and the weight-swap modes under frequent
pushes (e).

    .venv/bin/python bench/pipeline.py [--groups 32] [--rounds 3] [--steps 6] [--sync-rounds 3]
        [--step-seconds S | --step-from rollout|generation] [--prefetch N]
        [--parts abcde] [--inprocess-rounds 3] [--long-tokens 1024] [--long-groups 4] [--multiturn-rounds 3]
        [--swap-rounds 2] [--swap-seconds 30] [--push-seconds 2] [--swap-max-tokens 256]

The suite (trajectory, reference, reward, one generation replica) starts once
as real processes; only the collector is restarted between configurations,
each time with a fresh ``--state-dir``. Every sample is ``--max-tokens`` long
(``ignore_eos``), GRPO groups of ``--group-size``, reward ``char_fraction``.

(a) trajectories/s end to end vs generation alone. One collector in async mode
with an unbounded staleness; a trainer (the SDK's ``connect().batches()``)
submits ``--groups`` prompts and reads batches as fast as it can, no pushes:
the clock runs from the submit to the last batch received, so it includes
reference scoring, rewards, the trajectory buffer and the batch stream. The
baseline drives the same generation replica directly with ``Generate`` for the
same prompts, group size and sampling, as many calls in flight as the
collector allows (``max_generations_in_flight``). The two alternate
``--rounds`` times after a warm-up; ratio = end-to-end / generation alone per
round, median (target >= 0.85: reference and reward must overlap with
generation, not add to it). While the pipeline runs, the collector's
GetStatus is polled to get the mean number of groups inside each stage (by
Little's law, the time a group spends there), and the CPU seconds of every
service process (vLLM engine children included) are counted per phase: on a
2-core machine the pipeline can only keep up if the extra services fit in
the CPU that generation leaves idle.

(b) async (``--max-staleness 1``) vs sync with a simulated trainer: each of
``--steps`` steps reads one batch of ``--groups-per-step-b`` groups, sleeps
``--step-seconds`` (the trainer's compute) and pushes the tiny model's weights
through the collector. The step defaults to as long as producing one batch,
measured first (medians of 3 after a warm-up): ``--step-from rollout`` (the
default) the batch's prompts submitted to a collector until the batch is
received (generation, reference, reward, trajectory buffer), ``generation`` the
batch's groups generated directly on the replica (collector-like concurrency);
both are reported. The trainer reads its batches with ``--prefetch`` (default: the
SDK's own default), the same in both modes. trajectories/s = all
trajectories / wall time from the submit to the last push. Per step, the push is shown as the trainer
sees it and as long as it took at the collector (``PushResult.server_seconds``): the rest is the SDK
writing the weights into shared memory and the round trip. sync and async
alternate ``--sync-rounds`` times (sync first), a fresh collector each; ratio =
async / sync per round, median. Also shown: the same ratio after the first batch (trajectories of steps
2..``--steps`` / wall time from the first batch received to the last push), because async fills its pipeline
before its first batch (it generates two steps at once), a cost a run of thousands of steps pays once but
that weighs 1/``--steps`` here: even an async trainer that never waits after its first batch is at most
``steps x (rollout + step + push) / (fill + steps x (step + push))`` times as fast as sync.
The staleness histograms (trajectories by versions stale at append) are shown as a check.

(c) trajectories/s end to end vs plain vLLM in-process (``bench/_inprocess.py``): an ``AsyncLLM``
built in this process from the generation service's own config and engine kwargs (same KV-cache
bytes, max_model_len, max_num_seqs, dtype, prefix caching, seed, processed log-probs), fed the
same prompt token ids the service makes from the text prompts (checked against what the trainer
receives), ``n = --group-size``, the sampled token's log-prob, all prompts at once. The two sides
alternate (rlfleet, in-process, rlfleet, ...) ``--inprocess-rounds`` times after a warm-up, each
phase ``--settle-seconds`` after the previous one (an idle engine spins a core for ~1 s), for a
``--max-tokens`` row (``--groups`` groups) and a ``--long-tokens`` row (``--long-groups`` groups);
ratio = end-to-end / in-process per round, median. Both engines live at once (the tiny model's
KV cache is 256 MiB each). ``--inprocess-engine plain`` (the default) runs vLLM's own process layout
and queue readers in-process, as a user who calls ``AsyncLLM`` gets them; ``service`` runs the
generation service's (``GenerationEngine``: on a host of at most 2 CPUs the model in the engine-core
process, and readers that sleep between checks): the ratio then leaves out what those choices buy.
Each phase's CPU is counted (``CpuMeter``): per trajectory, every service's process tree, this process
(the trainer of one side, the in-process engine of the other) and the whole host; the CPU bound is
the in-process side's host CPU over the end-to-end side's, the ratio the host allows when both
saturate it.

(d) multi-turn episodes vs single turns of the same sampled tokens, end to end. The suite also runs
the environment service with ``bench_tools`` (``bench/_environments.py``), where every assistant turn is
answered by a real python tool call in the sandbox (bwrap: needs root), each call in a ready sandbox of
its own from a pool (the environment service's default), 3 turns per episode. One
async collector (as in (a)) with the environment service's address runs every side on ``--groups``
chat prompts: multi-turn prompts name ``bench_tools`` and sample ``--max-tokens`` per turn; the
single-turn prompts name no environment and sample 3 x ``--max-tokens`` at once (``ignore_eos``
both: every trajectory carries exactly 3 x ``--max-tokens`` sampled tokens, checked on every batch).
So the ratio is the cost of the turns themselves: a Generate call per turn and episode (``n = 1``
instead of one call per group), the environment's steps, the tool runs, and the prefill of the
history at every turn. A third side runs the same episodes on ``bench_canned_tools``, which answers
with the tool's output without running it: the turns' own cost, without the tool calls'. A fourth side
runs them on ``bench_episode_tools``: the same tool calls in a sandbox of the episode's own
(``EpisodeSandbox``), started when the episode opens. The sides alternate ``--multiturn-rounds`` times
after a warm-up, their order reversed every other round; ratio = multi-turn traj/s / single-turn
traj/s per round, median (goal >= 0.7). The environment logs each tool call's seconds to a file the
bench reads: the mean tool-call time, and the calls per trajectory. Every service serves its metrics, and
per side (summed over its rounds, divided by its trajectories) the bench counts: the gRPC calls each
service answered (``rlfleet_rpc_seconds_count`` by method; health checks and this bench's GetStatus poll
left out): ``calls_per_trajectory``; the CPU of each service process with all its descendants, reaped
ones included (the sandboxes count in the environment service's), and the busy CPU of the whole host
(``/proc/stat``: the kernel's share of starting and ending sandboxes too); and the later turns' prefix-cache
hit rate (``rlfleet_episode_cached_prompt_tokens_total`` / ``rlfleet_episode_prompt_tokens_total`` of
``turn="later"``, from the collector): ``prefix_cache_hit_rate``. The column "CPU bound" is the single
turn's host CPU per trajectory over the side's: on a host whose cores are all busy, the ratio that CPU
alone allows. The sandboxes' own costs come from the environment service's
``rlfleet_episode_sandbox_cpu_seconds{step}``: ``tool_call_host_cpu_ms`` is a call's CPU in the sandbox
of an episode (its processes, the zygote's fork and the reset after it: the zygote's count),
``episode_sandbox_host_cpu_ms`` the CPU per episode of sandbox starts (bwrap and the zygote until ready)
and separate resets; the ``per_call_`` keys the same on the sandbox-per-call side. As a cross-check,
``tool_call_cpu_ms_all_in`` is a side's CPU per trajectory beyond the canned side's, per tool call, of the
environment's process tree and of the whole host (everything a call costs anywhere, noisier).

(e) the weight-swap modes under a push every few seconds, with dynamic sampling: see ``bench/_swap_modes.py``.
Trajectories/s per mode, sampled tokens thrown away per push, tokens carried over, staleness histograms, the
fraction of full batches of varied groups; ``resume_over_keep`` is the median per-round ratio (target >= 0.95),
``resume_wasted_tokens`` the tokens resume threw away (target 0), ``full_batch_fraction`` (target 1).

The last line is ``RESULT {json}`` with the ratios of every part run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import psutil

from _common import CpuMeter, scrape, summarize
from _swap_modes import measure_swap_modes, report_swap_modes, swap_result
from rlfleet.client import Batch, connect
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, generation_pb2, generation_pb2_grpc, sampling_pb2

STAGES = ("generation", "reference", "reward", "trajectory")
MAX_GENERATIONS_IN_FLIGHT = 16  # the collector's default, also used by the generation-only baseline


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompt_texts(count: int) -> list[str]:
    return [f"what is {i} plus {2 * i + 1}?" for i in range(count)]


class StatusPoller:
    """Polls the collector's GetStatus while running; each reply kept as ``sample(reply)`` (default: the
    groups inside each stage)."""

    def __init__(self, address: str, period: float = 0.1, sample=None):
        self.address, self.period = address, period
        self.sample = sample or (lambda reply: {s.name: s.queued + s.in_flight for s in reply.stages})
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StatusPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = collector_pb2_grpc.CollectorServiceStub(channel)
            while not self._stop.wait(self.period):
                reply = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=10)
                self.samples.append(self.sample(reply))

    def mean(self) -> dict[str, float]:
        return {name: statistics.fmean(s.get(name, 0) for s in self.samples) if self.samples else 0.0
                for name in STAGES}


# ---------------------------------------------------------------- collector

def start_collector(backends: dict[str, ServiceProcess], workdir: Path, tag: str, ns, *args: str) -> ServiceProcess:
    replicas = [p.address for k, p in backends.items() if k.startswith("generation")]
    proc = ServiceProcess("collector", [
        "--generation-addresses", json.dumps(replicas),
        "--reference-address", backends["reference"].address, "--reward-address", backends["reward"].address,
        "--trajectory-address", backends["trajectory"].address, "--state-dir", str(workdir / f"{tag}-state"),
        "--group-size", str(ns.group_size), "--sampling", json.dumps(sampling(ns)), "--reward-fn", "char_fraction",
        "--max-generations-in-flight", str(MAX_GENERATIONS_IN_FLIGHT), "--log-level", os.environ.get("RLFLEET_BENCH_LOG_LEVEL", "WARNING"), *args])
    return proc.start(workdir / f"{tag}-proc").wait_ready(120)


def sampling(ns) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "max_tokens": ns.max_tokens, "ignore_eos": True}


def leftover(client) -> int:
    stats = client.buffer_stats()
    return stats.ready + stats.leased


# ---------------------------------------------------------------- (a) end to end vs generation alone

def end_to_end(address: str, prompts: list, tag: str, ns, *, groups_per_batch: int | None = None,
               spec: dict | None = None, on_batch: Callable[[Batch], None] | None = None
               ) -> tuple[float, dict[str, float]]:
    """Seconds from submit to the last batch of all groups, and the mean groups per stage.

    ``prompts``: the SDK's ``"prompt"`` of each (a text or chat messages); ``spec``: more keys of every
    prompt (``"sampling"`` overrides, an ``"environment"``); ``on_batch`` sees every batch received
    (inside the clock: keep it cheap)."""
    groups_per_batch = groups_per_batch or ns.groups_per_step
    per_batch = ns.group_size * groups_per_batch
    if len(prompts) % groups_per_batch:
        raise ValueError("--groups must be a multiple of --groups-per-step")
    with connect(address) as client, StatusPoller(address) as poller:
        started = time.perf_counter()
        client.submit_prompts([{"prompt": prompt, "prompt_id": f"{tag}-{i}", **(spec or {})}
                               for i, prompt in enumerate(prompts)])
        rows = 0
        with client.batches(per_batch, max_batches=len(prompts) // groups_per_batch) as batches:
            for batch in batches:
                rows += len(batch)
                if on_batch is not None:
                    on_batch(batch)
        seconds = time.perf_counter() - started
        if rows != len(prompts) * ns.group_size:
            raise RuntimeError(f"read {rows} trajectories, expected {len(prompts) * ns.group_size}")
    return seconds, poller.mean()


async def generation_alone(address: str, prompts: list[str], ns) -> float:
    """Seconds to generate every group directly on the replica, collector-like concurrency."""
    params = sampling_pb2.SamplingParams(n=ns.group_size, **sampling(ns))
    gate = asyncio.Semaphore(MAX_GENERATIONS_IN_FLIGHT)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one(text: str) -> int:
            async with gate:
                request = generation_pb2.GenerateRequest(prompt=sampling_pb2.Prompt(text=text), sampling=params)
                return len([reply async for reply in stub.Generate(request, timeout=600)])

        started = time.perf_counter()
        samples = await asyncio.gather(*(one(text) for text in prompts))
        seconds = time.perf_counter() - started
    if sum(samples) != len(prompts) * ns.group_size:
        raise RuntimeError(f"generated {sum(samples)} samples, expected {len(prompts) * ns.group_size}")
    return seconds


def measure_end_to_end(backends, workdir: Path, meter: CpuMeter, ns) -> dict:
    collector = start_collector(backends, workdir, "e2e", ns, "--mode", "async", "--max-staleness", "1000000", "--mismatch-kl-target", "null",
                                "--groups-per-step", str(ns.groups_per_step))
    meter.add("collector", collector.process.pid)
    generation = backends["generation-0"].address
    trajectories = ns.groups * ns.group_size
    e2e, alone, stage_means = [], [], []
    cpu = {"e2e": {}, "alone": {}}
    try:
        for round_index in range(-1, ns.rounds):  # round -1: warm-up of both sides
            count = ns.groups_per_step * 2 if round_index < 0 else ns.groups
            prompts = prompt_texts(count)
            before = meter.snapshot()
            seconds_e2e, stages = end_to_end(collector.address, prompts, f"r{round_index}", ns)
            middle = meter.snapshot()
            seconds_alone = asyncio.run(generation_alone(generation, prompts, ns))
            after = meter.snapshot()
            if round_index < 0:
                continue
            e2e.append(trajectories / seconds_e2e)
            alone.append(trajectories / seconds_alone)
            stage_means.append(stages)
            for phase, (a, b, wall) in {"e2e": (before, middle, seconds_e2e),
                                        "alone": (middle, after, seconds_alone)}.items():
                for key, value in CpuMeter.delta(a, b).items():
                    cpu[phase][key] = cpu[phase].get(key, 0.0) + value
                cpu[phase]["wall"] = cpu[phase].get("wall", 0.0) + wall
            log(f"  (a) round {round_index}: end-to-end {e2e[-1]:.1f} traj/s, generation alone {alone[-1]:.1f} "
                f"traj/s, groups per stage {({k: round(v, 1) for k, v in stages.items()})}")
    finally:
        collector.stop()
    out = summarize(alone, e2e)
    out["stages"] = {name: statistics.fmean(s[name] for s in stage_means) for name in STAGES}
    out["cpu"] = cpu
    return out


# ---------------------------------------------------------------- (b) async vs sync with a trainer

@dataclass
class TrainerRun:
    """One (b) run of ``--steps`` steps of read batch / sleep / push, in seconds."""

    seconds: float
    """From the submit to the last push's answer."""
    first_batch: float
    """From the submit to the first batch received (async fills its pipeline here: two steps generated at once)."""
    waiting: float
    """Waiting for batches (the first included)."""
    pushing: float
    """Pushing, as the trainer sees it."""
    at_collector: float
    """Pushing, by the collector's own clock (``PushResult.server_seconds``); the rest is the SDK writing the
    weights and the round trip."""
    histogram: list[int]
    leftover: int


def trainer_run(address: str, state: dict, tag: str, ns) -> TrainerRun:
    """A simulated trainer on the collector at ``address`` (see ``TrainerRun``); the staleness histogram and the
    rows left in the buffer are read at the end."""
    groups = ns.steps * ns.groups_per_step_b
    read_ahead = {} if ns.prefetch is None else {"prefetch": ns.prefetch}  # None: the SDK's default
    with connect(address) as client:
        started = time.perf_counter()
        client.submit_prompts([{"prompt": text, "prompt_id": f"{tag}-{i}"}
                               for i, text in enumerate(prompt_texts(groups))])
        rows, waiting, pushing, at_collector, first_batch = 0, 0.0, 0.0, 0.0, 0.0
        with client.batches(ns.group_size * ns.groups_per_step_b, max_batches=ns.steps, **read_ahead) as batches:
            for _ in range(ns.steps):
                asked = time.perf_counter()
                rows += len(next(batches))
                waiting += time.perf_counter() - asked
                first_batch = first_batch or time.perf_counter() - started
                time.sleep(ns.step_seconds)  # the trainer's step
                asked = time.perf_counter()
                result = client.push_weights(state, progress=False)
                pushing += time.perf_counter() - asked
                at_collector += result.server_seconds
                if not result.all_applied:
                    raise RuntimeError(f"push not applied everywhere: {result}")
        seconds = time.perf_counter() - started
        if rows != groups * ns.group_size:
            raise RuntimeError(f"read {rows} trajectories, expected {groups * ns.group_size}")
        status = client.status()
        return TrainerRun(seconds, first_batch, waiting, pushing, at_collector, list(status.staleness_histogram),
                          leftover(client))


def batch_generation_seconds(address: str, ns) -> float:
    """Seconds to generate one (b) batch directly on the replica: median of 3 after a warm-up."""
    prompts = prompt_texts(ns.groups_per_step_b)
    seconds = [asyncio.run(generation_alone(address, prompts, ns)) for _ in range(4)][1:]
    log(f"  (b) one batch of {ns.groups_per_step_b} groups generated alone: "
        f"{' '.join(f'{s:.2f}' for s in seconds)} s")
    return statistics.median(seconds)


def batch_rollout_seconds(backends, workdir: Path, ns) -> float:
    """Seconds from submitting one (b) batch's prompts to receiving the batch through the whole pipeline,
    nothing else in flight: median of 3 after a warm-up. (An async collector with unbounded staleness, as in
    (a): a sync one would wait for a push between the batches.)"""
    collector = start_collector(backends, workdir, "rollout", ns, "--mode", "async", "--max-staleness", "1000000", "--mismatch-kl-target", "null",
                                "--groups-per-step", str(ns.groups_per_step_b))
    try:
        seconds = [end_to_end(collector.address, prompt_texts(ns.groups_per_step_b), f"rollout{i}", ns,
                              groups_per_batch=ns.groups_per_step_b)[0] for i in range(4)][1:]
    finally:
        collector.stop()
    log(f"  (b) one batch of {ns.groups_per_step_b} groups through the pipeline: "
        f"{' '.join(f'{s:.2f}' for s in seconds)} s")
    return statistics.median(seconds)


def measure_sync_async(backends, workdir: Path, model_dir: Path, ns) -> dict:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    generation_seconds = batch_generation_seconds(backends["generation-0"].address, ns)
    rollout_seconds = batch_rollout_seconds(backends, workdir, ns)
    if ns.step_seconds is None:  # the trainer's step: as long as producing one batch, measured
        ns.step_seconds = round(rollout_seconds if ns.step_from == "rollout" else generation_seconds, 2)
    trajectories = ns.steps * ns.groups_per_step_b * ns.group_size
    rates = {"sync": [], "async": []}
    steady = {"sync": [], "async": []}
    histograms = {"sync": [], "async": []}
    per_step = {"sync": [], "async": []}
    for round_index in range(ns.sync_rounds):
        for mode in ("sync", "async"):
            tag = f"{mode}{round_index}"
            collector = start_collector(backends, workdir, tag, ns, "--mode", mode, "--max-staleness", "1",
                                        "--groups-per-step", str(ns.groups_per_step_b))
            try:
                run = trainer_run(collector.address, state, tag, ns)
            finally:
                collector.stop()
            if run.leftover:
                log(f"  WARNING: {run.leftover} trajectories left in the trajectory buffer after the {mode} run")
            rates[mode].append(trajectories / run.seconds)
            steady[mode].append(trajectories * (ns.steps - 1) / ns.steps / (run.seconds - run.first_batch))
            histograms[mode].append(run.histogram)
            per_step[mode].append((run.seconds / ns.steps, run.waiting / ns.steps, run.pushing / ns.steps,
                                   run.at_collector / ns.steps))
            log(f"  (b) round {round_index} {mode:>5}: {rates[mode][-1]:.1f} traj/s, "
                f"{run.seconds / ns.steps:.2f} s/step (batch wait {run.waiting / ns.steps:.2f} s, first batch after "
                f"{run.first_batch:.2f} s; push "
                f"{run.pushing / ns.steps:.2f} s, of it at the collector {run.at_collector / ns.steps:.2f} s), "
                f"staleness histogram {run.histogram}")
    out = summarize(rates["sync"], rates["async"])
    out["ratios_per_round"] = [a / b for b, a in zip(rates["sync"], rates["async"])]
    out["after_first_batch"] = summarize(steady["sync"], steady["async"])
    out["generation_seconds"] = generation_seconds
    out["rollout_seconds"] = rollout_seconds
    out["histograms"] = histograms
    out["per_step"] = {mode: [statistics.median(x) for x in zip(*values)] for mode, values in per_step.items()}
    return out


# ---------------------------------------------------------------- (c) end to end vs in-process vLLM

def generation_service_args(options: SuiteOptions) -> list[str]:
    """The flags ``start_suite`` gives the generation service (repeated here: the in-process baseline
    builds its engine from the same config)."""
    return ["--model", str(options.model_dir), "--kv-cache-memory-bytes", str(options.kv_cache_bytes),
            "--max-model-len", str(options.max_model_len), *options.generation_args]


def inprocess_rows(options: SuiteOptions, ns) -> dict[int, tuple[list[str], list[list[int]]]]:
    """Response length -> (prompt texts, their token ids as the service makes them)."""
    from _inprocess import prompt_token_ids

    rows = {}
    for tokens, groups in ((ns.max_tokens, ns.groups), (ns.long_tokens, ns.long_groups)):
        texts = prompt_texts(groups)
        rows[tokens] = (texts, prompt_token_ids(str(options.model_dir), texts))
    return rows


class PhaseCpu:
    """CPU seconds of (c)'s phases, per row and side: every service's process tree, this process (the
    trainer of the end-to-end side; the in-process engine, with its engine core, of the other) and the
    whole host (``CpuMeter``)."""

    def __init__(self, services: dict[str, ServiceProcess]):
        self.meter = CpuMeter({}, host=True)
        for key, proc in services.items():
            self.meter.follow(key, proc.process.pid)
        self.meter.follow("bench", os.getpid())  # its tree holds the services: they are taken out below
        self.totals: dict[tuple[int, str], dict[str, float]] = {}

    def snapshot(self) -> dict[str, float]:
        cpu = self.meter.snapshot()
        cpu["bench"] -= sum(value for key, value in cpu.items() if key not in ("bench", "host"))
        return cpu

    @contextlib.contextmanager
    def measure(self, tokens: int, side: str):
        """Adds the CPU of the ``with`` block's phase to ``side``'s total for ``tokens``."""
        before = self.snapshot()
        yield
        total = self.totals.setdefault((tokens, side), {})
        for key, value in CpuMeter.delta(before, self.snapshot()).items():
            total[key] = total.get(key, 0.0) + value

    def per_trajectory(self, tokens: int, side: str, trajectories: int) -> dict[str, float]:
        """Milliseconds per trajectory, by process and for the host."""
        return {key: round(1000 * value / trajectories, 2) for key, value in self.totals[(tokens, side)].items()}


async def inprocess_round(address: str, engine, rows: dict, round_index: int, ns,
                          cpu: PhaseCpu | None = None) -> dict[int, tuple[float, float]]:
    """One round of (c): per row, end to end then in-process, each after ``--settle-seconds``; seconds
    each, and each phase's CPU added to ``cpu``."""
    measure = cpu.measure if cpu else lambda tokens, side: contextlib.nullcontext()
    out = {}
    for tokens, (texts, token_ids) in rows.items():
        groups_per_batch = math.gcd(ns.groups_per_step, len(texts))
        if round_index < 0:  # warm-up: one batch of each side is enough
            texts, token_ids = texts[:groups_per_batch], token_ids[:groups_per_batch]
        seen: set = set()
        await asyncio.sleep(ns.settle_seconds)  # an idle vLLM worker spins ~1 s: let the other engine settle
        with measure(tokens, "e2e"):
            seconds_e2e, _ = await asyncio.to_thread(
                end_to_end, address, texts, f"c{tokens}r{round_index}", ns, groups_per_batch=groups_per_batch,
                spec={"sampling": {"max_tokens": tokens}},
                on_batch=lambda batch: seen.update(tuple(ids.tolist())
                                                   for ids in batch.ragged("tokens/prompt").to_list()))
        await asyncio.sleep(ns.settle_seconds)
        with measure(tokens, "inprocess"):
            seconds_local, samples = await engine.generate_groups(token_ids, ns.group_size, tokens)
        if samples != len(token_ids) * ns.group_size:
            raise RuntimeError(f"in-process: {samples} full samples of {tokens} tokens, "
                               f"expected {len(token_ids) * ns.group_size}")
        if seen != {tuple(ids) for ids in token_ids}:
            raise RuntimeError("the pipeline's prompt token ids differ from the in-process ones: not the same work")
        out[tokens] = (seconds_e2e, seconds_local)
    return out


async def alternate_inprocess(address: str, kwargs: dict, rows: dict, ns,
                              cpu: PhaseCpu) -> dict[int, dict[str, list[float]]]:
    """(c) rounds: rlfleet end to end, then in-process vLLM, per row; trajectories/s of each side."""
    from _inprocess import InProcessEngine

    rates = {tokens: {"e2e": [], "inprocess": []} for tokens in rows}
    log(f"  (c) starting the in-process engine (~30 s): {kwargs}")
    engine = await InProcessEngine(kwargs).start()
    try:
        for round_index in range(-1, ns.inprocess_rounds):  # round -1: warm-up of both sides
            seconds = await inprocess_round(address, engine, rows, round_index, ns, cpu if round_index >= 0 else None)
            if round_index < 0:
                continue
            for tokens, (seconds_e2e, seconds_local) in seconds.items():
                trajectories = len(rows[tokens][0]) * ns.group_size
                rates[tokens]["e2e"].append(trajectories / seconds_e2e)
                rates[tokens]["inprocess"].append(trajectories / seconds_local)
                log(f"  (c) round {round_index}, {tokens}-token responses: end-to-end "
                    f"{rates[tokens]['e2e'][-1]:.1f} traj/s, in-process vLLM {rates[tokens]['inprocess'][-1]:.1f} "
                    f"traj/s, ratio {seconds_local / seconds_e2e:.2f}")
    finally:
        await engine.shutdown()
    return rates


def measure_inprocess(backends, workdir: Path, options: SuiteOptions, ns) -> dict:
    """(c) end to end (a fresh async collector, as in (a)) vs plain vLLM in this process, same engine settings."""
    from _inprocess import engine_kwargs

    kwargs = engine_kwargs(generation_service_args(options), ns.inprocess_engine)
    rows = inprocess_rows(options, ns)
    collector = start_collector(backends, workdir, "inproc", ns, "--mode", "async", "--max-staleness", "1000000", "--mismatch-kl-target", "null",
                                "--groups-per-step", str(ns.groups_per_step))
    cpu = PhaseCpu({**backends, "collector": collector})
    try:
        rates = asyncio.run(alternate_inprocess(collector.address, kwargs, rows, ns, cpu))
    finally:
        collector.stop()
    out = {}
    for tokens, sides in rates.items():
        trajectories = len(rows[tokens][0]) * ns.group_size * ns.inprocess_rounds
        costs = {side: cpu.per_trajectory(tokens, side, trajectories) for side in ("e2e", "inprocess")}
        out[tokens] = {**summarize(sides["inprocess"], sides["e2e"]), "groups": len(rows[tokens][0]),
                       "e2e_per_round": sides["e2e"], "inprocess_per_round": sides["inprocess"],
                       "ratios_per_round": [e / i for e, i in zip(sides["e2e"], sides["inprocess"])],
                       "cpu_ms_per_trajectory": costs,
                       "cpu_bound": costs["inprocess"]["host"] / costs["e2e"]["host"]}
    return out


def report_inprocess(rows: dict, options: SuiteOptions, ns) -> None:
    print(f"\n(c) trajectories/s end to end vs {ns.inprocess_engine} vLLM in-process | same engine settings (kv cache "
          f"{options.kv_cache_bytes >> 20} MiB, max_model_len {options.max_model_len}, the service's max_num_seqs "
          f"and dtype) | groups of {ns.group_size} | {ns.inprocess_rounds} alternating rounds "
          f"(rlfleet, in-process, ...), {ns.settle_seconds:g} s apart")
    print(f"{'response tokens':>15} | {'groups':>6} | {'in-process traj/s':>18} | {'end-to-end traj/s':>17} | "
          f"{'ratio':>5} | {'ratio IQR':>11} | per-round ratios")
    print(f"{'-' * 15}-+-{'-' * 6}-+-{'-' * 18}-+-{'-' * 17}-+-{'-' * 5}-+-{'-' * 11}-+-{'-' * 20}")
    for tokens, row in rows.items():
        print(f"{tokens:>15} | {row['groups']:>6} | {row['base']:>18.1f} | {row['measured']:>17.1f} | "
              f"{row['ratio']:>5.2f} | {row['low']:>5.2f}-{row['high']:<5.2f} | "
              + " ".join(f"{r:.2f}" for r in row["ratios_per_round"]))
    print("\nCPU ms per trajectory over the rounds, by process tree (bench: the trainer of the end-to-end side, "
          "the in-process engine and its engine core of the other), and of the whole host; CPU bound = "
          "in-process host CPU / end-to-end host CPU (the ratio the host's CPU allows when both saturate it)")
    keys = sorted({key for row in rows.values() for side in row["cpu_ms_per_trajectory"].values() for key in side
                   if key != "host"})
    print(f"{'response tokens':>15} | {'side':>10} | " + " | ".join(f"{key:>12}" for key in keys)
          + f" | {'host':>8} | CPU bound")
    for tokens, row in rows.items():
        for side, costs in row["cpu_ms_per_trajectory"].items():
            bound = f"{row['cpu_bound']:.2f}" if side == "e2e" else ""
            print(f"{tokens:>15} | {side:>10} | " + " | ".join(f"{costs.get(key, 0.0):>12.2f}" for key in keys)
                  + f" | {costs['host']:>8.2f} | {bound}")


# ---------------------------------------------------------------- (d) multi-turn vs single turn, same tokens

ENVIRONMENTS = {"bench_tools": "_environments:ToolTurns", "bench_canned_tools": "_environments:CannedToolTurns",
                "bench_episode_tools": "_environments:EpisodeToolTurns"}
MULTITURN_GOAL = 0.7


def environment_options(workdir: Path) -> dict:
    """``SuiteOptions`` fields that start the environment service with the bench's environments registered."""
    from _environments import TOOL_SECONDS_FILE

    bench_dir = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(filter(None, [bench_dir, os.environ.get("PYTHONPATH")]))
    return dict(environments=ENVIRONMENTS,
                environment_env={"PYTHONPATH": python_path, TOOL_SECONDS_FILE: str(workdir / "tool-seconds.txt")})


def new_tool_seconds(path: Path, seen: list[float]) -> list[float]:
    """The tool-call seconds the environment appended to ``path`` since ``seen`` (extended with them)."""
    lines = path.read_text().split() if path.exists() else []
    fresh = [float(line) for line in lines[len(seen):]]
    seen.extend(fresh)
    return fresh


def sampled_check(tokens: int, turns: int, full_lengths: list[int]) -> Callable[[Batch], None]:
    """An ``on_batch`` that checks every trajectory sampled ``tokens`` tokens in ``turns`` turns (all sides
    of (d) do the same sampling work) and collects the full sequences' lengths."""
    def check(batch: Batch) -> None:
        sampled = {int(mask.sum()) for mask in batch.ragged("masks/all_assistant_mask").to_list()}
        turn_counts = set(batch.ragged("turns/policy_versions").lengths.tolist())
        if sampled != {tokens} or turn_counts != {turns}:
            raise RuntimeError(f"expected {tokens} sampled tokens in {turns} turns per trajectory, got "
                               f"{sorted(sampled)} tokens in {sorted(turn_counts)} turns")
        full_lengths.extend(batch.ragged("tokens/full").lengths.tolist())
    return check


def measure_multiturn(backends, workdir: Path, ns) -> dict:
    """(d) rounds: multi-turn episodes with tool calls, single turns of the same sampled tokens, then the same
    episodes with canned tool output, then with a sandbox per episode, on one async collector (as in (a)) that
    knows the environment service."""
    from _environments import EPISODE_SECONDS_SUFFIX, TOOL_SECONDS_FILE, TURNS

    metrics_port = free_port()
    collector = start_collector(backends, workdir, "multiturn", ns, "--mode", "async", "--max-staleness", "1000000", "--mismatch-kl-target", "null",
                                "--groups-per-step", str(ns.groups_per_step),
                                "--environment-address", backends["environment"].address,
                                "--metrics-port", str(metrics_port))
    collector.metrics_port = metrics_port
    services = {**{key: proc for key, proc in backends.items()}, "collector": collector}
    meter = SideMeter(services)
    tokens = TURNS * ns.max_tokens
    per_turn = {"sampling": {"max_tokens": ns.max_tokens}}
    sides = {"multiturn": ({"environment": "bench_tools", **per_turn}, TURNS),
             "singleturn": ({"sampling": {"max_tokens": tokens}}, 1),
             "canned": ({"environment": "bench_canned_tools", **per_turn}, TURNS),
             "episode": ({"environment": "bench_episode_tools", **per_turn}, TURNS)}
    rates = {side: [] for side in sides}
    full_lengths = {side: [] for side in sides}
    tool_file = Path(backends["environment"].env[TOOL_SECONDS_FILE])
    episode_tool_file = Path(str(tool_file) + EPISODE_SECONDS_SUFFIX)
    all_tool_seconds: list[float] = []
    tool_seconds: list[float] = []
    all_episode_seconds: list[float] = []
    episode_seconds: list[float] = []
    try:
        for round_index in range(-1, ns.multiturn_rounds):  # round -1: warm-up of every side
            count = ns.groups  # the warm-up too: the sandbox pools grow to what a round holds at once
            prompts = [[{"role": "user", "content": text}] for text in prompt_texts(count)]
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))  # no side always goes first
            for side in order:
                spec, turns = sides[side]
                lengths = full_lengths[side] if round_index >= 0 else []
                before = meter.snapshot()
                seconds, _ = end_to_end(collector.address, prompts, f"d-{side}-r{round_index}", ns, spec=spec,
                                        on_batch=sampled_check(tokens, turns, lengths))
                if round_index >= 0:
                    rates[side].append(count * ns.group_size / seconds)
                    meter.add(side, before, meter.snapshot(), count * ns.group_size)
            calls = new_tool_seconds(tool_file, all_tool_seconds)
            episode_calls = new_tool_seconds(episode_tool_file, all_episode_seconds)
            if round_index < 0:
                continue
            tool_seconds += calls
            episode_seconds += episode_calls
            log(f"  (d) round {round_index}: single-turn {rates['singleturn'][-1]:.1f} traj/s, multi-turn "
                f"{rates['multiturn'][-1]:.1f} (canned tools {rates['canned'][-1]:.1f}, sandbox per episode "
                f"{rates['episode'][-1]:.1f}), ratio {rates['multiturn'][-1] / rates['singleturn'][-1]:.2f} "
                f"({rates['episode'][-1] / rates['singleturn'][-1]:.2f} per episode), {len(calls)} tool calls, "
                f"mean {1000 * statistics.fmean(calls):.1f} ms ({1000 * statistics.fmean(episode_calls):.1f} ms)")
        started = {kind: sum(value for labels, value in scrape(
            meter.ports["environment"], f"rlfleet_episode_sandbox_cpu_seconds_{kind}").items()
            if dict(labels)["step"] == "start") for kind in ("sum", "count")}
    finally:
        collector.stop()
    trajectories = ns.multiturn_rounds * ns.groups * ns.group_size
    canned = summarize(rates["singleturn"], rates["canned"])
    episode = summarize(rates["singleturn"], rates["episode"])
    return {**summarize(rates["singleturn"], rates["multiturn"]), "turns": TURNS,
            "per_round": rates, "ratios_per_round": [m / s for m, s in zip(rates["multiturn"], rates["singleturn"])],
            "canned": {key: canned[key] for key in ("measured", "ratio", "low", "high")},
            "episode": {key: episode[key] for key in ("measured", "ratio", "low", "high")},
            "episode_ratios_per_round": [m / s for m, s in zip(rates["episode"], rates["singleturn"])],
            "episode_tool_seconds_mean": statistics.fmean(episode_seconds),
            "tool_seconds_mean": statistics.fmean(tool_seconds),
            "tool_calls_per_trajectory": len(tool_seconds) / trajectories,
            "sandbox_starts": started["count"],
            "sandbox_start_cpu_ms": 1000 * started["sum"] / started["count"] if started["count"] else None,
            "full_tokens": {side: statistics.fmean(lengths) for side, lengths in full_lengths.items()},
            "sides": meter.per_trajectory()}


class SideMeter:
    """What each side of (d) costs per trajectory, summed over its rounds: the gRPC calls every service
    answered (``rlfleet_rpc_seconds_count`` by method: the collector's calls to the others, the trainer's
    to the collector), the CPU of every service process (children included: the sandboxes in the
    environment's, vLLM's engine core in generation's) and of the whole host, and the later turns' prompt
    tokens and prefix-cache hits (the collector's ``rlfleet_episode_*prompt_tokens_total``)."""

    def __init__(self, services: dict[str, ServiceProcess]):
        self.ports = {key.split("-")[0]: proc.metrics_port for key, proc in services.items()}
        self.cpu = CpuMeter({}, host=True)
        for key, proc in services.items():
            self.cpu.follow(key.split("-")[0], proc.process.pid)
        self.collector_port = services["collector"].metrics_port
        self.totals: dict[str, dict] = {}

    def snapshot(self) -> dict:
        calls = {}
        for service, port in self.ports.items():
            for labels, value in scrape(port, "rlfleet_rpc_seconds_count").items():
                method = dict(labels)["method"].rsplit("/", 1)[-1]
                if method not in ("Check", "Watch", "GetStatus"):  # health probes, and this bench's poller
                    calls[f"{service}.{method}"] = value
        tokens = {name: scrape(self.collector_port, f"rlfleet_episode_{name}_total").get((("turn", "later"),), 0.0)
                  for name in ("prompt_tokens", "cached_prompt_tokens")}
        sandbox = {}  # the environment's sandboxes: CPU and count of each start, call and separate reset
        for kind in ("sum", "count"):
            for labels, value in scrape(self.ports["environment"], f"rlfleet_episode_sandbox_cpu_seconds_{kind}").items():
                sandbox[f"{dict(labels)['step']}_{kind}"] = value
        return {"calls": calls, "cpu": self.cpu.snapshot(), "tokens": tokens, "sandbox": sandbox}

    def add(self, side: str, before: dict, after: dict, trajectories: int) -> None:
        total = self.totals.setdefault(side, {"trajectories": 0, "calls": {}, "cpu": {}, "tokens": {}, "sandbox": {}})
        total["trajectories"] += trajectories
        for kind in ("calls", "cpu", "tokens", "sandbox"):
            for key, value in after[kind].items():
                total[kind][key] = total[kind].get(key, 0.0) + value - before[kind].get(key, 0.0)

    def per_trajectory(self) -> dict[str, dict]:
        out = {}
        for side, total in self.totals.items():
            n = total["trajectories"]
            calls = {key: value / n for key, value in sorted(total["calls"].items()) if value > 0}
            prompt, cached = total["tokens"]["prompt_tokens"], total["tokens"]["cached_prompt_tokens"]
            sandbox = total["sandbox"]
            tool_calls = sandbox.get("call_count", 0.0)
            out[side] = {"calls_per_trajectory": sum(calls.values()), "calls": calls,
                         "cpu_ms_per_trajectory": {key: 1000 * value / n for key, value in total["cpu"].items()},
                         "later_turn_prefix_cache_hit_rate": cached / prompt if prompt else None,
                         "sandbox_calls_per_trajectory": tool_calls / n,
                         "sandbox_starts_per_trajectory": sandbox.get("start_count", 0.0) / n,
                         "tool_call_host_cpu_ms": 1000 * sandbox["call_sum"] / tool_calls if tool_calls else None,
                         "episode_sandbox_host_cpu_ms": 1000 * (sandbox.get("start_sum", 0.0)
                                                                + sandbox.get("reset_sum", 0.0)) / n}
        canned = out.get("canned")
        for side, costs in out.items():  # each call's whole cost: the side's CPU beyond canned tools', per call
            calls_made = costs["sandbox_calls_per_trajectory"]
            if canned is None or side == "canned" or not calls_made:
                continue
            for key in ("environment", "host"):
                extra = costs["cpu_ms_per_trajectory"][key] - canned["cpu_ms_per_trajectory"][key]
                costs[f"tool_call_{key}_cpu_ms_all_in"] = extra / calls_made
        return out


def report_multiturn(row: dict, ns) -> None:
    turns, canned, episode = row["turns"], row["canned"], row["episode"]
    print(f"\n(d) multi-turn episodes vs single turns of the same sampled tokens, end to end | {ns.groups} groups x "
          f"{ns.group_size} | {turns} turns x {ns.max_tokens} tokens, each answered by a python tool call in the "
          f"sandbox, vs 1 turn x {turns * ns.max_tokens} tokens | {ns.multiturn_rounds} alternating rounds")
    print(f"{'measure':<36} | {'traj/s':>6} | {'ratio':>5} | {'ratio IQR':>11} | goal")
    print(f"{'-' * 36}-+-{'-' * 6}-+-{'-' * 5}-+-{'-' * 11}-+-----")
    print(f"{'single turn, same sampled tokens':<36} | {row['base']:>6.1f} | {1:>5.2f} | {'':>11} |")
    met = "met" if row["ratio"] >= MULTITURN_GOAL else "MISSED"
    print(f"{f'{turns} turns with tool calls':<36} | {row['measured']:>6.1f} | {row['ratio']:>5.2f} | "
          f"{row['low']:>5.2f}-{row['high']:<5.2f} | >= {MULTITURN_GOAL} {met}")
    print(f"{f'{turns} turns, tool output canned':<36} | {canned['measured']:>6.1f} | {canned['ratio']:>5.2f} | "
          f"{canned['low']:>5.2f}-{canned['high']:<5.2f} | (where the loss is)")
    met = "met" if episode["ratio"] >= MULTITURN_GOAL else "MISSED"
    print(f"{f'{turns} turns, a sandbox per episode':<36} | {episode['measured']:>6.1f} | {episode['ratio']:>5.2f} | "
          f"{episode['low']:>5.2f}-{episode['high']:<5.2f} | >= {MULTITURN_GOAL} {met}")
    print(f"  per-round ratios (with tool calls): {' '.join(f'{r:.2f}' for r in row['ratios_per_round'])}; "
          f"a sandbox per episode: {' '.join(f'{r:.2f}' for r in row['episode_ratios_per_round'])}")
    print_side_costs(row["sides"])
    if row["sandbox_start_cpu_ms"] is not None:
        print(f"  sandboxes started, every side and round (the warm-up's included): {row['sandbox_starts']:.0f}, "
              f"{row['sandbox_start_cpu_ms']:.1f} ms of CPU each (bwrap and the zygote until ready); an episode "
              f"or call given a parked one starts none")
    print(f"  tool calls: {row['tool_calls_per_trajectory']:.2f} per trajectory, {1000 * row['tool_seconds_mean']:.1f} "
          f"ms each (mean, the sandbox's run as the environment awaits it; a sandbox per episode "
          f"{1000 * row['episode_tool_seconds_mean']:.1f} ms); tokens per trajectory (prompt + sampled "
          f"+ observations): multi-turn {row['full_tokens']['multiturn']:.0f}, single-turn "
          f"{row['full_tokens']['singleturn']:.0f}")


SIDE_NAMES = {"singleturn": "single turn", "multiturn": "a sandbox per call", "canned": "canned tools",
              "episode": "sandbox per episode"}


def print_side_costs(sides: dict[str, dict]) -> None:
    """Per side: gRPC calls, CPU by process and of the host (ms per trajectory), the later turns' cache hits;
    and the ratio the host's CPU alone allows: single-turn host CPU / the side's (on a host whose cores are
    all busy, throughput follows CPU per trajectory)."""
    processes = sorted({key for side in sides.values() for key in side["cpu_ms_per_trajectory"]} - {"host"})
    base = sides["singleturn"]["cpu_ms_per_trajectory"]["host"]
    print(f"  per trajectory | {'side':<19} | calls | " + " | ".join(f"{p[:10]:>10}" for p in processes)
          + " |  host CPU ms | CPU bound | later-turn cache hits")
    for side, costs in sides.items():
        cpu = costs["cpu_ms_per_trajectory"]
        hits = costs["later_turn_prefix_cache_hit_rate"]
        print(f"                 | {SIDE_NAMES.get(side, side):<19} | {costs['calls_per_trajectory']:>5.2f} | "
              + " | ".join(f"{cpu.get(p, 0):>10.1f}" for p in processes)
              + f" | {cpu['host']:>12.1f} | {base / cpu['host']:>9.2f} | "
              + (f"{hits:.2f}" if hits is not None else "-"))
    for side in ("multiturn", "episode"):
        costs = sides[side]
        if costs["tool_call_host_cpu_ms"] is None:
            continue
        print(f"  tool calls, {SIDE_NAMES[side]}: {costs['sandbox_calls_per_trajectory']:.2f} per trajectory, "
              f"{costs['tool_call_host_cpu_ms']:.2f} ms of CPU each in the sandbox (its processes, the zygote's "
              f"fork and reset: tool_call_host_cpu_ms), sandboxes' starts and separate resets "
              f"{costs['episode_sandbox_host_cpu_ms']:.2f} ms per episode ({costs['sandbox_starts_per_trajectory']:.3f} "
              f"starts); all in, beyond canned tools: environment process tree "
              f"{costs.get('tool_call_environment_cpu_ms_all_in', float('nan')):.2f} ms, whole host "
              f"{costs.get('tool_call_host_cpu_ms_all_in', float('nan')):.2f} ms per call")
    for side in ("singleturn", "multiturn"):
        calls = sides[side]["calls"]
        print(f"  calls per trajectory, {SIDE_NAMES[side]}: "
              + ", ".join(f"{method} {count:.2f}" for method, count in sorted(calls.items(), key=lambda kv: -kv[1])))


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF model directory (default: build the tiny local model in a cache dir)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--groups", type=int, default=32, help="(a) groups per phase")
    parser.add_argument("--groups-per-step", type=int, default=8, help="(a) groups per trainer batch")
    parser.add_argument("--rounds", type=int, default=3, help="(a) alternating end-to-end/generation rounds")
    parser.add_argument("--steps", type=int, default=6, help="(b) trainer steps per run")
    parser.add_argument("--groups-per-step-b", type=int, default=4, help="(b) groups per trainer step")
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="(b) simulated trainer compute per step (default: one batch's generation, measured)")
    parser.add_argument("--step-from", choices=("rollout", "generation"), default="rollout",
                        help="(b) without --step-seconds, the step is as long as one batch's rollout through the "
                             "pipeline (submit to batch received), or its generation alone on the replica")
    parser.add_argument("--sync-rounds", type=int, default=3, help="(b) alternating sync/async runs")
    parser.add_argument("--prefetch", type=int, default=None,
                        help="(b) the trainer's batches(prefetch=N), both modes (default: the SDK's default)")
    parser.add_argument("--inprocess-rounds", type=int, default=3, help="(c) alternating end-to-end/in-process rounds")
    parser.add_argument("--inprocess-engine", choices=["plain", "service"], default="plain",
                        help="(c) the in-process engine's process layout and queue readers: vLLM's own, or the "
                             "generation service's (the model in the engine core on <= 2 CPUs, readers that sleep)")
    parser.add_argument("--long-tokens", type=int, default=1024, help="(c) response length of the long row")
    parser.add_argument("--long-groups", type=int, default=4, help="(c) groups of the long row")
    parser.add_argument("--settle-seconds", type=float, default=1.5,
                        help="(c) pause before each phase: an idle vLLM worker busy-spins ~1 s after its last step, "
                             "which would steal a core from the other engine's phase")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="both engines' max_model_len (default 1024, or room for --long-tokens when (c) runs)")
    parser.add_argument("--multiturn-rounds", type=int, default=3,
                        help="(d) alternating multi-turn/single-turn rounds")
    parser.add_argument("--parts", default="abcde", help="which parts to run: any of a, b, c, d, e")
    parser.add_argument("--swap-rounds", type=int, default=2, help="(e) rotating rounds of the four swap modes")
    parser.add_argument("--swap-modes", default="wait,abort,keep,resume", help="(e) the modes compared")
    parser.add_argument("--swap-seconds", type=float, default=30.0, help="(e) seconds each mode's trainer reads")
    parser.add_argument("--push-seconds", type=float, default=2.0, help="(e) seconds between pushes")
    parser.add_argument("--swap-max-tokens", type=int, default=256, help="(e) sampled tokens per sample")
    parser.add_argument("--swap-groups-per-step", type=int, default=4, help="(e) groups per batch")
    parser.add_argument("--swap-prompts", type=int, default=2000, help="(e) prompts submitted per run")
    parser.add_argument("--reference-threads", type=int, default=SuiteOptions.reference_threads,
                        help="the reference service's --torch-threads (0: torch's default, one per core)")
    ns = parser.parse_args()
    if "c" in ns.parts and ns.long_tokens == ns.max_tokens:
        parser.error("--long-tokens must differ from --max-tokens (they name the two rows of (c))")
    if "d" in ns.parts and os.geteuid() != 0:
        parser.error("(d) runs python tool calls in the sandbox, which drops to uid 65534 and so needs root; "
                     "leave d out of --parts")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from rlfleet.services.models.tiny import build_tiny_model

    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-bench-pipeline-"))
    max_model_len = ns.max_model_len or (max(1024, ns.long_tokens + 128) if "c" in ns.parts else 1024)
    options = SuiteOptions(model_dir=model_dir, generation_replicas=1, kv_cache_bytes=256 << 20,
                           max_model_len=max_model_len, reference_threads=ns.reference_threads,
                           metrics="d" in ns.parts, **(environment_options(workdir) if "d" in ns.parts else {}))
    backends = start_suite(options, workdir, without_collector=True)
    try:
        meter = CpuMeter()
        for key, proc in backends.items():
            meter.add(key.split("-")[0], proc.process.pid)
        e2e = measure_end_to_end(backends, workdir, meter, ns) if "a" in ns.parts else None
        sync = measure_sync_async(backends, workdir, model_dir, ns) if "b" in ns.parts else None
        inprocess = measure_inprocess(backends, workdir, options, ns) if "c" in ns.parts else None
        multiturn = measure_multiturn(backends, workdir, ns) if "d" in ns.parts else None
        swaps = (measure_swap_modes(backends, workdir, model_dir, start_collector, log, ns) if "e" in ns.parts
                 else None)
    finally:
        stop_suite(backends)
    print(f"\nmachine load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"({psutil.cpu_count()} cores); reference torch threads: {ns.reference_threads or 'default'}")
    if e2e is not None:
        report_end_to_end(e2e, model_dir, ns)
    if sync is not None:
        report_sync_async(sync, e2e, ns)
    if inprocess is not None:
        report_inprocess(inprocess, options, ns)
    if multiturn is not None:
        report_multiturn(multiturn, ns)
    swaps_result = swap_result(swaps) if swaps is not None else None
    if swaps is not None:
        report_swap_modes(swaps, swaps_result, ns)
    print(HOW_TO_READ)
    print("RESULT " + json.dumps({**result_json(e2e, sync, inprocess, multiturn, ns), **(swaps_result or {})}))


def result_json(e2e: dict | None, sync: dict | None, inprocess: dict | None, multiturn: dict | None, ns) -> dict:
    """The ratios of every part run (medians, and per round where the part keeps them)."""
    out: dict = {"parts": ns.parts}
    if e2e is not None:
        out.update(e2e_over_generation=e2e["ratio"], e2e_over_generation_sorted_ratios=e2e["ratios"],
                   e2e_traj_per_s=e2e["measured"], generation_alone_traj_per_s=e2e["base"])
    if sync is not None:
        out.update(async_over_sync=sync["ratio"], async_over_sync_sorted_ratios=sync["ratios"],
                   async_over_sync_per_round=[round(r, 4) for r in sync["ratios_per_round"]],
                   async_over_sync_after_first_batch=sync["after_first_batch"]["ratio"],
                   async_over_sync_after_first_batch_sorted_ratios=sync["after_first_batch"]["ratios"],
                   step_seconds=ns.step_seconds, prefetch=ns.prefetch,
                   batch_generation_seconds=round(sync["generation_seconds"], 4),
                   batch_rollout_seconds=round(sync["rollout_seconds"], 4))
    if inprocess is not None:
        out["inprocess_engine"] = ns.inprocess_engine
    for tokens, row in (inprocess or {}).items():
        out[f"e2e_over_inprocess_{tokens}"] = row["ratio"]
        out[f"e2e_over_inprocess_{tokens}_per_round"] = row["ratios_per_round"]
        out[f"e2e_traj_per_s_{tokens}_per_round"] = row["e2e_per_round"]
        out[f"inprocess_traj_per_s_{tokens}_per_round"] = row["inprocess_per_round"]
        out[f"cpu_ms_per_trajectory_{tokens}"] = row["cpu_ms_per_trajectory"]
        out[f"cpu_bound_{tokens}"] = row["cpu_bound"]
    if multiturn is not None:
        out.update(multiturn_ratio=multiturn["ratio"], multiturn_ratio_per_round=multiturn["ratios_per_round"],
                   multiturn_goal_met=multiturn["ratio"] >= MULTITURN_GOAL,
                   multiturn_traj_per_s=multiturn["measured"], singleturn_same_tokens_traj_per_s=multiturn["base"],
                   multiturn_canned_tools_ratio=multiturn["canned"]["ratio"],
                   multiturn_canned_tools_traj_per_s=multiturn["canned"]["measured"],
                   multiturn_tool_call_ms=1000 * multiturn["tool_seconds_mean"],
                   multiturn_episode_sandbox_ratio=multiturn["episode"]["ratio"],
                   multiturn_episode_sandbox_ratio_per_round=multiturn["episode_ratios_per_round"],
                   multiturn_episode_sandbox_traj_per_s=multiturn["episode"]["measured"],
                   multiturn_episode_sandbox_tool_call_ms=1000 * multiturn["episode_tool_seconds_mean"],
                   prefix_cache_hit_rate=multiturn["sides"]["multiturn"]["later_turn_prefix_cache_hit_rate"],
                   calls_per_trajectory={side: round(costs["calls_per_trajectory"], 2)
                                         for side, costs in multiturn["sides"].items()},
                   host_cpu_ms_per_trajectory={side: round(costs["cpu_ms_per_trajectory"]["host"], 1)
                                               for side, costs in multiturn["sides"].items()})
        episode, per_call = multiturn["sides"]["episode"], multiturn["sides"]["multiturn"]
        out.update(sandbox_start_cpu_ms=multiturn["sandbox_start_cpu_ms"], sandbox_starts=multiturn["sandbox_starts"],
                   tool_call_host_cpu_ms=episode["tool_call_host_cpu_ms"],
                   episode_sandbox_host_cpu_ms=episode["episode_sandbox_host_cpu_ms"],
                   per_call_tool_call_host_cpu_ms=per_call["tool_call_host_cpu_ms"],
                   per_call_sandbox_host_cpu_ms_per_episode=per_call["episode_sandbox_host_cpu_ms"],
                   tool_call_cpu_ms_all_in={side: {key: round(costs[f"tool_call_{key}_cpu_ms_all_in"], 2)
                                                   for key in ("environment", "host")}
                                            for side, costs in multiturn["sides"].items()
                                            if "tool_call_host_cpu_ms_all_in" in costs})
    return out


def report_end_to_end(e2e: dict, model_dir: Path, ns) -> None:
    cores = psutil.cpu_count() or 1
    print(f"\n(a) trajectories/s end to end vs generation alone | model {model_dir.name} | {ns.groups} groups x "
          f"{ns.group_size} samples x {ns.max_tokens} tokens | {MAX_GENERATIONS_IN_FLIGHT} Generate calls in flight "
          f"| {ns.rounds} alternating rounds")
    print(f"{'generation alone traj/s':>23} | {'end-to-end traj/s':>17} | {'ratio':>5} | {'ratio IQR':>11} | target")
    print(f"{'-' * 23}-+-{'-' * 17}-+-{'-' * 5}-+-{'-' * 11}-+-------")
    print(f"{e2e['base']:>23.1f} | {e2e['measured']:>17.1f} | {e2e['ratio']:>5.2f} | "
          f"{e2e['low']:>5.2f}-{e2e['high']:<5.2f} | >= 0.85 {'ok' if e2e['ratio'] >= 0.85 else 'MISSED'}")
    stages = "  ".join(f"{name} {value:.1f}" for name, value in e2e["stages"].items())
    print(f"  mean groups inside each collector stage (end to end): {stages}")
    keys = ["generation", "reference", "reward", "trajectory", "collector", "bench"]
    print(f"  CPU seconds per trajectory, by process tree ({cores} cores; busy = CPU s / (cores x wall s)):")
    print(f"  {'phase':>16} | " + " | ".join(f"{k:>10}" for k in keys) + f" | {'total':>7} | {'busy':>5}")
    for phase, label in (("alone", "generation alone"), ("e2e", "end to end")):
        cpu = e2e["cpu"][phase]
        n = ns.rounds * ns.groups * ns.group_size
        total = sum(cpu.get(k, 0.0) for k in keys)
        print(f"  {label:>16} | " + " | ".join(f"{1000 * cpu.get(k, 0.0) / n:>8.1f}ms" for k in keys)
              + f" | {1000 * total / n:>5.1f}ms | {total / (cores * cpu['wall']):>5.0%}")


def report_sync_async(sync: dict, e2e: dict | None, ns) -> None:
    print(f"\n(b) async (max_staleness=1) vs sync | {ns.steps} trainer steps of {ns.groups_per_step_b} groups "
          f"(batch {ns.groups_per_step_b * ns.group_size}), {ns.step_seconds:g} s compute + a weight push per step "
          f"| batches read with prefetch {ns.prefetch or 'of the SDK default'} | {ns.sync_rounds} alternating runs, "
          f"fresh collector each")
    print(f"{'sync traj/s':>11} | {'async traj/s':>12} | {'ratio':>5} | {'ratio IQR':>11} | staleness sync / async")
    print(f"{'-' * 11}-+-{'-' * 12}-+-{'-' * 5}-+-{'-' * 11}-+-{'-' * 30}")
    print(f"{sync['base']:>11.1f} | {sync['measured']:>12.1f} | {sync['ratio']:>5.2f} | "
          f"{sync['low']:>5.2f}-{sync['high']:<5.2f} | {sync['histograms']['sync'][-1]} / "
          f"{sync['histograms']['async'][-1]}")
    steady = sync["after_first_batch"]
    print(f"  after the first batch (steps 2..{ns.steps}: the pipeline's fill left out, as in a long run): sync "
          f"{steady['base']:.1f}, async {steady['measured']:.1f} traj/s, ratio {steady['ratio']:.2f} "
          f"({' '.join(f'{r:.2f}' for r in steady['ratios'])}, sorted)")
    print(f"  per-round ratios (async / sync): {' '.join(f'{r:.2f}' for r in sync['ratios_per_round'])}; "
          f"one batch: generated alone {sync['generation_seconds']:.2f} s, through the pipeline "
          f"{sync['rollout_seconds']:.2f} s (medians); trainer step {ns.step_seconds:g} s")
    for mode in ("sync", "async"):
        total, waiting, pushing, at_collector = sync["per_step"][mode]
        print(f"  {mode:>5}: {total:.2f} s/step = batch wait {waiting:.2f} + trainer {ns.step_seconds:g} + "
              f"push {pushing:.2f} (at the collector {at_collector:.2f}; "
              f"+ {total - waiting - pushing - ns.step_seconds:.2f} other), medians")
    if e2e is not None:
        gen_step = ns.groups_per_step_b * ns.group_size / e2e["base"]
        print(f"  per step: generation alone would take ~{gen_step:.2f} s, the trainer {ns.step_seconds:g} s + push;"
              f" sync pays both in series, async overlaps them (ideal ratio ~(gen + step) / max(gen, step)).")


HOW_TO_READ = """
How to read: ratios are medians of per-round ratios from runs adjacent in time (a noisy machine shifts both).
(a) ratio = end-to-end traj/s / generation-alone traj/s on the same replica, prompts, group size and sampling:
    1.0 = reference, reward, trajectory buffer and batch delivery add nothing to generation (target >= 0.85).
    'groups inside each stage' is where a group spends its time (Little's law); the CPU table shows whether the
    other services fit beside vLLM on this machine's cores.
(b) ratio = async traj/s / sync traj/s for a trainer that computes and pushes each step (> 1: async overlaps
    generation with the trainer; staleness histograms: trajectories by versions stale at append).
(c) ratio = end-to-end traj/s / plain in-process vLLM traj/s (AsyncLLM in the bench's process, the service's
    engine settings, the same prompt token ids, all prompts submitted at once): 1.0 = the whole data plane
    (gRPC, the generation service, reference, reward, trajectory buffer, batch delivery) costs nothing over
    calling vLLM yourself. The long row shows whether a fixed per-group cost hides behind longer generation.
(d) ratio = multi-turn traj/s / single-turn traj/s, both end to end with the same prompts and the same sampled
    tokens per trajectory: 1.0 = turns cost nothing over sampling the same tokens at once; what a turn adds is
    its own Generate call per episode, an environment step with a sandboxed tool call, and the prefill of the
    growing history (goal >= 0.7). The canned row runs the same episodes with the tool's output given instead
    of run: its gap to the single turn is the turns' own cost, its gap to the tool row the tool calls'.
(e) per swap mode under frequent pushes: traj/s (resume / keep >= 0.95), sampled tokens thrown away per push
    (abort throws away what was in flight; wait, keep and resume nothing), tokens carried over into resumed
    continuations, and whether every batch was full and held only groups whose scores vary."""


if __name__ == "__main__":
    main()
