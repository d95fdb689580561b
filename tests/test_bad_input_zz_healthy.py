"""After the bad input of tests/test_bad_input_*.py, the servers still generate, answer the standard
health check and hold no leftover sessions, also of a client that walked away (cancelled, or past its
deadline). pytest runs the files of a directory in name order and a file's tests in file order: this
file's name sorts after the other bad-input files', and the health check is its last test."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from tests.bad_input import EOS, PROMPT, RPC_TIMEOUT, VOCAB, generate_request

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


# --- a client that walks away leaves nothing behind -----------------------------------------------


def test_generate_cancel_and_deadline(generation_stub, cluster):
    req = generate_request(max_new_tokens=300, ignore_eos=True)
    call = generation_stub.Generate(req, timeout=RPC_TIMEOUT)
    assert next(call).HasField("chunk")
    call.cancel()
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as ei:
        list(generation_stub.Generate(req, timeout=0.05))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # (leftover sessions from these two are checked by the final test)


# --- the servers are healthy afterwards (keep this test last) ------------------------------------


def test_zz_servers_healthy_after_bad_input(cluster):
    # A normal greedy generation through the coordinator.
    with Client(cluster.address, timeout_s=RPC_TIMEOUT) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=8, num_speculative_tokens=3)
    assert 1 <= len(out.token_ids) <= 8
    assert all(0 <= t < VOCAB for t in out.token_ids)
    if len(out.token_ids) < 8:
        assert out.token_ids[-1] == EOS and out.finish_reason == "eos"
    else:
        assert out.finish_reason in ("length", "eos")

    # Standard health check on all three servers.
    for port in (cluster.port, cluster.target_port, cluster.draft_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, f"port {port}: {resp.status}"

    # No leftover sessions (cleanup after streams and generations is asynchronous: poll).
    cluster.wait_no_sessions(5.0)
