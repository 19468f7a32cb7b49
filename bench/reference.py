"""Reference service throughput against the same model called in-process.

    .venv/bin/python bench/reference.py [--callers 1 8 64] [--seconds 1] [--rounds 10]

For each number of concurrent callers ``c``: every caller owns one request of
``--seqs-per-request`` ragged sequences (random prompt and response lengths).

* in-process: one ``ReferenceScorer.score`` call on the union of the ``c``
  requests (the best an in-process caller can do with the same batch and the
  same token budget), repeated for ``--seconds``. It runs in a fresh child
  process with the service's environment: the bench process itself (gRPC
  client threads, two sets of imports) runs slower forward passes than a
  fresh process (see the reference benchmark page), which would flatter the
  service;
* service: ``c`` concurrent gRPC callers (one asyncio client, so the bench's own
  threads do not compete with the service for the CPU), each sending its
  request again as soon as the reply arrives, for ``--seconds``.

The two phases alternate ``--rounds`` times and the ratio service / in-process
is taken per round, from two phases adjacent in time: load from other
processes on a shared machine then hits both sides alike, and the median ratio
ignores the rounds it hit unevenly. The table reports median sequences/s and
the median (and interquartile range) of the ratio (target >= 0.9).

Both sides run torch with ``--torch-threads`` intra-op threads (default 1): on
a small shared machine OpenMP with every core busy slows down by an order of
magnitude whenever another process takes a core, which would drown the
service overhead this bench measures. ``--torch-threads 0`` keeps torch's default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from _common import summarize
from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import reference_pb2, reference_pb2_grpc
from rlfleet.wire import Ragged, decode_ragged, encode_ragged


def make_requests(callers: int, per_request: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                  vocab_size: int, seed: int) -> list[tuple[list[torch.Tensor], list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(callers):
        sequences, starts = [], []
        for _ in range(per_request):
            prompt = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (), generator=generator))
            response = int(torch.randint(response_len[0], response_len[1] + 1, (), generator=generator))
            sequences.append(torch.randint(0, vocab_size, (prompt + response,), generator=generator))
            starts.append(prompt)
        requests.append((sequences, starts))
    return requests


def in_process_worker(ns, service_args: list[str]) -> None:
    """Child process: load the scorer like the service does, answer "callers seconds" lines with seq/s."""
    import sys

    from rlfleet.services.reference.config import ReferenceConfig, ReferenceServiceConfig
    from rlfleet.services.reference.scorer import ReferenceScorer

    config = ReferenceServiceConfig.load(service_args, environ={})
    scorer = ReferenceScorer(ReferenceConfig(**{name: getattr(config, name) for name in ReferenceConfig.model_fields}))
    scorer.load()
    print("ready", scorer.vocab_size, flush=True)
    for line in sys.stdin:
        callers, seconds = line.split()
        requests = make_requests(int(callers), ns.seqs_per_request, tuple(ns.prompt_len), tuple(ns.response_len),
                                 scorer.vocab_size, seed=int(callers))
        print(in_process_rate(scorer, requests, float(seconds)), flush=True)


class InProcess:
    """The in-process side, driven over a pipe."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--in-process-worker", *argv], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env})
        ready = self.process.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the in-process worker failed to start")
        self.vocab_size = int(ready[1])

    def rate(self, callers: int, seconds: float) -> float:
        self.process.stdin.write(f"{callers} {seconds}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def in_process_rate(scorer, requests, seconds: float) -> float:
    """Sequences/s of repeated one-call scoring of the union of the requests."""
    sequences = [s for sequences, _ in requests for s in sequences]
    starts = [start for _, starts in requests for start in starts]
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or done == 0:
        scorer.score(sequences, starts)
        done += len(sequences)
    return done / (time.perf_counter() - started)


async def service_rate(stub, messages, sizes: list[int], seconds: float) -> float:
    """Sequences/s of len(messages) concurrent callers, each looping for ``seconds``."""
    deadline = time.perf_counter() + seconds
    counts = [0] * len(messages)

    async def caller(index: int) -> None:
        while True:
            reply = await stub.ScoreLogProbs(messages[index], timeout=300)
            if decode_ragged(reply.ref_log_probs).batch_size != sizes[index]:
                raise RuntimeError("wrong number of samples in a reply")
            counts[index] += sizes[index]
            if time.perf_counter() >= deadline:
                return

    started = time.perf_counter()
    await asyncio.gather(*(caller(index) for index in range(len(messages))))
    return sum(counts) / (time.perf_counter() - started)


async def measure(address: str, options, in_process: InProcess, vocab_size: int, ns) -> list[tuple]:
    rows = []
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = reference_pb2_grpc.ReferenceServiceStub(channel)
        for callers in ns.callers:
            requests = make_requests(callers, ns.seqs_per_request, tuple(ns.prompt_len), tuple(ns.response_len),
                                     vocab_size, seed=callers)
            messages = [
                reference_pb2.ScoreLogProbsRequest(
                    token_ids=encode_ragged(Ragged.from_list(sequences, torch.int64)), response_starts=starts)
                for sequences, starts in requests
            ]
            sizes = [len(sequences) for sequences, _ in requests]
            # Warm-up both sides on this batch shape.
            in_process.rate(callers, 0)
            await asyncio.gather(*(stub.ScoreLogProbs(m, timeout=300) for m in messages))
            local_rates, remote_rates = [], []
            for _ in range(ns.rounds):
                # The in-process phase blocks the loop on purpose: no RPC is in flight then.
                local_rates.append(in_process.rate(callers, ns.seconds))
                remote_rates.append(await service_rate(stub, messages, sizes, ns.seconds))
            summary = summarize(local_rates, remote_rates)
            rows.append((callers, summary["base"], summary["measured"], summary["ratio"], summary["low"],
                         summary["high"]))
            print(f"  {callers:>3} callers: ratios per round {[round(r, 2) for r in summary['ratios']]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF model directory (default: build the tiny local model in a cache dir)")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seqs-per-request", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--response-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per phase and round")
    parser.add_argument("--rounds", type=int, default=10, help="alternating in-process/service rounds")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads on both sides (0: default)")
    parser.add_argument("--service-arg", action="append", default=[],
                        help="extra flag for the service, e.g. --service-arg=--max-wait-ms=5 (repeatable)")
    parser.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()

    from rlfleet.services.models.tiny import build_tiny_model
    from rlfleet.services.reference.config import ReferenceServiceConfig

    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    service_args = ["--model-path", str(model_dir), "--log-level", "WARNING"]
    for extra in ns.service_arg:
        service_args += extra.split("=", 1)
    if ns.in_process_worker:
        in_process_worker(ns, service_args)
        return
    # Both sides get the same settings and the same environment.
    service_config = ReferenceServiceConfig.load(service_args, environ={})
    env = {"OMP_NUM_THREADS": str(ns.torch_threads)} if ns.torch_threads else {}
    worker_argv = [arg for arg in sys.argv[1:] if arg != "--in-process-worker"]
    if ns.model_dir is None:
        worker_argv += ["--model-dir", str(model_dir)]

    service = ServiceProcess("reference", service_args, env=env)
    service.start(Path(tempfile.mkdtemp(prefix="rlfleet-bench-reference-")))
    in_process = InProcess(worker_argv, env)
    limit = service_config.max_message_bytes
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    try:
        service.wait_ready(300)
        rows = asyncio.run(measure(service.address, options, in_process, in_process.vocab_size, ns))
    finally:
        in_process.close()
        service.stop()

    tokens = (sum(ns.prompt_len) + sum(ns.response_len)) / 2
    print(f"\nreference model {model_dir} | {ns.seqs_per_request} sequences/request, ~{tokens:.0f} tokens each | "
          f"max_wait_ms={service_config.max_wait_ms} token_budget={service_config.token_budget} | "
          f"torch threads {ns.torch_threads or 'default'} | {ns.rounds} rounds of {ns.seconds:g}s per side")
    print(f"{'callers':>7} | {'in-process seq/s':>16} | {'service seq/s':>13} | {'ratio':>5} | {'ratio IQR':>11}")
    print(f"{'-' * 7}-+-{'-' * 16}-+-{'-' * 13}-+-{'-' * 5}-+-{'-' * 11}")
    for callers, local, remote, ratio, low, high in rows:
        print(f"{callers:>7} | {local:>16.1f} | {remote:>13.1f} | {ratio:>5.2f} | {low:>5.2f}-{high:<5.2f}")


if __name__ == "__main__":
    main()
