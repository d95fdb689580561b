"""The bearer-token check of the public APIs: one comparison for gRPC metadata (BearerTokenInterceptor) and
the HTTP header (bearer_failure), constant time; health and reflection stay open."""

from __future__ import annotations

import hmac
import logging

import grpc

log = logging.getLogger(__name__)


# Always reachable without a token: Kubernetes / load-balancer probes and service discovery.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def check_token(token: str) -> str:
    """A usable bearer token: non-empty printable ASCII without spaces (it travels as gRPC metadata)."""
    if not token or not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError("the auth token must be non-empty printable ASCII without spaces")
    return token


def bearer_failure(value: str | None, token: bytes, carrier: str = "metadata") -> str | None:
    """Why an `authorization` value (None: absent) does not carry `token`, or None if it does. The one
    check of the public APIs (gRPC metadata, HTTP header), compared in constant time."""
    if value is None:
        return f"missing credentials: send {carrier} 'authorization: Bearer <token>'"
    scheme, _, credential = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return f"malformed authorization {carrier}: expected 'Bearer <token>'"
    if not hmac.compare_digest(credential.strip().encode("utf-8", "replace"), token):
        return "invalid bearer token"
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without metadata `authorization: Bearer <token>` with UNAUTHENTICATED (a constant-time
    comparison), except methods under OPEN_METHOD_PREFIXES (health and reflection)."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._token = check_token(token).encode()
        self._open = open_prefixes

    def _failure(self, metadata) -> str | None:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        value = None
        if values:
            value = values[0].decode("ascii", "replace") if isinstance(values[0], bytes) else str(values[0])
        return bearer_failure(value, self._token, "metadata")

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        message = self._failure(handler_call_details.invocation_metadata)
        if message is None:
            return await continuation(handler_call_details)
        log.debug("rejected %s: %s", method, message)
        return _abort_handler(grpc.StatusCode.UNAUTHENTICATED, message)


def _abort_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that fails any call with (code, message) before reading a request. One kind fits all
    four rpc shapes: nothing is sent before the status, and raw bytes are never deserialized."""

    async def abort(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)
