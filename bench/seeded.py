"""What a seed costs: seeded sampled requests (verified by the keyed race, so that the seed fixes the output) against
unseeded ones (rejection sampling), through the services as a user runs them.

Per row a fresh cluster (`LocalPipeline`, the default pair unless --target / --draft say otherwise, on this machine's
shared cores), the bench's open prompts, sampled at --temperature: one client in sequence with the default request,
then a fixed K from the draft model (its acceptance: the race's price), then a burst of --burst clients at once;
seeded and unseeded rows alternated --repeats times. A seeded row also generates each prompt at K = 0 and counts the
prompts whose three outputs (K = 0, the fixed K, the default) are one. Last, in this process, the target's draw per
row on its vocabulary: the race (specdec.math.race) against the inverse CDF rejection sampling ends with.

    python -m bench.seeded                  # 2 repeats, 6 prompts, 48 tokens, bursts of 16
    python -m bench.seeded --repeats 1 --burst 4 --prompts 2 --max-new-tokens 16 --target DIR --draft DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from bench.common import bench_log, log, md_table, publish, section_head
from bench.prompts import prompts_for


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.seeded", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the default pair's)")
    p.add_argument("--draft", default=None, help="draft model (default: the default pair's)")
    p.add_argument("--repeats", type=int, default=2, help="seeded and unseeded rows, alternated, each this many times")
    p.add_argument("--prompts", type=int, default=6, help="open prompts a client generates in sequence")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--k", type=int, default=2, help="the fixed K whose acceptance is measured")
    p.add_argument("--burst", type=int, default=16, help="clients starting together")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def generate(client, prompt: str, seed: int | None, args, out: list, **kw) -> None:
    """One request; appends (tokens, accepted drafts, drafts, mean K, token ids)."""
    g = client.generate(prompt=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                        temperature=args.temperature, **({"seed": seed} if seed is not None else {}), **kw)
    s = g.stats
    out.append((len(g.token_ids), s["accepted_tokens"], s["draft_tokens"], s.get("mean_num_speculative_tokens", 0.0),
                g.token_ids))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row(seeded: bool, args, prompts: list[str], target: str, draft: str) -> dict:
    """One fresh cluster's figures for seeded (or unseeded) requests."""
    from specdec.client import Client
    from specdec.client.local import LocalPipeline, LocalPipelineConfig, sharing

    seed = (lambda i: 1000 + i) if seeded else (lambda i: None)
    config = LocalPipelineConfig(target_model=target, draft_model=draft, coordinator_args=["--log-level", "warning"],
                                 **sharing("cpu"))
    with LocalPipeline(config) as pipe, Client(pipe.address) as client:
        default, fixed, alone, burst = [], [], [], []
        wall = timed(lambda: [generate(client, p, seed(i), args, default) for i, p in enumerate(prompts)])
        fixed_wall = timed(lambda: [generate(client, p, seed(i), args, fixed, num_speculative_tokens=args.k,
                                             proposer="draft") for i, p in enumerate(prompts)])
        if seeded:
            for i, p in enumerate(prompts):
                generate(client, p, seed(i), args, alone, num_speculative_tokens=0)
        clients = [Client(pipe.address) for _ in range(args.burst)]
        threads = [threading.Thread(target=generate, args=(clients[i], prompts[i % len(prompts)], seed(100 + i), args,
                                                           burst)) for i in range(args.burst)]
        burst_wall = timed(lambda: ([t.start() for t in threads], [t.join() for t in threads]))
        for c in clients:
            c.close()
    result = {"default": sum(r[0] for r in default) / wall, "mean_k": statistics.mean(r[3] for r in default),
              "fixed": sum(r[0] for r in fixed) / fixed_wall,
              "acceptance": sum(r[1] for r in fixed) / max(sum(r[2] for r in fixed), 1),
              "burst": sum(r[0] for r in burst) / burst_wall, "burst_k": statistics.mean(r[3] for r in burst)}
    if seeded:
        result["one"] = sum(a[4] == f[4] == d[4] for a, f, d in zip(alone, fixed, default))
    log(f"[seeded] {'seeded' if seeded else 'unseeded'}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
    return result


def draw_cost(vocab: int, rows: int = 3, repeats: int = 50) -> tuple[float, float]:
    """(race, inverse CDF) median ms for `rows` rows of a `vocab`-token distribution, one thread."""
    import torch

    from specdec.math.draw import inverse_cdf
    from specdec.math.keyed_draws import split_seeds
    from specdec.math.race import race_draw

    torch.set_num_threads(1)
    p = torch.softmax(4 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)), dim=-1)
    seeds, positions, u = split_seeds([7] * rows, "cpu"), torch.arange(rows), torch.rand(rows, dtype=torch.float64)

    def median_ms(fn) -> float:
        fn()
        return statistics.median(timed(fn) for _ in range(repeats)) * 1e3

    return median_ms(lambda: race_draw(p, seeds, positions)), median_ms(lambda: inverse_cdf(p, u))


def main(argv=None) -> int:
    args = parse_args(argv)
    from specdec.models import default_draft, default_target, load_tokenizer

    target, draft = args.target or default_target(), args.draft or default_draft()
    prompts = [p.content for p in prompts_for("open", None)][: args.prompts]
    rows: dict[bool, list[dict]] = {True: [], False: []}
    for rep in range(args.repeats):
        for seeded in (True, False) if rep % 2 == 0 else (False, True):
            rows[seeded].append(row(seeded, args, prompts, target, draft))
    vocab = len(load_tokenizer(target))
    race_ms, cdf_ms = draw_cost(vocab)

    def cells(kind: bool, key: str, fmt: str) -> str:
        return " / ".join(format(r[key], fmt) for r in rows[kind])

    table = [(name, cells(True, key, fmt), cells(False, key, fmt)) for name, key, fmt in (
        ("one client, the default request (tok/s)", "default", ".1f"), ("its mean K", "mean_k", ".2f"),
        (f"one client, K = {args.k} from the draft model (tok/s)", "fixed", ".1f"),
        (f"its acceptance (K = {args.k})", "acceptance", ".3f"),
        (f"a burst of {args.burst}, the default request (tok/s)", "burst", ".1f"), ("its mean K", "burst_k", ".2f"))]
    mean = lambda kind, key: statistics.mean(r[key] for r in rows[kind])
    section = [*section_head("seeded requests (the keyed race)", "bench.seeded", argv,
                             f"the pair {target} / {draft}, three processes on shared cores (`LocalPipeline`), a fresh "
                             f"cluster per row, {len(prompts)} open prompts, temperature {args.temperature}, "
                             f"{args.max_new_tokens} tokens; rows alternated, one figure per repeat."),
               *md_table(["", "seeded (the keyed race)", "unseeded (rejection sampling)"], table), "",
               f"Seeded against unseeded, by the means: the default request **{mean(True, 'default') / mean(False, 'default'):.2f}x**, "
               f"the burst **{mean(True, 'burst') / mean(False, 'burst'):.2f}x**, the acceptance at K = {args.k} "
               f"**{mean(True, 'acceptance') / max(mean(False, 'acceptance'), 1e-9):.2f}x**. One output at K = 0, "
               f"K = {args.k} and the default: **{min(r['one'] for r in rows[True])}/{len(prompts)}** prompts in every "
               f"seeded row.", "",
               f"The target's draw, {3} rows of {vocab} tokens, one thread: the race {race_ms:.3f} ms, the inverse CDF "
               f"{cdf_ms:.3f} ms.", ""]
    publish("\n".join(section), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
