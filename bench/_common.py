"""Helpers shared by the bench scripts (run as ``python bench/<name>.py``, so this imports as ``_common``)."""

from __future__ import annotations

import statistics

import psutil


def summarize(base: list[float], measured: list[float]) -> dict:
    """Median of each side and of the per-round ratios measured / base, with the ratios' quartiles."""
    ratios = sorted(m / b for b, m in zip(base, measured))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return dict(base=statistics.median(base), measured=statistics.median(measured),
                ratio=statistics.median(ratios), low=quartiles[0], high=quartiles[2], ratios=ratios)


class CpuMeter:
    """CPU seconds (user + system) of named groups of processes; "bench" is this process."""

    def __init__(self, trees: dict[str, list[psutil.Process]] | None = None):
        self.trees: dict[str, list[psutil.Process]] = trees if trees is not None else {"bench": [psutil.Process()]}

    def add(self, key: str, pid: int) -> None:
        """Count the process ``pid`` and all its descendants under ``key``."""
        root = psutil.Process(pid)
        self.trees[key] = [root, *root.children(recursive=True)]

    def snapshot(self) -> dict[str, float]:
        out = {}
        for key, procs in self.trees.items():
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            out[key] = total
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {key: after[key] - before.get(key, 0.0) for key in after}
