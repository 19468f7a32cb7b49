"""The server does not depend on the SDK: no module under services/ imports ``rlfleet.client`` (what both sides
use lives below both, in ``rlfleet.rpc``, ``rlfleet.wire`` and ``rlfleet.kl``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sdk_imports(source: str) -> list[str]:
    """The ``rlfleet.client`` modules ``source`` imports (at any depth of the code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("rlfleet.client")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "rlfleet.client" or node.module.startswith("rlfleet.client."):
                found.append(node.module)
            elif node.module == "rlfleet" and any(alias.name == "client" for alias in node.names):
                found.append("rlfleet.client")
    return found


def test_the_check_sees_each_way_of_importing_the_sdk():
    assert sdk_imports("import rlfleet.client.errors") == ["rlfleet.client.errors"]
    assert sdk_imports("def f():\n    from rlfleet.client import connect") == ["rlfleet.client"]
    assert sdk_imports("from rlfleet import client") == ["rlfleet.client"]
    assert sdk_imports("from rlfleet.rpc.errors import RlfleetClientError\nfrom rlfleet import kl") == []


def test_no_service_module_imports_the_sdk():
    edges = {str(path.relative_to(ROOT)): modules for path in sorted((ROOT / "services").rglob("*.py"))
             if (modules := sdk_imports(path.read_text()))}
    assert edges == {}
