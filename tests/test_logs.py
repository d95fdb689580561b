"""Structured logs: the JSON format (--log-format json), and what a generation logs: session id, proposer,
K and finish reason at INFO, the status of failures at WARNING, and never the prompt text at INFO."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from specdec.client import Client
from specdec.serving.logs import JsonFormatter, TextFormatter, configure_logging
from tests.helpers import Cluster

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

SECRET_PROMPT = "my-private-prompt-7f3a: the launch codes are"


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_json_and_text_formats():
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    out = io.StringIO()
    try:
        configure_logging("coordinator", "info", "json", stream=out)
        log = logging.getLogger("coordinator.test")
        log.info("generation finished", extra={"session_id": "abc", "round": 3, "proposer": "draft_model", "k": 4})
        log.debug("not shown at info")
        try:
            raise ValueError("boom")
        except ValueError:
            log.warning("generation failed", extra={"code": "UNAVAILABLE"}, exc_info=True)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["message"] == "generation finished" and first["level"] == "info" and first["service"] == "coordinator"
    assert (first["session_id"], first["round"], first["proposer"], first["k"]) == ("abc", 3, "draft_model", 4)
    assert first["logger"] == "coordinator.test" and first["ts"].endswith("Z")
    assert second["code"] == "UNAVAILABLE" and "ValueError: boom" in second["exception"]

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    record.session_id = "s1"
    assert TextFormatter("draft").format(record).endswith("hello world session_id=s1")
    assert json.loads(JsonFormatter("draft").format(record))["session_id"] == "s1"
    with pytest.raises(ValueError, match="log format"):
        configure_logging("x", "info", "yaml")


@pytest.fixture(scope="module")
def target_only(tiny_target):
    cluster = Cluster(tiny_target, None, coordinator_overrides={"tier_retry_s": 0.2})
    yield cluster
    cluster.close()


def test_generation_logs_fields_and_no_prompt_text(target_only):
    capture = Capture()
    logger = logging.getLogger("coordinator")
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    try:
        with Client(target_only.address) as client:
            out = client.generate(prompt=SECRET_PROMPT, max_new_tokens=6, num_speculative_tokens=2,
                                  proposer="lookup", ignore_eos=True)
            target_only.stop_target()
            with pytest.raises(grpc.RpcError) as e:
                client.generate(prompt=SECRET_PROMPT, max_new_tokens=6)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        logger.removeHandler(capture)
        logger.setLevel(logging.NOTSET)
    formatter = JsonFormatter("coordinator")
    records = [json.loads(formatter.format(r)) for r in capture.records]
    for r in records:
        if r["level"] != "debug":
            assert "launch codes" not in json.dumps(r), r
    finished = [r for r in records if r["message"] == "generation finished"]
    assert len(finished) == 1
    f = finished[0]
    assert f["level"] == "info" and len(f["session_id"]) == 32 and f["api"] == "grpc"
    assert (f["proposer"], f["k"], f["finish_reason"], f["generated_tokens"]) == ("prompt_lookup", 2, "length", out.stats["generated_tokens"])
    rounds = [r for r in records if r["message"] == "round" and r["session_id"] == f["session_id"]]
    assert [r["round"] for r in rounds] == list(range(out.stats["rounds"]))
    assert all({"proposer", "k", "drafts", "accepted"} <= set(r) for r in rounds)
    (failed,) = [r for r in records if r["message"] == "generation failed"]
    assert failed["level"] == "warning" and failed["code"] == "UNAVAILABLE" and failed["session_id"] != f["session_id"]


@pytest.mark.processes
def test_log_format_flag_on_a_service_process(tiny_target):
    """python -m coordinator --log-format json: even a refusal to start is one JSON line per record."""
    run = subprocess.run([sys.executable, "-m", "coordinator", "--log-format", "json", "--target", "127.0.0.1:9",
                          "--draft", "", "--tokenizer", tiny_target, "--connect-timeout", "0.5", "--address", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    refusal = [r for r in lines if r["message"].startswith("refusing to start")]
    assert refusal and refusal[0]["level"] == "error" and refusal[0]["service"] == "coordinator"
    assert all(line.startswith("{") for line in run.stderr.splitlines() if line.strip()), run.stderr


def run_coordinator_over_a_target_that_stops(tiny_target: str, env: dict) -> str:
    """A target (--grace 0) and a coordinator with JSON logs; the target is stopped while the coordinator's
    channel has its health watch in flight, so the coordinator's gRPC core receives a GOAWAY. Returns the
    coordinator's stderr."""
    with tempfile.TemporaryDirectory() as d:
        deadline, procs = time.monotonic() + 120, []

        def start(name: str, args: list[str], stderr) -> tuple[subprocess.Popen, str]:
            """python -m name on port 0; returns the process and its bound port once it serves."""
            port_file = Path(d) / f"{name}.port"
            proc = subprocess.Popen([sys.executable, "-m", name, "--address", "127.0.0.1:0", "--port-file", str(port_file),
                                     *args], stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env)
            procs.append(proc)
            while not port_file.exists():
                assert proc.poll() is None and time.monotonic() < deadline, f"{name} did not start"
                time.sleep(0.1)
            return proc, port_file.read_text()

        try:
            target, port = start("target_service", ["--model", tiny_target, "--grace", "0", "--threads", "1"],
                                 subprocess.DEVNULL)
            coordinator, _ = start("coordinator", ["--log-format", "json", "--target", f"127.0.0.1:{port}", "--draft", "",
                                                   "--tokenizer", tiny_target], subprocess.PIPE)
            time.sleep(0.5)  # the health watch is open
            target.send_signal(signal.SIGTERM)
            target.wait(30)
            time.sleep(1.5)  # the coordinator notices (and logs that the target is unreachable)
            coordinator.send_signal(signal.SIGTERM)
            return coordinator.communicate(timeout=60)[1]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.mark.processes
def test_json_logs_keep_grpc_core_chatter_off_stderr(tiny_target):
    """gRPC core's own INFO lines (here a GOAWAY from a target that stopped with a call in flight) bypass
    Python logging: a service keeps them off stderr unless GRPC_VERBOSITY asks for them, so
    --log-format json stays one JSON object per line."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    quiet = run_coordinator_over_a_target_that_stops(tiny_target, env)
    records = [json.loads(line) for line in quiet.splitlines() if line.strip()]  # every line is JSON
    assert any("no target replica is reachable" in r["message"] for r in records), quiet
    # With gRPC's INFO lines asked for, its plain-text lines are there (so the check above can fail): at
    # least its warning that INFO is not for production, and mostly the GOAWAY as well.
    chatty = run_coordinator_over_a_target_that_stops(tiny_target, {**env, "GRPC_VERBOSITY": "INFO"})
    assert any(not line.startswith("{") for line in chatty.splitlines() if line.strip()), chatty
