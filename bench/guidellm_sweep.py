"""guidellm against specdec's OpenAI API, as a user measures a server.

For each row a fresh `specdec serve` (the default pair unless --serve-args say otherwise) and guidellm's
concurrent profile at each level of --streams for --seconds, every stream sending its next request as soon as one
ends. `--data synthetic` (guidellm's own): random English words, --prompt-tokens of them, and exactly
--output-tokens out (guidellm then sets `ignore_eos`). `--data chat`: 632 distinct open-ended chat requests
(specdec.training.prompts: a dozen kinds of instruction over fifty topics, and code tasks; none of the bench's
held-out prompts), at most --output-tokens out, each answer ending where the model ends it. Each level is a
guidellm run of its own over prompts no earlier level of the row sent (chat: its share of the requests; synthetic:
its own seed), so neither the prefix cache nor suffix decoding's tree of recent answers has seen them.
Rows: `specdec` (the default request: hybrid proposer, adaptive K) and `k0` (`num_speculative_tokens: 0` in each
request's body, the target alone through the same services). guidellm runs from an environment of its own
(`make guidellm`: .venv-guidellm), like any client; its JSON report gives the table: the server's output tokens/s,
TTFT, inter-token latency and request latency (guidellm's medians and p95 over the level's completed requests).
guidellm sizes the synthetic prompts with the default draft's tokenizer (the pair shares one; the target is a GGUF).

    python -m bench.guidellm_sweep [--streams 1,4,16] [--seconds 30] [--rows specdec,k0] [--guidellm PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import REPO, bench_log, log, machine_info, md_table, plot_dir, publish

ROW_BODY = {"specdec": {}, "k0": {"num_speculative_tokens": 0}}  # what each row adds to every request's body
GUIDELLM_VERSION = "0.8.1"  # `make guidellm` installs this one
START_TIMEOUT_S = 600
GUIDELLM_SLACK_S = 120  # guidellm's start, and a level's requests in flight at its end, beyond the level's seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.guidellm_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,4,16", help="comma list of concurrent streams (guidellm's concurrent profile)")
    p.add_argument("--seconds", type=float, default=30.0, help="each level's duration")
    p.add_argument("--rows", default="specdec,k0", help="comma list of specdec, k0")
    p.add_argument("--data", default="synthetic", choices=["synthetic", "chat"], help="the prompts (module docstring)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="--data synthetic: the prompts' tokens")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--guidellm", default=str(REPO / ".venv-guidellm" / "bin" / "guidellm"), help="the guidellm CLI")
    p.add_argument("--tokenizer", default="", help="a tokenizer directory for the prompts (default: the default draft's)")
    p.add_argument("--serve-args", default="", help="extra flags for `specdec serve` (one string)")
    p.add_argument("--out", default=None, help="markdown file to append the section to ('' = none)")
    return p.parse_args(argv)


def scenario(target: str, body: dict, streams: int, seconds: float, prompt_tokens: int, output_tokens: int,
             tokenizer: str, report: Path, prompts: Path | None = None, seed: int = 1) -> dict:
    """guidellm's scenario (its `run -c FILE` format) for one level of concurrent streams. prompts: a JSON-lines file
    of {"prompt": text}, answered up to output_tokens (None: synthetic prompts drawn from `seed`, exactly that many)."""
    backend = {"kind": "openai_http", "target": target, "request_format": "/v1/chat/completions"}
    if body:
        backend["extras"] = {"body": body}
    if prompts is None:
        data = {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    else:
        data, backend["max_tokens"] = {"kind": "json_file", "path": str(prompts)}, output_tokens
    return {"metadata": {"name": "specdec", "description": "bench.guidellm_sweep"},
            "spec": {"backend": backend, "profile": {"kind": "concurrent", "streams": streams}, "data": [data],
                     "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
                     "seed": {"kind": "static", "value": seed},
                     "constraints": [{"kind": "max_duration", "seconds": seconds}],
                     "outputs": [{"kind": "json", "path": str(report)}]}}


def summarise(report: dict) -> list[dict]:
    """Per benchmark of a guidellm JSON report: its streams and the figures of the table."""
    out = []
    for b in report["benchmarks"]:
        m = b["metrics"]
        ok = lambda name: m[name]["successful"]  # noqa: E731 (completed requests' distribution)
        out.append({"streams": b["config"]["strategy"]["streams"], "requests": m["request_totals"]["successful"],
                    "errored": m["request_totals"]["errored"], "output_tps": ok("output_tokens_per_second")["mean"],
                    "ttft_p50": ok("time_to_first_token_ms")["median"],
                    "ttft_p95": ok("time_to_first_token_ms")["percentiles"]["p95"],
                    "itl_p50": ok("inter_token_latency_ms")["median"],
                    "latency_p50": ok("request_latency")["median"]})
    return out


class Serve:
    """`specdec serve` on free ports, until close()."""

    def __init__(self, extra: list[str], logfile: Path) -> None:
        from specdec.serving.ports import free_port

        self.port, self.http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.lines: list[str] = []
        self._log = logfile.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.client.cli", "serve", "--port", str(self.port),
                                      "--http-port", str(self.http_port), *extra], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._log.write(line)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("ready:" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("specdec serve did not start:\n" + "".join(self.lines[-30:]))
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def chat_files(work: Path, levels: int, prompts: list[str]) -> list[Path]:
    """The chat requests as guidellm's JSON lines, a disjoint share for each level (guidellm starts a level's data
    from its first line, so one file would send a level the requests an earlier one sent: their answers are then in
    suffix decoding's tree of recent answers and their prompts in the prefix cache). A level that runs out ends early:
    632 requests share out to 210 a level for the default three, more than 30 s of 16 streams sends here (~100)."""
    paths, share = [], len(prompts) // levels
    for i in range(levels):
        path = work / f"chat-{i}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[i * share : (i + 1) * share]))
        paths.append(path)
    return paths


def run_row(row: str, args, streams: list[int], files: list[Path | None], tokenizer: str, work: Path) -> list[dict]:
    """The row's levels on one fresh server, each its own guidellm run over prompts no earlier level sent (chat: its
    file of requests, from chat_files; synthetic, None: prompts drawn from a seed of its own)."""
    serve = Serve(shlex.split(args.serve_args), work / f"serve-{row}.log")
    out = []
    try:
        serve.wait_ready()
        for level, (n, prompts) in enumerate(zip(streams, files)):
            name = f"{row}-{n}"
            report, spec, logfile = work / f"guidellm-{name}.json", work / f"scenario-{name}.json", work / f"guidellm-{name}.log"
            spec.write_text(json.dumps(scenario(serve.url, ROW_BODY[row], n, args.seconds, args.prompt_tokens,
                                                args.output_tokens, tokenizer, report, prompts, seed=level + 1), indent=1))
            log(f"{row}: guidellm at {n} streams for {args.seconds:.0f} s")
            with logfile.open("w") as sink:
                done = subprocess.run([args.guidellm, "run", "-c", str(spec), "--disable-console-interactive"], stdout=sink,
                                      stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                      timeout=args.seconds + GUIDELLM_SLACK_S)  # a level ends by itself
            if done.returncode != 0 or not report.exists():
                raise RuntimeError(f"guidellm failed ({done.returncode}): {logfile.read_text()[-3000:]}")
            out += summarise(json.loads(report.read_text()))
        return out
    finally:
        serve.close()


def plot(results: dict[str, list[dict]], path: Path, title: str) -> bool:
    """Output tokens/s and TTFT p50 against streams, a line per row (False: no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    levels = sorted({r["streams"] for rs in results.values() for r in rs})
    for row, label in (("specdec", "default request (hybrid, adaptive K)"), ("k0", "K = 0")):
        rs = results.get(row) or []
        streams = [r["streams"] for r in rs]
        left.plot(streams, [r["output_tps"] for r in rs], marker="o", label=label)
        right.plot(streams, [r["ttft_p50"] for r in rs], marker="o", label=label)
    for ax, what in ((left, "output tokens / s"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent streams (guidellm)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def section(argv: list[str], args, m: dict, chat: int, results: dict[str, list[dict]], wall_s: float,
            plot_link: str | None) -> str:
    """The run's section; m: machine_info(); chat: the distinct chat requests (--data chat)."""
    prompts_said = (f"a synthetic chat prompt of {args.prompt_tokens} tokens (the chat template adds its own), exactly "
                    f"{args.output_tokens} tokens out (EOS ignored)" if args.data == "synthetic" else
                    f"one of {chat} distinct chat requests (specdec.training.prompts), at most {args.output_tokens} tokens "
                    "out (EOS honoured)")
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: guidellm against the OpenAI API", "",
             f"Command: `python -m bench.guidellm_sweep{''.join(' ' + shlex.quote(a) for a in argv)}`", "",
             f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; git {m['git']}; guidellm {GUIDELLM_VERSION}; "
             f"wall {wall_s / 60:.1f} min",
             f"- `specdec serve`{' ' + args.serve_args if args.serve_args else ''} (a fresh one per row) and guidellm's "
             f"concurrent profile: each stream {prompts_said}, the next request when one ends, {args.seconds:.0f} s a "
             "level. Output tok/s is guidellm's server throughput (its mean over the level); TTFT, ITL (inter-token "
             "latency) and latency are over the level's completed requests.", ""]
    rows = [(row, r["streams"], f"{r['output_tps']:.1f}", r["requests"], r["errored"], f"{r['ttft_p50']:.0f} / {r['ttft_p95']:.0f}",
             f"{r['itl_p50']:.1f}", f"{r['latency_p50']:.2f}") for row, rs in results.items() for r in rs]
    lines += md_table(["row", "streams", "output tok/s", "requests", "errored", "TTFT p50 / p95 (ms)", "ITL p50 (ms)",
                       "latency p50 (s)"], rows)
    if "specdec" in results and "k0" in results:
        k0 = {r["streams"]: r["output_tps"] for r in results["k0"]}
        ratios = [f"{r['streams']}: {r['output_tps'] / k0[r['streams']]:.2f}x" for r in results["specdec"]
                  if k0.get(r["streams"])]
        lines += ["", "- The default request against K = 0 (output tok/s), by streams: " + ", ".join(ratios) + "."]
    if plot_link:
        lines += ["", f"![guidellm: output tokens/s and TTFT by streams]({plot_link})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not Path(args.guidellm).exists():
        print(f"bench.guidellm_sweep: no guidellm at {args.guidellm} (`make guidellm` installs {GUIDELLM_VERSION} "
              "in .venv-guidellm)", file=sys.stderr)
        return 2
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROW_BODY]
    if unknown:
        print(f"bench.guidellm_sweep: unknown rows {unknown} (choose from {list(ROW_BODY)})", file=sys.stderr)
        return 2
    streams = [int(s) for s in args.streams.split(",") if s]
    if args.tokenizer:
        tokenizer = args.tokenizer
    else:
        from specdec.models import default_draft

        tokenizer = default_draft()
    from specdec.training.prompts import chat_prompts

    chat = chat_prompts() if args.data == "chat" else []
    t0, results = time.monotonic(), {}
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        files = chat_files(Path(tmp), len(streams), chat) if chat else [None] * len(streams)
        for row in rows:
            results[row] = run_row(row, args, streams, files, tokenizer, Path(tmp))
    m = machine_info()
    out = bench_log() if args.out is None else Path(args.out) if args.out else None  # (--out '': no plot either)
    link = None
    if out is not None:
        png = plot_dir(out) / f"bench_guidellm_{args.data}.png"
        where = f"{m['cores']} cores, specdec serve{' ' + args.serve_args if args.serve_args else ''}"
        if plot(results, png, f"guidellm against the OpenAI API ({args.data} prompts, {where})"):
            link = os.path.relpath(png, out.resolve().parent)
    publish(section(argv, args, m, len(chat), results, time.monotonic() - t0, link), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
