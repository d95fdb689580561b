"""Training data for an EAGLE-3 head, made by the target itself.

The target answers each training prompt (chat-templated) greedily, as it will be served, and `samples` more times
at a temperature (more answers than prompts: a head learnt ~58k tokens by heart, 0.76 agreement on them and 0.31
held out), on specdec's own step with taps, recording per position what the head learns from:

    ids       [T]        the tokens (prompt, then the target's answer)
    features  [T, 3 H]   the target's low / middle / high layer outputs, 16-bit (specdec.engine.eagle3_features)
    hidden    [T, H]     the target's last hidden state (after its final norm), 16-bit: the target's logits at
                         any position are hidden @ lm_head^T, recomputed when training (V floats a position
                         would not fit in memory: 49152 x 4 bytes for the default target)
    best      [T]        the target's argmax at each position from prompt_len - 1 (0 before: never scored)
    prompt_len           positions >= prompt_len - 1 predict answer tokens: the loss and agreement count those

and the draft vocabulary is the `size` target tokens most frequent in those sequences (SpecForge does the same).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.engine.config import TierConfig
from specdec.engine.tier_model import load_tier_model
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.llama import TorchRowOps
from specdec.engine.runner import Feed, ModelRunner
from specdec.engine.step import resolve_mode
from specdec.math.draft_vocab import d2t_from_target_ids, target_ids
from specdec.models import eos_token_ids

log = logging.getLogger(__name__)


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, 3 H] 16-bit
    hidden: torch.Tensor  # [T, H] 16-bit, after the target's final norm
    best: torch.Tensor  # [T] int64: the target's argmax at each position (its greedy next token)
    prompt_len: int


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """A user message, chat-templated with the generation prompt, as the pipeline sends it."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@dataclass
class _Answer:
    """One answer being generated: its sequence so far, and the rows recorded for it."""

    job: int  # its place in the output: prompt index x (samples + 1) + sample
    ids: list[int]
    prompt_len: int
    generator: torch.Generator | None  # None: greedy
    features: list[torch.Tensor]
    hidden: list[torch.Tensor]
    best: list[int]  # the target's argmax at positions prompt_len - 1, prompt_len, ...


@torch.no_grad()
def generated(config: TierConfig, tokenizer, prompts: list[str], layer_ids: Sequence[int], *, max_new_tokens: int,
              samples: int = 0, temperature: float = 0.8, sessions: int = 32, seed: int = 0) -> list[Example]:
    """Per prompt the target's greedy answer and `samples` more drawn at `temperature` (each from a seed of its own),
    cut after the first end-of-sequence token: Examples in (prompt, sample) order. The target runs as a tier of
    `config` runs it (specdec's step, a GGUF in its blocks on a CPU), `sessions` answers at a time, with taps on its
    layers: each token's features and last hidden state come out of the forward that feeds it, with no second pass
    (the tokens, features and argmaxes are transformers' own: tests/test_eagle3_training.py)."""
    model = load_tier_model(config)
    n_layers, width = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    taps = (*layer_ids, n_layers - 1)  # the head's layers, then the last one's output for the last hidden state
    norm = model.model.norm  # the target's final norm, applied to the last layer's output
    weight, eps = norm.weight.detach().float(), float(norm.variance_epsilon)
    eos = set(eos_token_ids(model, tokenizer))
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    cache = SlotKVCache(KVGeometry.of(model), sessions, max(len(x) for x in encoded) + max_new_tokens + 1,
                        scratch=resolve_mode(config.step.mode, torch.device(config.model.device)) == "cuda-graphs")
    runner = ModelRunner(model, cache, config.step)
    waiting = deque(_Answer(i * (samples + 1) + s, list(x), len(x),
                            None if s == 0 else torch.Generator().manual_seed(seed * 1_000_003 + i * (samples + 1) + s),
                            [], [], [])
                    for i, x in enumerate(encoded) for s in range(samples + 1))
    running: dict[int, _Answer] = {}  # slot -> answer
    free, done, start, reported = list(range(sessions)), [], time.monotonic(), 0
    while waiting or running:
        feeds, owners, budget = [], [], config.batch.max_batch_tokens
        for slot, a in running.items():  # each answer's last token, fed for its features and the next one
            feeds.append(Feed(slot, len(a.ids) - 1, a.ids[-1:], 1, taps=taps))
            owners.append(slot)
            budget -= 1
        while waiting and free and len(waiting[0].ids) <= budget:  # a new prompt, whole
            slot, a = free.pop(), waiting.popleft()
            running[slot] = a
            feeds.append(Feed(slot, 0, list(a.ids), 1, taps=taps))
            owners.append(slot)
            budget -= len(a.ids)
        if not feeds:
            raise ValueError(f"a prompt of {len(waiting[0].ids)} tokens exceeds max_batch_tokens")
        for f, slot, logits in zip(feeds, owners, runner.forward(feeds)):
            a = running[slot]
            a.features.append(f.features[:, : len(layer_ids) * width])
            last = f.features[:, len(layer_ids) * width :].float()
            a.hidden.append(TorchRowOps.add_rms_norm(last, None, weight, eps).to(f.features.dtype))
            row = logits[-1]
            a.best.append(int(row.argmax()))
            new = len(a.ids) - a.prompt_len
            if new and (a.ids[-1] in eos or new >= max_new_tokens):  # its last token fed: complete
                done.append(a)
                del running[slot]
                free.append(slot)
            else:
                a.ids.append(a.best[-1] if a.generator is None else
                             int(torch.multinomial(torch.softmax(row.float() / temperature, -1), 1, generator=a.generator)))
        if len(done) // 64 > reported:  # each 64 answers
            reported, tokens = len(done) // 64, sum(len(a.ids) - a.prompt_len for a in done)
            log.info("generated %d / %d answers, %d tokens, %.0f tokens/s", len(done), len(encoded) * (samples + 1),
                     tokens, tokens / (time.monotonic() - start))
    out = []
    for a in sorted(done, key=lambda a: a.job):
        best = torch.zeros(len(a.ids), dtype=torch.long)
        best[a.prompt_len - 1 :] = torch.tensor(a.best)
        out.append(Example(torch.tensor(a.ids), torch.cat(a.features), torch.cat(a.hidden), best, a.prompt_len))
    return out


def draft_vocabulary(data: list[Example], size: int, vocab_size: int) -> torch.Tensor:
    """d2t for the `size` target ids most frequent in the data (answers counted twice: they are what the head
    drafts); filled up with the lowest unseen ids when the data has fewer distinct tokens."""
    counts = Counter()
    for ex in data:
        counts.update(ex.ids.tolist())
        counts.update(ex.ids[ex.prompt_len :].tolist())
    ids = [t for t, _ in counts.most_common(size)]
    if len(ids) < size:
        seen = set(ids)
        ids += [t for t in range(vocab_size) if t not in seen][: size - len(ids)]
    return d2t_from_target_ids(torch.tensor(ids))


def coverage(data: list[Example], d2t: torch.Tensor) -> float:
    """The share of answer tokens inside the draft vocabulary (an upper bound on the head's agreement)."""
    covered = set(target_ids(d2t).tolist())
    tokens = [t for ex in data for t in ex.ids[ex.prompt_len :].tolist()]
    return sum(t in covered for t in tokens) / max(1, len(tokens))


def save_data(data: list[Example], path) -> None:
    torch.save([ex.__dict__ for ex in data], path)


def load_data(path) -> list[Example]:
    return [Example(**d) for d in torch.load(path, weights_only=True)]
