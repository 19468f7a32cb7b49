"""The shared scaffolding as a real process: health, errors, auth, clean SIGTERM."""

import gc
import subprocess
import sys
import time
import weakref
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.ray import node_dir
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc, tensor_pb2
from rlfleet.wire import Ragged, decode_tensordict, encode_tensordict, get_ragged
from tests import echo_service
from tests.leftovers import alive
from tests.waiting import wait_for

CALL_TIMEOUT = 60.0
"""A call's deadline: the first Echo loads tensordict (torch) in the service, seconds on a loaded 2-core host."""


def echo_stub(address: str, metadata=None):
    channel = grpc.insecure_channel(address)
    return diagnostics_pb2_grpc.DiagnosticsServiceStub(channel), channel


def test_health_echo_invalid_argument_and_clean_sigterm(start_service):
    proc = start_service("echo", "--startup-delay-seconds", "2", "--log-format", "text")
    proc.wait_listening(60)
    # Listening but still "loading": NOT_SERVING.
    assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    proc.wait_ready(60)
    assert proc.health() == health_pb2.HealthCheckResponse.SERVING

    stub, channel = echo_stub(proc.address)
    payload = encode_tensordict(
        {"tokens": Ragged.from_list([torch.arange(3), torch.arange(5)]), "score": torch.tensor([0.5, -1.0])},
        batch_size=[2],
    )
    reply = stub.Echo(diagnostics_pb2.EchoRequest(payload=payload), timeout=CALL_TIMEOUT)
    td = decode_tensordict(reply.payload)
    assert get_ragged(td, "tokens").lengths.tolist() == [3, 5]
    assert td["score"].tolist() == [0.5, -1.0]

    bad = diagnostics_pb2.EchoRequest(payload=payload)
    bad.payload.entries["score"].tensor.data = b"\x00" * 7
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(bad, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload.entries[score].tensor.data" in err.value.details()

    # Still serving after the bad request.
    assert stub.Echo(diagnostics_pb2.EchoRequest(payload=payload), timeout=CALL_TIMEOUT).decoded_bytes > 0
    channel.close()

    started = time.monotonic()
    assert proc.stop(timeout=20) == 0
    assert time.monotonic() - started < 15
    assert "stopped" in proc.log_tail()


def test_auth_token_is_enforced_but_health_stays_open(start_service):
    proc = start_service("echo", env={"RLFLEET_ECHO_AUTH_TOKEN": "s3cret"}).wait_ready(60)
    assert proc.health() == health_pb2.HealthCheckResponse.SERVING
    stub, channel = echo_stub(proc.address)
    request = diagnostics_pb2.EchoRequest(payload=encode_tensordict({"x": torch.ones(1)}, batch_size=[1]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(request, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(request, timeout=CALL_TIMEOUT, metadata=[("authorization", "Bearer wrong")])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = stub.Echo(request, timeout=CALL_TIMEOUT, metadata=[("authorization", "Bearer s3cret")])
    assert decode_tensordict(reply.payload)["x"].tolist() == [1.0]
    channel.close()


def test_oversized_message_is_resource_exhausted(start_service):
    proc = start_service("echo", "--max-message-bytes", str(1 << 20)).wait_ready(60)
    stub, channel = echo_stub(proc.address)
    big = encode_tensordict({"x": torch.zeros(1, 2 << 20, dtype=torch.uint8)}, batch_size=[1])
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(diagnostics_pb2.EchoRequest(payload=big), timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water mark of resident memory (exact, no sampling)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def test_echo_refuses_overflowing_shapes_and_stays_cheap_on_many_small_entries(start_service):
    proc = start_service("echo").wait_ready(60)
    channel = grpc.insecure_channel(proc.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = diagnostics_pb2_grpc.DiagnosticsServiceStub(channel)
    # Zero elements, but strides beyond int64: was INTERNAL ("stride calculation overflowed").
    request = diagnostics_pb2.EchoRequest(payload=encode_tensordict({"x": torch.zeros(1, 0)}, batch_size=[1]))
    request.payload.entries["x"].tensor.shape[:] = [1, 0, 2**62, 2**62]
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload.entries[x].tensor.shape" in err.value.details() and "overflows int64" in err.value.details()

    # Two million one-letter strings (6 MB): decoding built an object per string, ~220 bytes of
    # server memory per request byte (1.3 GB here). Validated without building, it stays a few
    # times the payload; the bound leaves room for allocator slack.
    strings = 2_000_000
    request = diagnostics_pb2.EchoRequest(payload=tensor_pb2.TensorDict(batch_size=[strings]))
    request.payload.entries["s"].strings.values[:] = ["a"] * strings
    size = request.ByteSize()
    stub.Echo(diagnostics_pb2.EchoRequest(payload=encode_tensordict({"x": torch.ones(1)}, batch_size=[1])),
              timeout=30)  # warm: lazy imports are not the echo's cost
    before = peak_rss_bytes(proc.process.pid)
    reply = stub.Echo(request, timeout=300)
    growth = peak_rss_bytes(proc.process.pid) - before
    assert len(reply.payload.entries["s"].strings.values) == strings
    assert growth < 60 * size, f"echo of {size} bytes grew the server's peak memory by {growth} bytes"
    channel.close()


def test_tls_service_keeps_health_on_a_plaintext_health_port_and_refuses_bad_files(start_service, tmp_path):
    """mTLS and tokens on the main port; the health port answers plaintext probes and nothing else;
    a key that is not the certificate's is a refusal at start naming the setting (exit 2)."""
    from rlfleet.services.credentials import make_credentials

    credentials = make_credentials(tmp_path / "credentials", names=("echo", "other"))
    tls = ["--tls-cert-file", str(credentials / "echo.pem"), "--tls-key-file", str(credentials / "echo.key"),
           "--tls-client-ca-file", str(credentials / "ca.pem"), "--auth-tokens-file", str(credentials / "tokens")]
    health_port = free_port()
    proc = start_service("echo", *tls, "--health-port", str(health_port))
    proc.health_credentials = grpc.ssl_channel_credentials(*(
        (credentials / name).read_bytes() for name in ("ca.pem", "echo.key", "echo.pem")))
    proc.wait_ready(60)
    from rlfleet.services import healthcheck

    address = f"127.0.0.1:{health_port}"
    assert healthcheck.check(address) == "SERVING"  # plaintext, no token, no certificate
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:  # the health port serves nothing but health
            diagnostics_pb2_grpc.DiagnosticsServiceStub(channel).Echo(diagnostics_pb2.EchoRequest(),
                                                                      timeout=CALL_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as err:  # the main port takes no plaintext, health included
        healthcheck.status(proc.address, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert healthcheck.main([proc.address, "--tls-ca", str(credentials / "ca.pem"), "--tls-cert",
                             str(credentials / "other.pem"), "--tls-key", str(credentials / "other.key")]) == 0

    bad = start_service("echo", *tls[:2], "--tls-key-file", str(credentials / "other.key"))
    assert bad.process.wait(60) == 2
    assert "tls_key_file" in bad.log_tail() and "does not belong to the certificate" in bad.log_tail()


GUARDED_LAUNCHER = """
import sys, time
from pathlib import Path
from rlfleet.services.launch import ServiceProcess
from tests import echo_service
proc = ServiceProcess("echo", ["--log-format", "text"], module=echo_service.MODULE).start(Path(sys.argv[1]))
proc.guard()
proc.wait_ready(120)
(proc.tmp / "left-by-the-service").write_text("x")
print(proc.process.pid, proc.tmp, flush=True)
time.sleep(600)
"""


def test_a_guarded_service_ends_with_its_launcher_however_it_ends_and_its_tmpdir_goes(tmp_path):
    """``ServiceProcess.guard`` (what ``rlfleet-suite`` does for each service): its launcher SIGKILLed, the
    reaper beside the service SIGKILLs the service's process group and removes its own ``TMPDIR``, where
    the service's temporary files were (a vLLM engine's IPC sockets and file store)."""
    launcher = subprocess.Popen([sys.executable, "-c", GUARDED_LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE,
                                text=True)
    try:
        pid, tmp = launcher.stdout.readline().split()
        assert alive(int(pid)) and (Path(tmp) / "left-by-the-service").exists()
        # TMPDIR under its work directory, or one of its own when that path is too long for IPC sockets
        assert Path(tmp).parent == tmp_path or Path(tmp).parent.name.startswith("rlfleet-tmp-"), tmp
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    wait_for(lambda: not alive(int(pid)) and not Path(tmp).exists(), 60,
             "the reaper to end the service and remove its TMPDIR")
    assert Path(tmp).parent == tmp_path or not Path(tmp).parent.exists()  # an rlfleet-tmp-* goes along


def test_a_service_that_ended_unstopped_leaves_no_temporary_files_once_its_launcher_drops_it(tmp_path):
    """A start that failed (the service exited on its own) and was never stopped: its ``TMPDIR`` goes
    when its ``ServiceProcess`` does (at the latest, the launcher's exit); a live one's stays."""
    failed = ServiceProcess("echo", ["--no-such-flag"], module=echo_service.MODULE).start(tmp_path / "failed")
    live = ServiceProcess("echo", ["--log-format", "text"], module=echo_service.MODULE).start(tmp_path / "live")
    try:
        with pytest.raises(RuntimeError, match="exited with code 2"):
            failed.wait_ready(60)
        tmp = failed.tmp
        assert tmp.exists()
        live.wait_ready(60)
        del failed
        gc.collect()
        assert not tmp.exists()
        live_tmp, live_ref = live.tmp, weakref.ref(live)
        live_process = live.process
        live = None
        gc.collect()
        assert live_ref() is None and live_tmp.exists()  # its process runs: not ours to remove
    finally:
        if live is None:
            live_process.kill()
            live_process.wait()
            node_dir.remove(live_tmp)  # and its rlfleet-tmp-* parent, when its work directory's path is long
        else:
            live.stop()


def test_a_stopped_or_killed_service_leaves_no_temporary_files(start_service):
    """Its own ``TMPDIR`` goes with it, whether it stops or is SIGKILLed."""
    for end in ("stop", "kill"):
        proc = start_service("echo", "--log-format", "text").wait_ready(60)
        (proc.tmp / "vllm_dist_left").write_text("x")
        getattr(proc, end)()
        assert not alive(proc.process.pid) and not proc.tmp.exists(), end
        assert not proc.tmp.parent.name.startswith("rlfleet-tmp-") or not proc.tmp.parent.exists()
