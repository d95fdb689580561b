"""Replicas that die, drain and join, with real processes (tiny models): two target and two draft replicas
on 127.0.0.x addresses, one port per tier, found through one DNS name per tier that the test serves
(tests/dns_server.py), and a coordinator process (`python -m coordinator`, which sets the ring-hash
environment variable itself) reaching each tier by that name.

1. kill -9 one target replica mid-run, then one draft replica: 16 concurrent generations all complete,
   with no client error and exactly their greedy outputs; the lost sessions re-prefill elsewhere.
2. SIGTERM one target and one draft replica mid-run (health turns NOT_SERVING, then they drain and exit 0):
   the same.
3. A target replica joins the tier's name during a run: it receives new sessions (the tiers age their
   connections, so the coordinator re-resolves the name)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from specdec.client import Client
from specdec.proto import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.dns_server import FakeDns
from tests.helpers import reference_greedy
from specdec.serving.ports import free_port
from tests.replicas import NAMES

pytestmark = pytest.mark.processes

TARGETS, DRAFTS, JOINING = ["127.0.0.2", "127.0.0.3"], ["127.0.0.4", "127.0.0.5"], "127.0.0.6"
N = 160  # tokens per generation: with the random draft ~one round per token, long enough to fault mid-run
SESSIONS = 16


class Replica:
    """One tier process on address:port, restartable."""

    def __init__(self, workdir: Path, tier: str, address: str, port: int, args: list[str]) -> None:
        self.workdir, self.tier, self.address, self.port, self.args = workdir, tier, address, port, args
        self.name = f"{tier}-{address}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        log = open(self.workdir / f"{self.name}.log", "a")
        module = "target_service" if self.tier == "target" else "draft_service"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--address", f"{self.address}:{self.port}", "--port-file", str(self.port_file),
             *self.args], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # OMP_WAIT_POLICY: conftest

    @property
    def port_file(self) -> Path:
        return self.workdir / f"{self.name}.port"

    def wait_started(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            assert self.proc.poll() is None, (self.workdir / f"{self.name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{self.name} did not start"
            time.sleep(0.1)

    def status(self) -> common_pb2.StatusResponse:
        stub_cls = target_pb2_grpc.TargetServiceStub if self.tier == "target" else draft_pb2_grpc.DraftServiceStub
        with grpc.insecure_channel(f"{self.address}:{self.port}") as ch:
            return stub_cls(ch).GetStatus(common_pb2.StatusRequest(), timeout=5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture(scope="module")
def fleet(tiny_target, tiny_random_draft):
    workdir = Path(tempfile.mkdtemp(prefix="specdec-replicas-"))
    dns = FakeDns()
    addresses = [*TARGETS, *DRAFTS, JOINING]
    ports = {"target": free_port(addresses)}
    ports["draft"] = free_port(addresses)
    assert ports["draft"] != ports["target"]
    # Connections age after 1 s: the coordinator re-resolves the names often (and finds a joining replica).
    tier_args = ["--threads", "1", "--max-connection-age", "1", "--grace", "3"]
    replicas = {a: Replica(workdir, "target", a, ports["target"], ["--model", tiny_target, *tier_args]) for a in TARGETS}
    replicas |= {a: Replica(workdir, "draft", a, ports["draft"], ["--model", tiny_random_draft, *tier_args]) for a in DRAFTS}
    dns.set(NAMES["target"], TARGETS)
    dns.set(NAMES["draft"], DRAFTS)
    metrics_port = free_port(["127.0.0.1"])
    coordinator_port_file = workdir / "coordinator.port"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"}
    coordinator = None
    try:
        for r in replicas.values():
            r.start()
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "--address", "127.0.0.1:0", "--port-file", str(coordinator_port_file),
             "--target", dns.target(NAMES["target"], ports["target"]), "--draft", dns.target(NAMES["draft"], ports["draft"]),
             "--tokenizer", tiny_target, "--min-resolution-interval", "0.2", "--rpc-timeout", "10",
             "--metrics-address", f"127.0.0.1:{metrics_port}"],
            stdout=open(workdir / "coordinator.log", "a"), stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"})  # the entry point sets the ring-hash variable itself
        for r in replicas.values():
            r.wait_started()
        deadline = time.monotonic() + 120
        while not coordinator_port_file.exists():
            assert coordinator.poll() is None, (workdir / "coordinator.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.1)
        yield {"dns": dns, "replicas": replicas, "ports": ports, "workdir": workdir, "tiny_target": tiny_target,
               "address": f"127.0.0.1:{int(coordinator_port_file.read_text())}",
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        for p in [coordinator, *(r.proc for r in replicas.values())]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        dns.close()


def prompt(i: int) -> list[int]:
    return [1, *range(400 + 37 * i, 412 + 37 * i)]


@pytest.fixture(scope="module")
def references(tiny_target_model):
    return [reference_greedy(tiny_target_model, prompt(i), N, None) for i in range(SESSIONS)]


class Run:
    """SESSIONS concurrent streamed greedy generations (K = 2, the draft model), each in its own thread."""

    def __init__(self, address: str) -> None:
        self.chunks = [[] for _ in range(SESSIONS)]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(address, i), daemon=True) for i in range(SESSIONS)]
        for t in self.threads:
            t.start()

    def _one(self, address: str, i: int) -> None:
        try:
            with Client(address, timeout_s=300) as c:
                for e in c.stream(token_ids=prompt(i), max_new_tokens=N, num_speculative_tokens=2, proposer="draft",
                                  ignore_eos=True):
                    if e.HasField("chunk"):
                        self.chunks[i].append(list(e.chunk.token_ids))
        except BaseException as e:  # reported by the test
            self.errors.append(e)

    def tokens(self) -> int:
        return sum(len(c) for chunks in self.chunks for c in chunks)

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens() < n:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"{self.tokens()} tokens after {timeout_s}s"
            time.sleep(0.02)
        assert self.running(), "every generation already finished: make N larger"

    def running(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def outputs(self, timeout_s: float = 300) -> list[list[int]]:
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a generation did not finish"
        assert not self.errors, [f"{type(e).__name__}: {e}" for e in self.errors]
        return [[tok for c in chunks for tok in c] for chunks in self.chunks]


def scrape(url: str, name: str, **labels) -> float:
    """Sum of a counter's samples with these labels, from a /metrics page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_sessions(replica: Replica, timeout_s: float = 30) -> int:
    """Wait until the replica holds a session (the fault below must hit some); returns how many."""
    deadline = time.monotonic() + timeout_s
    while (n := replica.status().num_sessions) == 0:
        assert time.monotonic() < deadline, f"{replica.name} holds no session"
        time.sleep(0.02)
    return n


