"""SDK error translation and retry policy."""

import asyncio

import grpc
import pytest

from rlfleet.client import errors
from rlfleet.client.channel import ChannelSettings, call_with_retry


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details="boom"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_status_code_maps_to_a_typed_error(code):
    if code == grpc.StatusCode.OK:
        return
    error = errors.from_rpc_error(FakeRpcError(code, "details here"), "Svc/Method")
    assert isinstance(error, errors.RlfleetClientError)
    assert "details here" in str(error) and "Svc/Method" in str(error)
    assert error.retryable == (code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_retries_only_transport_errors_and_stops_after_the_bound():
    attempts = []

    async def flaky(request, timeout, metadata):
        attempts.append(timeout)
        if len(attempts) < 3:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    settings = ChannelSettings(retries=4, backoff_seconds=0.001, timeout=7)
    assert run(call_with_retry(flaky, None, method="m", settings=settings)) == "ok"
    assert attempts == [7, 7, 7]

    async def always_down(request, timeout, metadata):
        attempts.append(1)
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)

    attempts.clear()
    with pytest.raises(errors.UnavailableError):
        run(call_with_retry(always_down, None, method="m", settings=settings))
    assert len(attempts) == 5

    async def bad_request(request, timeout, metadata):
        attempts.append(1)
        raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "field x")

    attempts.clear()
    with pytest.raises(errors.InvalidArgumentError, match="field x"):
        run(call_with_retry(bad_request, None, method="m", settings=settings))
    assert len(attempts) == 1


def test_auth_metadata():
    assert ChannelSettings(auth_token="t").metadata() == (("authorization", "Bearer t"),)
    assert ChannelSettings().metadata() == ()
