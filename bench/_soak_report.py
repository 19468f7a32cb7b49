"""Analysis and tables of ``bench/soak.py``: latencies, errors, RSS growth, service logs, the RESULT dict."""

from __future__ import annotations

import collections
import os
import re
import statistics
from pathlib import Path

import psutil

from _soak_load import BACKPRESSURE, UNARY_RPCS

RSS_TARGET_PERCENT = 5.0
SHUTDOWN_MARK = "rlfleet.server: shutting down"
NAN = float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return NAN
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}" if seconds == seconds else "-"


def merge(records: list[dict]) -> dict:
    """The drivers' records as one (loop lags and driver figures stay per driver)."""
    out = {"latencies": collections.defaultdict(list), "errors": collections.Counter(),
           "retried": collections.Counter(), "acks": collections.Counter(), "batches": [], "submitted": [],
           "pushes": [], "buffer": [], "notes": [], "loop_lag": [], "drivers": []}
    for record in records:
        for rpc, values in record["latencies"].items():
            out["latencies"][rpc] += values
        for key in ("errors", "retried", "acks"):
            out[key].update(record[key])
        for key in ("batches", "submitted", "pushes", "buffer", "notes"):
            out[key] += record[key]
        out["loop_lag"].append(record["loop_lag"])
        out["drivers"].append(record["driver"])
    return out


# ---------------------------------------------------------------- memory

def tree_total(sample: dict[str, dict[str, tuple]]) -> dict[str, int]:
    return {key: sum(memory[0] for memory in tree.values()) for key, tree in sample.items()}


def per_minute(samples: list[tuple[float, dict]], key: str) -> list[tuple[int, int]]:
    """(minute since the load started, MB) of ``key``'s tree: the sample nearest each whole minute, and the last."""
    started = samples[0][0]
    marks = [*range(0, int(samples[-1][0] - started) + 1, 60), samples[-1][0] - started]
    nearest = [min(samples, key=lambda sample: abs(sample[0] - started - mark)) for mark in marks]
    return [(round((t - started) / 60, 1), round(tree_total(s).get(key, 0) / 1e6)) for t, s in nearest]


def rss_growth(samples: list[tuple[float, dict]], warmup_end: float) -> dict:
    """Per service tree: RSS at the end of the warm-up and at the end, growth in %, the slope of a line
    fitted to the samples after the warm-up (MB/min), each process's memory at both ends, the series."""
    after = [(t, s) for t, s in samples if t >= warmup_end] or samples[-1:]
    start_time, start = after[0]
    end = after[-1][1]
    out = {}
    for key in start:
        first, last = tree_total(start)[key], tree_total(end).get(key, 0)
        points = [(t - start_time, tree_total(s).get(key, 0)) for t, s in after]
        slope = statistics.linear_regression(*zip(*points)).slope * 60 / 1e6 if len(points) > 2 else 0.0
        minute_ago = min(after, key=lambda sample: abs(sample[0] - (after[-1][0] - 60)))[1]
        out[key] = {"start_mb": first / 1e6, "end_mb": last / 1e6, "growth_percent": 100 * (last / first - 1),
                    "slope_mb_per_min": slope,
                    "last_minute_percent": 100 * (last / tree_total(minute_ago).get(key, last) - 1),
                    "processes": {name: (memory, end.get(key, {}).get(name)) for name, memory in start[key].items()},
                    "series_mb": per_minute(samples, key)}
    return out


# ---------------------------------------------------------------- service logs

def log_summary(log_paths: dict[str, Path], limit: int = 3) -> dict[str, dict]:
    """Per service: WARNING / ERROR / Traceback lines in its log, before and after its shutdown began,
    and a few distinct messages of each kind (numbers masked to tell them apart)."""
    out = {}
    for key, path in log_paths.items():
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        counts, samples, phase = collections.Counter(), collections.defaultdict(dict), "run"
        for line in lines:
            if SHUTDOWN_MARK in line:
                phase = "shutdown"
            kind = next((k for k in ("ERROR", "Traceback", "WARNING") if f" {k} " in f" {line} "), None)
            if kind is None:
                continue
            counts[f"{phase} {kind}"] += 1
            shape = re.sub(r"\d+", "N", line)[:160]
            if len(samples[f"{phase} {kind}"]) < limit:
                samples[f"{phase} {kind}"].setdefault(shape, line[:400])
        out[key] = {"counts": dict(counts), "log": str(path),
                    "samples": {kind: list(found.values()) for kind, found in samples.items()}}
    return out


