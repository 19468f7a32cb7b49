"""A model of a weight push's time against the number of replicas: star vs relay, measured here, projected.

    .venv/bin/python bench/fanout_sim.py [--calibration RESULT_JSON] [--link-gbps 400] [--plot PNG]

A push of M bytes to N replicas that cannot map the collector's memory (other hosts):

- **star** (each replica its own copy from the collector): the collector's egress link carries N copies,
  ``T = N * M / min(B, R) + A``;
- **relay** (a chain, rlfleet's ``weight_relay``: the collector sends one copy to the first replica, each
  forwards to the next as the chunks arrive): ``T = M / min(B, R) + (N - 1) * h + A``, where the per-hop
  delay ``h`` is one chunk through a replica (received, staged, forwarded: ``c / min(B, R)``) plus the
  link's latency ``L``;
- **tree** (each replica forwards to two): ``T = 2 * M / min(B, R) + ceil(log2(N + 1) - 1) * h + A``;

with B the link's bandwidth, R what one process can relay (receive, checksum, write, forward) per
second, c the chunk (1 MiB) and A the apply into the engine (once staged).

**Calibration** (``--calibration``: the ``RESULT`` of ``bench/weights.py``, which pushes a >= 500 MB model
relayed to 1, 2 and 3 replicas on this host): a least-squares fit of ``T(N) = T1 + (N - 1) * h`` to the
three measured push times gives R (the model's bytes over ``T1`` less the apply) and h, and the fit's
residual per point is printed: the check of the model against the runs it came from. On this host the
"link" is loopback and every replica shares the same two cores, so R is the CPU-bound rate of rlfleet's
Python relay, far below a 400 Gb/s link, and the fitted h is what each extra replica's copy takes from
the shared cores (an upper bound of a hop between hosts).

**Projection**: 70B (bf16, 140 GB) and 1T (bf16, 2 TB) models to 8 ... 1,024 replicas on ``--link-gbps``
links, twice: with this host's R (the code as it is: the relay's CPU bounds it) and link-bound (R >= B, a
relay that keeps up with its link: what the pipeline's shape alone gives). The apply is left out of the
projection (it is the same for every fan-out; on GPUs it is vLLM's ``load_weights`` at device bandwidth).
The table, then ``--plot`` (docs/images/fanout-sim.png), then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

CHUNK = 1 << 20
MODELS = {"70B bf16": 140e9, "1T bf16": 2e12}
REPLICAS = (8, 16, 32, 64, 128, 256, 512, 1024)


def star(m: float, n: int, rate: float, apply: float = 0.0) -> float:
    return n * m / rate + apply


def relay(m: float, n: int, rate: float, hop: float, apply: float = 0.0) -> float:
    return m / rate + (n - 1) * hop + apply


def tree(m: float, n: int, rate: float, hop: float, apply: float = 0.0) -> float:
    depth = max(0, math.ceil(math.log2(n + 1)) - 1)
    return (2 if n > 1 else 1) * m / rate + depth * hop + apply


def fit(times: dict[int, float]) -> tuple[float, float]:
    """Least squares of T(N) = T1 + (N - 1) * h over the measured points."""
    xs = [n - 1 for n in times]
    ys = list(times.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    h = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - h * mean_x, h


def calibrate(result: dict) -> dict:
    """R, h and the per-chunk overhead from ``bench/weights.py``'s RESULT."""
    t1 = result["relay_seconds_1"]
    times = {1: t1, 2: t1 * result["relay_time_2_over_1"], 3: t1 * result["relay_time_3_over_1"]}
    base, hop = fit(times)
    model_bytes = result["model_bytes"]
    apply = result.get("relay_apply_seconds_1", 0.0)
    rate = model_bytes / max(base - apply, 1e-9)
    return dict(times=times, base=base, hop=hop, rate=rate, apply=apply, model_bytes=model_bytes,
                residuals={n: t - (base + (n - 1) * hop) for n, t in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a file whose last RESULT line (or JSON) is bench/weights.py's")
    parser.add_argument("--link-gbps", type=float, default=400.0)
    parser.add_argument("--latency-us", type=float, default=10.0, help="one hop's network latency")
    parser.add_argument("--plot", type=Path, default=None)
    ns = parser.parse_args()
    link = ns.link_gbps * 1e9 / 8
    latency = ns.latency_us * 1e-6

    out: dict = {"link_gbps": ns.link_gbps}
    cal = None
    if ns.calibration is not None:
        text = ns.calibration.read_text()
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        cal = calibrate(json.loads(lines[-1][len("RESULT "):] if lines else text))
        print(f"calibration ({ns.calibration}): a {cal['model_bytes'] / 1e6:.0f} MB push relayed on this host")
        print(f"{'replicas':>8} | {'measured s':>10} | {'model s':>8} | residual")
        for n, t in cal["times"].items():
            print(f"{n:>8} | {t:>10.3f} | {t - cal['residuals'][n]:>8.3f} | {cal['residuals'][n]:+.3f}")
        print(f"R (one relay's rate here) = {cal['rate'] / 1e6:.0f} MB/s; apply {cal['apply']:.3f} s; fitted per "
              f"replica h = {cal['hop'] * 1e3:.1f} ms. Every replica here shares the same two cores, so h is the "
              f"CPU each extra replica's copy takes from the others (on separate hosts a hop costs a chunk's "
              f"time through a replica, {CHUNK / cal['rate'] * 1e3:.1f} ms at R, plus the link's latency): an upper "
              f"bound, not used in the projection.\n")
        out.update(calibration_rate_mb_s=cal["rate"] / 1e6, calibration_hop_ms=cal["hop"] * 1e3,
                   calibration_max_residual_s=max(abs(r) for r in cal["residuals"].values()),
                   calibration_max_residual_rel=max(abs(r) / cal["times"][n] for n, r in cal["residuals"].items()))

    scenarios = {"link-bound": (link, CHUNK / link + latency)}
    if cal is not None:
        rate = min(cal["rate"], link)
        scenarios["this host's relay rate"] = (rate, CHUNK / rate + latency)
    curves: dict = {}
    for scenario, (rate, hop) in scenarios.items():
        for model, m in MODELS.items():
            print(f"{model}, {ns.link_gbps:g} Gb/s links, {scenario} (R {rate / 1e9:.2f} GB/s, h {hop * 1e3:.2f} ms):")
            print(f"{'replicas':>8} | {'star s':>10} | {'relay s':>9} | {'tree s':>9} | star / relay")
            for n in REPLICAS:
                s, r, t = star(m, n, rate), relay(m, n, rate, hop), tree(m, n, rate, hop)
                curves.setdefault((scenario, model), []).append((n, s, r, t))
                print(f"{n:>8} | {s:>10.1f} | {r:>9.2f} | {t:>9.2f} | {s / r:>8.1f}")
            print()
    key = ("link-bound", "70B bf16")
    out.update({f"{name}_70b_{n}_s": round(v, 3) for n, s, r, t in curves[key]
                for name, v in (("star", s), ("relay", r)) if n in (64, 1024)})
    key = ("link-bound", "1T bf16")
    out.update({f"{name}_1t_{n}_s": round(v, 3) for n, s, r, t in curves[key]
                for name, v in (("star", s), ("relay", r)) if n in (64, 1024)})
    if ns.plot is not None:
        plot(curves, ns.plot, ns.link_gbps)
        print(f"plot: {ns.plot}")
    print("RESULT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


def plot(curves: dict, path: Path, link_gbps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({scenario for scenario, _ in curves}, reverse=True)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.2), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for model, color in zip(MODELS, ("tab:blue", "tab:red")):
            points = curves[scenario, model]
            ns = [p[0] for p in points]
            ax.plot(ns, [p[1] for p in points], "--", color=color, label=f"{model}: star")
            ax.plot(ns, [p[2] for p in points], "-", color=color, label=f"{model}: relay (chain)")
            ax.plot(ns, [p[3] for p in points], ":", color=color, label=f"{model}: tree (2 per replica)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas on other hosts")
        ax.set_ylabel("push time, s (apply left out)")
        ax.set_title(f"{link_gbps:g} Gb/s links, {scenario}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
