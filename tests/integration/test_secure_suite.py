"""The whole suite with TLS, client certificates (mTLS) and role tokens everywhere, as real processes.

The collector calls every inner service over mTLS with its ``service`` token; a trainer gets batches
and pushes weights with its certificate and ``trainer`` token; each other role is held to its RPCs
(PERMISSION_DENIED naming the roles an RPC takes), a caller without a token is UNAUTHENTICATED, and a
connection without TLS, without a client certificate or with another CA's never gets through.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.client import (PermissionDeniedError, UnauthenticatedError, UnavailableError, connect,
                            credentials_from)
from rlfleet.services.common.security import METHOD_ROLES, ROLES
from rlfleet.services.credentials import make_credentials
from rlfleet.v1 import (collector_pb2, diagnostics_pb2, environment_pb2, generation_pb2, reference_pb2,
                        reference_pb2_grpc, reward_pb2, trajectory_pb2)
from rlfleet.wire import Ragged, decode_ragged, encode_ragged
from tests.raw_calls import call_empty

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def suite(secure_suite):
    """The secure suite (tests/integration/conftest.py), shared with the viewer's test, which runs next."""
    return secure_suite


def client(suite, role: str | None, *, certificate: str | None = "trainer", roots: bool = True, **settings):
    procs, credentials = suite
    kwargs = {}
    if certificate:
        kwargs = {"certificate_chain": (credentials / f"{certificate}.pem").read_bytes(),
                  "private_key": (credentials / f"{certificate}.key").read_bytes()}
    token = (credentials / f"token-{role}").read_text().strip() if role else None
    return connect(procs["collector"].address, auth_token=token, tls=True,
                   root_certificates=(credentials / "ca.pem").read_bytes() if roots else None,
                   timeout=30, retries=0, **kwargs, **settings)


def test_a_trainer_trains_over_mtls_through_every_service(suite, tiny_model_dir):
    """Batches come (collector -> generation, reference, reward, trajectory over mTLS with the service
    token) and a weight push reaches the replica (UpdateWeights over mTLS)."""
    from transformers import AutoModelForCausalLM

    procs, credentials = suite
    with connect(procs["collector"].address, **credentials_from(credentials), timeout=30, retries=0) as trainer:
        # Scores that vary within a group: the suite filters groups of constant scores (dynamic sampling).
        trainer.submit_prompts([{"prompt": f"write the digits of {i}", "reward_fn": "char_fraction"} for i in range(3)])
        with trainer.batches(2) as batches:
            batch = next(iter(batches))
        assert len(batch) == 2 and batch.td["group_size"].tolist() == [2, 2]
        weights = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).state_dict()
        version = trainer.policy_version
        assert trainer.push_weights(weights, progress=False).version == version + 1
        assert trainer.policy_version == version + 1
        assert trainer.status().serving


def test_each_role_is_held_to_its_rpcs(suite):
    with client(suite, "reader") as reader:
        assert reader.status().serving
        with pytest.raises(PermissionDeniedError, match=r"SubmitPrompts.*role \(reader\).*takes: trainer"):
            reader.submit_prompts(["not mine to submit"])
        with pytest.raises(PermissionDeniedError, match="PushWeights"):
            reader.push_weights({"x": torch.zeros(1)})
        with pytest.raises(PermissionDeniedError, match="GetPassRates"):
            reader.pass_rates(["a-prompt"])
        assert reader.failures()[1] >= 0  # dead letters are a reader's to see (the rollout viewer shows them)
    with client(suite, "operator") as operator:
        assert operator.status().serving and operator.failures()[1] >= 0
        assert operator.buffer_stats() is not None
        with pytest.raises(PermissionDeniedError, match="StreamBatches"):
            with operator.batches(2) as batches:
                next(iter(batches))
    with client(suite, "service") as service:  # the inner services' token drives no trainer RPC
        with pytest.raises(PermissionDeniedError, match="SubmitPrompts"):
            service.submit_prompts(["x"])


