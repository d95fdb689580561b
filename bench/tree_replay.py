"""Offline replay of the draft model's token trees: how many tokens a round can commit, per tree shape.

The target generates each held-out open prompt's answer greedily; then every position of that answer is
taken as a round's start, and the draft grows its trees there exactly as its engine does
(specdec.engine.tree_growth.Growth: b children per expanded node, the b likeliest nodes of each level
expanded, greedy trees dynamic: grown past the budget, the N likeliest kept). A greedy round commits the
longest root path that matches the target's answer, plus one token; the table gives that mean (tokens
per target forward, had every round been such a tree) per shape, beside two references: the chain
(b = 1), and an exhaustive best-first tree (expand the likeliest node of the whole tree, one node at a
time), which bounds what any tree of N nodes from this draft can do.

No services and no timing: it measures the draft's agreement with the target, which caps what trees can
return (the end-to-end rows of bench.run measure speed). Every position is a round start here, so the
figures run ~0.1-0.2 above a real run's tokens per forward (whose rounds start after the accepted paths
and whose last round is cut at the token limit).

Run with ``python -m bench.tree_replay`` (a few minutes on 2 cores); it appends a section to
the month's log in docs/bench-logs/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import shlex
import sys
import time

from bench.common import append_section, bench_log, git_commit, log, machine_info, md_table

# (b, D, N): chains (b = 1), the fixed top-2 shape the draft grew before trees were dynamic (b = 2, every
# candidate kept), and dynamic trees of b = 4 at several depths and budgets.
SHAPES = [(1, 1, 1), (1, 2, 2), (1, 4, 4), (2, 2, 6), (2, 3, 8)] + [
    (4, d, n) for d in (2, 3, 4, 6) for n in (4, 8, 16)]
BUDGETS = [4, 8, 16]  # of the exhaustive best-first trees


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tree_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="open prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--best-first", type=int, default=16, help="largest exhaustive best-first tree (0 = none)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--out", default=str(bench_log()))
    return p.parse_args(argv)


class DraftAt:
    """The draft's distribution after a committed prefix and a path below it, cached per path."""

    def __init__(self, model, prefix: list[int], top: int = 8) -> None:
        self.model, self.prefix, self.top, self.cache = model, prefix, top, {}

    def __call__(self, path: tuple[int, ...]):
        import torch

        if path not in self.cache:
            with torch.inference_mode():
                logits = self.model(torch.tensor([self.prefix + list(path)])).logits[0, -1].float()
            probs, ids = torch.softmax(logits, -1).topk(self.top)
            self.cache[path] = (ids, probs)
        return self.cache[path]


def grow(dist_at: DraftAt, b: int, depth: int, budget: int):
    """The draft engine's greedy growth (the same Growth code) of a tree with this shape."""
    from specdec.engine.tree_growth import GREEDY, Growth, TreeShape

    g = Growth(TreeShape(budget, depth, b, GREEDY), -1, 0, dynamic=True)
    level = g.expand(-1, dist_at(()), 0, greedy_logits=True)
    while True:
        nodes = g.to_expand(level)
        if not nodes:
            g.keep_best()
            return [g.path(i) for i in range(len(g.tokens))]
        level = [c for n in nodes for c in g.expand(n, dist_at(g.path(n)), 0, greedy_logits=True)]


def best_first(dist_at: DraftAt, budget: int) -> list[tuple[int, ...]]:
    """The N likeliest paths of the draft's whole tree, found one expansion at a time."""
    heap = [(-p, (t,)) for t, p in zip(*(x.tolist() for x in dist_at(())))]
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < budget:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        if len(paths) < budget:
            for t, p in zip(*(x.tolist() for x in dist_at(path))):
                heapq.heappush(heap, (neg * p, path + (t,)))
    return paths


def committed(paths, truth: list[int]) -> int:
    """Tokens a greedy round commits: the longest path that the target's answer spells, + 1."""
    return 1 + max([len(p) for p in paths if list(p) == truth[: len(p)]] + [0])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench.prompts import prompts_for
    from specdec.models import ModelConfig, default_draft, default_target, eos_token_ids, load_model, load_tokenizer

    target_path, draft_path = args.target or default_target(), args.draft or default_draft()
    tok = load_tokenizer(target_path)
    target, draft = load_model(ModelConfig(target_path)).eval(), load_model(ModelConfig(draft_path)).eval()
    eos = eos_token_ids(target, tok)
    sums: dict[tuple, float] = {}
    rounds, t0 = 0, time.perf_counter()
    for prompt in prompts_for("open", args.prompts or None):
        enc = tok.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = target.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos[0])[0].tolist()
        start = enc["input_ids"].shape[1]
        for i in range(start, len(out) - 1):
            dist_at, truth = DraftAt(draft, out[:i]), out[i:]
            for b, depth, n in SHAPES:
                key = ("chain" if b == 1 else "tree", b, depth, n)
                sums[key] = sums.get(key, 0.0) + committed(grow(dist_at, b, depth, n), truth)
            for n in BUDGETS:
                if n <= args.best_first:
                    sums[("best-first", 0, 0, n)] = sums.get(("best-first", 0, 0, n), 0.0) + committed(
                        best_first(dist_at, n), truth)
            rounds += 1
        log(f"[tree_replay] {prompt.id}: {rounds} round starts, {time.perf_counter() - t0:.0f}s")
    rows = []
    order = {"chain": 0, "tree": 1, "best-first": 2}
    for (kind, b, depth, n), total in sorted(sums.items(), key=lambda x: (order[x[0][0]], x[0][1:])):
        shape = f"depth {depth}" if kind == "chain" else ("exhaustive" if kind == "best-first" else f"b = {b}, depth {depth}")
        rows.append((kind, shape, n, f"{total / rounds:.2f}"))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python -m bench.tree_replay " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    m = machine_info()
    lines = [f"## {stamp}: token-tree replay (draft's trees against the target's greedy answers)", "",
             f"Command: `{cmd.strip()}` ({time.perf_counter() - t0:.0f} s; commit {git_commit()}; {m.get('cpu', '')})", "",
             f"{rounds} round starts over {args.prompts or 'all'} open prompts ({args.max_new_tokens} greedy tokens "
             "each); tokens a greedy round would commit (accepted path + 1), mean over the starts. "
             "Trees: b children per expanded node, b nodes expanded per level, the N likeliest kept (dynamic). "
             "Exhaustive: the N likeliest paths of the draft's whole tree (the most any N-node tree can hold).", "",
             *md_table(["kind", "shape", "nodes N", "tokens / round"], rows), ""]
    append_section("\n".join(lines), args.out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
