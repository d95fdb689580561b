"""The HTTP API's gate, as ASGI middleware in front of the routes: the bearer token is checked from the
request's headers before anything reads its body, so a client without the token costs the coordinator
one header comparison however large a body it announces or sends. (FastAPI resolves a route's body
before its dependencies, so a token check written as a dependency would come after the body was read.)

The body's size limit is Starlette's RequestBodyLimitMiddleware, which FastAPI installs from
FastAPI(max_body_size=...): a Content-Length over the limit is refused with 413 at the first read, before
any byte of the body is taken, and a chunked body is cut with 413 as soon as the bytes read pass it.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.serving.auth import bearer_failure

OPEN_PATHS = frozenset({"/health"})  # load-balancer and Kubernetes probes: never a token
METRICS_PATH = "/metrics"


class BearerGuard:
    """Refuses an HTTP request without `authorization: Bearer <token>` (constant-time comparison) with 401
    before the app reads its body; /health stays open, and /metrics too where metrics_public."""

    def __init__(self, app, token: bytes, refuse: Callable, metrics_public: bool = False) -> None:
        """refuse(status, message, code): the ASGI response of a refusal (the API's error shape)."""
        self.app = app
        self.token = token
        self.refuse = refuse
        self.open = OPEN_PATHS | ({METRICS_PATH} if metrics_public else frozenset())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            return await self.app(scope, receive, send)
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        failure = bearer_failure(values[0].decode("latin-1") if values else None, self.token, "header")
        if failure is None:
            return await self.app(scope, receive, send)
        # Answered without a receive(): the body is never read (the server closes the connection after).
        await self.refuse(401, failure, "invalid_api_key")(scope, receive, send)
