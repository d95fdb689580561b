"""Per-round cost of suffix decoding in the coordinator (no model, no network): a micro-benchmark.

    python -m bench.suffix_cost                  # ~20 s on one core
    python -m bench.suffix_cost --entries 1024 --rounds 2000

Replays real token streams (the bench prompts, tokenized with the target's tokenizer) as if they
were generated, a few tokens per round, and times what the coordinator does each round: commit the
round's tokens to the session's tree, propose from the session's tree and the shared tree, and the
policy's choice among the strategies (their predictions included). Two scenarios:

* grounded: the output copies its prompt (long matches in the session's own tree);
* template: the shared tree holds `--entries` earlier answers to the same JSON template and the
  session writes one more (long matches in the shared tree, the worst case for its walk).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench.prompts import PROMPTS
from coordinator.proposers.lookup import LookupConfig, LookupStrategy
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.strategy import Ask
from coordinator.proposers.suffix import SuffixCache, SuffixConfig, SuffixStrategy
from coordinator.proposers.tier_cost import TierCost

NAMES = ["Maria Lopez", "Tom Becker", "Priya Nair", "Kenji Watanabe", "Claire Dubois", "Samuel Okafor"]
CITIES = ["Valencia", "Hamburg", "Toronto", "Osaka", "Lyon", "Lagos"]
JOBS = ["nurse", "head baker", "software engineer", "history teacher", "firefighter", "taxi driver"]


def json_answer(rng: random.Random) -> str:
    """An answer of the template workload's shape (what the target writes for it)."""
    person = {"name": rng.choice(NAMES), "age": rng.randint(18, 70), "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
    return "JSON:\n" + json.dumps(person, indent=2)


def percentiles(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs):6.1f} us, p90 {xs[int(0.9 * len(xs))]:6.1f} us, max {xs[-1]:7.1f} us"


def replay(label: str, tok, prompt: str, output: str, cache: SuffixCache, cfg: SuffixConfig, rounds: int, rng) -> None:
    prompt_ids = tok(prompt)["input_ids"]
    out_ids = tok(output)["input_ids"]
    commit, own, both, choose, index = [], [], [], [], []
    policy, target = Policy(PolicyConfig()), TierCost()
    while len(commit) < rounds:
        t0 = time.perf_counter()
        sp = SuffixStrategy(cfg, cache)
        sp.tree.extend(sp.SEQ, prompt_ids)
        index.append((time.perf_counter() - t0) * 1e6 / len(prompt_ids))
        own_only = SuffixStrategy(cfg, cache, shared=False)
        own_only.tree = sp.tree
        lookup = LookupStrategy(LookupConfig(), prompt_ids)
        lookup.index.extend(prompt_ids)  # (its start(), which the drafter runs beside the first round)
        i = 0
        while i < len(out_ids) and len(commit) < rounds:
            n = rng.randint(1, 4)  # tokens committed by the round
            chunk = out_ids[i : i + n]
            i += n
            t0 = time.perf_counter()
            sp.commit(chunk)
            t1 = time.perf_counter()
            own_only.offer(8)
            t2 = time.perf_counter()
            sp.offer(8)
            t3 = time.perf_counter()
            lookup.commit(chunk)
            policy.choose([sp, lookup], Ask(8, 0, False, True, target.verify_ms(8), target.batch))
            t4 = time.perf_counter()
            commit.append((t1 - t0) * 1e6)
            own.append((t2 - t1) * 1e6)
            both.append((t3 - t2) * 1e6)
            choose.append((t4 - t3) * 1e6)
    print(f"{label}: prompt {len(prompt_ids)} tokens, output {len(out_ids)} tokens, shared tree {cache.entries} outputs "
          f"({cache.estimated_bytes / 2**20:.1f} MiB est.)")
    print(f"  index the prompt, per token:       {statistics.median(index):6.1f} us")
    print(f"  commit the round's 1-4 tokens:     {percentiles(commit)}")
    print(f"  propose, own tree only:            {percentiles(own)}")
    print(f"  propose, own + shared tree:        {percentiles(both)}")
    print(f"  lookup + policy choice:            {percentiles(choose)}")
    total = [a + b + c for a, b, c in zip(commit, both, choose)]
    print(f"  per round, all of the above:       {percentiles(total)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.suffix_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=SuffixConfig.cache_entries, help="outputs in the shared tree (template scenario)")
    p.add_argument("--rounds", type=int, default=2000, help="rounds timed per scenario")
    args = p.parse_args(argv)
    from specdec.models import default_target, load_tokenizer

    tok = load_tokenizer(default_target())
    rng = random.Random(0)
    cfg = SuffixConfig()
    grounded = next(x for x in PROMPTS if x.id == "grounded-rewrite-lighthouse").content
    passage = grounded.split('"""')[1]
    replay("grounded (output copies the prompt)", tok, grounded, passage, SuffixCache(cfg), cfg, args.rounds, rng)
    cache = SuffixCache(cfg)
    t0 = time.perf_counter()
    answers = [tok(json_answer(rng))["input_ids"] for _ in range(args.entries)]
    for ids in answers:
        cache.add(ids)
    n = sum(map(len, answers))
    print(f"(shared tree: {args.entries} answers, {n} tokens, inserted at {(time.perf_counter() - t0) * 1e6 / n:.1f} us per token)")
    template = next(x for x in PROMPTS if x.workload == "template").content
    replay("template (shared tree warm)", tok, template, json_answer(rng), cache, cfg, args.rounds, rng)


if __name__ == "__main__":
    main()
