"""Train an EAGLE-3 head for a target: `python -m specdec.training.eagle3 --target PATH --out DIR` (`make eagle-head`).

1. Data: the target answers the training prompts (specdec.training.prompts) itself, greedily and `--samples`
   times more at `--temperature`, on specdec's own step with its features and last hidden states tapped
   (specdec.training.eagle3_data); the draft vocabulary is the data's most frequent tokens.
2. Head: the published EAGLE-3 layout at the target's shapes (specdec.engine.eagle3), the target's embedding
   shared and frozen; lm_head starts from the target's own rows for the draft vocabulary, norm from its final
   norm, the rest random.
3. Objective (EAGLE-3's training-time test): at each of `ttt_steps` draft steps j the head predicts, at every
   answer position i, the target's distribution over token i + j + 2 from token i + j + 1 and, for j = 0, fc
   of the target's features at i, for j > 0 its own output of step j - 1 (attending as it will when drafting:
   specdec.engine.eagle3.ttt_attention). Loss: cross-entropy to the target's distribution on the draft
   vocabulary, rows whose target argmax the draft vocabulary lacks left out (SpecForge's), step j weighted 0.8^j.
4. Checkpoint: config.json + model.safetensors in the published layout (write_checkpoint).

Reports per step the top-1 agreement with the target's argmax on the training data; `agreement` measures it
on other prompts (held-out: bench.eagle3_agreement).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.engine.eagle3 import (Eagle3Head, default_aux_layers, head_config, mapped_vocabulary, random_head,
                                   ttt_attention, write_checkpoint)
from specdec.math.draft_vocab import target_ids
from specdec.training.eagle3_data import Example, coverage, draft_vocabulary, generated, load_data, save_data

log = logging.getLogger(__name__)
STEP_DECAY = 0.8  # weight of draft step j's loss: 0.8^j (SpecForge's)


def new_head(target, draft_vocab_size: int, layer_ids: list[int] | None, d2t: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A head for `target` (a transformers causal LM), warm-started from the target's LM head and final norm."""
    head = random_head(head_config(target.config, draft_vocab_size, layer_ids), target.get_input_embeddings(), seed=seed)
    mapped_vocabulary(head, d2t)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[target_ids(head.d2t)])
        head.norm.weight.copy_(target.base_model.norm.weight)
    return head


def batch(data: list[Example]):
    """Right-padded tensors of a batch: ids [B, T], features [B, T, 3H] and the target's last hidden states
    [B, T, H] in float32, the target's argmax [B, T], the answer mask [B, T] (positions predicting an answer token)."""
    t = max(ex.ids.shape[0] for ex in data)
    b = len(data)
    ids = torch.zeros(b, t, dtype=torch.long)
    features = torch.zeros(b, t, data[0].features.shape[-1])
    hidden = torch.zeros(b, t, data[0].hidden.shape[-1])
    best = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for r, ex in enumerate(data):
        n = ex.ids.shape[0]
        ids[r, :n], features[r, :n], hidden[r, :n], best[r, :n] = ex.ids, ex.features.float(), ex.hidden.float(), ex.best
        mask[r, max(0, ex.prompt_len - 1) : n - 1] = True  # p at position m predicts token m + 1, which must exist
    return ids, features, hidden, best, mask


def ttt_outputs(head: Eagle3Head, ids: torch.Tensor, features: torch.Tensor, steps: int):
    """The head's outputs [B, T, H] at draft steps 0 .. steps - 1 over a whole sequence at once (training-time
    test): at step j, row i is what the head computes when drafting its (j + 1)-th token after position i
    with the true tokens x_{i+1} .. x_{i+j+1} as inputs: ids [B, T], features [B, T, 3 Ht]."""
    b, t = ids.shape
    g = head.fuse(features)  # [B, T, H]
    keys = []
    for j in range(steps):
        tok = F.pad(ids[:, j + 1 :], (0, j + 1))  # x_{i+j+1}
        positions = (torch.arange(t, device=ids.device) + j).expand(b, t)
        q, k, v, residual = head.qkv(tok, g, positions)
        keys.append((k, v))
        g = head.finish(ttt_attention(q, keys), residual)
        yield g


