"""A second-language client (examples/clients/node/, Node.js, built from protos/ alone) against the
real suite: health, version, status, submit, stream a batch, decode tensors/ragged/strings, ack."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlfleet.client import connect
from tests.integration.suites import suite_fixture

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "clients" / "node"
GROUP, BATCH = 2, 4


@pytest.fixture(scope="module")
def node_client():
    # Required, not optional: the contract's conformance check must run (Debian: apt install nodejs npm).
    assert shutil.which("node") and shutil.which("npm"), "node and npm are needed for the Node conformance test"
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True, timeout=600)
    return NODE_DIR / "client.mjs"


suite = suite_fixture([f"--group-size={GROUP}", f"--groups-per-step={BATCH // GROUP}",
                      '--sampling={"temperature": 1.0, "max_tokens": 8}'], "node-suite")


def test_node_client_speaks_the_contract_from_protos_alone(node_client, suite):
    address = suite["collector"].address
    run = subprocess.run(["node", str(node_client), address, str(BATCH)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["health"] == "SERVING" and got["group_size"] == GROUP
    assert got["batch_size"] == [BATCH] and len(got["prompt_ids"]) == BATCH // GROUP
    # Every kind decoded, with the schema's nesting flattened to "a/b" keys.
    assert got["keys"]["tokens/full"] == "ragged" and got["keys"]["next/done"] == "tensor"
    assert got["keys"]["trajectory_id"] == "strings" and got["keys"]["group_id"] == "tensor"
    assert got["full_lengths"] == [p + r for p, r in zip(got["prompt_lengths"], got["response_lengths"])]
    assert got["log_prob_lengths"] == got["response_lengths"] and min(got["response_lengths"]) > 0
    assert all(total < 0 for total in got["log_prob_sums"])  # log-probs of sampled tokens
    # The version that sampled each token: one per sample here (no push while it generated).
    assert got["token_versions"] == [[start] for start in got["version_start"]]
    assert got["done_shape"] == [BATCH, 1] and all(got["done"])
    # 64-bit ids decoded exactly (BigInt): trajectory ids are "<group id in hex>-<sample index>".
    assert got["trajectory_id"] == [f"{h}-{i}" for h, i in zip(got["group_id_hex"], got["sample_index"])]
    assert set(got["prompt_id"]) == set(got["prompt_ids"])
    assert got["malformed"]["code"] == "INVALID_ARGUMENT" and "token_ids" in got["malformed"]["details"]
    # The server answered the ack: applied, for the whole batch.
    assert got["ack"] == {"lease_id": got["lease_id"], "applied": True, "trajectories": BATCH, "reason": ""}
    # The ack landed: nothing leased, the batch counted as acked, so it is never delivered again.
    with connect(address) as client:
        stats = client.buffer_stats()
        assert stats.leased == 0 and stats.acked >= BATCH, stats
