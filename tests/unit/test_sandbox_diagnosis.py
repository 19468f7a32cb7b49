"""The sandbox's refusal names the setting that stopped bwrap, from bwrap's message and the host's facts."""

from __future__ import annotations

import dataclasses

import pytest

from rlfleet.services.environment.sandbox_diagnosis import BARE_HOST, DOCKER, KUBERNETES, HostFacts, explain

NO_USERNS = ("bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
             "non-privileged user namespaces.")
OPEN_HOST = HostFacts(seccomp_filtered=False, apparmor_profile=None, max_user_namespaces=15000,
                      unprivileged_userns_clone=None, apparmor_restricts_userns=False, platform=BARE_HOST)


@pytest.mark.parametrize(("message", "facts", "setting", "fix"), [
    (NO_USERNS, {"seccomp_filtered": True, "platform": DOCKER}, "seccomp filter", "security_opt: [seccomp=unconfined]"),
    (NO_USERNS, {"seccomp_filtered": True, "platform": KUBERNETES}, "seccomp filter", "seccompProfile: {type: Unconfined}"),
    ("bwrap: Creating new namespace failed: No space left on device", {"max_user_namespaces": 0},
     "user.max_user_namespaces=0", "sysctl -w user.max_user_namespaces=15000"),
    (NO_USERNS, {"unprivileged_userns_clone": 0}, "kernel.unprivileged_userns_clone=0",
     "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("bwrap: setting up uid map: Permission denied", {}, "apparmor_restrict_unprivileged_userns", "`userns,`"),
    ("bwrap: Failed to make / slave: Permission denied", {"apparmor_profile": "docker-default (enforce)",
                                                          "platform": DOCKER}, "AppArmor profile",
     "security_opt: [apparmor=unconfined]"),
    ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", {"platform": KUBERNETES},
     "masked paths", "procMount: Unmasked"),
])
def test_each_cause_names_its_setting_and_puts_this_hosts_fix_first(message, facts, setting, fix):
    host = dataclasses.replace(OPEN_HOST, **facts)

    explanation = explain(message, host)

    assert explanation.startswith("stopped by ") and setting in explanation.split(". The setting")[0]
    first_fix = explanation.split(": ", 1)[1].split("; ")[0]
    assert first_fix.startswith(host.platform) and fix in first_fix, explanation
    assert all(kind in explanation for kind in (DOCKER, KUBERNETES, BARE_HOST))


def test_an_unconfined_apparmor_profile_is_not_blamed_for_a_mount():
    host = dataclasses.replace(OPEN_HOST, apparmor_profile="unconfined")
    assert explain("bwrap: Failed to make / slave: Permission denied", host) == ""


def test_an_unrecognised_failure_explains_nothing():
    assert explain("a trivial snippet failed (exited with code 1)", OPEN_HOST) == ""


def test_host_facts_are_read_from_proc(tmp_path):
    (tmp_path / "self/attr/apparmor").mkdir(parents=True)
    (tmp_path / "sys/user").mkdir(parents=True)
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "self/status").write_text("Name:\tpython\nSeccomp:\t2\nSeccomp_filters:\t1\n")
    (tmp_path / "self/attr/apparmor/current").write_text("docker-default (enforce)\n")
    (tmp_path / "sys/user/max_user_namespaces").write_text("0\n")
    (tmp_path / "sys/kernel/apparmor_restrict_unprivileged_userns").write_text("1\n")

    facts = HostFacts.read(tmp_path, environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})

    assert facts == HostFacts(seccomp_filtered=True, apparmor_profile="docker-default (enforce)", max_user_namespaces=0,
                              unprivileged_userns_clone=None, apparmor_restricts_userns=True, platform=KUBERNETES)
    assert facts.apparmor_confined
