"""Roles, tokens and TLS files (services/common/security.py) and the credentials maker, as pure logic."""

import logging
import os
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from rlfleet.client.channel import ChannelSettings
from rlfleet.services.common import security
from rlfleet.services.common.errors import StartupError
from rlfleet.services.credentials import make_credentials
from rlfleet.v1 import (collector_pb2, diagnostics_pb2, environment_pb2, generation_pb2, reference_pb2, reward_pb2,
                        trajectory_pb2)
from tests.echo_service.config import EchoConfig

SECURITY_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "security.md"
TOKENS = {"t" * 16: frozenset({"trainer"}), "r" * 16: frozenset({"reader"}), "o" * 16: frozenset({"operator"}),
          "s" * 16: frozenset({"service"}), "x" * 16: frozenset({"reader", "operator"})}


def every_rpc() -> list[str]:
    modules = (collector_pb2, generation_pb2, reference_pb2, reward_pb2, trajectory_pb2, environment_pb2,
               diagnostics_pb2)
    return [f"/{service.full_name}/{method.name}" for module in modules
            for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods]


def test_every_rpc_of_every_service_is_in_the_role_table_and_nothing_else_is():
    assert sorted(security.METHOD_ROLES) == sorted(every_rpc())
    for method, roles in security.METHOD_ROLES.items():
        assert roles and roles <= set(security.ROLES), method


def test_the_security_guide_shows_the_role_table_as_it_is():
    text = SECURITY_GUIDE.read_text()
    for method, roles in security.METHOD_ROLES.items():
        service, name = method.strip("/").split("/")
        row = re.search(rf"^\| `{service.split('.')[-1]}\.{name}` \|(.*)\|$", text, re.MULTILINE)
        assert row, f"the security guide has no row for {method}"
        cells = [cell.strip() for cell in row.group(1).split("|")]
        assert cells == ["✓" if role in roles else "" for role in security.ROLES], method


