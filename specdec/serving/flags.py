"""Command-line flags with environment-variable defaults, shared by the three entry points.

Every flag --some-flag of a service can also be set as SPECDEC_<SERVICE>_SOME_FLAG (e.g.
SPECDEC_DRAFT_MODEL, SPECDEC_TARGET_ADDRESS); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys

from specdec.serving.logs import FORMATS as LOG_FORMATS
from specdec.serving.logs import configure_logging
from specdec.serving.server import ServerConfig, server_credentials


class EnvArgs:
    """argparse wrapper: each option's default comes from SPECDEC_<SERVICE>_<FLAG> if set."""

    def __init__(self, service: str, description: str) -> None:
        self.service = service.upper()
        self.parser = argparse.ArgumentParser(prog=f"python -m {service.lower()}_service" if service != "coordinator" else "python -m coordinator", description=description)

    def add(self, flag: str, *, type=str, default=None, help: str = "", secret: bool = False, **kw) -> None:
        """secret: never show the value (e.g. one taken from the environment) in --help."""
        env = f"SPECDEC_{self.service}_{flag.lstrip('-').replace('-', '_').upper()}"
        value = os.environ.get(env)
        if value is not None:
            default = type(value) if type is not bool else value.lower() in ("1", "true", "yes")
        if type is bool:
            self.parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]")
        else:
            shown = ("set" if default else "unset") if secret else default
            self.parser.add_argument(flag, type=type, default=default, help=f"{help} [env {env}; default {shown}]", **kw)

    def parse(self, argv=None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        configure_logging(self.service.lower(), args.log_level, getattr(args, "log_format", "text"))
        return args


# Tiers age their connections so the coordinators re-resolve the tier's name and find new replicas.
TIER_MAX_CONNECTION_AGE_S = 30.0


def add_server_args(a: EnvArgs, default_port: int, max_connection_age_s: float = ServerConfig.max_connection_age_s) -> None:
    a.add("--address", default=f"127.0.0.1:{default_port}", help="host:port to listen on (port 0 = any free port)")
    a.add("--max-message-bytes", type=int, default=ServerConfig.max_message_bytes, help="largest gRPC message accepted")
    a.add("--grace", type=float, default=ServerConfig.grace_s, help="seconds to drain in-flight rpcs on SIGTERM")
    a.add("--max-connection-age", type=float, default=max_connection_age_s,
          help="seconds before a client connection is closed (GOAWAY), so clients re-resolve DNS and find new replicas (0 = never)")
    a.add("--max-connection-age-grace", type=float, default=ServerConfig.max_connection_age_grace_s,
          help="seconds in-flight rpcs (e.g. a draft stream) may go on over an aged connection")
    a.add("--event-loop", default=ServerConfig.event_loop, choices=["uvloop", "asyncio"],
          help="the process's event loop: uvloop (libuv's, less time per rpc) or asyncio (the standard library's)")
    a.add("--port-file", default=None, help="write the bound port to this file once serving (for port 0)")
    a.add("--log-level", default="info", help="debug | info | warning | error")
    a.add("--log-format", default="text", choices=list(LOG_FORMATS),
          help="text, or json: one JSON object per line with session id, round, proposer, K and status fields")
    a.add("--metrics-address", default="",
          help="host:port of this service's Prometheus /metrics endpoint ('' = none; port 0 = any free port)")
    a.add("--tls-cert", default=None, help="PEM certificate chain: serve TLS instead of plaintext (needs --tls-key)")
    a.add("--tls-key", default=None, help="PEM private key of --tls-cert")
    a.add("--tls-client-ca", default=None, help="PEM CA bundle: require client certificates it signed (mutual TLS)")


def config_error(message: str, fields: tuple[str, ...] = ()) -> None:
    """Exit 2 with a one-line error, like argparse does for a bad flag; config field names in `fields`
    are shown as their flags (tls_cert -> --tls-cert)."""
    for name in sorted(fields, key=len, reverse=True):
        message = message.replace(name, "--" + name.replace("_", "-"))
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def server_config(args: argparse.Namespace) -> ServerConfig:
    try:
        return ServerConfig(address=args.address, max_message_bytes=args.max_message_bytes, grace_s=args.grace,
                            tls_cert=args.tls_cert or None, tls_key=args.tls_key or None,
                            tls_client_ca=args.tls_client_ca or None, max_connection_age_s=args.max_connection_age,
                            max_connection_age_grace_s=args.max_connection_age_grace, event_loop=args.event_loop)
    except ValueError as e:
        config_error(str(e), ("tls_cert", "tls_key", "tls_client_ca", "max_connection_age", "max_connection_age_grace"))


def add_tier_args(a: EnvArgs, default_model: str, default_port: int) -> None:
    from specdec.engine.config import BatchConfig, StepConfig, TierConfig
    from specdec.engine.sessions import SessionStoreConfig
    from specdec.engine.step import MODES as STEP_MODES

    add_server_args(a, default_port, max_connection_age_s=TIER_MAX_CONNECTION_AGE_S)
    a.add("--model", default=default_model, help="model: HF directory, .gguf file (or a directory holding one), or hub id")
    a.add("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    a.add("--dtype", default="float32", help="float32 | bfloat16 | float16")
    a.add("--max-sessions", type=int, default=SessionStoreConfig.max_sessions, help="KV slots (live sessions); an idle session is evicted (LRU) for a new one")
    a.add("--max-session-tokens", type=int, default=SessionStoreConfig.max_session_tokens, help="tokens one KV slot holds (capped by the model's context)")
    a.add("--max-cached-tokens", type=int, default=SessionStoreConfig.max_cached_tokens, help="tokens cached across sessions before LRU eviction")
    a.add("--idle-ttl", type=float, default=SessionStoreConfig.idle_ttl_s, help="seconds before an unused session is evicted")
    a.add("--max-draft-tokens", type=int, default=TierConfig.max_draft_tokens, help="largest K a request may ask for")
    a.add("--max-batch-sessions", type=int, default=BatchConfig.max_batch_sessions, help="sessions batched into one forward")
    a.add("--max-batch-tokens", type=int, default=BatchConfig.max_batch_tokens, help="tokens in one forward")
    a.add("--prefill-chunk", type=int, default=BatchConfig.prefill_chunk_tokens, help="a long prompt is fed this many tokens per step")
    a.add("--max-queue", type=int, default=BatchConfig.max_queue, help="queued requests before RESOURCE_EXHAUSTED")
    a.add("--coalesce-ms", type=float, default=BatchConfig.coalesce_ms,
          help="wait up to this long before a step for the last step's sessions, when they usually return within it (0 = never)")
    a.add("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    a.add("--kv-memory-gib", type=float, default=SessionStoreConfig.kv_memory_gib,
          help="size the KV pool from this memory budget (slots of --max-session-tokens) instead of --max-sessions")
    a.add("--prefix-cache", type=bool, default=SessionStoreConfig.prefix_cache,
          help="keep ended sessions' KV slots and start a new session from the longest cached prefix of its tokens")
    a.add("--prefix-block-tokens", type=int, default=SessionStoreConfig.prefix_block_tokens,
          help="prefix-cache granularity: prefixes are indexed every this many tokens")
    a.add("--step-mode", default=StepConfig.mode, choices=STEP_MODES,
          help="how each step runs: auto (packed linears on a CPU, CUDA graphs on CUDA), eager (no compiling: for "
               "debugging), packed, compile (torch.compile: minutes at start on a small CPU), cuda-graphs")
    a.add("--draft-chain", default=StepConfig.draft_chain, action=argparse.BooleanOptionalAction,
          help="draft tier: run a proposal's steps after the first as one chain on the device, one host round trip "
               "(--no-draft-chain: one engine step each)")
    a.add("--skinny-gemm", default=StepConfig.skinny_gemm, action=argparse.BooleanOptionalAction,
          help="packed steps in float32 on an AVX-512 CPU: run every linear on specdec's batch-invariant kernel "
               "(built once with the host's C++ compiler; --no-skinny-gemm: oneDNN's and the library's products)")
    a.add("--gguf-blocks", default=StepConfig.gguf_blocks, action=argparse.BooleanOptionalAction,
          help="packed steps on the skinny GEMM: serve a GGUF's Q4_0 / Q4_1 / Q8_0 matrices in their blocks, "
               "dequantised exactly inside the kernel (--no-gguf-blocks: a float32 copy, the reference's values)")
    a.add("--row-attention", default=StepConfig.row_attention, action=argparse.BooleanOptionalAction,
          help="packed and compile steps in float32 on an AVX-512 CPU: each decode or verify token attends to its own "
               "session's cache on specdec's batch-invariant kernel, with no padding (--no-row-attention: PyTorch's "
               "attention over padded groups)")
    a.add("--capture-sessions", default=",".join(map(str, StepConfig.capture_sessions)),
          help="CUDA graphs: batch sizes (sessions per step) captured")
    a.add("--fused-ops", default=StepConfig.fused_ops, action=argparse.BooleanOptionalAction,
          help="CUDA graphs capture the decoder with fused ops: norms, rotary and SiLU on Triton kernels, q/k/v and "
               "gate/up as one product each (--no-fused-ops: PyTorch's operators, one product per linear)")
    a.add("--capture-tokens", default=",".join(map(str, StepConfig.capture_tokens)),
          help="CUDA graphs: query tokens per session captured (a verify of K drafts needs K + 1)")


def tier_config(args: argparse.Namespace):
    from specdec.engine.config import BatchConfig, StepConfig, TierConfig
    from specdec.engine.sessions import SessionStoreConfig
    from specdec.models import ModelConfig

    batch = BatchConfig(max_batch_sessions=args.max_batch_sessions, max_batch_tokens=args.max_batch_tokens,
                        prefill_chunk_tokens=args.prefill_chunk, max_queue=args.max_queue, coalesce_ms=args.coalesce_ms)
    try:
        batch.validate()
    except ValueError as e:
        config_error(str(e), ("max_batch_sessions", "max_batch_tokens", "max_queue"))
    return TierConfig(
        model=ModelConfig(path=args.model, device=args.device, dtype=args.dtype),
        sessions=SessionStoreConfig(max_sessions=args.max_sessions, max_session_tokens=args.max_session_tokens,
                                    max_cached_tokens=args.max_cached_tokens, idle_ttl_s=args.idle_ttl,
                                    kv_memory_gib=args.kv_memory_gib, prefix_cache=args.prefix_cache,
                                    prefix_block_tokens=args.prefix_block_tokens),
        max_draft_tokens=args.max_draft_tokens,
        batch=batch,
        torch_threads=args.threads,
        step=StepConfig(mode=args.step_mode, capture_sessions=_sizes(args.capture_sessions, "capture_sessions"),
                        capture_tokens=_sizes(args.capture_tokens, "capture_tokens"),
                        max_capture_tokens=args.max_batch_tokens, draft_chain=args.draft_chain,
                        skinny_gemm=args.skinny_gemm, row_attention=args.row_attention, gguf_blocks=args.gguf_blocks,
                        fused_ops=args.fused_ops),
    )


def _sizes(text: str, name: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        config_error(f"--{name.replace('_', '-')} takes positive integers separated by commas, got {text!r}", (name,))
    return sizes


def write_port_file(path: str | None, port: int) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)


def check_server_tls(config: ServerConfig) -> None:
    """Read the TLS files now (before a model loads for seconds), exiting 2 with a clear error if unusable."""
    try:
        server_credentials(config)
    except (OSError, ValueError) as e:
        config_error(str(e))
