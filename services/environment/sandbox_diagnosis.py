"""Why bwrap could not start a sandbox here, and the setting to change: for Docker, Kubernetes and bare hosts.

``PythonSandbox`` refuses to start without a sandbox; its refusal quotes bwrap's own message and,
through ``explain()``, names the kernel or container setting that stopped it, read from bwrap's
message and from what this process can see of its host (``HostFacts``: its seccomp mode, its
AppArmor profile, the user-namespace sysctls, whether it runs in a container). One table of causes
(``_CAUSES``), each with its fix on the three kinds of host; the host it looks like comes first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DOCKER = "Docker (compose.yaml, the environment service)"
KUBERNETES = "Kubernetes (the environment Deployment's securityContext)"
BARE_HOST = "bare host"


@dataclass(frozen=True)
class HostFacts:
    """What this process sees of the settings that decide whether bwrap can run."""

    seccomp_filtered: bool
    """A seccomp filter applies to this process (``Seccomp: 2`` in /proc/self/status): a container's
    profile, or a service manager's ``SystemCallFilter``."""
    apparmor_profile: str | None
    """This process's AppArmor profile (``docker-default (enforce)``), None without AppArmor."""
    max_user_namespaces: int | None
    """``user.max_user_namespaces``: 0 forbids every user namespace."""
    unprivileged_userns_clone: int | None
    """``kernel.unprivileged_userns_clone`` (Debian and older Ubuntu kernels): 0 forbids them to non-root."""
    apparmor_restricts_userns: bool
    """``kernel.apparmor_restrict_unprivileged_userns=1`` (Ubuntu >= 23.10)."""
    platform: str
    """The kind of host this looks like: ``DOCKER``, ``KUBERNETES`` or ``BARE_HOST``."""

    @classmethod
    def read(cls, proc: Path = Path("/proc"), environ: dict[str, str] | None = None) -> HostFacts:
        """Read them from ``proc`` (and ``environ``, for Kubernetes' service variables)."""
        environ = os.environ if environ is None else environ
        status = _read(proc / "self/status") or ""
        seccomp = next((line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:")), "0")
        profile = _read(proc / "self/attr/apparmor/current") or _read(proc / "self/attr/current")
        if "KUBERNETES_SERVICE_HOST" in environ:
            platform = KUBERNETES
        elif Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
            platform = DOCKER
        else:
            platform = BARE_HOST
        return cls(
            seccomp_filtered=seccomp == "2",
            apparmor_profile=profile.strip("\0\n ") or None if profile else None,
            max_user_namespaces=_read_int(proc / "sys/user/max_user_namespaces"),
            unprivileged_userns_clone=_read_int(proc / "sys/kernel/unprivileged_userns_clone"),
            apparmor_restricts_userns=_read_int(proc / "sys/kernel/apparmor_restrict_unprivileged_userns") == 1,
            platform=platform,
        )

    @property
    def apparmor_confined(self) -> bool:
        return self.apparmor_profile is not None and not self.apparmor_profile.startswith("unconfined")


@dataclass(frozen=True)
class Cause:
    """One setting that stops bwrap: how to recognise it, what it is, and the change on each kind of host."""

    applies: Callable[[str, HostFacts], bool]
    """Whether it explains bwrap's message on a host with these facts."""
    setting: str
    fixes: dict[str, str]


def _userns_refused(message: str) -> bool:
    return "creating new namespace" in message.lower() or "setting up uid map" in message


def _mount_refused(message: str) -> bool:
    return any(word in message for word in ("mount", "Failed to make / slave", "pivot_root"))


_NODE_SYSCTL = "set it on the host (a container cannot)"
_CAUSES = (
    Cause(
        lambda message, host: _userns_refused(message) and host.max_user_namespaces == 0,
        "the kernel setting user.max_user_namespaces=0, which forbids every user namespace",
        {DOCKER: f"sysctl -w user.max_user_namespaces=15000: {_NODE_SYSCTL}",
         KUBERNETES: "sysctl -w user.max_user_namespaces=15000 on the node (a pod cannot)",
         BARE_HOST: "sysctl -w user.max_user_namespaces=15000 (and in /etc/sysctl.d to keep it)"},
    ),
    Cause(
        lambda message, host: _userns_refused(message) and host.unprivileged_userns_clone == 0,
        "the kernel setting kernel.unprivileged_userns_clone=0, which forbids user namespaces to non-root",
        {DOCKER: f"sysctl -w kernel.unprivileged_userns_clone=1: {_NODE_SYSCTL}",
         KUBERNETES: "sysctl -w kernel.unprivileged_userns_clone=1 on the node (a pod cannot)",
         BARE_HOST: "sysctl -w kernel.unprivileged_userns_clone=1 (and in /etc/sysctl.d to keep it)"},
    ),
    Cause(
        lambda message, host: "setting up uid map" in message or (_userns_refused(message) and host.apparmor_restricts_userns),
        "AppArmor's kernel.apparmor_restrict_unprivileged_userns=1 (Ubuntu >= 23.10), which confines "
        "processes that make a user namespace without a profile that allows `userns`",
        {DOCKER: "on the host, sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or load an AppArmor "
                 "profile that adds `userns,` and `mount,` to docker-default and set security_opt apparmor=<it>",
         KUBERNETES: "a Localhost AppArmor profile that allows `userns,` and `mount,` on the nodes: "
                     "appArmorProfile: {type: Localhost, localhostProfile: <it>}",
         BARE_HOST: "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for "
                    "bwrap that allows `userns,`"},
    ),
    Cause(
        lambda message, host: _userns_refused(message) and host.seccomp_filtered,
        "this process's seccomp filter, which (as Docker's and the container runtimes' default profiles do) "
        "refuses unshare/clone(CLONE_NEWUSER) and mount without CAP_SYS_ADMIN",
        {DOCKER: "security_opt: [seccomp=unconfined] (or seccomp=<a profile that adds unshare, clone, "
                 "mount, umount2, pivot_root to the default>)",
         KUBERNETES: "seccompProfile: {type: Unconfined} (or {type: Localhost} with such a profile)",
         BARE_HOST: "the seccomp filter of whatever starts the service (systemd: SystemCallFilter=, "
                    "RestrictNamespaces=) must allow user namespaces"},
    ),
    Cause(
        lambda message, host: "Can't mount proc" in message,
        "the masked paths of this container's /proc (Docker's and Kubernetes' default), with which the "
        "kernel refuses the sandbox a fresh proc mount",
        {DOCKER: 'RLFLEET_ENVIRONMENT_SANDBOX=\'{"proc": false}\' (no /proc in the sandbox; compose.yaml sets '
                 "it), or security_opt: [systempaths=unconfined], which lets this container's root write "
                 "host-wide /proc/sys settings",
         KUBERNETES: 'RLFLEET_ENVIRONMENT_SANDBOX=\'{"proc": false}\' (the manifests set it), or procMount: '
                     "Unmasked with hostUsers: false",
         BARE_HOST: 'RLFLEET_ENVIRONMENT_SANDBOX=\'{"proc": false}\', or unmask /proc where this runs'},
    ),
    Cause(
        lambda message, host: _mount_refused(message) and host.apparmor_confined,
        "this process's AppArmor profile, which (as docker-default does) denies mount(2), even inside "
        "bwrap's own namespaces",
        {DOCKER: "security_opt: [apparmor=unconfined] (or apparmor=<docker-default plus `mount,`>)",
         KUBERNETES: "appArmorProfile: {type: Unconfined} (or Localhost with a profile that allows `mount,`)",
         BARE_HOST: "the AppArmor profile that confines the service must allow `mount,`"},
    ),
    Cause(
        lambda message, host: _mount_refused(message) and host.seccomp_filtered,
        "this process's seccomp filter, which refuses mount(2) without CAP_SYS_ADMIN",
        {DOCKER: "security_opt: [seccomp=unconfined] (or a profile that allows mount, umount2, pivot_root)",
         KUBERNETES: "seccompProfile: {type: Unconfined} (or Localhost with such a profile)",
         BARE_HOST: "the seccomp filter of whatever starts the service must allow mount"},
    ),
    Cause(
        lambda message, host: "PR_SET_SECCOMP" in message or "seccomp" in message.lower(),
        "a kernel that refused the sandbox's seccomp filter (one without CONFIG_SECCOMP_FILTER)",
        {DOCKER: "a host kernel with seccomp filters (every mainstream distribution's has them)",
         KUBERNETES: "nodes whose kernel has seccomp filters",
         BARE_HOST: "a kernel built with CONFIG_SECCOMP_FILTER=y"},
    ),
    Cause(
        lambda message, host: _userns_refused(message),
        "the kernel or a security module, which refuses this process a user namespace",
        {DOCKER: "security_opt: [seccomp=unconfined, apparmor=unconfined]; on the host, "
                 "user.max_user_namespaces > 0",
         KUBERNETES: "seccompProfile and appArmorProfile {type: Unconfined}; on the node, "
                     "user.max_user_namespaces > 0",
         BARE_HOST: "user.max_user_namespaces > 0 (and kernel.unprivileged_userns_clone=1 where it exists)"},
    ),
)


def explain(bwrap_failure: str, host: HostFacts | None = None) -> str:
    """What stopped bwrap and the setting to change, for each kind of host (this one's first);
    empty when nothing in ``bwrap_failure`` is recognised."""
    host = host or HostFacts.read()
    for cause in _CAUSES:
        if cause.applies(bwrap_failure, host):
            order = [host.platform] + [kind for kind in (DOCKER, KUBERNETES, BARE_HOST) if kind != host.platform]
            fixes = "; ".join(f"{kind}: {cause.fixes[kind]}" for kind in order)
            return f"stopped by {cause.setting}. The setting to change (this host looks like {host.platform}): {fixes}"
    return ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # absent (no such setting on this kernel), or not readable here
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
