"""Start a whole pipeline (target, draft, coordinator) as local processes on free loopback ports.

Used by `specdec run-local` (and so `make run`), by `specdec serve` (specdec.client.serve), by the
benchmarks and by the process-level tests.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.ports import free_port


@dataclass
class LocalPipelineConfig:
    target_model: str
    draft_model: str | None  # None: target-only (no draft process)
    target_args: list[str] = field(default_factory=list)  # extra flags for python -m target_service
    draft_args: list[str] = field(default_factory=list)  # extra flags for python -m draft_service
    coordinator_args: list[str] = field(default_factory=list)  # extra flags for python -m coordinator
    start_timeout_s: float = 600.0  # the first GGUF conversion takes ~20 s; slow disks more
    env: dict[str, str] = field(default_factory=dict)
    coordinator_address: str = "127.0.0.1:0"  # where the coordinator listens (port 0 = any free port)
    inherit_output: bool = False  # children write to this process's stdout/stderr instead of log files
    die_with_parent: bool = False  # children get SIGTERM if this process dies (Linux), even by SIGKILL
    # The tiers compute on the same CPU cores (False: on a GPU, or pinned apart): a draft step beside a busy
    # target's then slows both, so the coordinator asks the draft model only while one generation runs
    # (--draft-max-sessions 1), and the draft computes on one thread (--threads 1): with a team of its own
    # on every core, its OpenMP threads spin after each Propose on the cores the target's verify needs
    # (measured: a verify of 3 tokens beside it 1.20x a step, 1.04x with one draft thread). Flags in
    # coordinator_args / draft_args override both.
    shared_cores: bool = True
    # Both tiers on one GPU: their processes' kernels take turns on it, so under load a draft step beside the
    # target's slows every session's round more than any price shows, as on shared cores: the coordinator asks
    # the draft model only while one generation runs (--draft-max-sessions 1; docs/performance.md, On a GPU).
    shared_gpu: bool = False

    def colocation_args(self) -> tuple[list[str], list[str]]:
        """(draft flags, coordinator flags) that the tiers' sharing of a device calls for; flags given in
        draft_args / coordinator_args come after them, and win."""
        draft = ["--threads", "1"] if self.shared_cores else []
        coordinator = ["--draft-max-sessions", "1"] if self.shared_cores or self.shared_gpu else []
        return draft, coordinator


def sharing(device: str) -> dict[str, bool]:
    """LocalPipelineConfig's shared_cores / shared_gpu for both tiers on `device` (cpu, cuda, cuda:1, ...)."""
    return {"shared_cores": device == "cpu", "shared_gpu": device != "cpu"}


class LocalPipeline:
    def __init__(self, config: LocalPipelineConfig) -> None:
        self.config = config
        self.dir = Path(tempfile.mkdtemp(prefix="specdec-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self._commands: dict[str, tuple[str, list[str], str]] = {}  # name -> (module, args, address), for respawn()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['coordinator']}"

    def __enter__(self) -> "LocalPipeline":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, args: list[str], address: str = "127.0.0.1:0") -> None:
        self._commands[name] = (module, args, address)
        port_file = self.dir / f"{name}.port"
        log = None if self.config.inherit_output else open(self.dir / f"{name}.log", "a")
        # OpenMP as it comes (spin-waiting between parallel regions): measured on 2 shared cores, making the
        # co-located tiers' threads sleep instead (OMP_WAIT_POLICY=PASSIVE) cost 1.5x in tokens/s, since a
        # decode step is hundreds of small parallel regions each woken through the kernel.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.config.env}
        cmd = [sys.executable, "-m", module, "--address", address, "--port-file", str(port_file), *args]
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=None if log is None else subprocess.STDOUT, env=env,
                                            start_new_session=True,
                                            preexec_fn=_die_with_parent if self.config.die_with_parent else None)

    def _wait_port(self, name: str, deadline: float) -> int:
        port_file = self.dir / f"{name}.port"
        while time.monotonic() < deadline:
            if port_file.exists():
                self.ports[name] = int(port_file.read_text())
                return self.ports[name]
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{self.log_tail(name)}")
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not start in time:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self) -> None:
        c = self.config
        deadline = time.monotonic() + c.start_timeout_s
        try:
            # Tier ports are picked up front so all three processes start (and import) at once; the
            # coordinator waits for the tiers to answer.
            target_port = free_port()
            self._spawn("target", "target_service", ["--model", c.target_model, *c.target_args], f"127.0.0.1:{target_port}")
            draft, (draft_colocation, coordinator_colocation) = "", c.colocation_args()
            if c.draft_model:
                draft_port = free_port()
                # --head-target: where the draft is an EAGLE-3 head, the target it drafts for (a draft model ignores
                # it); --direct-target: the target tier, for the rounds it runs itself (coordinator --direct-rounds)
                self._spawn("draft", "draft_service", ["--model", c.draft_model, "--head-target", c.target_model,
                                                       "--direct-target", f"127.0.0.1:{target_port}",
                                                       *draft_colocation, *c.draft_args],
                            f"127.0.0.1:{draft_port}")
                draft = f"127.0.0.1:{draft_port}"
            self._spawn("coordinator", "coordinator", [
                "--target", f"127.0.0.1:{target_port}", "--draft", draft, "--tokenizer", c.target_model,
                *coordinator_colocation, *c.coordinator_args],
                c.coordinator_address)
            for name in self.procs:
                self._wait_port(name, deadline)
        except BaseException:
            self.stop()
            raise

    def respawn(self, name: str) -> None:
        """Start an exited child again, with its command line and on the port it had (the others keep its
        address); returns at once, without waiting for it to serve."""
        module, args, address = self._commands[name]
        if name in self.ports:
            address = f"{address.rpartition(':')[0]}:{self.ports[name]}"
        (self.dir / f"{name}.port").unlink(missing_ok=True)
        self._spawn(name, module, args, address)

    def running(self) -> list[str]:
        """The children that are up (they wrote their port file: listening) and have not exited."""
        return [name for name, proc in self.procs.items() if proc.poll() is None and (self.dir / f"{name}.port").exists()]

    def healthy(self, name: str, timeout_s: float) -> bool:
        """Whether a running child answers gRPC's health check (its liveness, service "") within timeout_s.
        Only no answer in time, or an answer other than SERVING, is unhealthy: a refused or unreadable
        connection (say, a child serving TLS) is left to the child's exit."""
        port = int((self.dir / f"{name}.port").read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            except grpc.RpcError as e:
                return e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def kill(self, name: str) -> None:
        """SIGKILL a child (also one that is stopped or hung); exited() then reports it."""
        if self.procs[name].poll() is None:
            self.procs[name].kill()

    def exited(self) -> dict[str, int]:
        """The children that have exited so far, with their exit codes (negative: killed by that signal)."""
        return {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}

    def stop(self, timeout_s: float = 15.0) -> dict[str, int]:
        """SIGTERM the coordinator and wait for it (it drains its streams, which still need the tiers),
        then the tiers; SIGKILL whatever outlives timeout_s. Returns the exit codes."""
        codes = {}
        for group in (["coordinator"], ["draft", "target"]):
            procs = {name: self.procs[name] for name in group if name in self.procs}
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, proc in procs.items():
                try:
                    codes[name] = proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes[name] = proc.wait()
        return codes


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
