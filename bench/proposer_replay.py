"""The model-free proposers replayed on the target's own greedy outputs: tokens per target forward, offline.

    python -m bench.proposer_replay                       # ~3 min: template (20) + grounded (6), 128 tokens
    python -m bench.proposer_replay --outputs o.json      # keep the outputs (reused if the file exists)
    python -m bench.proposer_replay --workloads open      # the held-out chat prompts (their outputs added to the file)

Greedy speculative decoding commits exactly the target's greedy output, so a proposer's acceptance on a
workload can be computed without serving it: generate the output once (transformers `generate`,
greedy), then replay it round by round, each round proposing from the committed tokens and accepting
the longest prefix (or tree path) that matches the output, plus one token. No timing enters the count,
so it is exact and repeatable, and a proposer setting can be compared with another in seconds. The
template and open workloads are replayed in request order with the coordinator's shared suffix tree (each
output joins it after its request, as in serving); grounded with the shared tree off (as bench.run does).

Every round proposes the whole chain (or tree) the proposer offers, up to K; the serving policy may pick
fewer. Beside tokens per forward the table gives tokens per unit of verify cost: the same rounds charged
the measured time of scoring their nodes + 1 tokens (the packed target step, this run, relative to one
token), the speed-up over K = 0 that the rounds alone allow (no proposer, network or coordinator time).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from bench.common import bench_log, machine_info
from bench.prompts import prompts_for
from coordinator.proposers.lookup import LookupConfig, LookupStrategy
from coordinator.proposers.suffix import SuffixCache, SuffixConfig, SuffixStrategy
from coordinator.proposers.token_tree import match

REPO = Path(__file__).resolve().parents[1]
COST_TOKENS = (1, 2, 3, 5, 9, 17)
# (label, SuffixConfig changes): ArcticInference's chain limit (m tokens for an m-token match), ours, others.
SETTINGS = [("suffix, limit m (ArcticInference)", dict(max_spec_factor=1.0, max_spec_offset=0.0)),
            ("suffix, limit 2m", dict(max_spec_factor=2.0, max_spec_offset=0.0)),
            ("suffix, limit 2m + 2 (default)", dict(max_spec_factor=2.0, max_spec_offset=2.0)),
            ("suffix, limit 3m", dict(max_spec_factor=3.0, max_spec_offset=0.0)),
            ("suffix, limit 4m + 4", dict(max_spec_factor=4.0, max_spec_offset=4.0)),
            ("suffix, matches of 2+ tokens", dict(min_match=2)),
            ("suffix, matches of 3+ tokens", dict(min_match=3))]


def greedy_outputs(target: str, workloads: dict[str, int], n_new: int) -> list[dict]:
    import torch

    from specdec.models import ModelConfig, eos_token_ids, load_model, load_tokenizer

    tok = load_tokenizer(target)
    model = load_model(ModelConfig(target)).eval()
    eos = eos_token_ids(model, tok)
    out = []
    for wl, n in workloads.items():
        for p in prompts_for(wl, n or None):
            enc = tok.apply_chat_template(p.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.inference_mode():
                g = model.generate(**enc, max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            ids = enc["input_ids"][0].tolist()
            out.append({"id": p.id, "workload": wl, "prompt": ids, "output": g[0, len(ids):].tolist()})
            print(f"[replay] {p.id}: {len(out[-1]['output'])} tokens", flush=True)
    return out


def verify_curve(target: str, repeats: int = 9) -> dict[int, float]:
    """Time of one packed target forward scoring T tokens after a 100-token prefix, relative to T = 1."""
    import torch

    from bench.step_cost import PREFIX, make_runner, median_ms

    runner, Feed, _, _ = make_runner(target, "cpu", "float32", "packed", 1)
    ms = {}
    for t in COST_TOKENS:
        step = lambda: runner.forward([Feed(0, PREFIX, [5] * t, t)])  # noqa: E731
        step()  # warm-up
        ms[t] = median_ms(step, repeats, torch.device("cpu"))
    return {t: v / ms[1] for t, v in ms.items()}


def cost(curve: dict[int, float], tokens: int) -> float:
    """Linear interpolation of the curve (held flat past its last point's slope)."""
    ts = sorted(curve)
    for a, b in zip(ts, ts[1:]):
        if tokens <= b:
            return curve[a] + (curve[b] - curve[a]) * (max(tokens, a) - a) / (b - a)
    a, b = ts[-2], ts[-1]
    return curve[b] + (curve[b] - curve[a]) * (tokens - b) / (b - a)


def replay(records: list[dict], propose, shared: SuffixCache | None, max_k: int, curve: dict[int, float]) -> dict:
    """propose(session, k) -> (tokens, parents) per round; session = make(prompt) state. Returns the totals."""
    tokens = rounds = nodes = 0
    verify = 0.0
    for rec in records:
        prompt, out = rec["prompt"], rec["output"]
        session = propose.start(prompt)
        i = 0
        while i < len(out):
            k = min(max_k, len(out) - i - 1)
            drafts, parents = propose.offer(session, k) if k > 0 else ([], [])
            if parents:
                n = len(match(drafts, parents, out[i:]))
            else:
                n = 0
                while n < len(drafts) and drafts[n] == out[i + n]:
                    n += 1
            propose.commit(session, out[i : i + n + 1])
            i += n + 1
            rounds += 1
            nodes += len(drafts)
            verify += cost(curve, len(drafts) + 1)
        tokens += len(out)
        if shared is not None:
            shared.add(prompt[-shared.config.cache_context :] + out)
    return {"tok_per_fwd": tokens / rounds, "nodes_per_round": nodes / rounds, "per_cost": tokens / verify}


class SuffixReplay:
    def __init__(self, config: SuffixConfig, cache: SuffixCache | None, tree_nodes: int) -> None:
        self.config, self.cache, self.tree_nodes = config, cache, tree_nodes

    def start(self, prompt):
        s = SuffixStrategy(self.config, self.cache, prompt)
        asyncio.run(s.start())
        return s

    def offer(self, s: SuffixStrategy, k: int):
        p = s.offer(k, self.tree_nodes)
        return p.tokens, p.parents

    @staticmethod
    def commit(s, tokens) -> None:
        s.commit(tokens)


class LookupReplay:
    def start(self, prompt):
        s = LookupStrategy(LookupConfig(), prompt)
        asyncio.run(s.start())
        return s

    @staticmethod
    def offer(s: LookupStrategy, k: int):
        p = s.offer(k)
        return p.tokens, p.parents

    @staticmethod
    def commit(s, tokens) -> None:
        s.commit(tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proposer_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--grounded-prompts", type=int, default=6)
    p.add_argument("--workloads", default="template,grounded",
                   help="comma list of template, grounded, open (open: the 8 held-out chat prompts in order, the shared "
                        "tree on, as served)")
    p.add_argument("--max-k", type=int, default=8, help="the most drafts per round (the coordinator's default cap)")
    p.add_argument("--outputs", default=None, help="JSON file of the greedy outputs: written, or read if it exists")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    args = p.parse_args(argv)
    from specdec.models import default_target

    target = args.target or default_target()
    t0 = time.time()
    path = Path(args.outputs) if args.outputs else None
    reused = path is not None and path.exists()
    workloads = args.workloads.split(",")
    records = json.loads(path.read_text()) if reused else []
    missing = {wl: args.grounded_prompts if wl == "grounded" else 0 for wl in workloads
               if not any(r["workload"] == wl for r in records)}
    if missing:
        records += greedy_outputs(target, missing, args.max_new_tokens)
        if path is not None:
            path.write_text(json.dumps(records))
    curve = verify_curve(target)
    machine = machine_info()
    rows = []
    for wl in workloads:
        recs = [r for r in records if r["workload"] == wl]
        shared = wl != "grounded"
        rows.append((wl, "prompt lookup", replay(recs, LookupReplay(), None, args.max_k, curve)))
        for label, change in SETTINGS:
            for tree in (0, 8):
                cfg = dataclasses.replace(SuffixConfig(), **change)
                cache = SuffixCache(cfg) if shared else None
                name = label + (f", tree of {tree} nodes" if tree else "")
                rows.append((wl, name, replay(recs, SuffixReplay(cfg, cache, tree), cache, args.max_k, curve)))
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: suffix decoding's chain limit, replayed offline",
             "", f"Command: `{shlex.join(['python', '-m', 'bench.proposer_replay', *(sys.argv[1:] if argv is None else argv)])}` "
             f"({time.time() - t0:.0f} s"
             + (", the outputs read from an earlier run's file" if reused else "") + "). The target's greedy outputs "
             f"({args.max_new_tokens} tokens at most; template: all {sum(r['workload'] == 'template' for r in records)} "
             f"requests in order, the shared suffix tree on; grounded: the first {args.grounded_prompts} prompts, the "
             f"shared tree off; open: its prompts in order, the shared tree on; these here: {args.workloads}) replayed round by round, each round proposing the whole chain or tree offered, K <= "
             f"{args.max_k}. Verify cost: the packed target step scoring T tokens, x one token, measured in this run: "
             + ", ".join(f"T={t} {v:.2f}" for t, v in curve.items()) + f". Machine: {machine['cpu']}, {machine['cores']} "
             f"cores; git {machine['git']}.", "",
             "| workload | proposer | tokens / target forward | drafts scored / round | tokens / verify cost (x K = 0) |",
             "|---|---|---|---|---|"]
    for wl, name, r in rows:
        lines.append(f"| {wl} | {name} | {r['tok_per_fwd']:.2f} | {r['nodes_per_round']:.2f} | {r['per_cost']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:  # '' = print only
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