@pytest.mark.parametrize("method, token, code", [
    ("/rlfleet.v1.CollectorService/PushWeights", "t" * 16, None),
    ("/rlfleet.v1.CollectorService/PushWeights", "r" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.CollectorService/PushWeights", "s" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.CollectorService/SubmitPrompts", "o" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.TrajectoryService/StreamBatches", "r" * 16, None),
    ("/rlfleet.v1.TrajectoryService/StreamBatches", "o" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.TrajectoryService/DropStale", "o" * 16, None),
    ("/rlfleet.v1.TrajectoryService/DropStale", "t" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.CollectorService/ListFailures", "x" * 16, None),  # two roles: either will do
    ("/rlfleet.v1.GenerationService/Generate", "s" * 16, None),
    ("/rlfleet.v1.GenerationService/Generate", "t" * 16, "PERMISSION_DENIED"),
    ("/rlfleet.v1.GenerationService/Generate", "nope-not-a-token", "UNAUTHENTICATED"),
    ("/rlfleet.v1.GenerationService/Generate", None, "UNAUTHENTICATED"),
    ("/rlfleet.v1.SomethingNew/Method", "t" * 16, "PERMISSION_DENIED"),  # not in the table: closed
    ("/grpc.health.v1.Health/Check", None, None),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None, None),
])
def test_policy_checks_the_token_then_its_role(method, token, code):
    policy = security.AccessPolicy(TOKENS)
    metadata = [("authorization", f"Bearer {token}")] if token else [("x-other", "1")]
    verdict = policy.check(method, metadata)
    assert verdict.code == code
    if code == "PERMISSION_DENIED":
        assert method in verdict.message and "may not call it" in verdict.message


RUN_TOKENS = {**TOKENS, "a" * 16: security.Grant(frozenset({"trainer"}), frozenset({"exp-a"})),
              "b" * 16: security.Grant(frozenset({"reader"}), frozenset({"exp-a", "exp-b"}))}
PUSH, STREAM, STATUS = ("/rlfleet.v1.CollectorService/PushWeights", "/rlfleet.v1.TrajectoryService/StreamBatches",
                        "/rlfleet.v1.CollectorService/GetStatus")


@pytest.mark.parametrize("run, method, token, certificate, allowed", [
    ("exp-a", PUSH, "a" * 16, None, True),  # run a's token on run a's collector
    ("exp-b", PUSH, "a" * 16, None, False),  # ... on run b's
    ("", PUSH, "a" * 16, None, False),  # ... on a service of no one run
    ("exp-b", STREAM, "b" * 16, None, True),  # a reader of both runs
    ("exp-c", STREAM, "b" * 16, None, False),
    ("exp-b", PUSH, "t" * 16, None, True),  # an unscoped trainer token: every run (a fleet of one run)
    ("exp-b", STATUS, "o" * 16, {"exp-a"}, True),  # an operator sees every run, whatever its certificate
    ("exp-b", PUSH, "t" * 16, {"exp-a"}, False),  # run a's certificate with an unscoped token
    ("exp-a", PUSH, "t" * 16, {"exp-a"}, True),
    ("exp-b", PUSH, "a" * 16, {"exp-b"}, False),  # b's certificate does not widen a's token
    ("exp-b", PUSH, None, {"exp-a"}, False),  # no tokens configured: the certificate still names its run
    ("exp-a", PUSH, None, {"exp-a"}, True),
    ("exp-b", PUSH, None, None, True),  # no tokens, no run named: local development
])
def test_a_token_or_certificate_naming_runs_acts_on_those_runs_alone(run, method, token, certificate, allowed):
    policy = security.AccessPolicy(RUN_TOKENS if token else None, run=run, reads_certificates=True)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    verdict = policy.check(method, metadata, frozenset(certificate) if certificate else None)
    assert (verdict.code is None) is allowed, verdict
    if not allowed:
        assert verdict.code == "PERMISSION_DENIED" and method in verdict.message
        assert f"serves run {run}" in verdict.message if run else "every run shares it" in verdict.message


def test_a_certificates_runs_are_its_rlfleet_run_uris():
    assert security.certificate_runs([b"trainer-a", b"urn:rlfleet:run:exp-a", "urn:rlfleet:run:x"]) == {"exp-a", "x"}
    assert security.certificate_runs([b"urn:other:run:exp-a", b"trainer"]) is None
    assert security.certificate_runs([]) is None


def test_no_tokens_checks_nothing():
    assert security.AccessPolicy().check("/rlfleet.v1.CollectorService/PushWeights", ()).code is None
    assert not security.AccessPolicy().enabled


def test_tokens_file_lines_comments_and_roles(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\n\ntrainer " + "a" * 20 + "  # the trainer\nreader,operator " + "b" * 20 + "\n")
    assert security.read_tokens_file(path) == {"a" * 20: security.Grant(frozenset({"trainer"})),
                                               "b" * 20: security.Grant(frozenset({"reader", "operator"}))}


def test_a_tokens_third_field_names_the_runs_it_acts_for(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("trainer " + "a" * 20 + " exp-a\nreader " + "b" * 20 + " exp-a,exp.b\n")
    assert security.read_tokens_file(path) == {
        "a" * 20: security.Grant(frozenset({"trainer"}), frozenset({"exp-a"})),
        "b" * 20: security.Grant(frozenset({"reader"}), frozenset({"exp-a", "exp.b"}))}


@pytest.mark.parametrize("text, message", [
    ("trainer\n", "line 1: expected 'ROLE TOKEN'"),
    ("admin " + "a" * 20 + "\n", "line 1: unknown role 'admin'"),
    ("# x\ntrainer short\n", "line 2: a token of 5 characters is too short"),
    ("trainer " + "a" * 20 + "\nreader " + "a" * 20 + "\n", "line 2: this token is listed before with other roles"),
    ("# nothing\n", "no token in the file"),
    ("trainer " + "a" * 20 + " a b\n", "line 1: expected 'ROLE TOKEN'"),
    ("trainer " + "a" * 20 + " exp/a\n", "line 1: 'exp/a' is not a run name"),
    ("operator " + "a" * 20 + " exp-a\n", "line 1: an operator or service token sees every run"),
    ("trainer,service " + "a" * 20 + " exp-a\n", "line 1: an operator or service token sees every run"),
    ("trainer " + "a" * 20 + " exp-a\ntrainer " + "a" * 20 + " exp-b\n", "line 2: this token is listed before"),
])
def test_tokens_file_refusals_name_the_setting_file_and_line(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(StartupError, match="auth_tokens_file") as refused:
        security.read_tokens_file(path)
    assert message in str(refused.value) and str(path) in str(refused.value)


def test_missing_tokens_file_is_a_refusal_naming_it(tmp_path):
    with pytest.raises(StartupError, match=r"auth_tokens_file .*missing.*cannot read it"):
        security.read_tokens_file(tmp_path / "missing")


def test_auth_token_alone_has_every_role(tmp_path):
    policy = security.access_policy(EchoConfig(auth_token="single-token-value"))
    for method in security.METHOD_ROLES:
        assert policy.check(method, [("authorization", "Bearer single-token-value")]).code is None


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    return make_credentials(tmp_path_factory.mktemp("credentials"), names=("reference", "trainer"),
                            hosts=("reference.example", "10.1.2.3"))


def test_credentials_are_a_ca_and_certificates_it_signed_for_both_ends(credentials):
    ca = x509.load_pem_x509_certificate((credentials / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert = x509.load_pem_x509_certificate((credentials / "reference.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"reference", "localhost", "reference.example"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    for secret in ("reference.key", "tokens", "token-trainer"):
        assert os.stat(credentials / secret).st_mode & 0o777 == 0o640, secret
    assert os.stat(credentials / "ca.key").st_mode & 0o777 == 0o600
    tokens = security.read_tokens_file(credentials / "tokens")
    assert sorted(role for grant in tokens.values() for role in grant.roles) == sorted(security.ROLES)
    for role in security.ROLES:
        assert tokens[security.read_token(credentials / f"token-{role}", "x")].roles == {role}


def test_a_runs_credentials_name_it_and_adding_a_run_keeps_the_rest(tmp_path):
    directory = make_credentials(tmp_path / "c", names=("collector",), runs=("exp-a",))
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    make_credentials(directory, names=("collector",), runs=("exp-a", "exp-b"))
    after = {path.name: path.read_bytes() for path in directory.iterdir()}
    assert {name: data for name, data in after.items() if name in before and name != "tokens"} == {
        name: data for name, data in before.items() if name != "tokens"}
    cert = x509.load_pem_x509_certificate(after["trainer-exp-b.pem"])
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(after["ca.pem"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:rlfleet:run:exp-b"]
    grants = security.read_tokens_file(directory / "tokens")
    for role in security.ROLES:
        assert grants[security.read_token(directory / f"token-{role}", "x")] == security.Grant(frozenset({role}))
    for run in ("exp-a", "exp-b"):
        for role in ("trainer", "reader"):
            token = security.read_token(directory / f"token-{role}-{run}", "x")
            assert grants[token] == security.Grant(frozenset({role}), frozenset({run}))
    assert len(grants) == len(security.ROLES) + 4


def test_credentials_run_again_keep_what_is_there_unless_forced(credentials):
    before = {path.name: path.read_bytes() for path in credentials.iterdir()}
    make_credentials(credentials, names=("reference", "trainer"))
    assert {path.name: path.read_bytes() for path in credentials.iterdir()} == before
    make_credentials(credentials, names=("reference", "trainer"), hosts=("reference.example", "10.1.2.3"), force=True)
    assert (credentials / "ca.pem").read_bytes() != before["ca.pem"]
    assert (credentials / "tokens").read_bytes() != before["tokens"]


def tls_config(credentials, **fields):
    base = {"tls_cert_file": str(credentials / "reference.pem"), "tls_key_file": str(credentials / "reference.key")}
    return EchoConfig(**{**base, **fields})


def test_server_credentials_from_good_files(credentials):
    assert security.server_credentials(EchoConfig()) is None
    assert security.server_credentials(tls_config(credentials)) is not None
    assert security.server_credentials(tls_config(credentials, tls_client_ca_file=str(credentials / "ca.pem")))


@pytest.mark.parametrize("fields, message", [
    ({"tls_key_file": None}, "tls_key_file is not set"),
    ({"tls_cert_file": None}, "tls_cert_file is not set"),
    ({"tls_key_file": "TRAINER_KEY"}, "this key does not belong to the certificate"),
    ({"tls_cert_file": "CA_KEY"}, "tls_cert_file .*: not a PEM certificate"),
    ({"tls_key_file": "CA_PEM"}, "tls_key_file .*: not an unencrypted PEM private key"),
    ({"tls_client_ca_file": "TOKENS"}, "tls_client_ca_file .*: not a PEM certificate"),
    ({"tls_cert_file": "MISSING"}, "tls_cert_file .*: cannot read it"),
])
def test_bad_tls_files_are_refusals_naming_the_setting(credentials, fields, message):
    files = {"TRAINER_KEY": credentials / "trainer.key", "CA_KEY": credentials / "ca.key",
             "CA_PEM": credentials / "ca.pem", "TOKENS": credentials / "tokens", "MISSING": credentials / "nope.pem"}
    fields = {key: None if value is None else str(files.get(value, value)) for key, value in fields.items()}
    with pytest.raises(StartupError, match=message):
        security.server_credentials(tls_config(credentials, **fields))


def test_client_ca_without_server_certificate_is_refused(credentials):
    with pytest.raises(StartupError, match="tls_client_ca_file requires tls_cert_file"):
        security.server_credentials(EchoConfig(tls_client_ca_file=str(credentials / "ca.pem")))


def test_channel_files_read_and_check_a_clients_files(credentials):
    roots, chain, key = security.channel_files(str(credentials / "ca.pem"), str(credentials / "trainer.pem"),
                                               str(credentials / "trainer.key"), "upstream_tls")
    assert roots.startswith(b"-----BEGIN CERTIFICATE") and chain and key
    with pytest.raises(StartupError, match="upstream_tls_key_file is not set"):
        security.channel_files(None, str(credentials / "trainer.pem"), None, "upstream_tls")
    with pytest.raises(StartupError, match="upstream_tls_key_file .*does not belong"):
        security.channel_files(None, str(credentials / "trainer.pem"), str(credentials / "reference.key"),
                               "upstream_tls")


def test_plaintext_or_open_service_beyond_loopback_is_warned_about(caplog):
    caplog.set_level(logging.WARNING, "rlfleet.security")
    security.warn_if_exposed("127.0.0.1", tls=False, policy=security.AccessPolicy())
    security.warn_if_exposed("localhost", tls=False, policy=security.AccessPolicy())
    security.warn_if_exposed("::1", tls=False, policy=security.AccessPolicy())
    assert not caplog.records
    security.warn_if_exposed("0.0.0.0", tls=False, policy=security.AccessPolicy())
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [
        "serving plaintext on 0.0.0.0", "no auth token on 0.0.0.0"]
    caplog.clear()
    security.warn_if_exposed("0.0.0.0", tls=True, policy=security.AccessPolicy(TOKENS))
    assert not caplog.records


def test_services_bind_loopback_unless_told_otherwise():
    config = EchoConfig()
    assert config.host == "127.0.0.1" and config.metrics_host == "127.0.0.1"


def test_channel_settings_name_override_only_with_tls():
    assert ("grpc.ssl_target_name_override", "reference") in ChannelSettings(tls=True, server_name="reference").options()
    assert all(name != "grpc.ssl_target_name_override" for name, _ in ChannelSettings(server_name="x").options())
    assert ChannelSettings().credentials() is None and ChannelSettings(tls=True).credentials() is not None