# ---------------------------------------------------------------- tables

def analyse(merged: dict, end_state: dict, cpu: dict, ns) -> dict:
    """The figures of the measured window (errors: the whole run)."""
    warmup_end = end_state["warmup_end"]
    batches = [(t, i, n) for t, i, n in merged["batches"] if t >= warmup_end]
    errors = merged["errors"]
    dead, dead_total = end_state["dead"]
    non_backpressure = sum(n for key, n in errors.items() if not key.endswith(BACKPRESSURE))
    drivers_cpu = sum(d["cpu_end"] - d["cpu_start"] for d in merged["drivers"] if d)
    return {
        "latencies": {rpc: [v for t, v in values if t >= warmup_end] for rpc, values in merged["latencies"].items()},
        "batches": batches, "per_stream": collections.Counter(i for _, i, _ in batches),
        "accepted": sum(n for t, n in merged["submitted"] if t >= warmup_end),
        "backpressure": sum(n for key, n in errors.items() if key.endswith(BACKPRESSURE)),
        "non_backpressure": non_backpressure + merged["acks"]["refused"] + dead_total,
        "dead": dead, "dead_total": dead_total,
        "ours_cpu": sum(v for k, v in cpu.items() if k != "machine") + drivers_cpu,
        "machine_cpu": cpu.get("machine", 0.0),
    }


def print_throughput(merged: dict, a: dict, ns) -> None:
    window, per_stream = ns.seconds, a["per_stream"]
    print(f"\nsoak | {ns.streams} trainers in {ns.processes} driver process(es) | {ns.warmup:g} s warm-up + "
          f"{window:g} s measured | batch {ns.batch_size} (groups of {ns.group_size}), {ns.max_tokens} tokens | "
          f"prompt queue {ns.max_queued_prompts} | push every {ns.push_every:g} s | "
          f"{psutil.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"\nthroughput (measured window): {len(a['batches']) / window:.2f} batches/s, "
          f"{sum(n for _, _, n in a['batches']) / window:.1f} trajectories/s, {a['accepted'] / window:.1f} prompts "
          f"accepted/s; {len(merged['pushes'])} pushes (whole run); batches per stream min "
          f"{min((per_stream.get(i, 0) for i in range(ns.streams)), default=0)} / median "
          f"{statistics.median([per_stream.get(i, 0) for i in range(ns.streams)]):g} / max "
          f"{max(per_stream.values(), default=0)}")


def print_rpcs(merged: dict, a: dict) -> None:
    errors, latencies = merged["errors"], a["latencies"]
    print(f"\n{'rpc':<17} | {'calls':>6} | {'p50 ms':>8} | {'p99 ms':>8} | {'max ms':>8} | {'errors':>6} | "
          f"{'backpr.':>7} | {'retried':>7}")
    print("-" * 92)
    for rpc in [*UNARY_RPCS, "StreamBatches", "batch wait", "ack answer"]:
        values = latencies.get(rpc, [])
        errs = sum(n for key, n in errors.items() if key.split()[0] == rpc and not key.endswith(BACKPRESSURE))
        retried = sum(n for key, n in merged["retried"].items() if key.split()[0] == rpc)
        print(f"{rpc:<17} | {len(values):>6} | {ms(percentile(values, 50)):>8} | {ms(percentile(values, 99)):>8} | "
              f"{ms(max(values, default=NAN)):>8} | {errs:>6} | {errors.get(f'{rpc} {BACKPRESSURE}', 0):>7} | "
              f"{retried:>7}")
    print("  calls/latencies: the measured window; errors: the whole run, after the SDK's retries; retried: failed "
          "attempts the SDK retried (UNAVAILABLE / DEADLINE_EXCEEDED); StreamBatches: errors of the streams, whose "
          "latencies are batch wait (next() until a batch) and ack answer (ack() until the server's answer, polled "
          "every 0.1 s)")
    print(f"  errors by RPC and status: {dict(errors) or 'none'}")
    print(f"  acks: {dict(merged['acks'])}; dead letters at the end: {a['dead_total']}"
          + (f" (first: {[(d.prompt_id, d.stage, d.code, d.error[:120]) for d in a['dead']]})" if a["dead"] else ""))
    for note in merged["notes"][:10]:
        print(f"    {note}")


