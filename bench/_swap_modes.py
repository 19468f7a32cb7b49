"""Part (e) of ``bench/pipeline.py``: the weight-swap modes under frequent pushes, with dynamic sampling.

For each mode (wait, abort, keep, resume; the collector's ``--swap-mode``, so every push does it) a fresh
async collector (unbounded ``--max-staleness``, so that a group is thrown away only by its swap mode, never
for its staleness; ``--dynamic-sampling``) runs for ``--swap-seconds``: a trainer reads
whole-group batches as fast as they come while a pusher pushes the tiny model's weights every
``--push-seconds``. Half the prompts score 0 whatever is sampled (reward ``none``: filtered), half score
the fraction of lowercase characters (``char_fraction [a-z]``: they vary), ``--swap-max-tokens`` sampled
tokens each (``ignore_eos``), so a push nearly always lands on samples in flight. The modes alternate
``--swap-rounds`` times, the order rotating every round. Per mode: trajectories/s delivered, sampled tokens
thrown away per push (the collector's ``discarded_tokens``: the samples of aborted or too-stale groups),
the tokens the engine carried over into continuations (``resumed_tokens``), the staleness histogram; over
every run, the fraction of batches that were full (``batch_size`` rows) and held only groups whose scores
vary. Between runs the trajectory service's leftovers are dropped (DropStale) so no run reads another's.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import grpc

from rlfleet.client import DeadlineExceededError, connect
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, trajectory_pb2, trajectory_pb2_grpc

MODES = ("wait", "abort", "keep", "resume")
MAX_STALENESS = 1_000_000


def _prompts(tag: str, count: int) -> list[dict]:
    """Half flat (always filtered), half varied, interleaved."""
    prompts = []
    for i in range(count):
        varied = i % 2 == 0
        prompts.append({"prompt": f"write {i} words about the sea", "prompt_id": f"{tag}-{i}",
                        "reward_fn": "char_fraction" if varied else "none",
                        "reward_args": {"pattern": "[a-z]"} if varied else {}})
    return prompts


def _resumed_tokens(backends) -> int:
    total = 0
    for name, proc in backends.items():
        if name.startswith("generation"):
            with grpc.insecure_channel(proc.address) as channel:
                total += generation_pb2_grpc.GenerationServiceStub(channel).GetEngineStatus(
                    generation_pb2.GetEngineStatusRequest(), timeout=30).resumed_tokens
    return total


def _drop_leftovers(backends) -> int:
    with grpc.insecure_channel(backends["trajectory"].address) as channel:
        return trajectory_pb2_grpc.TrajectoryServiceStub(channel).DropStale(
            trajectory_pb2.DropStaleRequest(below_policy_version=2**63 - 1), timeout=60).dropped


def one_run(backends, workdir: Path, start_collector, state: dict, mode: str, tag: str, ns) -> dict:
    """One collector in ``mode`` for ``ns.swap_seconds``: what the trainer got and what was thrown away."""
    per_batch = ns.group_size * ns.swap_groups_per_step
    collector = start_collector(backends, workdir, tag, ns, "--mode", "async", "--max-staleness", str(MAX_STALENESS), "--mismatch-kl-target", "null",
                                "--groups-per-step", str(ns.swap_groups_per_step), "--swap-mode", mode,
                                "--dynamic-sampling", "true",
                                "--sampling", f'{{"temperature": 1.0, "max_tokens": {ns.swap_max_tokens}, '
                                              f'"ignore_eos": true}}')
    resumed_before = _resumed_tokens(backends)
    pushes, stop = [], threading.Event()
    try:
        with connect(collector.address) as client, connect(collector.address) as pusher_client:
            # Enough prompts that the run never starves (--swap-prompts; the rest die with the state directory).
            client.submit_prompts(_prompts(tag, ns.swap_prompts))

            def pusher():
                while not stop.wait(ns.push_seconds):
                    pushes.append(pusher_client.push_weights(state, progress=False).server_seconds)

            thread = threading.Thread(target=pusher, name="pusher", daemon=True)
            batches = full = rows = 0
            started = time.perf_counter()
            thread.start()
            # A mode may starve the trainer (abort, when pushes come faster than a group generates): a batch
            # wait is bounded by the run's length, and the run ends with what it got.
            with client.batches(per_batch, idle_timeout=ns.swap_seconds) as stream:
                while time.perf_counter() - started < ns.swap_seconds:
                    try:
                        batch = next(stream)
                    except DeadlineExceededError:
                        break
                    batches += 1
                    rows += len(batch)
                    by_group: dict[int, set[float]] = {}
                    for group_id, score in zip(batch["group_id"].tolist(), batch["score"].tolist()):
                        by_group.setdefault(group_id, set()).add(score)
                    full += len(batch) == per_batch and all(len(scores) > 1 for scores in by_group.values())
            seconds = time.perf_counter() - started
            stop.set()
            thread.join()
            status = client.status()
    finally:
        stop.set()
        collector.stop()
    dropped = _drop_leftovers(backends)
    return {"mode": mode, "traj_per_s": rows / seconds, "batches": batches, "full_batches": full,
            "pushes": len(pushes), "push_seconds": statistics.median(pushes) if pushes else 0.0,
            "discarded_tokens": status.discarded_tokens, "discarded_samples": status.discarded_samples,
            "resumed_tokens": _resumed_tokens(backends) - resumed_before,
            "filtered_groups": status.dynamic_sampling.filtered_groups,
            "oversampling": status.dynamic_sampling.oversampling,
            "histogram": list(status.staleness_histogram), "dropped_after": dropped}


def measure_swap_modes(backends, workdir: Path, model_dir: Path, start_collector, log, ns) -> dict:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    modes = tuple(ns.swap_modes.split(","))
    if "keep" not in modes or "resume" not in modes or set(modes) - set(MODES):
        raise ValueError(f"--swap-modes: a comma-separated subset of {','.join(MODES)} with keep and resume")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    one_run(backends, workdir, start_collector, state, "keep", "swap-warmup", ns)  # warm-up, not counted
    for round_index in range(ns.swap_rounds):
        order = modes[round_index % len(modes):] + modes[:round_index % len(modes)]
        for mode in order:
            run = one_run(backends, workdir, start_collector, state, mode, f"swap-{mode}{round_index}", ns)
            runs[mode].append(run)
            log(f"  (e) round {round_index} {mode:>6}: {run['traj_per_s']:.1f} traj/s, {run['pushes']} pushes, "
                f"{run['discarded_tokens']} tokens thrown away, {run['resumed_tokens']} carried over, "
                f"{run['full_batches']}/{run['batches']} full batches, staleness {run['histogram']}")
    return runs


def swap_result(runs: dict[str, list[dict]]) -> dict:
    def per_push(run: dict) -> float:
        return run["discarded_tokens"] / max(run["pushes"], 1)

    rounds = len(runs["keep"])
    resume_over_keep = [runs["resume"][i]["traj_per_s"] / runs["keep"][i]["traj_per_s"] for i in range(rounds)]
    every = [run for mode_runs in runs.values() for run in mode_runs]
    return {
        "swap_traj_per_s": {mode: statistics.median(r["traj_per_s"] for r in mode_runs) for mode, mode_runs in runs.items()},
        "swap_wasted_tokens_per_push": {mode: statistics.median(per_push(r) for r in mode_runs)
                                        for mode, mode_runs in runs.items()},
        "swap_resumed_tokens_per_push": {mode: statistics.median(r["resumed_tokens"] / max(r["pushes"], 1)
                                                                 for r in mode_runs) for mode, mode_runs in runs.items()},
        "resume_wasted_tokens": sum(r["discarded_tokens"] for r in runs["resume"]),
        "resume_over_keep": statistics.median(resume_over_keep),
        "resume_over_keep_per_round": [round(r, 4) for r in resume_over_keep],
        "full_batch_fraction": sum(r["full_batches"] for r in every) / max(sum(r["batches"] for r in every), 1),
        "swap_histograms": {mode: [r["histogram"] for r in mode_runs] for mode, mode_runs in runs.items()},
    }


def report_swap_modes(runs: dict[str, list[dict]], result: dict, ns) -> None:
    print(f"\n(e) swap modes under a push every {ns.push_seconds:g} s | async, unbounded staleness, dynamic "
          f"sampling (half the prompts always filtered) | {ns.swap_groups_per_step} groups x {ns.group_size} samples "
          f"x {ns.swap_max_tokens} tokens per batch | {ns.swap_seconds:g} s per run, {ns.swap_rounds} rotating rounds")
    print(f"{'mode':>6} | {'traj/s':>6} | {'pushes/run':>10} | {'tokens thrown away/push':>23} | "
          f"{'carried over/push':>17} | {'full batches':>12} | staleness histogram (last run)")
    for mode, mode_runs in runs.items():
        batches = sum(r["batches"] for r in mode_runs)
        full = sum(r["full_batches"] for r in mode_runs)
        print(f"{mode:>6} | {result['swap_traj_per_s'][mode]:>6.1f} | "
              f"{statistics.median(r['pushes'] for r in mode_runs):>10.0f} | "
              f"{result['swap_wasted_tokens_per_push'][mode]:>23.1f} | "
              f"{result['swap_resumed_tokens_per_push'][mode]:>17.1f} | {full:>5}/{batches:<6} | "
              f"{mode_runs[-1]['histogram']}")
    print(f"  resume / keep traj/s per round: {' '.join(f'{r:.2f}' for r in result['resume_over_keep_per_round'])} "
          f"(median {result['resume_over_keep']:.2f}; target >= 0.95); resume threw away "
          f"{result['resume_wasted_tokens']} sampled tokens (target 0); full batches "
          f"{result['full_batch_fraction']:.0%} (target 100 %)")
