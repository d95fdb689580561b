"""What scoring a prompt costs through the OpenAI API, as lm-eval's loglikelihood requests send it (token ids, `echo`,
`logprobs` 1, `max_tokens` 1, temperature 0), against the same request without the scores, and against transformers'
own forward over the same tokens (the peer: float32, the reference function, and bfloat16, another function), with
the served scores' largest difference from the float32 reference.

One fresh `specdec serve` (the default pair unless --serve-args say otherwise; one client), windows of the bench's
passages --lengths tokens long, each request a window no earlier one began with (so the prefix cache holds none),
plain and scored alternated; the peer runs after the server has stopped, in this process.

    python -m bench.scoring                             # 128- and 512-token prompts, 9 requests each
    python -m bench.scoring --lengths 1000 --requests 3
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bench_log, log, md_table, publish, section_head
from bench.guidellm_sweep import Serve
from bench.prompts import passages


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scoring", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="128,512", help="comma list of prompt lengths (tokens)")
    p.add_argument("--requests", type=int, default=9, help="timed requests of each kind per length (after one warm-up)")
    p.add_argument("--serve-args", default="", help="extra flags for `specdec serve` (one string)")
    p.add_argument("--threads", type=int, default=2, help="the peer's torch threads")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def windows(tokenizer, length: int, count: int) -> list[list[int]]:
    """count token windows of the passages, each starting elsewhere (no window a prefix of another's start)."""
    ids = tokenizer("\n\n".join(passages()))["input_ids"]
    while len(ids) < length + count * 7:
        ids = ids + ids
    return [ids[7 * i : 7 * i + length] for i in range(count)]


def served(url: str, prompts: dict[int, list[list[int]]]) -> tuple[dict[int, tuple[float, float]], dict]:
    """Per length, (plain, scored) median seconds a request; and the scores of the last window of each length."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    times, scores = {}, {}
    for length, windows_ in prompts.items():
        plain, scored = [], []
        for i, ids in enumerate(windows_):
            for kind, out in (("plain", plain), ("scored", scored)):
                t0 = time.perf_counter()
                r = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                              **({"echo": True, "logprobs": 1} if kind == "scored" else {}))
                if i:  # (the first of each kind warms up)
                    out.append(time.perf_counter() - t0)
                if kind == "scored":
                    scores[length] = (ids, r.choices[0].logprobs.token_logprobs[1 : len(ids)])
        times[length] = (statistics.median(plain), statistics.median(scored))
        log(f"[scoring] {length} tokens: plain {times[length][0] * 1e3:.0f} ms, scored {times[length][1] * 1e3:.0f} ms")
    return times, scores


def peer(target: str, prompts: dict[int, list[list[int]]], threads: int, scores: dict):
    """Per length and dtype, transformers' median seconds for a forward with log-softmax; and the served scores'
    largest difference from the float32 forward's."""
    import torch

    from specdec.models import ModelConfig, load_model

    torch.set_num_threads(threads)
    model = load_model(ModelConfig(target, device="cpu", dtype="float32"))
    times, worst = {}, 0.0
    for dtype in ("float32", "bfloat16"):
        m = model.to(getattr(torch, dtype))
        for length, windows_ in prompts.items():
            spent = []
            for i, ids in enumerate(windows_):
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    lp = m(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
                    if i:
                        spent.append(time.perf_counter() - t0)
                if dtype == "float32" and ids is scores[length][0]:
                    want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
                    worst = max(worst, max(abs(a - b) for a, b in zip(scores[length][1], want)))
            times[(length, dtype)] = statistics.median(spent)
    return times, worst


def main(argv=None) -> int:
    args = parse_args(argv)
    from specdec.models import default_target, load_tokenizer

    extra = shlex.split(args.serve_args)
    target = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--target-model"), None) or default_target()
    tokenizer = load_tokenizer(target)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    prompts = {n: windows(tokenizer, n, args.requests + 1) for n in lengths}
    serve = Serve(extra, Path(tempfile.mkdtemp(prefix="scoring-")) / "serve.log")
    try:
        serve.wait_ready()
        times, scores = served(serve.url, prompts)
    finally:
        serve.close()
    peer_times, worst = peer(target, prompts, args.threads, scores)
    rows = [(n, f"{times[n][0] * 1e3:.0f}", f"{times[n][1] * 1e3:.0f}", f"{(times[n][1] - times[n][0]) * 1e3:+.0f}",
             f"{peer_times[(n, 'float32')] * 1e3:.0f}", f"{peer_times[(n, 'bfloat16')] * 1e3:.0f}") for n in lengths]
    section = [*section_head("scoring a prompt", "bench.scoring", argv,
                             f"`specdec serve`{' ' + args.serve_args if args.serve_args else ''}, one client, the "
                             f"official `openai` client, token-id prompts of the bench's passages, {args.requests} "
                             f"requests of each kind per length (medians, alternated, after one warm-up); the peer: "
                             f"transformers' forward with log-softmax over the same tokens, {args.threads} threads, "
                             f"after the server stopped."),
               *md_table(["prompt tokens", "plain, max_tokens 1 (ms)", "scored: echo + logprobs 1 (ms)", "scoring adds",
                          "transformers float32 (ms)", "transformers bfloat16 (ms)"], rows), "",
               f"The served scores against the float32 forward's: largest difference **{worst:.1e}**.", ""]
    publish("\n".join(section), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
