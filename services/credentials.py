"""Make a deployment's credentials: a local CA, a certificate per service, and one token per role.

    python -m rlfleet.services.credentials DIR [--name collector --name reference ...] [--run exp-a ...]
        [--host extra.dns.name ...] [--days 365] [--owner UID:GID] [--ca-key-dir DIR] [--force]

Writes, into ``DIR``:

- ``ca.pem`` (the CA certificate every party verifies the others against) and ``ca.key`` (its key,
  mode 0600, owned by whoever runs this: the services never need it; ``--ca-key-dir`` puts it
  elsewhere, e.g. a volume only this init mounts);
- ``<name>.pem`` / ``<name>.key`` per name: a certificate signed by the CA for ``DNS:<name>``,
  ``DNS:localhost``, ``IP:127.0.0.1`` and every ``--host``, good for both ends of a connection
  (server and client authentication), so a service presents it to its callers and the collector
  (or a trainer named ``trainer``) presents its own as a client certificate under mTLS;
- ``tokens``: the services' ``auth_tokens_file`` (one fresh token per role), and ``token-<role>``
  per role for the callers (the collector reads ``token-service``, a trainer ``token-trainer``);
- per ``--run`` (runs sharing a fleet, docs/concepts/many-runs.md): ``trainer-<run>.pem``/``.key``, a
  certificate naming the run (``urn:rlfleet:run:<run>``), and ``token-trainer-<run>`` /
  ``token-reader-<run>``, tokens that act for that run alone (listed in ``tokens`` with it). Run again
  with another ``--run``, it adds that run's and keeps the rest.

Keys and tokens are mode 0640 and, with ``--owner``, owned by that uid:gid (the services' user in a
container). Run again, it keeps what is there (a restarted init container changes nothing) unless
``--force``. compose.yaml's one-shot ``credentials`` service runs it; the suite's ``secure`` option
too. Uses the ``cryptography`` package (the services extra).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import secrets
from pathlib import Path

from rlfleet.services.common.files import write_atomically
from rlfleet.services.common.run_ids import is_run_id
from rlfleet.services.common.security import READER, ROLES, RUN_URI, TRAINER

DEFAULT_NAMES = ("generation", "reference", "reward", "trajectory", "environment", "collector", "trainer")
RUN_ROLES = (TRAINER, READER)
"""The roles a run's own tokens hold (operators and services see every run)."""
CA_NAME = "rlfleet local CA"


def upstream_files(directory: str | Path, name: str, role: str) -> dict[str, str]:
    """The ``upstream_*`` settings (``services/common/upstream.py``) of a caller using this directory's
    files: the CA, the certificate and key of ``name``, and the token of ``role``."""
    directory = Path(directory)
    return {"upstream_tls_ca_file": str(directory / "ca.pem"),
            "upstream_tls_cert_file": str(directory / f"{name}.pem"),
            "upstream_tls_key_file": str(directory / f"{name}.key"),
            "upstream_auth_token_file": str(directory / f"token-{role}")}


