"""An ASGI app served by uvicorn inside the coordinator's running event loop, beside the gRPC server, on
its own port. The process's signal handling stays with specdec.serving.server.serve()."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from specdec.serving.metrics import split_address
from specdec.serving.server import ServerConfig


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the host process owns SIGTERM / SIGINT
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, address: str, grace_s: float = 5.0, tls: ServerConfig | None = None) -> None:
        """address: host:port (port 0 = any free port). grace_s: how long stop() lets responses finish.
        tls: serve HTTPS with its tls_cert / tls_key, requiring client certs signed by tls_client_ca if set
        (the gRPC port's settings, so both public APIs have the same transport security)."""
        self.app = app
        self.tls = tls if tls is not None and tls.tls_cert else None
        self.host, self._port = split_address(address)
        self.grace_s = grace_s
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        tls = {}
        if self.tls is not None:
            tls = dict(ssl_certfile=self.tls.tls_cert, ssl_keyfile=self.tls.tls_key)
            if self.tls.tls_client_ca:
                tls.update(ssl_ca_certs=self.tls.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=self.grace_s, **tls)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: raise its error
                await self._task
                raise OSError(f"HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, let in-flight responses finish for grace_s, then cancel them."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
