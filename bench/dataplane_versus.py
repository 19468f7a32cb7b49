"""The data plane's CPU per trajectory, this tree against an older commit.

``bench/dataplane.py`` on this tree and on an older commit, alternated: per-service CPU before and after.

    .venv/bin/python bench/dataplane_versus.py BASE_COMMIT [--new COMMIT] [--pairs 3] [-- DATAPLANE FLAGS...]

(default flags: ``--rounds 2 --seconds 15 --warmup 5``)

The older commit is checked out in a temporary git worktree and imported instead of this tree by
every service process (``bench/dataplane.py --services-code``: the services' ``PYTHONPATH`` holds an
``rlfleet`` package whose modules are that worktree's ``client/rlfleet`` and ``services``), so they
run its code; so is ``--new``'s commit, else the new side runs the working tree as it is. The
harness (``bench/dataplane.py``, its load generator, the SDK trainers) is this tree's on both
sides, with this tree's ``rlfleet``: an older commit need not have the harness's imports.
``--pairs`` pairs of runs, the order alternating within each pair; for each measure the medians
of both sides and of the per-pair ratios (new / base), which a shared machine's load hits alike.
The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURES = ("collector", "reward", "trajectory", "reference", "c+r+t", "traj/s")


def shadow_package(commit: str, workdir: Path) -> Path:
    """A directory to put on PYTHONPATH whose ``rlfleet`` package is ``commit``'s code (its worktree:
    ``workdir/tree``)."""
    tree = workdir / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit],
                   check=True, capture_output=True)
    package = workdir / "path" / "rlfleet"
    package.mkdir(parents=True)
    for entry in (tree / "client" / "rlfleet").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "services").symlink_to(tree / "services")
    return package.parent


def run(pythonpath: Path | None, flags: list[str]) -> dict[str, float]:
    code = ["--services-code", str(pythonpath)] if pythonpath is not None else []
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "dataplane.py"), *flags, *code],
                          cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"bench/dataplane.py failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    cpu = result["cpu_ms_per_traj"]
    return {"collector": cpu["collector"], "reward": cpu["reward"], "trajectory": cpu["trajectory"],
            "reference": cpu["reference"], "c+r+t": result["services_cpu_ms_per_traj"],
            "traj/s": result["ceiling_traj_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit to compare with (e.g. a landed one)")
    parser.add_argument("--new", default=None, metavar="COMMIT",
                        help="measure this commit's code instead of the working tree's (which may hold "
                             "uncommitted edits)")
    parser.add_argument("--pairs", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:split])
    ns.flags = argv[split + 1:] or ["--rounds", "2", "--seconds", "15", "--warmup", "5"]
    with tempfile.TemporaryDirectory(prefix="rlfleet-versus-") as tmp:
        workdirs = {"base": Path(tmp) / "base", "new": Path(tmp) / "new"}
        try:
            paths = {"base": shadow_package(ns.base, workdirs["base"]),
                     "new": shadow_package(ns.new, workdirs["new"]) if ns.new else None}
            sides: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
            for pair in range(ns.pairs):
                for side in ("base", "new") if pair % 2 == 0 else ("new", "base"):
                    row = run(paths[side], ns.flags)
                    sides[side].append(row)
                    print(f"pair {pair} {side:4s} " + "  ".join(f"{k} {row[k]:.3f}" for k in MEASURES), flush=True)
        finally:
            for workdir in workdirs.values():
                if (workdir / "tree").exists():
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(workdir / "tree")],
                                   capture_output=True)
    result: dict[str, object] = {"base": ns.base, "new": ns.new or "working tree", "pairs": ns.pairs}
    print(f"\n{'measure':>10} | {'base':>8} | {'new':>8} | new/base (per pair)")
    for key in MEASURES:
        ratios = [n[key] / b[key] for b, n in zip(sides["base"], sides["new"])]
        base, new = (statistics.median(r[key] for r in sides[s]) for s in ("base", "new"))
        print(f"{key:>10} | {base:8.3f} | {new:8.3f} | {statistics.median(ratios):.3f} "
              f"({' '.join(f'{r:.3f}' for r in ratios)})")
        result[key] = {"base": round(base, 3), "new": round(new, 3), "ratio": round(statistics.median(ratios), 3),
                       "ratio_per_pair": [round(r, 3) for r in ratios]}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