def test_a_trainer_token_reaches_no_inner_service(suite):
    procs, credentials = suite
    channel_credentials = grpc.ssl_channel_credentials((credentials / "ca.pem").read_bytes(),
                                                       (credentials / "trainer.key").read_bytes(),
                                                       (credentials / "trainer.pem").read_bytes())
    request = reference_pb2.ScoreLogProbsRequest(
        token_ids=encode_ragged(Ragged.from_list([torch.tensor([1, 2, 3])])), response_starts=[1])
    with grpc.secure_channel(procs["reference"].address, channel_credentials) as channel:
        stub = reference_pb2_grpc.ReferenceServiceStub(channel)
        for role, code in (("trainer", grpc.StatusCode.PERMISSION_DENIED), (None, grpc.StatusCode.UNAUTHENTICATED)):
            metadata = [("authorization", f"Bearer {(credentials / f'token-{role}').read_text().strip()}")] if role else []
            with pytest.raises(grpc.RpcError) as refused:
                stub.ScoreLogProbs(request, timeout=30, metadata=metadata)
            assert refused.value.code() == code
        service = (credentials / "token-service").read_text().strip()
        scored = stub.ScoreLogProbs(request, timeout=30, metadata=[("authorization", f"Bearer {service}")])
        assert decode_ragged(scored.ref_log_probs).lengths.tolist() == [2]
        # Health stays open to a caller without a token (probes), over mTLS all the same.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_without_tls_a_client_certificate_or_the_right_ca_nothing_gets_through(suite, tmp_path):
    with client(suite, None) as anonymous:
        with pytest.raises(UnauthenticatedError):
            anonymous.status()
    with client(suite, "trainer", certificate=None) as no_certificate:  # TLS, but no client certificate
        with pytest.raises(UnavailableError):
            no_certificate.status()
    other = make_credentials(tmp_path / "other", names=("trainer",))
    procs, credentials = suite
    with connect(procs["collector"].address, auth_token=(credentials / "token-trainer").read_text().strip(),
                 root_certificates=(other / "ca.pem").read_bytes(), certificate_chain=(other / "trainer.pem").read_bytes(),
                 private_key=(other / "trainer.key").read_bytes(), timeout=30, retries=0) as other_ca:
        with pytest.raises(UnavailableError):  # the server is not the one its CA signed, nor is the client
            other_ca.status()
    with connect(procs["collector"].address, timeout=30, retries=0) as plaintext:
        with pytest.raises(UnavailableError):
            plaintext.status()


SERVED = {"collector": (collector_pb2, "CollectorService", trajectory_pb2, "TrajectoryService"),
          "generation-0": (generation_pb2, "GenerationService"), "reference": (reference_pb2, "ReferenceService"),
          "reward": (reward_pb2, "RewardService"), "trajectory": (trajectory_pb2, "TrajectoryService"),
          "environment": (environment_pb2, "EnvironmentService")}


def test_every_rpc_of_every_service_takes_exactly_the_roles_in_the_table(suite):
    """Each role's token on every RPC of every process, over mTLS: PERMISSION_DENIED exactly where the
    table says (an empty request otherwise gets whatever the RPC answers it, never an auth status)."""
    procs, credentials = suite
    channel_credentials = grpc.ssl_channel_credentials(*((credentials / name).read_bytes()
                                                         for name in ("ca.pem", "trainer.key", "trainer.pem")))
    wrong = []
    calls = 0
    for key, served in SERVED.items():
        services = [getattr(module.DESCRIPTOR.services_by_name[name], "methods")
                    for module, name in zip(served[::2], served[1::2])]
        services.append(diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"].methods)
        with grpc.secure_channel(procs[key].address, channel_credentials) as channel:
            for methods in services:
                for method in methods:
                    path = f"/{method.containing_service.full_name}/{method.name}"
                    for role in ROLES:
                        calls += 1
                        code = call_empty(channel, path, method, (credentials / f"token-{role}").read_text().strip())
                        denied = code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
                        if denied != (role not in METHOD_ROLES[path]) or code == grpc.StatusCode.UNAUTHENTICATED:
                            wrong.append(f"{key} {path} as {role}: {code.name}")
    proxied = len(trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"].methods)
    assert calls == 4 * (len(METHOD_ROLES) + proxied + 5)  # plus the collector's proxy of them, Echo on 5 more
    assert not wrong, wrong
