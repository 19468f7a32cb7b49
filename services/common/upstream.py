"""How a process calls rlfleet's services as a client: the ``upstream_*`` settings and the channel
settings they make (the collector calls its upstreams this way, the rollout viewer reads with them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # configs import this module, and configs load without torch (the SDK's channel imports it)
    from rlfleet.rpc.channel import ChannelSettings


class UpstreamConfig(BaseModel):
    """Token and TLS files this process presents to the services it calls."""

    model_config = ConfigDict(use_attribute_docstrings=True)  # the docstrings below document the settings

    upstream_auth_token: str | None = None
    """Bearer token sent to the other services (if they enforce one). Prefer
    ``upstream_auth_token_file``: a command line shows in ``ps``."""
    upstream_auth_token_file: str | None = None
    """File holding the bearer token sent to the other services (a mounted secret); overrides
    ``upstream_auth_token``."""
    upstream_tls_ca_file: str | None = None
    """PEM CA certificate(s) the other services' certificates are verified against; set (or a client
    certificate set), the other services are called over TLS."""
    upstream_tls_cert_file: str | None = None
    """PEM client certificate presented to services that require one (mTLS)."""
    upstream_tls_key_file: str | None = None
    """PEM private key of ``upstream_tls_cert_file``."""
    upstream_tls_server_name: str | None = None
    """The name the other services' certificates hold, when it differs from their addresses' hosts."""
    upstream_timeout_seconds: float = Field(120.0, gt=0)
    """Deadline of each call to another service."""


def upstream_settings(config: UpstreamConfig, max_message_bytes: int) -> "ChannelSettings":
    """The channel settings of ``config``'s upstream fields: token and TLS files read and checked now
    (a bad one refuses the start, naming the setting), deadlines and message sizes."""
    from rlfleet.rpc.channel import ChannelSettings
    from rlfleet.services.common import security

    token = config.upstream_auth_token
    if config.upstream_auth_token_file:
        token = security.read_token(config.upstream_auth_token_file, "upstream_auth_token_file")
    roots, chain, key = security.channel_files(config.upstream_tls_ca_file, config.upstream_tls_cert_file,
                                               config.upstream_tls_key_file, "upstream_tls")
    return ChannelSettings(auth_token=token, timeout=config.upstream_timeout_seconds,
                           max_message_bytes=max_message_bytes, tls=bool(roots or chain),
                           root_certificates=roots, certificate_chain=chain, private_key=key,
                           server_name=config.upstream_tls_server_name)
