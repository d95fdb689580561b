"""How often does floating point break token-for-token greedy equality? Measured directly, per dtype.

Greedy specdec is exact in exact arithmetic: it commits argmax p at every position. But the argmax
the target computes depends on the shape of the forward that computes it: a verify forward scores
K + 1 tokens at once, plain decoding one; a batched step puts many sessions' rows in one matrix
product; transformers' own generate uses other attention kernels. Different shapes pick different
kernels (above all on a GPU), which may round differently, and a near-tie can then flip. This probe
counts such flips for the target on --device in each --dtypes, over the bench's open prompts:

1. **decode**: N greedy tokens per prompt through the engine's runner, one token per step (the K = 0
   path): the reference sequence S and its rows.
2. **verify K**: S re-scored in (K + 1)-token steps, as verifications that accept every draft compute
   it; a row whose argmax is not S's next token is a position where greedy specdec at K would leave
   the K = 0 output.
3. **batched**: all prompts decoded together, one token per session per step (the group attention
   path, every matrix product B rows tall), compared with their solo sequences; **split prefill**: each
   prompt prefilled in two steps (its first whole 16-token blocks, then the rest), as prefix reuse and
   chunked prefill compute a prompt, then decoded, compared with its solo sequence.
4. **generate**: transformers' model.generate(do_sample=False) on the same device and dtype, compared
   with S (the services' K = 0 against the target alone).

5. **vs eager**: each step mode (specdec.engine.step: packed / compile on a CPU, cuda-graphs on CUDA)
   runs 1-4 with its own runner, and its solo decode S is compared with the eager mode's.

For 2 the unit is a position (teacher-forced on S); for 3, split prefill, 4 and 5 a whole sequence (after the first
difference the sequences go apart). Flipped positions report the reference's top-1 / top-2 logit gap.

    python -m bench.exactness --device cuda --dtypes float32,bfloat16 [--modes eager,cuda-graphs] [--tokens 128]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

from bench.common import bench_log

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.exactness", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=0, help="open prompts to use (0 = all)")
    p.add_argument("--ks", default="1,3,7", help="verify shapes: K drafts + 1 tokens per step")
    p.add_argument("--modes", default=None,
                   help="step modes (default: eager,packed,compile on a CPU; eager,cuda-graphs on CUDA)")
    p.add_argument("--target", default=None, help="model (default: specdec.models.default_target())")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch

    from bench.prompts import prompts_for
    from bench.common import git_commit, gpu_name, machine_info
    from specdec.engine.config import StepConfig
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.runner import Feed, ModelRunner, use_exact_float32_matmuls
    from specdec.models import ModelConfig, default_target, load_model, load_tokenizer

    t_start = time.time()
    target = args.target or default_target()
    device = torch.device(args.device)
    if device.type == "cuda":
        use_exact_float32_matmuls()
    tok = load_tokenizer(target)
    prompts = []
    for pr in prompts_for("open", args.prompts or None):
        ids = tok.apply_chat_template(pr.messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    n = args.tokens
    ks = [int(x) for x in args.ks.split(",") if x]
    modes = args.modes.split(",") if args.modes else (
        ["eager", "cuda-graphs"] if device.type == "cuda" else ["eager", "packed", "compile"])
    results = {}
    eager_solo = {}

    for dtype, mode in [(d, m) for d in args.dtypes.split(",") if d for m in modes]:
        t0 = time.time()
        model = load_model(ModelConfig(target, device=str(device), dtype=dtype))
        hf_model = load_model(ModelConfig(target, device=str(device), dtype=dtype))  # sdpa attention, for generate
        slot_tokens = max(len(x) for x in prompts) + n + 8
        runner = ModelRunner(model, SlotKVCache(KVGeometry.of(model), len(prompts), slot_tokens,
                                                scratch=mode == "cuda-graphs"), StepConfig(mode=mode))

        def top2_gap(row) -> float:
            v = row.float().topk(2).values
            return float(v[0] - v[1])

        def decode(prompt: list[int], cut: int) -> tuple[list[int], list]:
            """n greedy tokens, one per step, after the prompt prefilled in steps [0, cut) and [cut, end)
            (cut 0: one step): the sequence and the row that chose each token."""
            if cut:
                runner.forward([Feed(0, 0, prompt[:cut], 1)])
            logits = runner.forward([Feed(0, cut, prompt[cut:], 1)])[0]
            seq, rows = [int(logits[-1].argmax())], [logits[-1]]
            for i in range(n - 1):
                logits = runner.forward([Feed(0, len(prompt) + i, [seq[-1]], 1)])[0]
                seq.append(int(logits[-1].argmax()))
                rows.append(logits[-1])
            return seq, rows

        # 1. decode, one session at a time, one token per step
        solo, solo_rows = map(list, zip(*(decode(prompt, 0) for prompt in prompts)))
        r = {"positions": 0, "verify": {}, "batched": None, "generate": None}
        # 2. verify-shaped re-scoring: S in (K + 1)-token steps after the same prefill
        for k in ks:
            flips, total, gaps = 0, 0, []
            for prompt, seq, rows in zip(prompts, solo, solo_rows):
                runner.forward([Feed(0, 0, prompt, 1)])
                pos = 0  # seq[pos] is the next token to feed
                while pos < n - 1:
                    chunk = seq[pos : min(n - 1, pos + k + 1)]
                    logits = runner.forward([Feed(0, len(prompt) + pos, chunk, len(chunk))])[0]
                    for j, row in enumerate(logits):
                        total += 1
                        if int(row.argmax()) != seq[pos + j + 1]:
                            flips += 1
                            gaps.append(top2_gap(rows[pos + j + 1]))
                    pos += len(chunk)
            r["verify"][k] = {"flips": flips, "total": total, "gaps": gaps}
        r["positions"] = len(prompts) * (n - 1)
        # 3. batched decoding: every prompt in each step
        feeds = [Feed(i, 0, prompt, 1) for i, prompt in enumerate(prompts)]
        outs = runner.forward(feeds)  # the prefills share one step too
        batched = [[int(o[-1].argmax())] for o in outs]
        for i in range(n - 1):
            outs = runner.forward([Feed(b, len(prompts[b]) + i, [batched[b][-1]], 1) for b in range(len(prompts))])
            for b, o in enumerate(outs):
                batched[b].append(int(o[-1].argmax()))
        r["batched"] = _sequence_diffs(batched, solo)
        # 3b. a split prefill, as prefix reuse or chunked prefill computes a prompt: its first blocks in one step
        # (a multiple of 16 tokens, the prefix index's block), the rest in the next, then greedy decoding
        split = [decode(p, max(16, (len(p) - 1) // 16 * 16) if len(p) > 16 else len(p) // 2)[0] for p in prompts]
        r["split"] = _sequence_diffs(split, solo)
        # 4. transformers' own generate, same device and dtype
        generated = []
        for prompt in prompts:
            with torch.inference_mode():
                out = hf_model.generate(input_ids=torch.tensor([prompt], device=device),
                                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                                        max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            generated.append(out[0, len(prompt):].tolist())
        r["generate"] = _sequence_diffs(generated, solo)
        eager_solo.setdefault(dtype, solo)  # modes run eager first
        r["vs_eager"] = _sequence_diffs(solo, eager_solo[dtype])
        r["seconds"] = time.time() - t0
        results[(dtype, mode)] = r
        print(f"[exactness] {dtype} {mode}: " + "; ".join(f"verify K={k}: {v['flips']}/{v['total']} flips" for k, v in r["verify"].items())
              + f"; batched: {r['batched']['differ']}/{len(prompts)} sequences differ; split prefill: "
              f"{r['split']['differ']}/{len(prompts)} differ; generate: "
              f"{r['generate']['differ']}/{len(prompts)} differ; vs eager: {r['vs_eager']['differ']} differ "
              f"({r['seconds']:.0f}s)", file=sys.stderr, flush=True)
        del model, hf_model, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()

    m = machine_info()
    where = f"GPU **{gpu_name(args.device)}**" if device.type == "cuda" else f"{m['cpu']}, {m['cores']} cores, no GPU"
    command = " ".join(["python -m bench.exactness", shlex.join(list(argv if argv is not None else sys.argv[1:]))]).strip()
    L = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: greedy exactness under floating point ({args.device})", "",
         f"Command: `{command}`", "",
         f"- Machine: {where}; torch {m.get('torch')}, transformers {m.get('transformers')}; git {git_commit()}; "
         f"wall {(time.time() - t_start) / 60:.1f} min",
         f"- Target `{target}`, {len(prompts)} open prompts x {n} greedy tokens; float32 matrix products in IEEE float32 "
         "(no TF32). What each column compares: see `bench/exactness.py`'s docstring. A verify flip is a position "
         "where the (K + 1)-token forward's argmax differs from 1-token decoding's, teacher-forced; batched, split "
         "prefill and generate compare whole sequences with the solo 1-token decode.", ""]
    L.append("| dtype | step mode | " + " | ".join(f"verify K={k}: flipped positions" for k in ks)
             + " | batched decode: sequences that differ (first difference at) | split prefill: sequences that differ "
               "(first difference at) | HF generate: sequences that differ "
               "(first difference at) | eager mode's decode: sequences that differ |")
    L.append("|---|---|" + "---|" * len(ks) + "---|---|---|---|")
    for (dtype, mode), r in results.items():
        cells = []
        for k in ks:
            v = r["verify"][k]
            gap = f" (top-2 gap {max(v['gaps']):.2g} at most)" if v["gaps"] else ""
            cells.append(f"{v['flips']}/{v['total']}{gap}")
        seqs = [f"{d['differ']}/{len(prompts)}" + (f" ({', '.join(map(str, d['first']))})" if d["first"] else "")
                for d in (r["batched"], r["split"], r["generate"], r["vs_eager"])]
        L.append(f"| {dtype} | {mode} | " + " | ".join(cells) + " | " + " | ".join(seqs) + " |")
    L.append("")
    text = "\n".join(L) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


def _sequence_diffs(seqs: list[list[int]], refs: list[list[int]]) -> dict:
    first = []
    for s, ref in zip(seqs, refs):
        d = next((i for i, (a, b) in enumerate(zip(s, ref)) if a != b), None)
        if d is None and len(s) != len(ref):
            d = min(len(s), len(ref))
        if d is not None:
            first.append(d)
    return {"differ": len(first), "first": first}


if __name__ == "__main__":
    raise SystemExit(main())
