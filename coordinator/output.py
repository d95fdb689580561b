"""A generation's output as the client sees it: the committed tokens cut at EOS, the token budget or a stop
string, detokenized incrementally, and streamed as one TokenChunk per round (text held back while it may
still become a stop string)."""

from __future__ import annotations

from collections.abc import Sequence, Set

from coordinator.text import IncrementalDetokenizer, StopMatcher
from specdec.proto import generate_pb2

FinishReason = generate_pb2.FinishReason
UNFINISHED = FinishReason.FINISH_REASON_UNSPECIFIED


class Output:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int],
                 stop: Sequence[str] = (), stop_ids: Set[int] = frozenset(), include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        """eos: the token ids that end the generation (empty with ignore_eos); stop: stop strings (include_stop: the
        text keeps the one it ends at); stop_ids: tokens that end it with FINISH_REASON_STOP; min_tokens: no stop
        string is looked for before the output holds this many tokens (vLLM's; EOS and the stop tokens the target
        refuses until then: coordinator.min_tokens)."""
        self.max_new_tokens, self.min_tokens = max_new_tokens, min_tokens
        self.eos, self.stop_ids = eos, stop_ids
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_ids))
        self.stop = StopMatcher(list(stop), include_stop)
        self.text = ""  # the output's text so far (cut at a stop string)
        self.streamed = 0  # characters of it already streamed
        self.generated = 0  # tokens committed
        self.finish = UNFINISHED if max_new_tokens > 0 else FinishReason.FINISH_REASON_LENGTH  # (0: the prompt scored only)
        self.cut = False  # a stop string ended the text (nothing after it is text)

    @property
    def finished(self) -> bool:
        return self.finish != UNFINISHED

    @property
    def remaining(self) -> int:
        """Tokens the budget still allows."""
        return self.max_new_tokens - self.generated

    def end(self, reason: int) -> None:
        self.finish = reason

    def take(self, tokens: Sequence[int]) -> list[int]:
        """A round's tokens (accepted drafts + the next token) cut at EOS or the token budget, then at the
        first token whose text completes a stop string: the tokens to commit."""
        chunk: list[int] = []
        for tok in tokens:
            chunk.append(tok)
            if tok in self.stop_ids:
                self.finish = FinishReason.FINISH_REASON_STOP
                break
            if tok in self.eos:
                self.finish = FinishReason.FINISH_REASON_EOS
                break
            if self.generated + len(chunk) >= self.max_new_tokens:
                self.finish = FinishReason.FINISH_REASON_LENGTH
                break
        if self.stop.stops:  # token by token, to end at the first token whose text completes a stop string
            for i, tok in enumerate(chunk):
                before = len(self.text)
                self.text += self.detok.push(tok, last=self.finished and i == len(chunk) - 1)
                if self.generated + i + 1 < self.min_tokens:
                    continue
                at = self.stop.find(self.text, before)
                if at >= 0:
                    self.text = self.text[:at]
                    chunk = chunk[: i + 1]
                    self.finish, self.cut = FinishReason.FINISH_REASON_STOP, True
                    break
        else:
            self.text += self.detok.push_many(chunk, last=self.finished)
        self.generated += len(chunk)
        return chunk

    def event(self, chunk: list[int], logprobs: Sequence = ()) -> generate_pb2.GenerateResponse:
        """The round's TokenChunk: its tokens, the text that can no longer become a stop string, and the
        tokens' logprobs (target_pb2.TokenLogprobs, one per token, when the request asked for them)."""
        upto = len(self.text) if self.finished else self.stop.safe_len(self.text)
        delta = self.text[self.streamed:upto] if upto > self.streamed else ""
        self.streamed = max(self.streamed, upto)
        return generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(token_ids=chunk, text=delta,
                                                                          logprobs=_reported(logprobs)))

    @staticmethod
    def prompt_event(prompt_ids: Sequence[int], scores: Sequence) -> generate_pb2.GenerateResponse:
        """The prompt's scores (target_pb2.TokenLogprobs, one per prompt token after the first) as the stream's first
        message."""
        return generate_pb2.GenerateResponse(prompt_logprobs=generate_pb2.PromptLogprobs(
            token_ids=prompt_ids, logprobs=_reported(scores)))

    def tail(self) -> generate_pb2.GenerateResponse | None:
        """Text held back until the end, if any."""
        if not self.cut:  # (an end the tokens did not make: the context full)
            self.text += self.detok.flush()
        if self.streamed >= len(self.text):
            return None
        text, self.streamed = self.text[self.streamed:], len(self.text)
        return generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(text=text))


def _reported(logprobs: Sequence) -> list[generate_pb2.TokenLogprob]:
    """The target's TokenLogprobs as the public API's."""
    return [generate_pb2.TokenLogprob(
        token_id=t.token_id, logprob=t.logprob, rank=t.rank,
        top_logprobs=[generate_pb2.TopLogprob(token_id=i, logprob=v) for i, v in zip(t.top_token_ids, t.top_logprobs)])
        for t in logprobs]
