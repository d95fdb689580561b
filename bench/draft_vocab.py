"""A draft vocabulary (the draft tier's --draft-vocab): what scoring part of the vocabulary costs the draft's
agreement with the target and saves of its step.

Per draft vocabulary (the whole; N lowest ids; auto): teacher-forced on the target's own greedy answers to the
held-out open and grounded prompts, the share of answer positions where the draft's argmax is the target's
token, a sampled draft's expected acceptance there (sum over tokens of min(p, q) at temperature T, the rejection
sampler's chance to accept a draw from q), and the share of answer tokens inside the vocabulary; then the draft's
one-token step as its tier runs it (the packed step, Q8_0 blocks, one thread), each vocabulary's runner timed in
turn, best and median.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import bench_log, log, md_table, publish, section_head

PREFIX = 100  # context tokens before the timed steps
TEMPERATURES = (0.7, 1.0)  # a sampled draft's acceptance at these


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the default pair's)")
    p.add_argument("--draft", default=None, help="draft model (default: the default pair's)")
    p.add_argument("--vocabs", default="0,8192,auto,24576", help="draft vocabularies (--draft-vocab values)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per workload (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=200, help="timed steps per vocabulary, interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the draft tier's under `make run`: 1)")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench.prompts import prompts_for
    from specdec.engine.config import StepConfig, TierConfig
    from specdec.engine.draft_vocab_head import vocabulary_head
    from specdec.engine.tier_model import load_tier_model
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.runner import Feed, ModelRunner
    from specdec.models import ModelConfig, default_draft, default_target, load_tokenizer
    from specdec.training.eagle3_data import generated

    torch.set_num_threads(args.threads)
    target_path, draft_path = args.target or default_target(), args.draft or default_draft()
    vocabs = [v.strip() for v in args.vocabs.split(",") if v.strip()]
    prompts = {w: [p.content for p in prompts_for(w, args.prompts or None)] for w in ("open", "grounded")}
    tok = load_tokenizer(target_path)
    answers = {w: generated(TierConfig(ModelConfig(target_path)), tok, ps, [], max_new_tokens=args.max_new_tokens)
               for w, ps in prompts.items()}
    log(f"[draft_vocab] the target answered {sum(len(a) for a in answers.values())} prompts")
    target_config = TierConfig(ModelConfig(target_path))
    target_model = load_tier_model(target_config)
    target = ModelRunner(target_model, SlotKVCache(KVGeometry.of(target_model), 1, 4096), target_config.step)
    p_rows = {w: [target.forward([Feed(0, 0, ex.ids.tolist()[:-1], ex.ids.numel() - ex.prompt_len)])[0]
                  for ex in data] for w, data in answers.items()}  # the target's logits at every answer position
    del target, target_model
    runners, kept, covers = {}, {}, {}  # covers: the vocabulary's ids (None: every id)
    for v in vocabs:
        config = TierConfig(ModelConfig(draft_path), step=StepConfig(quantize="auto", draft_vocab=v))
        model = load_tier_model(config)
        head = vocabulary_head(model)
        covers[v] = None if head is None else set(head.ids.tolist())
        kept[v] = int(model.config.vocab_size) if head is None else len(covers[v])
        runners[v] = ModelRunner(model, SlotKVCache(KVGeometry.of(model), 2, 4096), config.step)
    rows, inside, sampled = {}, {}, {}
    for v, runner in runners.items():  # agreement: each answer fed whole, every answer position's argmax
        covered = covers[v]
        for w, data in answers.items():
            hits = positions = tokens_in = 0
            accept = {t: 0.0 for t in TEMPERATURES}
            for ex, p_logits in zip(data, p_rows[w]):
                seq = ex.ids.tolist()
                logits = runner.forward([Feed(0, 0, seq[:-1], len(seq) - ex.prompt_len)])[0]
                guess = logits.argmax(-1)
                for t in TEMPERATURES:
                    p, q = torch.softmax(p_logits / t, -1), torch.softmax(logits / t, -1)
                    accept[t] += float(torch.minimum(p, q).sum())
                want = ex.best[ex.prompt_len - 1 : len(seq) - 1]
                hits += int((guess == want).sum())
                positions += want.numel()
                tokens_in += sum(covered is None or t in covered for t in seq[ex.prompt_len :])
            rows[(v, w)] = hits / max(positions, 1)
            for t in TEMPERATURES:
                sampled[(v, w, t)] = accept[t] / max(positions, 1)
            inside[(v, w)] = tokens_in / max(positions, 1)
    for runner in runners.values():
        runner.forward([Feed(1, 0, list(range(1000, 1000 + PREFIX)), 1)])
    times = {v: [] for v in vocabs}
    for _ in range(args.repeats):  # interleaved: the machine's drift reaches every vocabulary alike
        for v, runner in runners.items():
            t0 = time.perf_counter()
            runner.forward([Feed(1, PREFIX, [5], 1)])
            times[v].append((time.perf_counter() - t0) * 1e3)
    full = statistics.median(times[vocabs[0]])
    n_open, n_grounded = (sum(ex.ids.numel() - ex.prompt_len for ex in answers[w]) for w in ("open", "grounded"))
    section = [*section_head("a draft vocabulary (--draft-vocab)", "bench.draft_vocab", argv,
                             f"draft {draft_path} in Q8_0 blocks on the packed step, {args.threads} thread(s); "
                             f"the target's greedy answers ({args.max_new_tokens} tokens at most) to "
                             f"{len(answers['open'])} open and {len(answers['grounded'])} grounded held-out prompts "
                             f"({n_open} and {n_grounded} answer tokens), teacher-forced."),
               *md_table(("--draft-vocab", "tokens scored", "agreement, open", "agreement, grounded",
                          *(f"sampled acceptance at T = {t}, open / grounded" for t in TEMPERATURES),
                          "answer tokens inside, open / grounded", "draft step, best (ms)", "median (ms)",
                          f"median / {vocabs[0]}'s"),
                         [(v, kept[v], f"{rows[(v, 'open')]:.3f}", f"{rows[(v, 'grounded')]:.3f}",
                           *(f"{sampled[(v, 'open', t)]:.3f} / {sampled[(v, 'grounded', t)]:.3f}" for t in TEMPERATURES),
                           f"{inside[(v, 'open')]:.3f} / {inside[(v, 'grounded')]:.3f}", f"{min(times[v]):.3f}",
                           f"{statistics.median(times[v]):.3f}", f"{statistics.median(times[v]) / full:.2f}x")
                          for v in vocabs]), ""]
    publish("\n".join(section), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
