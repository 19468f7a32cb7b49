"""The sandbox under the restrictions Docker puts on compose.yaml's environment service, reproduced
without Docker (tests/container_restrictions.py): read-only /proc/sys, Docker's masked paths, the
service's four capabilities, no_new_privs. Compose's first run failed on exactly these; this keeps
it from regressing unseen between compose runs (scripts/compose-smoke runs the real thing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.sandbox_cases import NESTED_USER_NAMESPACE_REFUSED, REPOSITORY, sandbox_processes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")

# DAC_OVERRIDE 1, KILL 5, SETGID 6, SETUID 7: compose.yaml's cap_add
SERVICE_CAPABILITIES = f"{(1 << 1) | (1 << 5) | (1 << 6) | (1 << 7):016x}"
DISK_FULL = "disk limit exceeded (4194304 bytes in the working directory, 1048576 in /tmp)"


@pytest.fixture(scope="module")
def seen() -> dict:
    """What the sandbox did in the container-like process (one run for every test of this module)."""
    assert not sandbox_processes(), "a uid 65534 process was running before the test"
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-m",
                          "tests.container_restrictions"], cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not sandbox_processes()
    seen = json.loads(run.stdout.splitlines()[-1])
    os.rmdir(seen["tmpdir"])  # its tmpfs lived in the namespace; the empty mount point stays here
    return seen


def test_the_restrictions_are_dockers(seen):
    assert seen["no_new_privs"] == "1"
    assert seen["capabilities"] == SERVICE_CAPABILITIES
    assert seen["proc_sys"] == "Read-only file system"
    assert seen["root"] == "Read-only file system"  # and Kubernetes' readOnlyRootFilesystem


def test_bwraps_own_userns_switch_fails_there_as_it_did_under_compose(seen):
    assert "max_user_namespaces: Read-only file system" in seen["disable_userns"]


def test_the_sandbox_starts_and_refuses_a_nested_user_namespace(seen):
    assert seen["isolation"] == "bwrap"
    assert seen["nested"] == seen["episode_nested"] == NESTED_USER_NAMESPACE_REFUSED


def test_the_disk_bound_holds(seen):
    assert seen["disk"] == seen["episode_disk"] == DISK_FULL


def test_a_proc_mount_is_refused_naming_the_masked_paths_and_the_settings_to_change(seen):
    refusal = seen["with_proc"]
    assert refusal.startswith("no bwrap sandbox on this host: a trivial snippet failed"), refusal
    assert "Can't mount proc" in refusal
    assert "stopped by the masked paths of this container's /proc" in refusal
    for setting in ('RLFLEET_ENVIRONMENT_SANDBOX=\'{"proc": false}\'', "systempaths=unconfined", "procMount: Unmasked"):
        assert setting in refusal