def test_kill_one_target_then_one_draft_replica_mid_run(fleet, references):
    replicas = fleet["replicas"]
    target, draft = replicas[TARGETS[0]], replicas[DRAFTS[0]]
    before = scrape(fleet["metrics"], "specdec_reprefills_total", tier="target")
    run = Run(fleet["address"])
    run.wait_tokens(SESSIONS * 10)
    wait_sessions(target)
    target.proc.kill()  # SIGKILL: no goodbye; its sessions' next Verify lands on the other replica
    target.proc.wait()
    killed_at = run.tokens()
    run.wait_tokens(killed_at + SESSIONS * 10)
    wait_sessions(draft)
    draft.proc.kill()
    draft.proc.wait()
    assert run.outputs() == references
    assert scrape(fleet["metrics"], "specdec_reprefills_total", tier="target") > before, "no session moved"
    for r in (target, draft):  # back for the next tests, at the same address
        r.start()
    for r in (target, draft):
        r.wait_started()


def test_drain_one_target_and_one_draft_replica_mid_run(fleet, references):
    replicas = fleet["replicas"]
    target, draft = replicas[TARGETS[1]], replicas[DRAFTS[1]]
    before = scrape(fleet["metrics"], "specdec_reprefills_total", tier="target")
    run = Run(fleet["address"])
    run.wait_tokens(SESSIONS * 10)
    wait_sessions(target)
    wait_sessions(draft)
    target.proc.send_signal(signal.SIGTERM)  # NOT_SERVING at once (the coordinator's health watch sees it), then drain
    draft.proc.send_signal(signal.SIGTERM)
    run.wait_tokens(run.tokens() + SESSIONS * 5)  # generations go on meanwhile
    assert target.proc.wait(30) == 0 and draft.proc.wait(30) == 0
    assert run.outputs() == references
    assert scrape(fleet["metrics"], "specdec_reprefills_total", tier="target") > before, "no session moved"


def test_a_replica_that_joins_receives_new_sessions(fleet, references):
    replicas, dns = fleet["replicas"], fleet["dns"]
    joining = Replica(fleet["workdir"], "target", JOINING, fleet["ports"]["target"],
                      ["--model", fleet["tiny_target"], "--threads", "1", "--max-connection-age", "1"])
    replicas[JOINING] = joining  # the fixture stops it
    joining.start()
    joining.wait_started()
    queries = dns.queries(NAMES["target"])
    dns.set(NAMES["target"], [*dns.get(NAMES["target"]), JOINING])
    deadline = time.monotonic() + 30
    while dns.queries(NAMES["target"]) < queries + 2:  # A + AAAA: the live replicas' connections age (1 s), so
        assert time.monotonic() < deadline, "the coordinator never re-resolved the target's name"  # it re-resolves
        time.sleep(0.1)
    time.sleep(0.5)  # the new address list reaches the ring
    run = Run(fleet["address"])
    held = wait_sessions(joining, timeout_s=60)
    assert run.outputs() == references
    assert held > 0 and joining.status().steps > 0
