"""Who may call what, and over which transport: server TLS, bearer tokens and their roles.

**Roles.** A token carries one or more roles; each RPC accepts the roles in ``METHOD_ROLES``, the one
table of them (docs/guides/security.md shows it). Health and reflection stay open (probes, grpcurl).

- ``trainer``: push weights, submit prompts, read and ack batches (and everything a reader or an
  operator reads);
- ``reader``: read and ack batches, read the version and the status;
- ``operator``: status, buffer stats, dead letters, drop stale rows, engine and KL-controller status;
- ``service``: service to service (the collector calling generation, reference, reward, trajectory
  and environment).

A call without a known token is UNAUTHENTICATED; a known token whose roles the RPC does not accept is
PERMISSION_DENIED naming the roles it accepts. With no token configured a service checks nothing
(local development, the embedded suite).

**Runs.** Where several runs share a fleet (docs/concepts/many-runs.md) each run's collector and
trajectory store serve one run, named by ``run_name``. A trainer's or reader's credentials may name the
runs they act for: a token by a third field in the tokens file, a client certificate by a URI
``urn:rlfleet:run:<run>`` among its subject alternative names. A call whose token or certificate names
runs is PERMISSION_DENIED on a service of any other run (and on the services every run shares), so
nothing of run B reaches run A's trainer. ``operator`` and ``service`` see every run: a call the RPC
takes for one of those roles is not held to a run (a token naming runs may hold neither role). An
unscoped trainer token acts on every run (a fleet of one run).

**Tokens** come from ``auth_tokens_file`` (one ``ROLE[,ROLE...] TOKEN [RUN[,RUN...]]`` per line, ``#``
comments: a mounted secret, never a command line, where ``ps`` shows it) and from ``auth_token`` (one
token with every role, as before roles existed).

**TLS.** ``tls_cert_file`` + ``tls_key_file`` make a service serve TLS; ``tls_client_ca_file`` also
requires a client certificate signed by that CA (mTLS). Every file is read and checked at start (a
PEM certificate, a key that matches it): a bad one is a refusal naming the setting, not a handshake
failure later.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from rlfleet.services.common.errors import StartupError
from rlfleet.services.common.run_ids import is_run_id

if TYPE_CHECKING:
    import grpc

    from rlfleet.services.common.config import ServiceConfig

log = logging.getLogger("rlfleet.security")

TRAINER, READER, OPERATOR, SERVICE = "trainer", "reader", "operator", "service"
ROLES = (TRAINER, READER, OPERATOR, SERVICE)
"""Every role a token may carry."""

UNSCOPED = frozenset({OPERATOR, SERVICE})
"""The roles that see every run: a call an RPC takes for one of them is not held to a run."""
RUN_URI = "urn:rlfleet:run:"
"""A client certificate's subject alternative name ``urn:rlfleet:run:<run>`` names a run it acts for."""

_READS = frozenset({TRAINER, READER, OPERATOR})  # status and version: every outside caller
_INNER = frozenset({SERVICE})

