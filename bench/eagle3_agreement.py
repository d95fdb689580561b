"""An EAGLE-3 head's greedy agreement with its target on the held-out open prompts, beside the draft model's.

The target answers each open benchmark prompt (bench/prompts.py; never trained on: the trainer's prompts are
specdec/training/prompts.py) greedily; at every answer position the head drafts a greedy chain from the
target's features and the true tokens (specdec.training.eagle3.ttt_outputs, what it computes when drafting
over its cache). The table gives, per draft step j, the share of positions whose first j + 1 drafts all match
the target's answer, and the tokens a greedy chain of K would commit per target forward had every position
been a round start (1 + the mean matching prefix, capped at K; runs ~0.1-0.2 above a real run, as
bench.tree_replay's). The draft model's per-token agreement on the same answers is the peer. No services and
no timing: agreement only.

Run with ``python -m bench.eagle3_agreement --head DIR`` (~1-3 min on 2 cores); it appends a section to
the month's run log (docs/bench-logs/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time

from bench.common import append_section, git_commit, log, machine_info, md_table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.eagle3_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="the EAGLE-3 head checkpoint directory")
    p.add_argument("--target", default=None, help="default: the default target")
    p.add_argument("--draft", default=None, help="the peer draft model (default: the default draft)")
    p.add_argument("--prompts", type=int, default=0, help="open prompts (0: all 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="draft steps (the longest chain scored)")
    p.add_argument("--no-write", action="store_true", help="print the section instead of appending it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench.prompts import prompts_for
    from specdec.engine.eagle3 import load_head
    from specdec.models import ModelConfig, default_draft, default_target, load_model, load_tokenizer
    from specdec.training.eagle3 import ttt_outputs
    from specdec.engine.config import TierConfig
    from specdec.training.eagle3_data import generated

    t0 = time.perf_counter()
    target_path, draft_path = args.target or default_target(), args.draft or default_draft()
    tok = load_tokenizer(target_path)
    target, draft = load_model(ModelConfig(target_path)), load_model(ModelConfig(draft_path))
    head = load_head(args.head, target.config, target.get_input_embeddings(), dtype=torch.float32)
    layers = head.layer_ids(target.config.num_hidden_layers)
    prompts = [p.content for p in prompts_for("open", args.prompts or None)]
    data = generated(TierConfig(ModelConfig(target_path)), tok, prompts, layers, max_new_tokens=args.max_new_tokens)
    k = args.steps
    prefix_hits = [0] * k  # positions whose first j + 1 drafts all match
    draft_hits, positions = 0, 0
    with torch.inference_mode():
        for ex in data:
            t, start = ex.ids.shape[0], ex.prompt_len - 1  # positions predicting answer tokens
            outs = list(ttt_outputs(head, ex.ids[None], ex.features[None].float(), k))
            guesses = [head.target_ids(head.logits(o[0]).argmax(-1)) for o in outs]  # [T] each
            peer = draft(ex.ids[None]).logits[0].argmax(-1)
            for m in range(max(1, start), t - 1):  # the target's argmax at m is the answer token m + 1
                ok = True  # the head drafts it from row m - 1: token m with the features at m - 1
                for j in range(k):
                    ok = ok and m + j < t - 1 and bool(guesses[j][m - 1] == ex.best[m + j])
                    prefix_hits[j] += ok
                draft_hits += bool(peer[m] == ex.best[m])
                positions += 1
            log(f"[eagle3_agreement] {positions} positions, {time.perf_counter() - t0:.0f}s")
    rows = [(j + 1, f"{prefix_hits[j] / positions:.3f}", f"{1 + sum(prefix_hits[: j + 1]) / positions:.2f}")
            for j in range(k)]
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python -m bench.eagle3_agreement " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"## {stamp}: EAGLE-3 head agreement on the held-out open prompts", "",
             f"Command: `{cmd.strip()}` ({time.perf_counter() - t0:.0f} s; commit {git_commit()}; "
             f"{machine_info().get('cpu', '')}; shared machine)", "",
             f"{positions} answer positions over {len(prompts)} open prompts ({args.max_new_tokens} greedy tokens each); "
             f"head: layers {layers}, draft vocabulary {head.draft_vocab_size}. Per-token greedy agreement: "
             f"head {prefix_hits[0] / positions:.3f}, draft model {draft_hits / positions:.3f}.", ""]
    lines += md_table(("chain K", "first K drafts all match", "tokens per target forward (every position a start)"), rows)
    section = "\n".join(lines) + "\n"
    print(section) if args.no_write else append_section(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
