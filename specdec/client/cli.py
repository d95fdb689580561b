"""The `specdec` command: generate through a running coordinator, inspect it, or run all locally.

    specdec generate "Write a haiku" --chat --max-new-tokens 64 --json --address 127.0.0.1:50051
    specdec info --address 127.0.0.1:50051
    specdec run-local --prompt "Explain KV caches" --max-new-tokens 128
    specdec serve --host 0.0.0.0          # target + draft + coordinator until stopped (specdec.client.serve)
    specdec bench-client -n 64 -c 8 --max-new-tokens 128 --address 127.0.0.1:50051
    SPECDEC_TOKEN=... specdec generate "Hi" --tls-ca ca.pem --address coordinator.example:50051
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dataclasses import dataclass

import grpc

from specdec.client import Client, finish_reason_name
from specdec.core.proposer_names import ALIASES, NAMES
from specdec.core.settings import Settings, setting
from specdec.client.bench import BenchConfig
from specdec.models import default_draft, default_target

STAT_ROWS = [
    ("generated tokens", "generated_tokens", "{:d}"),
    ("prompt tokens", "prompt_tokens", "{:d}"),
    ("rounds (target forwards)", "rounds", "{:d}"),
    ("proposer", "proposer", "{}"),
    ("K requested (-1 = adaptive)", "num_speculative_tokens", "{:d}"),
    ("mean K per round", "mean_num_speculative_tokens", "{:.2f}"),
    ("draft tokens proposed", "draft_tokens", "{:d}"),
    ("draft tokens accepted", "accepted_tokens", "{:d}"),
    ("acceptance rate", "acceptance_rate", "{:.3f}"),
    ("mean tokens per target forward", "mean_tokens_per_forward", "{:.3f}"),
    ("tokens/s", "tokens_per_s", "{:.2f}"),
    ("time to first token (s)", "time_to_first_token_s", "{:.3f}"),
    ("elapsed (s)", "elapsed_s", "{:.3f}"),
    ("draft compute (ms)", "draft_ms", "{:.1f}"),
    ("target compute (ms)", "verify_ms", "{:.1f}"),
    ("tiers, outside the forwards (ms)", "tier_ms", "{:.1f}"),
    ("network + gRPC (ms)", "network_ms", "{:.1f}"),
    ("coordinator (ms)", "coordinator_ms", "{:.1f}"),
]


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="send the prompt as one user chat message (default) or as raw text (--no-chat)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="K; 0 = target-only decoding")
    p.add_argument("--num-speculative-nodes", type=int, default=None,
                   help="N, each round's token-tree node budget (K is then its depth); 0 = chains; default: the server's")
    p.add_argument("--ignore-eos", action="store_true")
    aliases = ", ".join(f"{a} = {p}" for a, p in ALIASES.items())
    p.add_argument("--proposer", choices=list(NAMES), default=None,
                   help=f"draft model, prompt lookup, suffix decoding, or the hybrid policy over all three ({aliases}; "
                        "default: the server's)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason, stats")


@dataclass(frozen=True)
class ConnectionConfig:
    """The connection to a coordinator."""

    address: str = "127.0.0.1:50051"  # coordinator host:port
    tls_ca: str | None = setting(None, env="SPECDEC_TLS_CA")  # PEM CA that signed the coordinator's certificate: connect over TLS
    client_cert: str | None = setting(None, env="SPECDEC_CLIENT_CERT")  # PEM client certificate, for a coordinator that requires one
    client_key: str | None = setting(None, env="SPECDEC_CLIENT_KEY")  # PEM private key of --client-cert
    tls_server_name: str | None = None  # name to verify in the coordinator's certificate (default: the address's host)
    token: str | None = setting(None, env="SPECDEC_TOKEN", secret=True)  # bearer token for the coordinator (the variable keeps it out of `ps`)


def connection_settings() -> Settings:
    """The connection flags of specdec generate, info and bench-client (specdec.core.settings)."""
    return Settings("client", {"connection": ConnectionConfig})


def add_connection_args(p: argparse.ArgumentParser) -> None:
    connection_settings().add_to(p)


def make_client(address: str, args: argparse.Namespace) -> Client:
    """A Client from the connection flags (run-local has none: plaintext, no token); exits 2 on unusable TLS files."""
    c = connection_settings().load(args)["connection"] if hasattr(args, "connection.address") else ConnectionConfig()
    try:
        return Client(address, tls_ca=c.tls_ca, token=c.token, client_cert=c.client_cert, client_key=c.client_key,
                      tls_server_name=c.tls_server_name)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def address(args: argparse.Namespace) -> str:
    return connection_settings().load(args)["connection"].address


def generation_kwargs(args: argparse.Namespace) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, stop=args.stop, num_speculative_tokens=args.num_speculative_tokens,
              num_speculative_nodes=args.num_speculative_nodes, ignore_eos=args.ignore_eos, proposer=args.proposer)
    if args.chat:
        kw["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kw["prompt"] = args.prompt
    return kw


def format_stats(stats: dict) -> str:
    """The stats as the CLI prints them; a rate over no drafts reads as none, not as 0.000."""
    width = max(len(label) for label, _, _ in STAT_ROWS)

    def value(key: str, fmt: str) -> str:
        if key == "acceptance_rate" and not stats.get("draft_tokens", 0):
            return "- (nothing drafted: every round was the target's alone)"
        return fmt.format(stats.get(key, 0))

    return "\n".join(f"  {label:<{width}}  {value(key, fmt)}" for label, key, fmt in STAT_ROWS)


def run_generation(address: str, args: argparse.Namespace) -> int:
    with make_client(address, args) as client:
        try:
            if args.json:
                out = client.generate(**generation_kwargs(args))
                print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                  "stats": out.stats}, indent=2))
                return 0
            result = None
            for event in client.stream(**generation_kwargs(args)):
                if event.HasField("chunk"):
                    sys.stdout.write(event.chunk.text)
                    sys.stdout.flush()
                elif event.HasField("result"):
                    result = event.result
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    from google.protobuf.json_format import MessageToDict

    stats = MessageToDict(result.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    print(f"\n\n[finish: {finish_reason_name(result.finish_reason)}]")
    print(format_stats(stats))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    return run_generation(address(args), args)


def cmd_info(args: argparse.Namespace) -> int:
    with make_client(address(args), args) as client:
        try:
            print(json.dumps(client.info(), indent=2))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def cmd_bench_client(args: argparse.Namespace) -> int:
    from specdec.client.bench import main_bench

    return main_bench(args, address(args), lambda: make_client(address(args), args))


def cmd_run_local(args: argparse.Namespace) -> int:
    from specdec.client.local import LocalPipeline, LocalPipelineConfig, sharing

    threads = ["--threads", str(args.threads)] if args.threads else []
    draft_model = args.draft_model or None
    draft_dtype = args.draft_dtype
    if args.self_draft:  # the target's own low-precision copy serves as the draft
        draft_model, draft_dtype = args.target_model, args.self_draft
    config = LocalPipelineConfig(
        target_model=args.target_model, draft_model=draft_model,
        target_args=["--device", args.device, *threads],
        draft_args=["--device", args.device, "--dtype", draft_dtype, *threads], **sharing(args.device),
    )
    print(f"starting target ({config.target_model}), draft ({config.draft_model}) and coordinator on loopback...", file=sys.stderr)
    t0 = time.perf_counter()
    with LocalPipeline(config) as pipeline:
        print(f"ready in {time.perf_counter() - t0:.1f}s; coordinator at {pipeline.address}\n", file=sys.stderr)
        if not args.json:
            print(f">>> {args.prompt}\n")
        code = run_generation(pipeline.address, args)
    print("all services stopped", file=sys.stderr)
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Distributed speculative decoding: client and local runner.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate through a running coordinator")
    g.add_argument("prompt")
    add_connection_args(g)
    add_generation_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="show the pipeline's models, defaults and limits")
    add_connection_args(i)
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench-client", help="N concurrent requests against a running coordinator; latency and throughput summary")
    b.add_argument("--prompt", default=BenchConfig.prompt, help="every request's prompt")
    b.add_argument("-n", "--num-requests", type=int, default=BenchConfig.num_requests)
    b.add_argument("-c", "--concurrency", type=int, default=BenchConfig.concurrency, help="requests in flight at once")
    add_connection_args(b)
    add_generation_args(b)
    b.set_defaults(func=cmd_bench_client, ignore_eos=True, max_new_tokens=64)
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so every request generates --max-new-tokens)")

    r = sub.add_parser("run-local", help="start target, draft and coordinator locally, generate once, stop")
    r.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    r.add_argument("--target-model", default=default_target())
    r.add_argument("--draft-model", default=default_draft(), help="'' for target-only decoding")
    r.add_argument("--draft-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--self-draft", default=None, choices=["float16", "bfloat16"],
                   help="use the target's own copy at this precision as the draft (no draft model needed; "
                        "float16 agrees best on CPU, see docs/performance.md)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--threads", type=int, default=0, help="torch threads per tier (0 = default)")
    add_generation_args(r)
    r.set_defaults(func=cmd_run_local)

    from specdec.client.serve import add_serve_parser

    add_serve_parser(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