def ttt_loss(head: Eagle3Head, ids, features, hidden, best, mask, full_head: torch.Tensor, steps: int):
    """The training-time-test loss and, per draft step, (agreeing rows, rows): the head's argmax (a target id)
    against the target's argmax over the full vocabulary."""
    t = ids.shape[1]
    rows = full_head[target_ids(head.d2t)]  # [Vd, H] the target's LM head on the draft vocabulary
    total, stats = 0.0, []
    for j, out in enumerate(ttt_outputs(head, ids, features, steps)):
        shift = j + 1
        h = F.pad(hidden[:, shift:], (0, 0, 0, shift))  # the target's hidden at position i + j + 1
        valid = F.pad(mask[:, shift:], (0, shift)) & (torch.arange(t) < t - shift)
        target_best = F.pad(best[:, shift:], (0, shift))  # and its argmax there
        with torch.no_grad():  # only the scored rows go through the LM heads (prompt and padding rows do not)
            p = torch.softmax(h[valid] @ rows.T, dim=-1)  # [N, Vd] the target's distribution on the draft vocabulary
            best_here = target_best[valid]  # [N]
            inside = head.t2d[best_here]
        logp = torch.log_softmax(head.logits(out[valid]).float(), dim=-1)  # [N, Vd]
        loss = -(p * logp).sum(-1)[inside].sum() / inside.sum().clamp(min=1)
        total = total + STEP_DECAY**j * loss
        with torch.no_grad():
            guess = target_ids(head.d2t)[logp.argmax(-1)]
            stats.append((int((guess == best_here).sum()), int(valid.sum())))
    return total, stats


