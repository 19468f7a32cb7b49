"""``python -m gen_docs [--check] [--only NAME ...]`` from ``scripts/`` (what ``scripts/gen-docs`` runs)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from . import api, benchmarks, cli, modules, rewards, settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATORS = {"settings": settings.render, "api": api.render, "cli": cli.render, "benchmarks": benchmarks.render,
              "modules": modules.render, "rewards": rewards.render}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gen-docs", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail if a committed page differs from what its source says now")
    parser.add_argument("--only", nargs="*", choices=sorted(GENERATORS), default=sorted(GENERATORS))
    args = parser.parse_args(argv)
    stale = []
    for name in args.only:
        try:
            pages = GENERATORS[name]()
        except benchmarks.ResultError as err:
            print(f"gen-docs: {err}", file=sys.stderr)
            return 1
        for relative, text in sorted(pages.items()):
            path = DOCS / relative
            have = path.read_text() if path.exists() else ""
            if have == text:
                continue
            if args.check:
                stale.append(relative)
                diff = difflib.unified_diff(have.splitlines(), text.splitlines(), f"docs/{relative} (committed)",
                                            f"docs/{relative} (from its source)", lineterm="", n=1)
                print("\n".join(list(diff)[:40]), file=sys.stderr)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                print(f"wrote docs/{relative}")
    if stale:
        print(f"gen-docs: {len(stale)} page(s) out of date with their source: {', '.join(stale)}; "
              "run scripts/gen-docs and commit", file=sys.stderr)
        return 1
    if args.check:
        print("generated docs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
