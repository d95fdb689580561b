"""Faults with real processes (the real model pair, so a generation lasts long enough to restart a
tier under it): a killed draft (speculation resumes), the only target killed under a stream (a quick
UNAVAILABLE, then recovery by itself), a target that stays down past the client's deadline, and SIGTERM
on the coordinator. Greedy output never changes."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.proto import common_pb2, draft_pb2_grpc, target_pb2_grpc

pytestmark = [pytest.mark.processes, pytest.mark.real_pair]

QUESTION = "Write a long story about a lighthouse keeper and a storm."
N = 300  # long enough (~20 s on 2 cores, the target's steps eager) for a tier to restart mid-generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One service process on a fixed port, restartable."""

    def __init__(self, workdir: Path, name: str, module: str, port: int, args: list[str]) -> None:
        self.workdir, self.name, self.module, self.port, self.args = workdir, name, module, port, args
        self.proc = None

    def start(self, wait: bool = True) -> None:
        port_file = self.workdir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.workdir / f"{self.name}.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--address", f"127.0.0.1:{self.port}", "--port-file", str(port_file), *self.args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # OMP_WAIT_POLICY: conftest
        if wait:
            deadline = time.monotonic() + 120
            while not port_file.exists():
                assert self.proc.poll() is None, (self.workdir / f"{self.name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{self.name} did not start"
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def services(real_pair):
    target_model, draft_model = real_pair
    workdir = Path(tempfile.mkdtemp(prefix="specdec-faults-"))
    tp, dp, cp = free_port(), free_port(), free_port()
    # The target steps eager here: packed steps would finish a generation before a killed draft restarts
    # (a draft process takes ~6 s to start and be asked again on these shared cores).
    target = Proc(workdir, "target", "target_service", tp, ["--model", target_model, "--threads", "1", "--step-mode", "eager"])
    draft = Proc(workdir, "draft", "draft_service", dp, ["--model", draft_model, "--threads", "1"])
    coordinator = Proc(workdir, "coordinator", "coordinator", cp, [
        "--target", f"127.0.0.1:{tp}", "--draft", f"127.0.0.1:{dp}", "--tokenizer", target_model, "--rpc-timeout", "10",
        "--grace", "30"])  # drain time on SIGTERM: generous, so a loaded CI machine finishes in time
    target.start(wait=False)
    draft.start()
    target.start() if target.proc.poll() is not None else None
    while not (workdir / "target.port").exists():
        time.sleep(0.1)
    coordinator.start()
    procs = {"target": target, "draft": draft, "coordinator": coordinator}
    yield procs
    for p in procs.values():
        if p.proc and p.proc.poll() is None:
            p.kill()


def generate(address, n: int = N, **kw):
    with Client(address, timeout_s=kw.pop("timeout_s", 180)) as c:
        return c.generate(messages=[{"role": "user", "content": QUESTION}], max_new_tokens=n, num_speculative_tokens=3,
                          proposer="draft", ignore_eos=True, **kw)


def stream_in_thread(address, chunks: list, result: dict):
    def run():
        try:
            with Client(address, timeout_s=180) as c:
                for e in c.stream(messages=[{"role": "user", "content": QUESTION}], max_new_tokens=N,
                                  num_speculative_tokens=3, proposer="draft", ignore_eos=True):
                    if e.HasField("chunk"):
                        chunks.append(list(e.chunk.token_ids))
                    else:
                        result["result"] = e.result
        except Exception as e:  # reported by the test
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def tier_sessions(port: int, tier: str) -> int:
    stub_cls = draft_pb2_grpc.DraftServiceStub if tier == "draft" else target_pb2_grpc.TargetServiceStub
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stub_cls(ch).GetStatus(common_pb2.StatusRequest(), timeout=5).num_sessions


def coordinator_health(services) -> int:
    """The coordinator's readiness: the health status of specdec.v1.Generation (what Kubernetes probes)."""
    with grpc.insecure_channel(f"127.0.0.1:{services['coordinator'].port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Generation"),
                                                    timeout=5).status


def wait_health(services, status: int, timeout_s: float) -> float:
    """Seconds until the coordinator reports `status`; fails the test after timeout_s."""
    t0 = time.monotonic()
    while coordinator_health(services) != status:
        assert time.monotonic() - t0 < timeout_s, f"coordinator health not {status} within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def reference(services):
    return generate(f"127.0.0.1:{services['coordinator'].port}").token_ids


