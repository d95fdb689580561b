"""What drafting from the target's features costs: the target's step with and without the feature taps (the rows an
EAGLE-3 head reads, returned with each verdict), and a head's draft step at 1..64 sessions, on any device.

    python -m bench.head_cost                                   # the default target, a head of its shapes, the CPU
    python -m bench.head_cost --device cuda --dtype bfloat16    # on a GPU (the tapping step runs uncaptured there)
    python -m bench.head_cost --random-weights --target bench/shapes/llama-3-8b --device cuda --dtype bfloat16

The head has random weights of the target's shapes (a draft vocabulary of --draft-vocab tokens): its cost depends
on shapes, not values. A step with taps runs the mode's decoder eagerly (compile: uncompiled; cuda-graphs:
uncaptured), so on a GPU the taps' price is mostly the graphs it gives up (DESIGN.md, "Feature drafts").
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from bench.common import gpu_name, machine_info, publish
from bench.step_cost import PREFIX, make_runner, median_ms


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.head_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the default target)")
    p.add_argument("--random-weights", action="store_true", help="the target's shapes (config.json alone), random weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--mode", default="auto", help="the target's step mode")
    p.add_argument("--tokens", default="1,4,17", help="tokens per step (a decode, a verify of K = 3, of 16)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the head's draft vocabulary")
    p.add_argument("--quantize", default="auto", choices=("none", "auto", "q8_0"),
                   help="the head's weights as the draft tier serves them (--quantize; auto: Q8_0 blocks on the CPU kernel)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--curve-s", type=float, default=10.0, help="time budget of the head's cost curve")
    p.add_argument("--out", default=None, help="markdown file to append to (default: this month's log; '' = none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from specdec.engine.config import StepConfig, TierConfig
    from specdec.engine.eagle3 import default_aux_layers, head_config, random_head
    from specdec.engine.head_engine import HeadEngine
    from specdec.models import ModelConfig, default_target

    args = parse_args(argv)
    target = args.target or default_target()
    device = torch.device(args.device)
    runner, Feed, _, _ = make_runner(target, args.device, args.dtype, args.mode, 1, args.random_weights)
    config = runner.model.config
    depth = config.num_hidden_layers
    layers = tuple(min(max(i, 0), depth - 1) for i in default_aux_layers(depth))  # (a shallow test model's: clamped)
    taps = []
    for n in (int(x) for x in args.tokens.split(",")):
        def step(tapped: bool, n=n):
            runner.forward([Feed(0, PREFIX, [5] * n, n, taps=layers if tapped else None)])

        for tapped in (False, True):
            step(tapped)  # warm
        plain, tapped = median_ms(lambda: step(False), args.repeats, device), median_ms(lambda: step(True), args.repeats, device)
        taps.append((n, plain, tapped))
    embedding = runner.model.get_input_embeddings()
    head = random_head(head_config(config, min(args.draft_vocab, config.vocab_size), list(layers)), None,
                       dtype=getattr(torch, args.dtype), own_embedding=False).to(device)
    head._shared[0] = embedding  # the target's embedding, as a head shares it
    del runner
    engine = HeadEngine(TierConfig(ModelConfig(target, device=args.device, dtype=args.dtype),
                                   step=StepConfig(quantize=args.quantize)), head, config, [], "")
    t0 = time.perf_counter()
    curve = engine.measure_cost_curve(args.curve_s)
    curve_s = time.perf_counter() - t0

    info = machine_info()
    where = gpu_name(args.device) if device.type == "cuda" else f"{info['cpu']}, {info['cpus_allowed']} cores"
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC: the cost of drafting from the target's features", "",
             f"Command: `{shlex.join(['python', '-m', 'bench.head_cost', *(argv if argv is not None else sys.argv[1:])])}` "
             f"(commit {info['git']}; {where}; {args.dtype})", "",
             f"Target `{target}`{' (random weights of its shapes)' if args.random_weights else ''}: {config.num_hidden_layers} "
             f"layers, hidden {config.hidden_size}, step mode {runner_mode(args)}; taps of layers {list(layers)} "
             f"(rows of {6 * config.hidden_size:,} bytes). One session over {PREFIX} cached tokens; median of {args.repeats} (ms):", "",
             "| tokens | step | step with the taps | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {plain:.2f} | {tapped:.2f} | {tapped / plain:.2f}x |" for n, plain, tapped in taps]
    lines += ["", f"A head of the target's shapes (draft vocabulary {head.draft_vocab_size:,}, random weights; products on "
              f"{f'the skinny GEMM, --quantize {args.quantize}' if engine.skinny else 'the library'}): one draft step of b sessions, each over 32 "
              f"cached entries, then their LM head (best of 3; {curve_s:.1f} s):", "",
              "| sessions | ms | ms per session |", "|---|---|---|"]
    lines += [f"| {b} | {ms:.2f} | {ms / b:.2f} |" for b, _, ms in curve]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


def runner_mode(args) -> str:
    from specdec.engine.step import resolve_mode

    import torch

    return resolve_mode(args.mode, torch.device(args.device))


if __name__ == "__main__":
    sys.exit(main())