METHOD_ROLES: Mapping[str, frozenset[str]] = {
    # The collector: what trainers, readers and operators call.
    "/rlfleet.v1.CollectorService/PushWeights": frozenset({TRAINER}),
    "/rlfleet.v1.CollectorService/SubmitPrompts": frozenset({TRAINER}),
    "/rlfleet.v1.CollectorService/JoinRun": frozenset({TRAINER, READER}),
    "/rlfleet.v1.CollectorService/GetPolicyVersion": _READS,
    "/rlfleet.v1.CollectorService/GetStatus": _READS,
    "/rlfleet.v1.CollectorService/ListFailures": _READS,  # dead letters: the rollout viewer shows them
    "/rlfleet.v1.CollectorService/GetPassRates": frozenset({TRAINER, OPERATOR}),
    "/rlfleet.v1.CollectorService/ReportMismatch": frozenset({TRAINER}),
    "/rlfleet.v1.CollectorService/CloseMismatchBreaker": frozenset({OPERATOR}),
    # The trajectory service (and the collector's forward of it): batches are read and acked on the stream.
    "/rlfleet.v1.TrajectoryService/StreamBatches": frozenset({TRAINER, READER, SERVICE}),
    "/rlfleet.v1.TrajectoryService/GetStats": _READS | _INNER,
    "/rlfleet.v1.TrajectoryService/DropStale": frozenset({OPERATOR, SERVICE}),
    "/rlfleet.v1.TrajectoryService/Append": _INNER,
    # The sample log and per-version statistics: read-only (the rollout viewer's reader token).
    "/rlfleet.v1.TrajectoryService/GetVersionStats": _READS,
    "/rlfleet.v1.TrajectoryService/ListSamples": _READS,
    "/rlfleet.v1.TrajectoryService/GetSample": _READS,
    # The inner services: the collector calls them; operators read their status.
    "/rlfleet.v1.GenerationService/Generate": _INNER,
    "/rlfleet.v1.GenerationService/UpdateWeights": _INNER,
    "/rlfleet.v1.GenerationService/RelayWeights": _INNER,
    "/rlfleet.v1.GenerationService/ShareWeights": _INNER,
    "/rlfleet.v1.GenerationService/GetEngineStatus": frozenset({OPERATOR, SERVICE}),
    "/rlfleet.v1.GenerationService/EndRun": frozenset({OPERATOR, SERVICE}),
    "/rlfleet.v1.ReferenceService/ScoreLogProbs": _INNER,
    "/rlfleet.v1.RewardService/ComputeRewards": _INNER,
    "/rlfleet.v1.RewardService/CheckTasks": _INNER,
    "/rlfleet.v1.RewardService/GetKLController": frozenset({OPERATOR, SERVICE}),
    "/rlfleet.v1.EnvironmentService/OpenEpisode": _INNER,
    "/rlfleet.v1.EnvironmentService/Step": _INNER,
    "/rlfleet.v1.EnvironmentService/CloseEpisode": _INNER,
    # Diagnostics (an echo of bytes): any authenticated caller.
    "/rlfleet.v1.DiagnosticsService/Echo": frozenset(ROLES),
}
"""Full gRPC method name -> the roles that may call it. A served method missing here is refused to
everyone (fail closed); tests/unit/test_security.py checks that every RPC of every service is here."""

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
"""Reachable without a token: health (probes) and reflection (grpcurl)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of an access check: ``code`` None lets the call through."""

    code: str | None = None
    """``UNAUTHENTICATED`` or ``PERMISSION_DENIED``."""
    message: str = ""


ALLOWED = Verdict()


@dataclass(frozen=True)
class Grant:
    """What a token may do: its roles, and the runs it acts for."""

    roles: frozenset[str]
    runs: frozenset[str] | None = None
    """None: every run (an unscoped token)."""


class AccessPolicy:
    """Tokens and their grants, and the run this service serves; ``check`` says whether a call may go
    on. No token: roles are not checked (a run named by a client certificate still is)."""

    def __init__(self, tokens: Mapping[str, Grant | frozenset[str]] | None = None, run: str = "",
                 reads_certificates: bool = False):
        self._tokens = [(token.encode(), grant if isinstance(grant, Grant) else Grant(frozenset(grant)))
                        for token, grant in (tokens or {}).items()]
        self.run = run
        """The run this service serves ("": none; the services every run shares)."""
        self.reads_certificates = reads_certificates
        """Clients present certificates (mTLS): the runs they name are checked (``certificate_runs``)."""

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def grant_of(self, token: str) -> Grant | None:
        """The grant of ``token``, None for an unknown one (every token compared in constant time)."""
        found = None
        presented = token.encode()
        for known, grant in self._tokens:
            if hmac.compare_digest(presented, known):
                found = grant
        return found

    def roles_of(self, token: str) -> frozenset[str] | None:
        grant = self.grant_of(token)
        return None if grant is None else grant.roles

    def check(self, method: str, metadata: Iterable[tuple[str, str]] | None,
              certificate_runs: frozenset[str] | None = None) -> Verdict:
        """``certificate_runs``: the runs the caller's client certificate names (None: it names none)."""
        if method.startswith(OPEN_SERVICES):
            return ALLOWED
        token_runs = None
        if self._tokens:
            token = _bearer(metadata)
            grant = None if token is None else self.grant_of(token)
            if grant is None:
                return Verdict("UNAUTHENTICATED", "missing or invalid 'authorization: Bearer <token>' metadata")
            accepted = METHOD_ROLES.get(method, frozenset())
            if not grant.roles & accepted:
                wanted = ", ".join(role for role in ROLES if role in accepted) or "no role (not in the role table)"
                held = ", ".join(role for role in ROLES if role in grant.roles)
                return Verdict("PERMISSION_DENIED",
                               f"{method}: the token's role ({held}) may not call it; it takes: {wanted}")
            if grant.roles & accepted & UNSCOPED:
                return ALLOWED  # operators and services see every run
            token_runs = grant.runs
        for credential, runs in (("token", token_runs), ("client certificate", certificate_runs)):
            if runs is not None and self.run not in runs:
                served = f"run {self.run}" if self.run else "no one run (every run shares it)"
                return Verdict("PERMISSION_DENIED", f"{method}: the {credential} acts for run "
                                                    f"{', '.join(sorted(runs))}; this service serves {served}")
        return ALLOWED


