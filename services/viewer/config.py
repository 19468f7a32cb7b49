"""Config of the rollout viewer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.services.common.config import Settings
from rlfleet.services.common.upstream import UpstreamConfig


class ViewerRun(BaseModel):
    """One run of a fleet that runs share, as the viewer reads it."""

    model_config = ConfigDict(extra="forbid")

    trajectory_address: str
    """The run's trajectory service."""
    collector_address: str | None = None
    """The run's collector (None: its trajectory store only)."""


class ViewerConfig(Settings, UpstreamConfig):
    """The rollout viewer: a web page showing what the policy sampled, read-only (a ``reader`` token)."""

    service_name = "viewer"

    host: str = "127.0.0.1"
    """Interface the web server binds to: loopback by default (reach it with an SSH tunnel or a
    port-forward); anything else should serve HTTPS with ``access_tokens_file`` set (a warning is
    logged otherwise)."""
    port: int = Field(8265, ge=0, le=65535)
    """HTTP(S) port; 0 picks a free port (written to ``port_file``)."""
    port_file: str | None = None
    """If set, the bound port is written here once the server listens (for launchers and tests)."""
    suite_dir: str | None = None
    """An ``rlfleet-suite`` work directory (``runs/suite``): the trajectory service's and the collector's
    addresses are read from the port files the suite's services wrote there, over ``trajectory_address``
    and ``collector_address`` (a collector that has stopped is shown as not answering); for a suite started
    with ``--secure``, the reader's token and the trainer's certificate come from its ``credentials``."""
    trajectory_address: str = "127.0.0.1:50054"
    """The trajectory service: its sample log, per-version statistics and buffer counts."""
    collector_address: str | None = "127.0.0.1:50050"
    """The collector: its status and dead letters. None: the viewer shows the trajectory store only."""
    runs: dict[str, ViewerRun] = Field(default_factory=dict)
    """The runs of a fleet that runs share, by name (docs/concepts/many-runs.md), each its trajectory
    service and collector: the page has a run filter, ``?run=NAME`` on every read; what a run's services
    refuse to the viewer's credentials (another run's, with a token acting for one run), the page shows
    refused. Empty: one run, at ``trajectory_address`` and ``collector_address``. A ``suite_dir`` of a
    suite started with ``--runs N`` sets it (r0, r1, ...)."""
    tokenizer: str | None = None
    """Tokenizer directory (the served model's) to show token text; None shows token ids."""
    tls_cert_file: str | None = None
    """PEM certificate (chain) the web server presents; with ``tls_key_file`` it serves HTTPS only."""
    tls_key_file: str | None = None
    """PEM private key (unencrypted) of ``tls_cert_file``."""
    access_tokens_file: str | None = None
    """Tokens a browser must present (the same ``ROLE[,ROLE...] TOKEN`` lines as the services'
    ``auth_tokens_file``; any role may look): open the page once as ``/?token=TOKEN`` (kept in a
    cookie for the session) or send ``authorization: Bearer TOKEN``. None: no token asked."""
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """grpc.max_receive_message_length of the viewer's calls (one trajectory at a time)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Logging level."""
    log_format: Literal["json", "text"] = "json"
    """Structured JSON lines (for log shippers) or human-readable text."""
