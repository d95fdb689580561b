"""Penalties over the tokens before a position, in vLLM's semantics (vllm/model_executor/layers/utils.py,
apply_penalties), which follow OpenAI's definition for presence and frequency:

    repetition: every token of the prompt or of the output so far: logit / r if logit > 0, else logit * r
    frequency:  logit -= frequency_penalty * (times the token occurs in the output so far)
    presence:   logit -= presence_penalty * (1 if it occurs in the output so far)

"The output so far" at a position is every generated token before it. Under speculation that is, for the
target's row i of a verify (i = 0..K, row K the bonus position): the committed generated tokens plus the
drafts d_1..d_i before it; for the draft's step: the committed generated tokens plus its own proposals so
far. So every row is exactly what a one-token-at-a-time decode would compute at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenCounts:
    """Token counts for some rows of a logits batch (only the penalised ones)."""

    rows: torch.Tensor  # [R] int64: the logits rows these counts belong to
    output: torch.Tensor  # [R, V] float32: times each token occurs among the generated tokens before the row
    seen: torch.Tensor  # [R, V] bool: the token occurs in the prompt or among those generated tokens

    @classmethod
    def at_positions(cls, tokens: Sequence[int], prompt_len: int, start: int, num_rows: int, first_row: int,
                     vocab_size: int, device: torch.device | str = "cpu") -> "TokenCounts":
        """Counts for num_rows consecutive positions of one sequence: row j's position sees tokens[:start + j].

        tokens: the session's sequence (prompt, generated, then any drafts), of length >= start + num_rows - 1;
        prompt_len: how many leading tokens are the prompt; first_row: the logits row of position `start`."""
        ids = torch.as_tensor(list(tokens[: start + num_rows - 1]), dtype=torch.long)
        prompt_len = min(prompt_len, start)
        base = torch.bincount(ids[prompt_len:start], minlength=vocab_size).float()  # [V] generated before `start`
        later = ids[start:]  # [num_rows - 1] the tokens each next row sees one more of
        steps = torch.zeros(num_rows, vocab_size)
        if later.numel():
            steps[1:] = torch.nn.functional.one_hot(later, vocab_size).float().cumsum(0)
        output = base[None, :] + steps  # [num_rows, V]
        prompt = torch.zeros(vocab_size, dtype=torch.bool)
        prompt[ids[:prompt_len]] = True
        seen = prompt[None, :] | (output > 0)
        rows = torch.arange(first_row, first_row + num_rows)
        return cls(rows.to(device), output.to(device), seen.to(device))

    @classmethod
    def cat(cls, parts: Sequence["TokenCounts"]) -> "TokenCounts | None":
        """One TokenCounts for the rows of all parts; None when there are none."""
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return cls(torch.cat([p.rows for p in parts]), torch.cat([p.output for p in parts]),
                   torch.cat([p.seen for p in parts]))


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32 (modified in place and returned)
    output: torch.Tensor,  # [R, V] float32: output counts (TokenCounts.output)
    seen: torch.Tensor,  # [R, V] bool: in the prompt or the output (TokenCounts.seen)
    presence: torch.Tensor,  # [R] presence penalties
    frequency: torch.Tensor,  # [R] frequency penalties
    repetition: torch.Tensor,  # [R] repetition penalties
) -> torch.Tensor:
    """vLLM's apply_penalties: repetition, then frequency, then presence."""
    penalty = torch.where(seen, repetition[:, None], 1.0)  # [R, V]
    logits *= torch.where(logits > 0, 1.0 / penalty, penalty)
    logits -= frequency[:, None] * output
    logits -= presence[:, None] * (output > 0).float()
    return logits
