"""What row attention costs a prompt's prefill: the target's prefill time with every chain on specdec's row
attention kernel (the default on an AVX-512 or AVX2 CPU in float32, so that a prompt split anyhow gives the same bits:
docs/DESIGN.md, Step cost) against its prefill chunks on PyTorch's attention (what ran before), interleaved in
one process, the prompt fed in --chunk-token chunks as the tier feeds it.

    python -m bench.prefill_cost                       # the default target, 300 and 1500 tokens, 2 threads
    python -m bench.prefill_cost --threads 1 --lengths 1500
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time

from bench.common import bench_log, git_commit, machine_info, md_table, publish


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the default pair's)")
    p.add_argument("--lengths", default="300,1500", help="comma list of prompt lengths (tokens)")
    p.add_argument("--chunk-tokens", type=int, default=128, help="tokens per prefill step (the tiers' --prefill-chunk)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best of each is reported")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from specdec.engine import attention
    from specdec.engine.config import StepConfig
    from specdec.engine.gguf_weights import load_model
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.runner import Feed, ModelRunner
    from specdec.models import ModelConfig, default_target

    torch.set_num_threads(args.threads)
    target = args.target or default_target()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    model = load_model(ModelConfig(target, device="cpu", dtype="float32"), blocks=True)
    runner = ModelRunner(model, SlotKVCache(KVGeometry.of(model), 1, max(lengths) + 8), StepConfig(mode="packed"))
    if not runner.row_attention:
        print("prefill_cost: row attention does not apply here (an AVX-512 or AVX2 CPU in float32 only)", file=sys.stderr)
        return 2
    rows_visibility = attention.row_visibility

    def torch_chunks(cached: int, new: int, hidden):  # what ran before: chunks over 32 tokens on PyTorch's attention
        return None if not hidden and new > attention.GROUP_MAX_NEW else rows_visibility(cached, new, hidden)

    def prefill(n: int) -> float:
        prompt = [(7 * i + 3) % 40000 for i in range(n)]
        t0 = time.perf_counter()
        for start in range(0, n, args.chunk_tokens):
            runner.forward([Feed(0, start, prompt[start : start + args.chunk_tokens], 1)])
        return time.perf_counter() - t0

    rows = []
    try:
        for n in lengths:
            best = {"rows": float("inf"), "torch": float("inf")}
            for _ in range(args.repeats):
                for name, visibility in (("torch", torch_chunks), ("rows", rows_visibility)):
                    attention.row_visibility = visibility
                    best[name] = min(best[name], prefill(n))
            rows.append((n, f"{best['rows']:.2f}", f"{best['torch']:.2f}", f"{best['rows'] / best['torch']:.2f}x"))
            print(f"[prefill_cost] {n} tokens: rows {best['rows']:.2f}s, PyTorch's {best['torch']:.2f}s", file=sys.stderr)
    finally:
        attention.row_visibility = rows_visibility
    m = machine_info()
    command = "python -m bench.prefill_cost " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    section = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: prefill on row attention", "",
               f"Command: `{command.strip()}`. Machine: {m['cpu']}, {m['cores']} cores, {args.threads} torch threads; "
               f"git {git_commit()}; target `{target}` (packed, GGUF blocks), the prompt in {args.chunk_tokens}-token "
               f"chunks, best of {args.repeats} interleaved runs.", "",
               *md_table(["prompt tokens", "row attention (s)", "chunks on PyTorch's attention (s)", "rows / PyTorch's"], rows)]
    text = "\n".join(section)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
