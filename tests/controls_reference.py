"""The target alone with the sampling controls: our math (specdec.math) applied in a plain one-token loop
over the model's full forward (no KV cache, no speculation, no batching): what the served output and its
logprobs must equal."""

from __future__ import annotations

import torch

from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts
from specdec.math.sampling import logprobs_rows, process_logits, top_logprobs


def _last_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([seq], device=model.device)).logits[0, -1:].float().cpu()  # [1, V]


def _counts(seq: list[int], prompt_len: int, vocab: int) -> TokenCounts:
    return TokenCounts.at_positions(seq, prompt_len, len(seq), 1, 0, vocab)


def reference_greedy_processed(model, prompt: list[int], max_new: int, params: SamplingParams,
                               eos: list[int] | None = (2,)) -> list[int]:
    """Greedy decoding one token at a time with logit_bias and the penalties applied at every position."""
    seq = list(prompt)
    for _ in range(max_new):
        logits = _last_logits(model, seq)
        tok = int(process_logits(logits, params, _counts(seq, len(prompt), logits.shape[-1])).argmax())
        seq.append(tok)
        if eos and tok in eos:
            break
    return seq[len(prompt):]


def reference_logprobs(model, prompt: list[int], output: list[int], params: SamplingParams, top_n: int):
    """Per token of `output` (teacher-forced): (logprob, top ids, top logprobs) the target alone reports."""
    seq, out = list(prompt), []
    for tok in output:
        logits = _last_logits(model, seq)
        lp = logprobs_rows(logits, [params], _counts(seq, len(prompt), logits.shape[-1]))
        chosen, ids, vals = top_logprobs(lp, torch.tensor([tok]), top_n)
        out.append((float(chosen[0]), ids[0, :top_n].tolist(), vals[0, :top_n].tolist()))
        seq.append(tok)
    return out
