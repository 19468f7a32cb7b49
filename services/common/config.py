"""One pydantic config per service, loaded from a file, env vars and CLI flags.

Precedence (highest first): CLI flags (``--field-name VALUE`` or
``--field-name=VALUE``), environment variables ``RLFLEET_<SERVICE>_<FIELD>``
(e.g. ``RLFLEET_REFERENCE_PORT=50052``), the config file (``--config
path.yaml|.json``), field defaults. pydantic-settings reads the sources; dict
and list fields take JSON in env vars and flags, decoded by the model (bad JSON
is a ``ValidationError`` naming the field); any other value is handed to the
field as written, so a string field given ``[abc`` or ``{x`` keeps it. On the
command line ``null`` sets an optional field to None.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence, TypeVar

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

C = TypeVar("C", bound="Settings")


class Settings(BaseSettings):
    """How every rlfleet process loads its config (flags, env vars, a file; see the module doc).
    A process's config subclasses this (a gRPC service through ``ServiceConfig``) and sets ``service_name``."""

    model_config = SettingsConfigDict(
        extra="forbid", validate_default=True, use_attribute_docstrings=True,
        # Flags and file keys are matched exactly; env var names ignore case (see _EnvironSource).
        case_sensitive=True,
        # Dict/list values reach the model as text and _decode_json turns them into
        # ValidationErrors naming the field, not a SettingsError from inside a source.
        enable_decoding=False,
        cli_kebab_case=True,
    )
    service_name: ClassVar[str] = "service"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # A config built in code holds exactly its arguments; only load() reads the outside world.
        return (init_settings,)

    @field_validator("*", mode="before")
    @classmethod
    def _decode_json(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and info.field_name and _takes_json(cls.model_fields[info.field_name].annotation):
            try:
                return json.loads(value)
            except ValueError as err:
                raise ValueError(f"invalid JSON ({err})") from None
        return value

    @classmethod
    def env_prefix(cls) -> str:
        return f"RLFLEET_{cls.service_name.upper()}_"

    @classmethod
    def load(cls: type[C], argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> C:
        """Build the config from ``argv`` (CLI flags; default ``sys.argv[1:]``), ``environ``
        (default ``os.environ``) and the ``--config`` file they name."""
        parser, cli = cls._command_line()
        parsed = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
        config_file = parsed.pop("config")
        # Dict/list flags are argparse "append" actions: the last one wins, like every other flag.
        cli(parsed_args={name: value[-1] if isinstance(value, list) else value for name, value in parsed.items()})
        # Highest precedence first; pydantic-settings fills each field from the first source that has it.
        sources: list[PydanticBaseSettingsSource] = [
            cli, _EnvironSource(cls, os.environ if environ is None else environ, cls.env_prefix()),
        ]
        if config_file:
            sources.append(InitSettingsSource(cls, init_kwargs=read_config_file(config_file)))
        return cls(_build_sources=(tuple(sources), {}))

    @classmethod
    def user_fields(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def argument_parser(cls) -> argparse.ArgumentParser:
        """``--config`` plus one ``--field-name`` flag per field, documented by the field's docstring."""
        return cls._command_line()[0]

    @classmethod
    def _command_line(cls) -> tuple[argparse.ArgumentParser, CliSettingsSource]:
        parser = argparse.ArgumentParser(
            prog=f"rlfleet-{cls.service_name}",
            description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None,
            epilog=(f"Every flag can also be set as env var {cls.env_prefix()}<FIELD> or in --config. "
                    "Dict and list values are JSON; null sets an optional field to None."),
            allow_abbrev=False,  # a truncated or mistyped flag is an error, not another field
        )
        parser.add_argument("--config", help="YAML or JSON file with config fields")
        return parser, CliSettingsSource(cls, root_parser=parser)


class ServiceConfig(Settings):
    """Fields every gRPC service has. Each service subclasses this and sets ``service_name``."""

    host: str = "127.0.0.1"
    """Interface the gRPC server binds to: loopback by default; ``0.0.0.0`` (all interfaces) in a
    container or a cluster, with TLS and tokens (a warning is logged otherwise)."""
    port: int = Field(50050, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
    health_port: int = Field(0, ge=0, le=65535)
    """A second port serving only ``grpc.health.v1`` (Check, Watch, List), plaintext and without
    tokens, on ``host``: for probes that cannot do TLS (Kubernetes' gRPC probes) when ``port``
    requires it. It tells whether the service serves, nothing else. 0: none."""
    port_file: str | None = None
    """If set, the bound port is written here once the server listens (for launchers and tests)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus metrics HTTP port; 0 disables the endpoint."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics endpoint binds to (plain HTTP, no auth: loopback unless a scraper needs it)."""
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
    auth_tokens_file: str | None = None
    """Tokens and their roles (``services/common/security.py``): one ``ROLE[,ROLE...] TOKEN`` per line,
    roles ``trainer``, ``reader``, ``operator``, ``service``. Set, every RPC must carry
    ``authorization: Bearer <token>`` (UNAUTHENTICATED otherwise) of a role it accepts
    (PERMISSION_DENIED otherwise); health and reflection stay open."""
    auth_token: str | None = None
    """One token with every role (as ``auth_tokens_file``). Prefer the file, or the env var: a command
    line shows in ``ps``."""
    tls_cert_file: str | None = None
    """PEM certificate (chain) the server presents; with ``tls_key_file`` the service serves TLS only."""
    tls_key_file: str | None = None
    """PEM private key (unencrypted) of ``tls_cert_file``."""
    tls_client_ca_file: str | None = None
    """PEM CA certificate(s): set, every client must present a certificate signed by one (mTLS)."""
    run_name: str = Field("", pattern=r"^([A-Za-z0-9._-]{1,128})?$")
    """The run this service serves alone, where runs share a fleet (docs/concepts/many-runs.md): a run's
    collector and trajectory store. A trainer's or reader's token or certificate naming other runs is
    refused here (PERMISSION_DENIED); "": no one run (a fleet of one run, or a service runs share)."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint (``host:port``: an OpenTelemetry Collector, Jaeger) this service's trace spans
    are exported to (``docs/guides/tracing.md``); None: no tracing, nothing added to any call."""
    otlp_insecure: bool = True
    """Export to ``otlp_endpoint`` in plaintext; false: over TLS, verified against the system roots."""
    trace_sample_ratio: float = Field(1.0, ge=0, le=1)
    """Share of the traces this service starts that are recorded (a trace begun by a caller follows
    the caller's decision)."""


class _EnvironSource(EnvSettingsSource):
    """``RLFLEET_<SERVICE>_<FIELD>`` variables, read from the mapping ``load`` was given."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str], prefix: str):
        self._environ = environ
        super().__init__(settings_cls, env_prefix=prefix, case_sensitive=False)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # EnvSettingsSource reads os.environ here; DotEnvSettingsSource overrides it the same way.
        return {name.lower(): value for name, value in self._environ.items()}


def _takes_json(annotation: Any) -> bool:
    """Whether a field's values are dicts, lists or models (spelt as JSON in env vars and flags)."""
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for member in typing.get_args(annotation) if is_union else (annotation,):
        container = typing.get_origin(member) or member
        if isinstance(container, type) and issubclass(container, (dict, list, tuple, set, frozenset, BaseModel)):
            return True
    return False


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
