"""`specdec serve`: the whole pipeline (target, draft, coordinator) on one machine under one command, for
a laptop or a single GPU box:

    specdec serve                                    # the default pair, OpenAI API on 127.0.0.1:8000
    specdec serve --device cuda --host 0.0.0.0 --served-model-name smollm2

Three processes, started by the launcher `specdec run-local` uses (specdec.client.local), and supervised
here. Processes rather than one process with the tiers on local channels: each tier's forwards hold its
interpreter (torch, the GIL) for milliseconds at a time, which would stall the coordinator's event loop
and the other tier; the processes are the services of the three-process and Kubernetes forms with the
same flags, so what runs on a laptop is what runs in a cluster. The tiers listen on free loopback ports;
only the coordinator's gRPC and HTTP ports are exposed (on --host).

Supervision: if one of the three exits, or stops answering its gRPC health check for --health-timeout seconds
(hung: deadlocked, stopped, swapping; serve then kills it with SIGKILL), serve says which and how, and starts it
again on the same port
(the others keep talking to it: the coordinator re-prefills the sessions a restarted tier lost, and
reports 503 on /health while no target is up). A child that has to be restarted more than
MAX_RESTARTS times within RESTART_WINDOW_S is crash-looping: serve says so, stops the others and exits 1,
for whatever runs serve (systemd, a container's restart policy) to see. SIGTERM or SIGINT stops the
coordinator first (it drains its streams for its --grace), then the tiers, and serve exits 0 once all
three have exited. The children also get SIGTERM if serve itself is killed (Linux). Before starting any
child, serve checks that the coordinator's ports are free on --host, and says which is not.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import socket
import sys
import time

from dataclasses import dataclass, replace

from specdec.client.local import LocalPipeline, LocalPipelineConfig, sharing
from specdec.core.settings import Settings, setting
from specdec.models import DTYPES, default_draft, default_target, served_model_name
from specdec.serving.ports import free_port

POLL_S = 0.2  # how often serve looks at its children
MAX_RESTARTS = 5  # restarts of one child within RESTART_WINDOW_S before serve gives up (exit 1)
RESTART_WINDOW_S = 300.0
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # wait before the 1st, 2nd, ... restart within the window
HEALTH_INTERVAL_S = 2.0  # how often serve health-checks each running child
HEALTH_PROBE_TIMEOUT_S = 2.0  # a health check unanswered this long fails
STOP_TIMEOUT_S = 30.0  # after SIGTERM, how long each child may take to exit before SIGKILL (> the coordinator's grace)


class _Stop(BaseException):
    """SIGTERM / SIGINT arrived (a BaseException, so that a start in progress is unwound and cleaned up)."""


@dataclass(frozen=True)
class ServeConfig:
    """specdec serve: the three services on this machine."""

    target_model: str = setting()  # HF directory, .gguf file (or a directory holding one), or hub id
    draft_model: str | None = setting()  # the draft model ('' = target-only decoding)
    device: str = "cpu"  # torch device of both tiers: cpu, cuda, cuda:1, ...
    dtype: str = setting("float32", choices=DTYPES)  # the target's dtype
    draft_dtype: str = setting("float32", choices=DTYPES)  # the draft's dtype
    threads: int = 0  # torch threads per tier (0 = torch's default)
    host: str = "127.0.0.1"  # where the coordinator listens (0.0.0.0: every interface)
    port: int = 50051  # the gRPC API's port (0: a free one, named in the ready line)
    http_port: int = 8000  # the OpenAI-compatible API's port (0: a free one, named in the ready line)
    metrics_port: int | None = None  # the coordinator's Prometheus /metrics port (default: none; 0: a free one)
    served_model_name: str | None = None  # the model's id in the OpenAI API and the metrics (default: derived from --target-model)
    target_args: str = ""  # more flags for python -m target_service, one string (e.g. "--max-batch-sessions 8")
    draft_args: str = ""  # more flags for python -m draft_service, one string
    coordinator_args: str = ""  # more flags for python -m coordinator, one string
    start_timeout_s: float = LocalPipelineConfig.start_timeout_s  # seconds for all three to be up (a first GGUF conversion takes a while)
    # Restart a child whose gRPC health check has failed for this long, seconds (0 = only restart exits)
    health_timeout_s: float = 30.0


def settings() -> Settings:
    """Every flag of specdec serve: the fields of ServeConfig (specdec.core.settings)."""
    return Settings("serve", {"serve": ServeConfig}, defaults={"target-model": default_target, "draft-model": default_draft})


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run target, draft and coordinator on this machine until stopped (SIGTERM / Ctrl-C)",
                       description="\n\n".join(__doc__.split("\n\n")[:2]), formatter_class=argparse.RawDescriptionHelpFormatter)
    settings().add_to(s)
    s.set_defaults(func=cmd_serve)


def pipeline_config(args: ServeConfig) -> LocalPipelineConfig:
    threads = ["--threads", str(args.threads)] if args.threads else []
    coordinator = ["--http-address", f"{args.host}:{args.http_port}"]
    if args.metrics_port is not None:
        coordinator += ["--metrics-address", f"{args.host}:{args.metrics_port}"]
    if args.served_model_name:
        coordinator += ["--served-model-name", args.served_model_name]
    return LocalPipelineConfig(
        target_model=args.target_model, draft_model=args.draft_model or None,
        target_args=["--device", args.device, "--dtype", args.dtype, *threads, *shlex.split(args.target_args)],
        draft_args=["--device", args.device, "--dtype", args.draft_dtype, *threads, *shlex.split(args.draft_args)],
        coordinator_args=[*coordinator, *shlex.split(args.coordinator_args)],
        coordinator_address=f"{args.host}:{args.port}", start_timeout_s=args.start_timeout_s, **sharing(args.device),
        inherit_output=True, die_with_parent=True)


def cmd_serve(namespace: argparse.Namespace) -> int:
    args = with_free_ports(settings().load(namespace)["serve"])
    config = pipeline_config(args)
    name = args.served_model_name or served_model_name(args.target_model)

    def stop_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    clash = port_clash(args.host, [args.port, args.http_port] + ([args.metrics_port] if args.metrics_port is not None else []))
    if clash:
        say(f"cannot start: {clash}")
        return 1
    previous = {s: signal.signal(s, stop_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    pipeline = LocalPipeline(config)
    try:
        say(f"starting target ({config.target_model}), draft ({config.draft_model or 'none: target-only'}) "
            f"and coordinator...")
        pipeline.start()
        metrics = f", metrics at http://{args.host}:{args.metrics_port}/metrics" if args.metrics_port is not None else ""
        say(f"ready: OpenAI API at http://{args.host}:{args.http_port}/v1 (model {name!r}), "
            f"gRPC at {args.host}:{args.port}{metrics}; SIGTERM or Ctrl-C stops")
        supervisor = Supervisor(pipeline, health_timeout_s=args.health_timeout_s)
        while supervisor.tick():
            time.sleep(POLL_S)
        quiet_stop(pipeline)
        return 1
    except _Stop as e:
        say(f"{e}: stopping the coordinator, then the tiers")
        codes = quiet_stop(pipeline)
        bad = {child: code for child, code in codes.items() if code != 0}
        if bad:
            say(f"stopped, but not cleanly: {bad}")
            return 1
        say("stopped")
        return 0
    except (RuntimeError, TimeoutError) as e:  # a child failed to start (its output is above)
        say(f"failed to start: {str(e).splitlines()[0]}")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def with_free_ports(args: ServeConfig) -> ServeConfig:
    """args with each port given as 0 replaced by one free on args.host now (free_port, as the local runner picks
    the tiers'), so that the ready line can name it and the three APIs never share one."""
    chosen = {p for p in (args.port, args.http_port, args.metrics_port) if p}

    def free(port: int | None) -> int | None:
        if port != 0:
            return port
        while (port := free_port((args.host,))) in chosen:
            pass
        chosen.add(port)
        return port

    return replace(args, port=free(args.port), http_port=free(args.http_port), metrics_port=free(args.metrics_port))


def port_clash(host: str, ports: list[int]) -> str | None:
    """Why the coordinator could not listen on these ports of host (taken, or one given twice), or None."""
    if len(set(ports)) < len(ports):
        return f"a port is given twice: {ports}"
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                sock.bind((host, port))
            except OSError as e:
                return f"port {port} on {host} is not free ({e.strerror or e}); choose another with --port / --http-port / --metrics-port"
    return None


class Supervisor:
    """Restarts the children that exit, with a growing delay, until one crash-loops; kills (to restart) the
    ones whose health check fails for health_timeout_s."""

    def __init__(self, pipeline: LocalPipeline, clock=time.monotonic, health_timeout_s: float = 0.0) -> None:
        self.pipeline = pipeline
        self.clock = clock
        self.health_timeout_s = health_timeout_s  # a running child unhealthy this long is killed; 0 = never checked
        self.restarts: dict[str, list[float]] = {}  # child -> its restart times within the window
        self.due: dict[str, float] = {}  # child -> when to restart it (it has exited)
        self.unhealthy_since: dict[str, float] = {}  # child -> when its health checks began to fail
        self._next_probe = 0.0

    def tick(self) -> bool:
        """Look at the children once; False when one crash-loops (serve gives up)."""
        now = self.clock()
        for child, code in self.pipeline.exited().items():
            if child in self.due:
                continue
            recent = [t for t in self.restarts.get(child, []) if now - t < RESTART_WINDOW_S]
            self.restarts[child] = recent
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            if len(recent) >= MAX_RESTARTS:
                say(f"the {child} {how}, its {len(recent) + 1}th exit within {RESTART_WINDOW_S:.0f}s; "
                    f"giving up: stopping the others")
                return False
            delay = RESTART_DELAYS_S[min(len(recent), len(RESTART_DELAYS_S) - 1)]
            say(f"the {child} {how}; restarting it" + (f" in {delay:.0f}s" if delay else ""))
            self.due[child] = now + delay
        for child, when in list(self.due.items()):
            if now >= when:
                del self.due[child]
                self.restarts[child].append(now)
                self.unhealthy_since.pop(child, None)
                self.pipeline.respawn(child)
        if self.health_timeout_s > 0 and now >= self._next_probe:
            self._next_probe = now + HEALTH_INTERVAL_S
            self._check_health(now)
        return True

    def _check_health(self, now: float) -> None:
        """Kill the running children whose health checks have failed for health_timeout_s (the next tick
        sees them exit and restarts them)."""
        for child in self.pipeline.running():
            if self.pipeline.healthy(child, HEALTH_PROBE_TIMEOUT_S):
                self.unhealthy_since.pop(child, None)
                continue
            since = self.unhealthy_since.setdefault(child, now)
            if now - since >= self.health_timeout_s:
                say(f"the {child} has failed its health checks for {now - since:.0f}s (hung); killing it to restart it")
                del self.unhealthy_since[child]
                self.pipeline.kill(child)


def quiet_stop(pipeline: LocalPipeline) -> dict[str, int]:
    """Stop every child, ignoring further SIGTERM / SIGINT meanwhile (a second Ctrl-C must not leave any behind)."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    return pipeline.stop(STOP_TIMEOUT_S)


def say(message: str) -> None:
    print(f"specdec serve: {message}", file=sys.stderr, flush=True)
