"""Training data for an EAGLE-3 head, made by the target itself.

The target answers each training prompt (chat-templated, greedy by default, as it will be served), then a
forward over prompt + answer records, per position, what the head learns from:

    ids       [T]        the tokens (prompt, then the target's answer)
    features  [T, 3 H]   the target's low / middle / high layer outputs, 16-bit (specdec.engine.eagle3_features)
    hidden    [T, H]     the target's last hidden state (after its final norm), 16-bit: the target's logits at
                         any position are hidden @ lm_head^T, recomputed when training (V floats a position
                         would not fit in memory: 49152 x 4 bytes for the default target)
    best      [T]        the target's argmax at each position
    prompt_len           positions >= prompt_len - 1 predict answer tokens: the loss and agreement count those

and the draft vocabulary is the `size` target tokens most frequent in those sequences (SpecForge does the same).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from specdec.engine.eagle3_features import target_features
from specdec.math.draft_vocab import d2t_from_target_ids, target_ids

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


@torch.no_grad()
def answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 16,
            temperature: float = 0.0, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per prompt: the target's own continuation (greedy at temperature 0), cut after
    its first end-of-sequence token."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    torch.manual_seed(seed)
    out, start = [], time.monotonic()
    for b in range(0, len(prompts), batch_size):
        batch = [chat_ids(tokenizer, p) for p in prompts[b : b + batch_size]]
        width = max(len(x) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])  # left-padded
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             **sampling)
        for x, row in zip(batch, gen[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append((x, row[:cut]))
        done = sum(len(a) for _, a in out)
        log.info("generated %d / %d answers, %d tokens, %.0f tokens/s", len(out), len(prompts), done,
                 done / (time.monotonic() - start))
    return out


@torch.no_grad()
def examples(model, pairs: list[tuple[list[int], list[int]]], layer_ids: list[int],
             dtype: torch.dtype = torch.bfloat16, batch_size: int = 8) -> list[Example]:
    """Forwards over whole sequences (prompt + answer), recording features, last hidden states and argmaxes.
    Batched right-padded: under causal attention a sequence's positions never see the padding after them."""
    out = []
    for b in range(0, len(pairs), batch_size):
        seqs = [prompt + answer for prompt, answer in pairs[b : b + batch_size]]
        width = max(len(x) for x in seqs)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])
        features, base = target_features(model.base_model, ids, layer_ids, dtype=dtype)
        for r, (x, (prompt, _)) in enumerate(zip(seqs, pairs[b : b + batch_size])):
            n, hidden = len(x), base.last_hidden_state[r, : len(x)]
            best = model.get_output_embeddings()(hidden).argmax(-1)  # [n], one row's logits at a time
            out.append(Example(ids[r, :n].clone(), features[r, :n].clone(), hidden.to(dtype), best, len(prompt)))
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
