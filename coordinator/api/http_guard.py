"""The HTTP API's gate, two ASGI middlewares in front of the routes, both deciding before a body is read:

- BearerGuard checks the bearer token from the request's headers, so a client without the token costs the
  coordinator one header comparison however large a body it announces or sends. (FastAPI resolves a
  route's body before its dependencies: a token check written as a dependency comes after the body.)
- BodyLimit refuses a Content-Length over the limit with 413 before the app runs, and cuts a body sent
  without one (chunked) with 413 as soon as the bytes read pass it (Starlette's RequestBodyLimitMiddleware
  does the same, but answers in plain text, and from outside the token check).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException

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


class BodyLimit:
    """413 for a request body over max_bytes: by its Content-Length before the app runs, else (chunked) by
    the bytes read, raised from the read as an HTTPException(413) (FastAPI passes it to the app's handler)."""

    def __init__(self, app, max_bytes: int, refuse: Callable) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = [v for k, v in scope["headers"] if k == b"content-length"]
        if length and length[0].isdigit() and int(length[0]) > self.max_bytes:
            return await self.refuse(413, self.message(), "request_too_large")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self.message())
            return message

        await self.app(scope, limited, send)

    def message(self) -> str:
        return f"the request body is larger than max_body_bytes={self.max_bytes}"