def wait_chunks(chunks, n, timeout=60):
    deadline = time.monotonic() + timeout
    while len(chunks) < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_draft_killed_mid_generation(services, reference):
    draft = services["draft"]
    chunks, result = [], {}
    t = stream_in_thread(f"127.0.0.1:{services['coordinator'].port}", chunks, result)
    wait_chunks(chunks, 5)
    draft.kill()  # SIGKILL: no goodbye
    killed_at = len(chunks)
    time.sleep(1.0)
    assert t.is_alive(), "the generation should still be running (make N larger on a fast machine)"
    draft.start()
    # Speculation resumes: the coordinator opens a session on the restarted draft mid-generation.
    resumed = False
    while t.is_alive() and not resumed:
        resumed = tier_sessions(draft.port, "draft") > 0
        time.sleep(0.05)
    t.join(180)
    assert "error" not in result, result.get("error")
    tokens = [tok for c in chunks for tok in c]
    assert tokens == reference  # greedy output unchanged
    assert len(chunks) > killed_at
    assert resumed, "no draft session was opened after the restart"


def test_target_restarted_mid_generation(services, reference):
    """The only target replica dies under a stream: with no replica left the stream cannot go on, so it
    ends with UNAVAILABLE within a couple of seconds (not after the 30 s retry budget); once the target is
    back the coordinator serves again by itself, with unchanged output. (With several replicas the session
    moves to another one instead: tests/test_replica_faults.py.)"""
    target = services["target"]
    chunks, result = [], {}
    t = stream_in_thread(f"127.0.0.1:{services['coordinator'].port}", chunks, result)
    wait_chunks(chunks, 5)
    killed = time.monotonic()
    target.kill()
    try:
        t.join(30)
        assert not t.is_alive() and time.monotonic() - killed < 5, "the stream's error took too long"
        err = result.get("error")
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, result
        assert "no target replica is reachable" in err.details()
        assert [tok for c in chunks for tok in c] == reference[:sum(len(c) for c in chunks)]  # what came was right
        assert coordinator_health(services) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        target.start()  # a fresh process on the same port (the module's later tests need it even if one failed)
    # the coordinator finds it by itself, and serves the same greedy output again (its first tokens: a greedy
    # output's first n tokens are the n-token output, as test_sigterm_on_coordinator_... relies on too)
    wait_health(services, health_pb2.HealthCheckResponse.SERVING, 10)
    assert generate(f"127.0.0.1:{services['coordinator'].port}", n=48).token_ids == reference[:48]


def test_stalled_target_answers_before_the_client_deadline_and_frees_sessions(services):
    """SIGSTOP: the target accepts connections but never answers. Per-call deadlines bounded by the
    client's own deadline turn that into an error before the client's deadline, never a hang."""
    target = services["target"]
    target.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(f"127.0.0.1:{services['coordinator'].port}", timeout_s=3.0)
        assert time.monotonic() - t0 < 3.5
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err.value
    finally:
        target.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (tier_sessions(target.port, "target") or tier_sessions(services["draft"].port, "draft")):
        time.sleep(0.1)
    assert tier_sessions(target.port, "target") == 0 and tier_sessions(services["draft"].port, "draft") == 0


def test_target_down_past_deadline_gives_unavailable(services):
    target = services["target"]
    target.kill()
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(f"127.0.0.1:{services['coordinator'].port}", timeout_s=4.0)
        assert time.monotonic() - t0 < 4.5  # an answer before the deadline, never a hang
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "target" in err.value.details()
        # the coordinator knows: not ready, and the next request is refused at once
        assert wait_health(services, health_pb2.HealthCheckResponse.NOT_SERVING, 5) < 5
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(f"127.0.0.1:{services['coordinator'].port}", timeout_s=30.0)
        assert time.monotonic() - t0 < 1.5 and err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no target replica is reachable" in err.value.details()
    finally:
        target.start()
        wait_health(services, health_pb2.HealthCheckResponse.SERVING, 10)  # recovered by itself


def test_sigterm_on_coordinator_drains_in_flight_generation(services, reference):
    coordinator = services["coordinator"]
    result = {}
    short = 24
    def run():
        try:
            with Client(f"127.0.0.1:{coordinator.port}", timeout_s=60) as c:
                result["out"] = c.generate(messages=[{"role": "user", "content": QUESTION}], max_new_tokens=short,
                                           num_speculative_tokens=3, proposer="draft", ignore_eos=True)
        except Exception as e:
            result["error"] = e
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    code = coordinator.terminate()  # within the 30 s grace period the in-flight generation finishes
    t.join(30)
    assert code == 0
    assert "error" not in result, result.get("error")
    assert result["out"].token_ids == reference[:short]
    # sessions freed on both tiers
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (tier_sessions(services["target"].port, "target") or tier_sessions(services["draft"].port, "draft")):
        time.sleep(0.1)
    assert tier_sessions(services["target"].port, "target") == 0
    assert tier_sessions(services["draft"].port, "draft") == 0