def certificate_runs(peer_uris: Iterable[bytes | str]) -> frozenset[str] | None:
    """The runs a client certificate names (its ``urn:rlfleet:run:<run>`` URIs; gRPC's auth context
    ``peer_uri``), None when it names none."""
    runs = frozenset(uri[len(RUN_URI):] for uri in
                     (raw.decode(errors="replace") if isinstance(raw, bytes) else raw for raw in peer_uris)
                     if uri.startswith(RUN_URI))
    return runs or None


def _bearer(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[7:]
    return None


# --- loading from the config ------------------------------------------------------------------

def read_tokens_file(path: str | Path, setting: str = "auth_tokens_file") -> dict[str, Grant]:
    """``ROLE[,ROLE...] TOKEN [RUN[,RUN...]]`` per line (``#`` starts a comment) -> token -> grant.
    StartupError naming ``setting``, the file and the line for anything else."""
    text = _read_text(path, setting)
    tokens: dict[str, Grant] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{setting} {path}, line {number}"
        fields = line.split()
        if len(fields) not in (2, 3):
            raise StartupError(f"{where}: expected 'ROLE TOKEN' (roles comma-separated) or 'ROLE TOKEN RUN' "
                               f"(runs comma-separated), got {len(fields)} fields")
        roles = frozenset(role.strip() for role in fields[0].split(","))
        unknown = sorted(roles - set(ROLES))
        if unknown:
            raise StartupError(f"{where}: unknown role {unknown[0]!r}; the roles are {', '.join(ROLES)}")
        token = fields[1]
        if len(token) < 16:
            raise StartupError(f"{where}: a token of {len(token)} characters is too short to be a secret (>= 16)")
        runs = None
        if len(fields) == 3:
            runs = frozenset(fields[2].split(","))
            bad = sorted(run for run in runs if not is_run_id(run))
            if bad:
                raise StartupError(f"{where}: {bad[0]!r} is not a run name (1 to 128 characters of [A-Za-z0-9._-])")
            if roles & UNSCOPED:
                raise StartupError(f"{where}: an operator or service token sees every run; name runs on trainer "
                                   f"and reader tokens only")
        grant = Grant(roles, runs)
        if token in tokens and tokens[token] != grant:
            raise StartupError(f"{where}: this token is listed before with other roles or runs")
        tokens[token] = grant
    if not tokens:
        raise StartupError(f"{setting} {path}: no token in the file (one 'ROLE TOKEN' per line)")
    return tokens


def read_token(path: str | Path, setting: str) -> str:
    """A client's token from a file (a mounted secret): its text less surrounding whitespace."""
    token = _read_text(path, setting).strip()
    if not token or any(char.isspace() for char in token):
        raise StartupError(f"{setting} {path}: expected one token (no spaces), got {len(token.split())} words")
    return token


def access_policy(config: "ServiceConfig") -> AccessPolicy:
    """The service's tokens (``auth_tokens_file``'s, plus ``auth_token`` with every role), its run, and
    whether its clients present certificates."""
    tokens = read_tokens_file(config.auth_tokens_file) if config.auth_tokens_file else {}
    if config.auth_token:
        tokens[config.auth_token] = Grant(frozenset(ROLES))
    return AccessPolicy(tokens, run=config.run_name, reads_certificates=bool(config.tls_client_ca_file))


def server_credentials(config: "ServiceConfig") -> "grpc.ServerCredentials | None":
    """TLS credentials from the config (None: plaintext), every file read and checked now."""
    import grpc

    cert_file, key_file, ca_file = config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    if not cert_file and not key_file:
        if ca_file:
            raise StartupError("tls_client_ca_file requires tls_cert_file and tls_key_file (mTLS is TLS first)")
        return None
    if not cert_file or not key_file:
        missing = "tls_key_file" if cert_file else "tls_cert_file"
        raise StartupError(f"{missing} is not set: tls_cert_file and tls_key_file go together")
    certificate = _read_bytes(cert_file, "tls_cert_file")
    key = _read_bytes(key_file, "tls_key_file")
    check_key_pair(certificate, key, f"tls_cert_file {cert_file}", f"tls_key_file {key_file}")
    client_ca = None
    if ca_file:
        client_ca = _read_bytes(ca_file, "tls_client_ca_file")
        load_certificate(client_ca, f"tls_client_ca_file {ca_file}")
    return grpc.ssl_server_credentials([(key, certificate)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_files(ca_file: str | None, cert_file: str | None, key_file: str | None,
                  prefix: str) -> tuple[bytes | None, bytes | None, bytes | None]:
    """A client's TLS files (roots, certificate chain, key), read and checked; ``prefix`` names the
    settings (``upstream_tls`` -> ``upstream_tls_ca_file`` ...)."""
    if bool(cert_file) != bool(key_file):
        missing = f"{prefix}_key_file" if cert_file else f"{prefix}_cert_file"
        raise StartupError(f"{missing} is not set: {prefix}_cert_file and {prefix}_key_file go together")
    roots = _read_bytes(ca_file, f"{prefix}_ca_file") if ca_file else None
    if roots is not None:
        load_certificate(roots, f"{prefix}_ca_file {ca_file}")
    chain = key = None
    if cert_file and key_file:
        chain, key = _read_bytes(cert_file, f"{prefix}_cert_file"), _read_bytes(key_file, f"{prefix}_key_file")
        check_key_pair(chain, key, f"{prefix}_cert_file {cert_file}", f"{prefix}_key_file {key_file}")
    return roots, chain, key


def load_certificate(pem: bytes, where: str):
    """The first certificate of a PEM file (StartupError naming ``where`` if there is none)."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(pem)[0]
    except ValueError as exc:
        raise StartupError(f"{where}: not a PEM certificate ({exc})") from None


def check_key_pair(certificate_pem: bytes, key_pem: bytes, cert_where: str, key_where: str) -> None:
    """StartupError unless the key is a PEM private key (unencrypted) matching the certificate."""
    from cryptography.hazmat.primitives import serialization

    certificate = load_certificate(certificate_pem, cert_where)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise StartupError(f"{key_where}: not an unencrypted PEM private key ({exc})") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.PEM
    if key.public_key().public_bytes(encoding, public) != certificate.public_key().public_bytes(encoding, public):
        raise StartupError(f"{key_where}: this key does not belong to the certificate in {cert_where}")


def warn_if_exposed(host: str, tls: bool, policy: AccessPolicy) -> None:
    """A warning in the log when a service listens beyond loopback without TLS or without tokens."""
    if is_loopback(host):
        return
    if not tls:
        log.warning("serving plaintext on %s: anyone on the network can read and alter the traffic; "
                    "set tls_cert_file and tls_key_file (plaintext is meant for loopback)", host)
    if not policy.enabled:
        log.warning("no auth token on %s: anyone who reaches the port may call every RPC; "
                    "set auth_tokens_file", host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_bytes(path: str | Path, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"{setting} {path}: cannot read it ({exc.strerror or exc})") from None


def _read_text(path: str | Path, setting: str) -> str:
    try:
        return _read_bytes(path, setting).decode()
    except UnicodeDecodeError as exc:
        raise StartupError(f"{setting} {path}: not UTF-8 text ({exc})") from None