def train(head: Eagle3Head, data: list[Example], full_head: torch.Tensor, *, ttt_steps: int = 4, epochs: float = 1.0,
          batch_size: int = 8, lr: float = 1e-3, minutes: float | None = None, seed: int = 0, log_every: int = 10,
          autocast: torch.dtype | None = None):
    """AdamW with warm-up and cosine decay (over the steps, or over `minutes` where that ends first) on the head's
    trainable weights; returns the per-step losses. autocast: the forward's products in this dtype (the weights,
    their gradients and the optimiser stay float32; None: all float32)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    order = sorted(range(len(data)), key=lambda i: data[i].ids.shape[0])  # similar lengths batched together
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    total_steps = max(1, math.ceil(epochs * len(batches)))
    warmup = max(1, total_steps // 20)
    rng, losses, start = random.Random(seed), [], time.monotonic()
    head.train()
    for step in range(total_steps):
        if step % len(batches) == 0:
            rng.shuffle(batches)
        done = step / total_steps  # the schedule's progress: by steps, or by time under a time box
        if minutes is not None:
            done = max(done, (time.monotonic() - start) / (60 * minutes))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        with torch.autocast(full_head.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss, stats = ttt_loss(head, *batch([data[i] for i in batches[step % len(batches)]]), full_head, ttt_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % log_every == 0 or step == total_steps - 1:
            acc = " ".join(f"{a / max(1, n):.2f}" for a, n in stats)
            log.info("step %d / %d loss %.3f agreement per draft step %s (%.0f s)", step + 1, total_steps, losses[-1], acc,
                     time.monotonic() - start)
        if minutes is not None and time.monotonic() - start > 60 * minutes:
            log.info("time box of %.1f min reached at step %d", minutes, step + 1)
            break
    head.eval()
    return losses


@torch.no_grad()
def agreement(head: Eagle3Head, data: list[Example], full_head: torch.Tensor, ttt_steps: int = 3) -> list[float]:
    """Per draft step, the share of answer positions where the head's argmax is the target's (step 0: the
    per-token greedy agreement given the target's own prefix; step j: after j of its own steps)."""
    sums = [[0, 0] for _ in range(ttt_steps)]
    for i in range(0, len(data), 8):
        _, stats = ttt_loss(head, *batch(data[i : i + 8]), full_head, ttt_steps)
        for s, (a, n) in zip(sums, stats):
            s[0] += a
            s[1] += n
    return [a / max(1, n) for a, n in sums]


def parse_args(argv=None) -> argparse.Namespace:
    from specdec.models import default_target

    p = argparse.ArgumentParser(prog="python -m specdec.training.eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=default_target(), help="the target model (directory, .gguf or hub id)")
    p.add_argument("--out", help="checkpoint directory (default: the cache directory's eagle3/<target name>)")
    p.add_argument("--prompts", type=int, default=0, help="training prompts to use (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the target's answer length per prompt")
    p.add_argument("--samples", type=int, default=0,
                   help="answers per prompt drawn at --temperature, beside the greedy one (as many more distinct "
                        "prompts served as well, and greedy answers are made faster)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    p.add_argument("--sessions", type=int, default=32, help="answers the target generates at a time")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft_vocab_size (0: the target's full vocabulary)")
    p.add_argument("--layers", default="", help="target layer outputs to read, e.g. 1,14,26 (default: low/middle/high)")
    p.add_argument("--ttt-steps", type=int, default=4, help="draft steps of the training-time test")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--minutes", type=float, default=None, help="stop training after this long")
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="of the checkpoint")
    p.add_argument("--autocast", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="the training forward's products: bfloat16 (autocast; the weights and optimiser stay float32), "
                        "float32, or auto: bfloat16 where the device multiplies it natively (a CPU with AVX-512: AMX or "
                        "AVX-512 BF16 through oneDNN; a CUDA GPU with bfloat16), else float32")
    p.add_argument("--data", help="cache of the generated data (.pt): read if it exists, else written")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """--autocast: None for float32. On a CPU, bfloat16 pays where oneDNN has native bfloat16 products (AVX-512;
    on the Xeon with AMX a training step took 0.6 s against 1.2 s in float32, docs/performance.md); on an
    AVX2-only CPU it is emulated, slower than float32."""
    if choice != "auto":
        return torch.bfloat16 if choice == "bfloat16" else None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    native = device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else None


def default_out(target: str | None = None) -> Path:
    """Where `make eagle-head` writes a target's head (and `make bench` looks for it): the cache's eagle3/<target>."""
    from specdec.model_cache import cache_dir
    from specdec.models import default_target, served_model_name

    return cache_dir() / "eagle3" / served_model_name(target or default_target())


def main(argv=None) -> int:
    from specdec.engine.config import TierConfig
    from specdec.models import ModelConfig, load_model, load_tokenizer
    from specdec.training.prompts import training_prompts

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else default_out(args.target)
    target = load_model(ModelConfig(args.target))
    for p in target.parameters():
        p.requires_grad_(False)
    config = target.config
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else None
    layers = layer_ids or default_aux_layers(config.num_hidden_layers)
    if args.data and Path(args.data).exists():
        data = load_data(args.data)
    else:
        tokenizer = load_tokenizer(args.target)
        data = generated(TierConfig(ModelConfig(args.target)), tokenizer, training_prompts(args.prompts or None), layers,
                         max_new_tokens=args.max_new_tokens, samples=args.samples, temperature=args.temperature,
                         sessions=args.sessions, seed=args.seed)
        if args.data:
            save_data(data, args.data)
    size = args.draft_vocab or config.vocab_size
    d2t = draft_vocabulary(data, size, config.vocab_size)
    log.info("%d sequences, %d answer tokens; draft vocabulary %d covers %.3f of them; layers %s", len(data),
             sum(ex.ids.shape[0] - ex.prompt_len for ex in data), size, coverage(data, d2t), layers)
    head = new_head(target, size, layer_ids, d2t, seed=args.seed)
    full_head = target.get_output_embeddings().weight
    autocast = autocast_dtype(args.autocast, full_head.device)
    log.info("training products in %s", "float32" if autocast is None else f"{autocast} (autocast)")
    train(head, data, full_head, ttt_steps=args.ttt_steps, epochs=args.epochs, batch_size=args.batch, lr=args.lr,
          minutes=args.minutes, seed=args.seed, autocast=autocast)
    log.info("agreement on the training data per draft step: %s",
             " ".join(f"{a:.3f}" for a in agreement(head, data[: min(len(data), 64)], full_head)))
    write_checkpoint(head.to(getattr(torch, args.dtype)), out)
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
