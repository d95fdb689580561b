"""bench.concurrency's peer: the target alone under transformers' own batched generation, the same prompts and
token counts as specdec's rows (greedy, EOS ignored)."""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.common import log


def run_peer(levels: list[int], max_new: int, target: str, chat_prompts: Callable[[int], list[list[dict]]],
             device: str = "cpu", dtype: str = "float32") -> dict:
    """Aggregate tok/s of transformers' batched greedy generation at each level of clients: `generate_batch`
    (continuous batching) and padded `generate`, on chat_prompts(c) (the sweep's own prompts)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from specdec.models import ModelConfig, load_model, load_tokenizer

    transformers.logging.set_verbosity_error()
    tok = load_tokenizer(target)
    model = load_model(ModelConfig(target, device=device, dtype=dtype))
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        from specdec.engine.runner import use_exact_float32_matmuls

        use_exact_float32_matmuls()  # as the tiers do
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def continuous(prompts: list[list[int]]) -> float:
        cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=pad)
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
        wall = time.perf_counter() - t
        assert all(len(r.generated_tokens) == max_new for r in out.values()), "generate_batch stopped early"
        return wall

    def padded(prompts: list[list[int]]) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=pad)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    out: dict = {"continuous": {}, "padded": {}}
    for name, fn in (("continuous", continuous), ("padded", padded)):
        try:
            fn([encode(chat_prompts(1)[0])])  # warm-up
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"peer {name}: {out[name]['error']}")
            continue
        for c in levels:
            wall = fn([encode(m) for m in chat_prompts(c)])
            out[name][c] = {"clients": c, "aggregate_tok_s": c * max_new / wall, "per_client_tok_s": max_new / wall,
                            "latency_p50_s": wall}
            log(f"peer {name} C={c}: {c * max_new / wall:.1f} tok/s aggregate ({wall:.1f}s)")
    return out
