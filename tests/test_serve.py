"""`specdec serve` as a user runs it: one command, real processes on free ports, called with the official
`openai` client. The coordinator's health follows the tiers: a draft killed with SIGKILL only degrades;
a target killed mid-stream ends the stream with an error, turns /health to 503 and makes new requests
fail at once with 503, within seconds; serve restarts what died and the coordinator recovers by itself.
SIGTERM stops everything with no child left behind; a crash loop makes serve give up (unit test)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdec.client import Client
from specdec.serving.ports import free_port
from tests.helpers import tier_device_args

pytestmark = pytest.mark.processes

START_TIMEOUT_S = 180


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Serve:
    """specdec serve as a user starts it; with any_ports its ports are 0 (any free ones), read off its ready line."""

    def __init__(self, tmp_path: Path, *args: str, any_ports: bool = False) -> None:
        self.http_port, self.port = (0, 0) if any_ports else (free_port(), free_port())
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        device = tier_device_args()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.client.cli", "serve", "--port", str(self.port), "--http-port", str(self.http_port),
             "--target-args", " ".join(device), "--draft-args", " ".join(device), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.children: dict[int, str] = {}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.output()}"
            self.children.update(children(self.proc.pid))
            ready = re.search(r"ready: OpenAI API at (http://[\d.]+:(\d+))/v1 .*gRPC at [\d.]+:(\d+)", self.output())
            if ready and not self.port:  # ports given as 0: the ones serve chose, as it names them
                self.url, self.http_port, self.port = ready[1], int(ready[2]), int(ready[3])
            try:  # healthy, and serve has said so (it says "ready" once its start-up checks return)
                if ready and httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.children.update(children(self.proc.pid))
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"serve not ready in {START_TIMEOUT_S}s:\n{self.output()}"
            time.sleep(0.2)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child(self, module: str) -> int:
        (pid,) = [pid for pid, cmd in self.children.items() if f"-m {module} " in cmd]
        return pid

    def close(self) -> None:
        for pid in [self.proc.pid, *self.children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve_factory(tmp_path):
    started = []

    def start(*args: str, any_ports: bool = False) -> Serve:
        s = Serve(tmp_path, *args, any_ports=any_ports)
        started.append(s)
        s.wait_ready()
        return s

    yield start
    for s in started:
        s.close()


def child_name(cmd: str) -> str:
    return cmd.split(" -m ")[1].split()[0]


def test_serve_answers_restarts_and_stops_cleanly(serve_factory, tiny_target):
    s = serve_factory("--target-model", tiny_target, "--draft-model", tiny_target, "--served-model-name", "smollm2",
                      any_ports=True)  # --port 0 --http-port 0: the ready line names the ports chosen
    assert 0 not in (s.port, s.http_port) and s.port != s.http_port
    with Client(f"127.0.0.1:{s.port}") as grpc_client:  # the gRPC API on the port the ready line names
        assert grpc_client.info()["target"]["model"]
    assert sorted(child_name(cmd) for cmd in s.children.values()) == ["coordinator", "draft_service", "target_service"]
    oai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def complete():
        return oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                           extra_body={"ignore_eos": True})

    assert [m.id for m in oai.models.list().data] == ["smollm2"]  # --served-model-name overrides the derived name
    r = complete()
    assert r.model == "smollm2" and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert "ready: OpenAI API at" in s.output() and "'smollm2'" in s.output()

    def wait_output(line: str) -> None:
        deadline = time.monotonic() + 30
        while line not in s.output():
            assert time.monotonic() < deadline, f"no {line!r} in:\n{s.output()}"
            time.sleep(0.05)

    def health() -> httpx.Response:
        return httpx.get(s.url + "/health", timeout=5)

    def until(predicate, timeout_s: float) -> float:
        """Seconds until predicate() holds (fails the test after timeout_s)."""
        t0 = time.monotonic()
        while not predicate():
            assert s.proc.poll() is None, s.output()
            assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s}s:\n{s.output()[-3000:]}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def answers() -> str:
        """'' when a completion comes back whole; else what went wrong, with serve's output (the children's
        logs), so that a failure says why."""
        try:
            n = complete().usage.completion_tokens
            return "" if n == 5 else f"{n} tokens instead of 5"
        except openai.APIError as e:
            return f"{type(e).__name__}: {e}\n{s.output()[-4000:]}"

    # The draft dies: only a degradation (prompt lookup drafts), /health stays 200; serve restarts it.
    os.kill(s.child("draft_service"), signal.SIGKILL)
    wait_output("the draft was killed by SIGKILL; restarting it")
    assert not (failure := answers()), failure
    assert health().status_code == 200
    # back: serving again (a request the suffix tree answered alone may not have noticed it gone), and no longer
    # reported missing
    until(lambda: s.output().count("draft_service: draft service for") >= 2, START_TIMEOUT_S)
    until(lambda: health().json().get("draft") is None, START_TIMEOUT_S)

    # The target dies in the middle of a stream: the stream gets its error, /health turns 503 and new
    # requests are refused at once with 503, all within seconds; serve restarts the target and the
    # coordinator recovers by itself.
    stream = iter(oai.completions.create(model="smollm2", prompt="Hi", max_tokens=900, stream=True,
                                         extra_body={"ignore_eos": True, "num_speculative_tokens": 0}))
    assert next(stream).choices[0].text is not None
    killed = time.monotonic()
    os.kill(s.child("target_service"), signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    stream_error_s = time.monotonic() - killed
    until(lambda: health().status_code == 503, 10)
    health_s = time.monotonic() - killed
    down = health().json()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        complete()
    refused_s = time.monotonic() - t0
    assert refused.value.status_code == 503 and "no target replica is reachable" in refused.value.body["message"]
    assert down["status"] == "unavailable" and "no target replica is reachable" in down["message"]
    assert stream_error_s < 3, f"the stream's error came {stream_error_s:.1f}s after the target died"
    assert health_s < 5, f"/health said 503 {health_s:.1f}s after the target died"
    assert refused_s < 1.5, f"a request took {refused_s:.1f}s to be refused"
    wait_output("the target was killed by SIGKILL; restarting it")
    until(lambda: health().status_code == 200, START_TIMEOUT_S)
    assert not (failure := answers()), failure
    s.children.update(children(s.proc.pid))
    oai.close()
    live = children(s.proc.pid)
    assert len(live) == 3 and set(live) - set(s.children) == set()

    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.output()
    assert "stopped" in s.output()
    assert not [pid for pid in s.children if alive(pid)], "children left behind after SIGTERM"


class FakePipeline:
    """The two calls Supervisor makes: which children exited (and how), and respawn one."""

    def __init__(self) -> None:
        self.dead: dict[str, int] = {}
        self.respawned: list[str] = []

    def exited(self) -> dict[str, int]:
        return dict(self.dead)

    def respawn(self, name: str) -> None:
        self.respawned.append(name)
        del self.dead[name]


def test_supervisor_restarts_with_back_off_and_gives_up_on_a_crash_loop(capsys):
    from specdec.client.serve import MAX_RESTARTS, RESTART_DELAYS_S, RESTART_WINDOW_S, Supervisor

    now = [0.0]
    pipeline = FakePipeline()
    sup = Supervisor(pipeline, clock=lambda: now[0])
    for i in range(MAX_RESTARTS):
        pipeline.dead["target"] = -9
        assert sup.tick()
        now[0] += RESTART_DELAYS_S[i] - 0.01
        if RESTART_DELAYS_S[i]:  # not before its delay
            assert sup.tick() and pipeline.respawned.count("target") == i
        now[0] += 0.01
        assert sup.tick() and pipeline.respawned.count("target") == i + 1
    pipeline.dead["target"] = 1
    assert not sup.tick()  # the 6th exit within the window: crash loop
    assert "giving up" in capsys.readouterr().err
    now[0] += RESTART_WINDOW_S  # later exits, one at a time, are restarted again
    assert sup.tick() and pipeline.respawned[-1] == "target"


def test_serve_restarts_a_child_that_hangs(serve_factory, tiny_target):
    """A child that stops answering (SIGSTOP: alive, its port open, nothing served) is killed after
    --health-timeout and started again; the pipeline answers again by itself."""
    s = serve_factory("--target-model", tiny_target, "--draft-model", tiny_target, "--served-model-name", "smollm2",
                      "--health-timeout", "3")
    target = s.child("target_service")
    os.kill(target, signal.SIGSTOP)
    oai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    deadline = time.monotonic() + 120
    while "the target was killed by SIGKILL; restarting it" not in s.output():  # serve's next look after the kill
        assert time.monotonic() < deadline, s.output()[-3000:]
        time.sleep(0.1)
    assert "the target has failed its health checks for" in s.output()
    while True:  # the restarted target loads, the coordinator finds it
        try:
            r = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            extra_body={"ignore_eos": True})
            break
        except openai.APIError:
            assert time.monotonic() < deadline, s.output()[-3000:]
            time.sleep(0.5)
    s.children.update(children(s.proc.pid))  # the restarted target too, for close()
    assert r.usage.completion_tokens == 3 and not alive(target) and s.proc.poll() is None


def test_serve_finds_a_port_clash_before_loading_any_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "specdec.client.cli", "serve", "--http-port", str(port),
                              "--port", str(free_port()), "--target-model", str(tmp_path / "no-such-model")],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"cannot start: port {port} on 127.0.0.1 is not free" in out.stderr  # not a word about the model
    assert "starting target" not in out.stderr


@pytest.mark.parametrize("device, draft_flags, coordinator_flags", [
    ("cpu", ["--threads", "1"], ["--draft-max-sessions", "1"]),  # shared cores: one draft thread, the draft alone only
    ("cuda", [], ["--draft-max-sessions", "1"]),  # one GPU: its kernels take turns with the target's
])
def test_serve_asks_the_draft_alone_only_where_the_tiers_share_a_device(device, draft_flags, coordinator_flags):
    """specdec serve runs both tiers on one device: the coordinator offers the draft model only while one
    generation runs, on a CPU (shared cores) and on a GPU (measured on an H100: 0.48x K = 0 at 32 clients
    otherwise, docs/performance.md); only a CPU gets the one-thread draft. A user's own flags come after."""
    from specdec.client.serve import ServeConfig, pipeline_config

    config = pipeline_config(ServeConfig(target_model="t", draft_model="d", device=device,
                                         coordinator_args="--draft-max-sessions 4"))
    assert config.colocation_args() == (draft_flags, coordinator_flags)
    assert config.coordinator_args[-2:] == ["--draft-max-sessions", "4"]  # the user's, after (argparse: last wins)
