"""The Ray actor that hosts one service process: ``python -m rlfleet.services.<name>`` on its node.

The actor starts the process (``services/launch.py``'s ``ServiceProcess``: port file, health wait),
publishes its address in the fleet's registry once it serves, and watches it:

- the process dies with the actor: ``PR_SET_PDEATHSIG`` (SIGKILL) for the process itself, and a
  detached reaper (``reaper.py``) for its process group (a vLLM engine core and its workers outlive
  their parent otherwise), which then removes what the group leaves (a vLLM engine's shared memory,
  the actor's node directory with its credentials and the process's temporary files): a node that
  goes, or an actor that Ray kills, leaves nothing behind on a host that stays, and an actor started
  in its place on that host removes whatever its predecessor left (``node_dir.py``);
- the process exiting on its own makes the actor exit (``os._exit``, after the same clean-up): Ray's
  restart policy (``max_restarts``) then starts the actor again, on this node or another, and the new
  one republishes; its start count is kept in the registry, across actors;
- the collector's upstreams (trajectory, reference, reward, environment) are read from the registry at
  start; when one of them is republished at another address (it restarted on another node), the
  collector's process is restarted with the new addresses (SIGTERM, same state directory): it resumes
  from its durable state at the committed version. Generation replicas are found by the collector itself
  (``RayDiscovery``): a replica that moves is a member that leaves and one that joins, re-synced to the
  committed weights before it serves.

Credentials arrive as bytes in the actor's arguments and are written to the actor's private directory
(0700, files 0600) on the node; the process reads them from there. The stateful services get
``--fresh true`` on their first start after ``up --fresh`` only (``runs.py``). A start that fails
leaves its error (the service's own lines, from this start's log) in the registry for ``Fleet.up``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rlfleet.ray import runs
from rlfleet.ray.node_dir import NodeDirectory
from rlfleet.registry import Registry

log = logging.getLogger("rlfleet.ray")
WATCH_SECONDS = 0.5
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the thread that started it (the actor's) ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def substitute(value: Any, variables: dict[str, str]) -> Any:
    """``{workdir}``, ``{key}`` ... replaced in every string of ``value`` (dicts and lists walked)."""
    if isinstance(value, str):
        for name, replacement in variables.items():
            value = value.replace("{" + name + "}", replacement)
        return value
    if isinstance(value, dict):
        return {k: substitute(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables) for v in value]
    return value


class ServiceHost:
    """One service instance (``spec``: what ``Fleet`` builds, see ``Fleet._actor_spec``)."""

    def __init__(self, spec: dict[str, Any]):
        import ray

        self.spec = spec
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.registry = Registry(spec["gcs_address"], spec["fleet"])
        # The node's address in the cluster (ray start --node-ip-address), not whatever this host routes by.
        self.node_ip = self.registry.node_ip(self.node_id) or ray.util.get_node_ip_address()
        self.node = NodeDirectory.claim(spec["fleet"], spec["key"])
        self.credentials = self.node.write_credentials(spec.get("credentials"))
        self.workdir = Path(spec["workdir"]) / spec["key"]
        self.process = None
        self.upstreams: dict[str, str] = {}
        self.starts = 0
        self._stopping = False
        self._lock = threading.Lock()
        try:
            self._start()
        except BaseException as exc:
            # Ray shows a failed __init__ as ActorDiedError around a traceback: Fleet.up reads this instead.
            self.registry.put("error", spec["key"], str(exc))
            self._stop_process()
            self.node.remove()
            raise
        threading.Thread(target=self._watch, name=f"rlfleet-watch-{spec['key']}", daemon=True).start()

    # -- the process -------------------------------------------------------------------------------

    def _start(self) -> None:
        from rlfleet.services import healthcheck
        from rlfleet.services.launch import ServiceProcess

        spec = self.spec
        self.upstreams = self._resolve_upstreams(spec["start_timeout_seconds"])
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = []
        if spec["settings"]:
            settings_file = self.workdir / "settings.json"
            settings_file.write_text(json.dumps(spec["settings"]))
            args += ["--config", str(settings_file)]
        args += [*spec["args"], *runs.start_args(self.registry, spec["key"])]
        args += ["--host", spec["bind_host"], "--port", str(spec["port"])]
        for setting, address in self.upstreams.items():
            args += [f"--{setting.replace('_', '-')}", address]
        if spec["service"] == "collector":  # the fleet's shared replicas, or those its run holds alone
            own = f"/{spec['replicas_of']}" if spec.get("replicas_of") else ""
            args += ["--generation-addresses", json.dumps([f"ray+gcs://{spec['gcs_address']}/{spec['fleet']}{own}"])]
        process = ServiceProcess(spec["service"], args, env=self._process_env(), preexec_fn=die_with_parent,
                                 module=spec.get("module"))
        if self.credentials is not None:
            process.args += self._tls_args()
            process.health_credentials = healthcheck.tls_credentials(
                str(self.credentials / "ca.pem"), str(self.credentials / f"{spec['service']}.pem"),
                str(self.credentials / f"{spec['service']}.key"))
        process.start(self.workdir)
        self.process = process
        process.guard(self.node.path)  # the actor's end (SIGKILL included) takes the service's group along
        process.wait_ready(spec["start_timeout_seconds"])
        runs.started(self.registry, spec["key"])
        self.starts = self.registry.count_start(spec["key"])
        self.registry.delete("error", spec["key"])
        self.registry.publish(spec["key"], self.record())
        log.info("%s serving at %s on node %s", spec["key"], self.address(), self.node_id)

    def _process_env(self) -> dict[str, str]:
        """The process's environment: the fleet's ``env`` over a ``TMPDIR`` in this actor's node directory
        (a vLLM engine's file store and IPC sockets go with the directory, even when the engine is killed)."""
        from rlfleet.services.launch import tmp_env

        return {**tmp_env(self.node.fresh_tmp()), **self.spec["env"]}

    def _stop_process(self) -> int | None:
        """SIGTERM the process (SIGKILL after a timeout) and its group; the engine segments a killed group
        left removed (``ServiceProcess.stop``)."""
        if self.process is None or self.process.process is None:
            return None
        return self.process.stop()

    def _exit(self) -> None:
        """The actor ends for Ray to restart it: what the process left removed first."""
        self._stop_process()
        self.node.remove()
        os._exit(1)

    def _tls_args(self) -> list[str]:
        from rlfleet.services.suite import upstream_args, secure_args

        args = secure_args(self.credentials, self.spec["service"])
        if self.spec["service"] == "collector":
            args += upstream_args(self.credentials)
        return args

    def _resolve_upstreams(self, timeout: float) -> dict[str, str]:
        """The collector's upstream settings -> the addresses the registry holds now (waits for each)."""
        wanted = self.spec.get("upstreams", {})
        deadline = time.monotonic() + timeout
        while True:
            found = {setting: self.registry.address(key) for setting, key in wanted.items()}
            if all(found.values()):
                return found
            if time.monotonic() > deadline:
                missing = [wanted[setting] for setting, address in found.items() if not address]
                raise TimeoutError(f"{self.spec['key']}: no address for {missing} within {timeout:.0f} s")
            time.sleep(WATCH_SECONDS)

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self._lock:
                if self._stopping:
                    return
                if self.process.process.poll() is not None:
                    log.error("%s exited with code %s: the actor exits for Ray to restart it; log tail:\n%s",
                              self.spec["key"], self.process.process.returncode, self.process.log_tail())
                    self._exit()
                if self.spec.get("upstreams") and self._upstreams_moved():
                    log.warning("%s: an upstream moved (%s): restarting the process with the new addresses",
                                self.spec["key"], self.upstreams)
                    self._stop_process()
                    try:
                        self._start()
                    except Exception:  # noqa: BLE001 - whatever stopped it, Ray's restart is the way on
                        log.exception("%s did not start again: the actor exits for Ray to restart it",
                                      self.spec["key"])
                        self._exit()

    def _upstreams_moved(self) -> bool:
        try:
            now = {setting: self.registry.address(key) for setting, key in self.spec["upstreams"].items()}
        except Exception as exc:  # noqa: BLE001 - a GCS hiccup: ask again next round
            log.warning("registry unreadable (%s): keeping the current upstreams", exc)
            return False
        return any(address and address != self.upstreams.get(setting) for setting, address in now.items())

    # -- what callers ask ---------------------------------------------------------------------------

    def address(self) -> str:
        return f"{self.node_ip}:{self.process.port}"

    def record(self) -> dict[str, Any]:
        """What the registry holds for this instance."""
        return {"service": self.spec.get("group") or self.spec["service"], "key": self.spec["key"],
                "address": self.address(),
                "node_id": self.node_id, "node_ip": self.node_ip, "pid": self.process.process.pid,
                "starts": self.starts, "log": str(self.process.log_path)}

    def info(self) -> dict[str, Any]:
        return self.record()

    def stop(self) -> int | None:
        """Take the record out of the registry, SIGTERM the process (graceful), remove this actor's node
        directory: before ``ray.kill``."""
        with self._lock:
            self._stopping = True
            self.registry.withdraw(self.spec["key"])
            code = self._stop_process()
            self.node.remove()
            return code
