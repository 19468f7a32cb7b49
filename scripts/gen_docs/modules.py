"""docs/reference/modules.md: one line per module saying what it owns, from the first sentence of its docstring.

Every package of the SDK (``client/rlfleet``) and of the services (``services/``), in the import order of the
layers: the wire format, the SDK, the Ray fleet, the services' shared scaffolding, then each service. A module
without a docstring fails the generation: every module says what it owns.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ._markdown import cell, generated_banner

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ("client/rlfleet", "rlfleet: rules the SDK and the services share"),
    ("client/rlfleet/wire", "rlfleet.wire: the wire format"),
    ("client/rlfleet/client", "rlfleet.client: the trainer's SDK"),
    ("client/rlfleet/client/torchrl", "rlfleet.client.torchrl: the TorchRL drop-in"),
    ("client/rlfleet/ray", "rlfleet.ray: the fleet on a Ray cluster"),
    ("services/common", "services/common: what every service shares"),
    ("services/collector", "services/collector"),
    ("services/generation", "services/generation"),
    ("services/reference", "services/reference"),
    ("services/reward", "services/reward"),
    ("services/trajectory", "services/trajectory"),
    ("services/environment", "services/environment"),
    ("services/viewer", "services/viewer"),
    ("services/models", "services/models"),
    ("services", "services: processes"),
]
SKIPPED = {"__init__.py", "__main__.py"}


def summary(path: Path) -> str:
    """The docstring's first sentence (up to its first period that ends a sentence), on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise RuntimeError(f"{path.relative_to(ROOT)} has no docstring: say what the module owns")
    first = " ".join(doc.split("\n\n")[0].split())
    for end in (". ", ".\n"):
        if end in first + "\n":
            first = (first + "\n").split(end)[0] + "."
            break
    return first


def render() -> dict[str, str]:
    lines = [*generated_banner("scripts/gen_docs/modules.py", "each module's docstring"),
             "# Modules", "",
             "What each module owns, in one line: the first sentence of its docstring. "
             "[Code layout](layout.md) says how the packages depend on each other.", ""]
    for package, title in PACKAGES:
        directory = ROOT / package
        modules = sorted(p for p in directory.glob("*.py") if p.name not in SKIPPED)
        if not modules:
            continue
        lines += [f"## {title}", "", "| module | what it owns |", "|---|---|"]
        lines += [f"| `{path.name}` | {cell(summary(path))} |" for path in modules]
        lines.append("")
    return {"reference/modules.md": "\n".join(lines).rstrip() + "\n"}
