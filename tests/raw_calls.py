"""Any RPC called with an empty request, for the access tests: the status it answers."""

from __future__ import annotations

import grpc


def empty_call_status(channel, path, method, token: str | None) -> tuple[grpc.StatusCode, str]:
    """``path`` (``method`` its descriptor) called with an empty request or stream and ``token`` (None:
    none): its status code and details."""
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    stub = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    try:
        result = stub(iter([]) if method.client_streaming else b"", timeout=20,
                      metadata=[("authorization", f"Bearer {token}")] if token else [])
        if method.server_streaming:
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""


def call_empty(channel, path, method, token: str | None) -> grpc.StatusCode:
    return empty_call_status(channel, path, method, token)[0]