def print_pushes_and_buffer(merged: dict, warmup_end: float, ns) -> None:
    """Each push's time split; the unary RPCs' latency while a push ran vs not; the buffer as polled."""
    pushes = merged["pushes"]
    if pushes:
        print("  pushes: " + "; ".join(
            f"v{p['version']} {p['seconds']:.2f} s at the client, {p['server_seconds']:.2f} s in the collector "
            f"(stage {p['stage_seconds']:.2f}, apply {p['apply_seconds']:.2f}, {p['transport']})" for p in pushes))
        during, outside = collections.defaultdict(list), collections.defaultdict(list)
        for rpc in ("SubmitPrompts", "GetStatus", "GetStats", "GetPolicyVersion", "ack answer"):
            for ended, seconds in merged["latencies"].get(rpc, []):
                if ended >= warmup_end:
                    overlaps = any(ended - seconds < p["end"] and ended > p["start"] for p in pushes)
                    (during if overlaps else outside)[rpc].append(seconds)
        print("  p50 / p99 ms while a push ran vs not: " + "; ".join(
            f"{rpc} {ms(percentile(during[rpc], 50))} / {ms(percentile(during[rpc], 99))} vs "
            f"{ms(percentile(outside[rpc], 50))} / {ms(percentile(outside[rpc], 99))}" for rpc in outside))
    buffer = [(ready, leased, pending) for t, ready, leased, pending in merged["buffer"] if t >= warmup_end]
    if buffer:
        ready, leased, pending = zip(*buffer)
        print(f"  as the pollers saw it: buffer ready mean {statistics.fmean(ready):.0f} (max {max(ready)}), leased "
              f"mean {statistics.fmean(leased):.0f}, collector pending prompts mean {statistics.fmean(pending):.0f} "
              f"(max {max(pending)}; the queue bound is {ns.max_queued_prompts} + groups in flight)")


def print_memory(rss: dict, cpu: dict, merged: dict, ns) -> None:
    print(f"\n{'service':<13} | {'process':<32} | {'RSS start MB':>12} | {'RSS end MB':>10} | {'growth':>7} | "
          f"{'MB/min':>7} | {'CPU % core':>10}")
    print("-" * 108)
    for key, tree in rss.items():
        print(f"{key:<13} | {'(tree)':<32} | {tree['start_mb']:>12.1f} | {tree['end_mb']:>10.1f} | "
              f"{tree['growth_percent']:>6.2f}% | {tree['slope_mb_per_min']:>7.2f} | "
              f"{100 * cpu.get(key, NAN) / ns.seconds:>10.0f}")
        for name, (first, last) in tree["processes"].items() if len(tree["processes"]) > 1 else ():
            growth = f"{100 * (last[0] / first[0] - 1):>6.2f}%" if last else "   gone"
            split = ""
            if last and last[0] > 1.02 * first[0]:
                split = "  anon/file/shmem/heap MB " + ", ".join(
                    f"{x / 1e6:.0f}->{y / 1e6:.0f}" for x, y in zip(first[1:], last[1:]))
            print(f"{'':<13} | {name[:32]:<32} | {first[0] / 1e6:>12.1f} | {(last or (0,))[0] / 1e6:>10.1f} | "
                  f"{growth} |{split}")
    for index, driver in enumerate(merged["drivers"]):
        if not driver:
            continue
        lag, wall = merged["loop_lag"][index], driver["wall_end"] - driver["wall_start"]
        print(f"{f'bench {index}':<13} | {'(load driver)':<32} | {driver['rss_start'] / 1e6:>12.1f} | "
              f"{driver['rss_end'] / 1e6:>10.1f} | {100 * (driver['rss_end'] / driver['rss_start'] - 1):>6.2f}% | "
              f"{'':>7} | {100 * (driver['cpu_end'] - driver['cpu_start']) / wall:>10.0f}")
        print(f"{'':<13}   its event-loop lag p50 {ms(percentile(lag, 50))} ms, p99 {ms(percentile(lag, 99))} ms, "
              f"max {ms(max(lag, default=NAN))} ms")
    print("  RSS of each tree over the run (warm-up included), minute: MB; growth over the last minute:")
    for key, tree in rss.items():
        print(f"    {key:<13} {'  '.join(f'{minute:g}: {mb}' for minute, mb in tree['series_mb'])}; "
              f"last minute {tree['last_minute_percent']:+.2f}%")


