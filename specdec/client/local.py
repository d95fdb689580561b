"""Start a whole pipeline (target, draft, coordinator) as local processes on free loopback ports.

Used by `specdec run-local` (and so `make run`), by the benchmarks and by the process-level tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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


class LocalPipeline:
    def __init__(self, config: LocalPipelineConfig) -> None:
        self.config = config
        self.dir = Path(tempfile.mkdtemp(prefix="specdec-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['coordinator']}"

    def __enter__(self) -> "LocalPipeline":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, args: list[str], port: int = 0) -> None:
        port_file = self.dir / f"{name}.port"
        log = open(self.dir / f"{name}.log", "w")
        # Co-located tiers take turns on the same cores: OpenMP threads that spin while idle would
        # steal the other tier's time, so they sleep (unless the caller says otherwise).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               **self.config.env}
        cmd = [sys.executable, "-m", module, "--address", f"127.0.0.1:{port}", "--port-file", str(port_file), *args]
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

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
            self._spawn("target", "target_service", ["--model", c.target_model, *c.target_args], target_port)
            draft = ""
            if c.draft_model:
                draft_port = free_port()
                self._spawn("draft", "draft_service", ["--model", c.draft_model, *c.draft_args], draft_port)
                draft = f"127.0.0.1:{draft_port}"
            self._spawn("coordinator", "coordinator", [
                "--target", f"127.0.0.1:{target_port}", "--draft", draft, "--tokenizer", c.target_model, *c.coordinator_args])
            for name in self.procs:
                self._wait_port(name, deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 15.0) -> dict[str, int]:
        """SIGTERM everything (coordinator first), wait, then SIGKILL stragglers; returns exit codes."""
        for name in ("coordinator", "draft", "target"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes
