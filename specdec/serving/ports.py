"""free_port: the one way specdec picks a TCP port before a server binds it (the local runner, the
benchmarks and the tests, whose tier replicas share one port on several loopback addresses)."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port(addresses: Sequence[str] = ("127.0.0.1",)) -> int:
    """A TCP port free on every one of the addresses (the replicas of a tier share it; IPv4 or IPv6 ones)."""
    for _ in range(100):
        with _socket(addresses[0]) as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for address in addresses[1:]:
                with _socket(address) as s:
                    s.bind((address, port))
            return port
        except OSError:
            continue
    raise OSError(f"no port free on all of {list(addresses)}")


def _socket(address: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
