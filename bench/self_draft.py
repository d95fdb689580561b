"""Which low-precision copy of the target makes the best draft? A probe on this machine.

For each candidate precision of the target (float32 as the reference, bfloat16, float16, and int8
dynamic quantisation of the linear layers), over the bench's open-ended chat prompts:

* **agreement**: teacher-forced on the float32 target's own greedy continuation, the fraction of
  positions where the copy's argmax equals the target's (what a greedy draft's acceptance would be);
* **time per token**: one-token decode steps through the tier engine's runner, as the draft tier
  would run them, relative to float32.

The analytical speed-up of speculative decoding with such a draft follows from both: with acceptance
a, K drafts and a draft step costing c target steps, a round yields (1 - a^(K+1)) / (1 - a) tokens for
K * c + v(K) target-step times (v(K) = verify cost of K + 1 tokens, measured by the main bench).

Run: python -m bench.self_draft [--tokens 64] [--prompts 6] [--threads 2]; appends to the month's log in docs/bench-logs/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time

from bench.common import bench_log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.self_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(bench_log()))
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, ... (int8 dynamic quantisation is CPU-only)")
    args = p.parse_args(argv)
    import torch

    from bench.prompts import prompts_for
    from bench.common import append_section, git_commit, gpu_name, machine_info, md_table
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.runner import Feed, ModelRunner, use_exact_float32_matmuls
    from specdec.models import ModelConfig, default_target, load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    dev = args.device
    on_gpu = torch.device(dev).type == "cuda"
    if on_gpu:
        use_exact_float32_matmuls()
    target = default_target()
    tok = load_tokenizer(target)
    prompts = []
    for pr in prompts_for("open", args.prompts):
        ids = tok.apply_chat_template(pr.messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))

    def runner_for(model) -> ModelRunner:
        return ModelRunner(model, SlotKVCache(KVGeometry.of(model), 1, 1024))

    def continuation(runner: ModelRunner, prompt: list[int]) -> list[int]:
        slot = 0
        out = []
        logits = runner.forward([Feed(slot, 0, prompt, 1)])[0]
        for i in range(args.tokens):
            out.append(int(logits[-1].argmax()))
            logits = runner.forward([Feed(slot, len(prompt) + i, [out[-1]], 1)])[0]
        return out

    def teacher_forced(runner: ModelRunner, prompt: list[int], cont: list[int]) -> list[int]:
        logits = runner.forward([Feed(0, 0, prompt + cont[:-1], len(cont))])[0]
        return logits.argmax(-1).tolist()

    def step_ms(runner: ModelRunner, prompt: list[int]) -> float:
        runner.forward([Feed(0, 0, prompt, 1)])
        for i in range(3):  # warm
            runner.forward([Feed(0, len(prompt) + i, [7], 1)])
        t = time.perf_counter()
        n = 24
        for i in range(n):
            runner.forward_checked([Feed(0, len(prompt) + 3 + i, [7], 1)])  # synchronised, as the engine's steps
        return (time.perf_counter() - t) / n * 1e3

    reference = runner_for(load_model(ModelConfig(target, device=dev)))
    conts = [continuation(reference, pr) for pr in prompts]
    ref_ms = sum(step_ms(reference, pr) for pr in prompts[:2]) / 2

    def int8_dynamic():
        model = load_model(ModelConfig(target))
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)

    candidates = [("float32", lambda: load_model(ModelConfig(target, device=dev))),
                  ("bfloat16", lambda: load_model(ModelConfig(target, device=dev, dtype="bfloat16"))),
                  ("float16", lambda: load_model(ModelConfig(target, device=dev, dtype="float16")))]
    if not on_gpu:
        candidates.append(("int8 dynamic (linear layers)", int8_dynamic))
    rows = []
    for name, make in candidates:
        try:
            runner = runner_for(make())
            agree = total = 0
            for pr, cont in zip(prompts, conts):
                got = teacher_forced(runner, pr, cont)
                agree += sum(a == b for a, b in zip(got, cont))
                total += len(cont)
            ms = sum(step_ms(runner, pr) for pr in prompts[:2]) / 2
            rows.append((name, agree / total, ms, ms / ref_ms))
            print(f"{name}: agreement {agree / total:.3f}, {ms:.1f} ms/token ({ms / ref_ms:.2f}x float32)", flush=True)
        except Exception as e:  # a precision this torch build cannot run here
            rows.append((name, None, None, f"{type(e).__name__}: {e}"))
            print(f"{name}: failed: {e}", flush=True)

    m = machine_info()
    cmd = " ".join(["python -m bench.self_draft", shlex.join(list(argv if argv is not None else sys.argv[1:]))]).strip()
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: the target's own low-precision copy as the draft", "",
             f"Command: `{cmd}` (git {git_commit()}; "
             + (f"GPU {gpu_name(dev)}" if on_gpu else f"{m['cpu']}, {args.threads} torch threads") + f", torch {m.get('torch')})", "",
             f"Teacher-forced greedy agreement with the float32 target over {len(prompts)} open-ended chat prompts x "
             f"{args.tokens} tokens, and one-token decode time through the engine's runner.", ""]
    lines += md_table(["copy", "greedy agreement", "ms / token", "vs float32"],
                      [[name, "–", "–", rel] if agree is None else [name, f"{agree:.3f}", f"{ms:.1f}", f"{rel:.2f}x"]
                       for name, agree, ms, rel in rows])
    lines.append("")
    append_section("\n".join(lines), args.out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
