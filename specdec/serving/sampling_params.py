"""The wire codec of SamplingParams: specdec.math.params.SamplingParams (+ the session's prompt length)
<-> common.proto's SamplingParams message. encode() is the coordinator's (the same message goes to both
tiers, so p and q are processed identically); decode() is the tiers' and checks what arrives, each failure
an INVALID_ARGUMENT naming the field. No torch: the coordinator imports it."""

from __future__ import annotations

from specdec.core.errors import invalid_argument
from specdec.math.params import SamplingParams
from specdec.proto import common_pb2


def encode(params: SamplingParams, prompt_len: int) -> common_pb2.SamplingParams:
    """prompt_len: the session's prompt tokens (the penalties' boundary between prompt and output)."""
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_p=params.min_p, logit_bias=dict(params.logit_bias),
        prompt_len=prompt_len)


def decode(msg: common_pb2.SamplingParams, vocab_size: int, committed_len: int) -> tuple[SamplingParams, int]:
    """(params, prompt_len), or RequestError(INVALID_ARGUMENT) naming the field. committed_len: the session's
    committed tokens as the request leaves them (prefix_len + new tokens), which bounds prompt_len."""
    params = SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0, min_p=msg.min_p,
        logit_bias=SamplingParams.bias_items(msg.logit_bias))
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise invalid_argument(f"sampling.{e}") from None
    if not 0 <= msg.prompt_len <= committed_len:
        raise invalid_argument(f"sampling.prompt_len must be in [0, {committed_len}] (the committed tokens), "
                               f"got {msg.prompt_len}")
    return params, msg.prompt_len
