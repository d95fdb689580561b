"""A DNS server the tests control: names -> lists of IPv4 addresses, served over UDP on 127.0.0.1.

gRPC's DNS resolver (c-ares) takes the server in the target's authority, so a channel to
`dns://127.0.0.1:<port>/target.specdec.test:50062` resolves `target.specdec.test` here, and re-resolves
it (when a connection closes, at most every grpc.dns_min_time_between_resolutions_ms) to pick up the
replicas a test adds or removes with set().
"""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class _Resolver(BaseResolver):
    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self.queries: dict[str, int] = {}  # name -> questions (A, AAAA) answered so far
        self._lock = threading.Lock()

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        with self._lock:
            self.queries[name] = self.queries.get(name, 0) + 1
            addresses = list(self.names.get(name, ()))
        if name not in self.names:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply  # no AAAA records: IPv4 only


class FakeDns:
    """Start on a free UDP port of 127.0.0.1; set(name, addresses) at any time; close() when done."""

    def __init__(self) -> None:
        self._resolver = _Resolver()
        self._server = DNSServer(self._resolver, port=0, address="127.0.0.1", tcp=False,
                                 logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"))
        self._server.start_thread()
        self.port: int = self._server.server.server_address[1]

    def set(self, name: str, addresses: list[str]) -> None:
        with self._resolver._lock:
            self._resolver.names[name.lower()] = list(addresses)

    def get(self, name: str) -> list[str]:
        with self._resolver._lock:
            return list(self._resolver.names.get(name.lower(), ()))

    def queries(self, name: str) -> int:
        """How often `name` was asked for (A and AAAA each count): a resolver re-resolving it shows here."""
        with self._resolver._lock:
            return self._resolver.queries.get(name.lower(), 0)

    def target(self, name: str, port: int) -> str:
        """The gRPC target that resolves `name` through this server."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def close(self) -> None:
        self._server.stop()