def print_machine_and_end(a: dict, end_state: dict, logs: dict, ns) -> None:
    window = ns.seconds
    print(f"\nmachine CPU over the window: {a['machine_cpu'] / window:.2f} cores busy of {psutil.cpu_count()}, of "
          f"which the suite + bench {a['ours_cpu'] / window:.2f}, other processes "
          f"{(a['machine_cpu'] - a['ours_cpu']) / window:.2f} (a shared machine: others' load stretches latencies)")
    status, stats = end_state["status"], end_state["stats"]
    print(f"\ncollector at the end: version {status.policy_version}, {status.trajectories} trajectories appended, "
          f"{status.pending_prompts} prompts pending, {status.failed_prompts} dead letters, "
          f"{status.discarded_samples} samples discarded; buffer ready {stats.ready} leased {stats.leased} "
          f"acked {stats.acked} redelivered batches {stats.redelivered_batches}")
    print("\nservice logs: WARNING / ERROR / Traceback lines during the run and after SIGTERM (shutdown)")
    for key, summary in logs.items():
        print(f"  {key:<13} {summary['counts'] or 'none'}  {summary['log']}")
        for kind, lines in summary["samples"].items():
            for line in lines:
                print(f"      [{kind}] {line}")


def result(merged: dict, a: dict, rss: dict, logs: dict, ns) -> dict:
    """The RESULT line's dict."""
    window, latencies = ns.seconds, a["latencies"]
    growth = {key: round(tree["growth_percent"], 3) for key, tree in rss.items()}
    return {
        "errors_by_status": dict(merged["errors"]), "backpressure_errors": a["backpressure"],
        "non_backpressure_errors": a["non_backpressure"], "acks": dict(merged["acks"]),
        "dead_letters": a["dead_total"], "retried_attempts": dict(merged["retried"]),
        "rss_growth_percent": max(growth.values()), "rss_growth_percent_by_service": growth,
        "rss_slope_mb_per_min": {key: round(tree["slope_mb_per_min"], 3) for key, tree in rss.items()},
        "rss_growth_percent_last_minute": {key: round(tree["last_minute_percent"], 3) for key, tree in rss.items()},
        "p50_seconds": {rpc: round(percentile(v, 50), 4) for rpc, v in latencies.items() if v},
        "p99_seconds": {rpc: round(percentile(v, 99), 4) for rpc, v in latencies.items() if v},
        "batches_per_second": round(len(a["batches"]) / window, 3),
        "trajectories_per_second": round(sum(n for _, _, n in a["batches"]) / window, 2),
        "prompts_submitted_per_second": round(a["accepted"] / window, 2),
        "pushes": len(merged["pushes"]),
        "service_log_errors_during_run": {key: s["counts"].get("run ERROR", 0) + s["counts"].get("run Traceback", 0)
                                          for key, s in logs.items()},
        "driver_loop_lag_p99_seconds": round(max(percentile(lag, 99) for lag in merged["loop_lag"]), 4),
        "machine_cores_busy": round(a["machine_cpu"] / window, 2),
        "other_processes_cores": round((a["machine_cpu"] - a["ours_cpu"]) / window, 2),
        "streams": ns.streams, "processes": ns.processes, "seconds": ns.seconds, "warmup_seconds": ns.warmup,
    }


def report(records: list[dict], samples: list, cpu: dict, end_state: dict, log_paths: dict, ns) -> dict:
    """Print every table; return the RESULT dict."""
    merged = merge(records)
    rss = rss_growth(samples, end_state["warmup_end"])
    logs = log_summary(log_paths)
    a = analyse(merged, end_state, cpu, ns)
    print_throughput(merged, a, ns)
    print_rpcs(merged, a)
    print_pushes_and_buffer(merged, end_state["warmup_end"], ns)
    print_memory(rss, cpu, merged, ns)
    print_machine_and_end(a, end_state, logs, ns)
    out = result(merged, a, rss, logs, ns)
    met = a["non_backpressure"] == 0 and out["rss_growth_percent"] <= RSS_TARGET_PERCENT
    print(f"\ntarget: zero errors other than RESOURCE_EXHAUSTED backpressure ({a['non_backpressure']} found: errors, "
          f"refused acks, dead letters), RSS growth <= {RSS_TARGET_PERCENT:g}% after warm-up "
          f"({out['rss_growth_percent']:.2f}% max): {'met' if met else 'MISSED'}")
    return out
