"""Runs the sandbox under the restrictions Docker puts on compose.yaml's environment service, without Docker.

``python -m tests.container_restrictions`` is started by tests/integration/test_sandbox_in_a_container.py
inside ``unshare --mount --propagation private`` (a mount namespace of its own, as root). Here it
makes what a Docker container's runtime makes — /proc/sys and its siblings read-only, Docker's
masked paths covered (files by /dev/null, directories by an empty read-only tmpfs), and the root
file system read-only with a tmpfs for temporary files as the Kubernetes manifest has it — then execs
itself through ``setpriv`` with the service's capability set (compose.yaml's ``cap_add``:
DAC_OVERRIDE, SETUID, SETGID, KILL; every other capability out of the bounding set) and
``no_new_privs`` (``no-new-privileges=true``). Seccomp and AppArmor stay off, as the service's
``security_opt`` sets them. The second stage runs the sandbox the service would and prints one JSON
object of what it saw. Without these restrictions reproduced, the failure compose met (bwrap's
``--disable-userns`` writing the read-only ``/proc/sys``) passed every test on a bare host.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile

# moby's defaults (oci/defaults.go): masked paths, and paths mounted read-only
DOCKER_MASKED_PATHS = ("/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys",
                       "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                       "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap")
DOCKER_READ_ONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
SERVICE_CAPABILITIES = ("dac_override", "setuid", "setgid", "kill")  # compose.yaml's cap_add


def restrict() -> None:
    """Make this mount namespace look as a Docker container's does (call as root, in a namespace of its own),
    with the root file system read-only and a tmpfs on /tmp, as the Kubernetes manifest has it
    (``readOnlyRootFilesystem`` and an ``emptyDir`` for /tmp): the temporary directory is a tmpfs of its own
    (``TMPDIR``, mounted on a fresh directory, not over /tmp: the repository may live there)."""
    scratch = tempfile.mkdtemp(prefix="rlfleet-container-tmp-")
    _mount("-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", scratch)
    os.environ["TMPDIR"] = scratch
    _mount("-o", "remount,bind,ro", "/")
    for path in DOCKER_MASKED_PATHS:
        if os.path.isdir(path):
            _mount("-t", "tmpfs", "-o", "ro,size=0", "tmpfs", path)
        elif os.path.exists(path):
            _mount("--bind", "/dev/null", path)
    for path in DOCKER_READ_ONLY_PATHS:
        if os.path.exists(path):
            _mount("--bind", path, path)
            _mount("-o", "remount,bind,ro", path)


def drop_privileges_and_run() -> None:
    """Exec the second stage with the service's capabilities and no_new_privs."""
    keep = ",".join(f"+{name}" for name in SERVICE_CAPABILITIES)
    os.execv(shutil.which("setpriv"), ["setpriv", f"--bounding-set=-all,{keep}", "--inh-caps=-all", "--no-new-privs",
                                       "--", sys.executable, "-m", "tests.container_restrictions", "--restricted"])


async def observe() -> dict:
    """What the sandbox does here: the isolation it finds, the escapes it refuses, the disk it bounds."""
    from rlfleet.services.environment.episode_sandbox import EpisodeSandboxes
    from rlfleet.services.environment.sandbox import PythonSandbox, SandboxUnavailable, find_bwrap
    from tests.sandbox_cases import FILL_THE_DISK, LIMITS, NESTED_USER_NAMESPACE

    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    seen: dict = {"no_new_privs": status["NoNewPrivs"].strip(), "capabilities": status["CapEff"].strip(),
                  "tmpdir": os.environ["TMPDIR"]}
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as setting:
            setting.write("1")
        seen["proc_sys"] = "writable"
    except OSError as error:
        seen["proc_sys"] = error.strerror
    try:
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "read-only-probe"), "w").close()
        seen["root"] = "writable"
    except OSError as error:
        seen["root"] = error.strerror
    # bwrap's own way to forbid nested user namespaces, which compose's first run died of
    old_way = subprocess.run([find_bwrap(), "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "true"],
                             capture_output=True, text=True, user=65534, group=65534, extra_groups=[])
    seen["disable_userns"] = old_way.stderr.strip()

    limits = LIMITS.model_copy(update={"proc": False, "max_disk_bytes": 4 * 2**20})  # compose.yaml: proc false
    sandbox = PythonSandbox(limits)
    seen["isolation"] = await sandbox.probe()
    seen["nested"] = (await sandbox.run(NESTED_USER_NAMESPACE)).stdout
    seen["disk"] = (await sandbox.run(FILL_THE_DISK)).error
    episode = EpisodeSandboxes(sandbox).episode()
    try:
        seen["episode_nested"] = (await episode.run(NESTED_USER_NAMESPACE)).stdout
        seen["episode_disk"] = (await episode.run(FILL_THE_DISK)).error
    finally:
        await episode.close()
        await episode.pool.close()
    try:
        await PythonSandbox(limits.model_copy(update={"proc": True})).probe()
        seen["with_proc"] = "started"
    except SandboxUnavailable as refusal:
        seen["with_proc"] = str(refusal)
    return seen


def _mount(*arguments: str) -> None:
    subprocess.run(["mount", *arguments], check=True, capture_output=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--restricted"]:
        print(json.dumps(asyncio.run(observe())))
    else:
        restrict()
        drop_privileges_and_run()