def make_credentials(directory: str | Path, names: tuple[str, ...] | list[str] = DEFAULT_NAMES,
                     hosts: tuple[str, ...] | list[str] = (), days: int = 365,
                     owner: tuple[int, int] | None = None, force: bool = False,
                     ca_key_dir: str | Path | None = None, runs: tuple[str, ...] | list[str] = ()) -> Path:
    """Write the CA, a certificate per name, the tokens and each run's certificate and tokens into
    ``directory`` (see the module docstring); returns it. What already exists is kept unless ``force``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key_path = Path(ca_key_dir or directory) / "ca.key"
    ca_key_path.parent.mkdir(parents=True, exist_ok=True)
    if force or not (directory / "ca.pem").exists() or not ca_key_path.exists():
        ca_key = _new_key()
        ca_cert = _certificate(CA_NAME, ca_key.public_key(), ca_key, None, days, ca=True)
        write_atomically(ca_key_path, _key_pem(ca_key), mode=0o600)  # owned by whoever runs this
        write_atomically(directory / "ca.pem", _cert_pem(ca_cert), mode=0o644, owner=owner)
        force = True  # new CA: every certificate again
    ca_key, ca_cert = _load(ca_key_path, directory / "ca.pem")
    certificates = [(name, ()) for name in names] + [(f"trainer-{run}", (f"{RUN_URI}{run}",)) for run in runs]
    for name, uris in certificates:
        if force or not (directory / f"{name}.pem").exists():
            key = _new_key()
            cert = _certificate(name, key.public_key(), ca_key, ca_cert, days, sans=(name, "localhost", *hosts),
                                uris=uris)
            write_atomically(directory / f"{name}.key", _key_pem(key), mode=0o640, owner=owner)
            write_atomically(directory / f"{name}.pem", _cert_pem(cert), mode=0o644, owner=owner)
    force = force or not (directory / "tokens").exists()
    wanted = [f"token-{role}" for role in ROLES] + [f"token-{role}-{run}" for run in runs for role in RUN_ROLES]
    for file in wanted:
        if force or not (directory / file).exists():
            write_atomically(directory / file, f"{secrets.token_urlsafe(32)}\n".encode(), mode=0o640, owner=owner)
    _write_tokens(directory, owner)
    return directory


def _write_tokens(directory: Path, owner: tuple[int, int] | None) -> None:
    """The services' ``tokens`` from the ``token-*`` files: a line per role, and one per run's token."""
    def token(file: str) -> str:
        return (directory / file).read_text().strip()

    lines = ["# role token [run]: the services' auth_tokens_file (made by rlfleet.services.credentials)"]
    lines += [f"{role} {token(f'token-{role}')}" for role in ROLES]
    for role in RUN_ROLES:
        prefix = f"token-{role}-"
        lines += [f"{role} {token(path.name)} {path.name[len(prefix):]}"
                  for path in sorted(directory.glob(f"{prefix}*"))]
    text = ("\n".join(lines) + "\n").encode()
    if not (directory / "tokens").exists() or (directory / "tokens").read_bytes() != text:
        write_atomically(directory / "tokens", text, mode=0o640, owner=owner)


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(name: str, public_key, signing_key, issuer, days: int, ca: bool = False, sans: tuple[str, ...] = (),
                 uris: tuple[str, ...] = ()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer.subject if issuer is not None else subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([_general_name(host) for host in dict.fromkeys(
                       (*sans, "127.0.0.1"))] + [x509.UniformResourceIdentifier(uri) for uri in uris]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()),
                                  critical=False))
    return builder.sign(signing_key, hashes.SHA256())


def _general_name(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _load(key_path: Path, cert_path: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.services.credentials",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--name", action="append", default=None,
                        help=f"a certificate for this name (repeatable; default: {', '.join(DEFAULT_NAMES)})")
    parser.add_argument("--run", action="append", default=[],
                        help="a run sharing the fleet: a trainer certificate and trainer/reader tokens that act for "
                             "it alone (repeatable; docs/concepts/many-runs.md)")
    parser.add_argument("--host", action="append", default=[], help="another DNS name or IP in every certificate")
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--owner", default=None, help="UID:GID owning the keys and tokens (default: whoever runs this)")
    parser.add_argument("--ca-key-dir", type=Path, default=None,
                        help="where the CA's key is kept (default: DIRECTORY); the services never need it")
    parser.add_argument("--force", action="store_true", help="make everything again (a new CA, new tokens)")
    ns = parser.parse_args(argv)
    owner = None
    if ns.owner:
        uid, _, gid = ns.owner.partition(":")
        owner = (int(uid), int(gid or uid))
    for run in ns.run:
        if not is_run_id(run):
            parser.error(f"--run {run!r}: a run name is 1 to 128 characters of [A-Za-z0-9._-]")
    directory = make_credentials(ns.directory, tuple(ns.name or DEFAULT_NAMES), tuple(ns.host), ns.days, owner,
                                 ns.force, ns.ca_key_dir, tuple(ns.run))
    runs = ", trainer-<run>.pem/.key and token-<trainer|reader>-<run> per run" if ns.run else ""
    print(f"credentials in {directory}: ca.pem, <name>.pem/.key, tokens, token-<role>{runs}")


if __name__ == "__main__":
    main()
