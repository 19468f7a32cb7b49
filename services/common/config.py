"""One pydantic config per service, loaded from a file, env vars and CLI flags.

Precedence (highest first): CLI flags, environment variables, the config file
(``--config path.yaml|.json``), field defaults. Env vars are named
``RLFLEET_<SERVICE>_<FIELD>`` (e.g. ``RLFLEET_REFERENCE_PORT=50052``); dict
and list fields take JSON in env vars and on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field

C = TypeVar("C", bound="ServiceConfig")


class ServiceConfig(BaseModel):
    """Fields every service has. Each service subclasses this and sets ``service_name``."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)
    service_name: ClassVar[str] = "service"

    host: str = "0.0.0.0"
    """Interface the gRPC server binds to."""
    port: int = Field(50050, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
    port_file: str | None = None
    """If set, the bound port is written here once the server listens (for launchers and tests)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus metrics HTTP port; 0 disables the endpoint."""
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """grpc.max_send/receive_message_length. Weights stream in ~1 MiB chunks, so this bounds other payloads."""
    keepalive_seconds: float = Field(30.0, gt=0)
    """Server keepalive ping interval (detects dead trainers/collectors behind NATs)."""
    grace_seconds: float = Field(10.0, ge=0)
    """On SIGTERM/SIGINT: how long in-flight RPCs may finish before being cancelled."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Logging level."""
    log_format: Literal["json", "text"] = "json"
    """Structured JSON lines (for log shippers) or human-readable text."""
    auth_token: str | None = None
    """If set, every RPC must carry ``authorization: Bearer <token>`` metadata (UNAUTHENTICATED otherwise); health stays open."""

    @classmethod
    def env_prefix(cls) -> str:
        return f"RLFLEET_{cls.service_name.upper()}_"

    @classmethod
    def load(cls: type[C], argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> C:
        """Build the config from ``argv`` (CLI flags), ``environ`` and ``--config``."""
        environ = os.environ if environ is None else environ
        parser = cls.argument_parser()
        ns = parser.parse_args(argv)
        values: dict[str, Any] = {}
        if ns.config:
            values.update(read_config_file(ns.config))
        prefix = cls.env_prefix()
        for name in cls.user_fields():
            raw = environ.get(prefix + name.upper())
            if raw is not None:
                values[name] = _parse_value(raw)
        for name in cls.user_fields():
            raw = getattr(ns, name)
            if raw is not None:
                values[name] = _parse_value(raw)
        return cls.model_validate(values)

    @classmethod
    def user_fields(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def argument_parser(cls) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=f"rlfleet-{cls.service_name}",
            description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None,
            epilog=f"Every flag can also be set as env var {cls.env_prefix()}<FIELD> or in --config.",
        )
        parser.add_argument("--config", help="YAML or JSON file with config fields")
        for field_name in cls.user_fields():
            field = cls.model_fields[field_name]
            parser.add_argument(
                "--" + field_name.replace("_", "-"), dest=field_name, default=None,
                metavar=field_name.upper(), help=(field.description or "").replace("%", "%%"),
            )
        return parser


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of config fields."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config fields")
    return data


def _parse_value(raw: str) -> Any:
    # JSON for dicts/lists/numbers/bools; anything else stays a string for pydantic.
    if raw[:1] in "[{":
        return json.loads(raw)
    return raw
