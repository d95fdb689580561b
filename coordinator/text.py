"""Incremental detokenization and stop strings for streaming."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never splitting a multi-byte character.

    Decodes a short window (a few tokens of context + the new ones) per step, as vLLM and TGI do, so
    cost does not grow with the length of the generation.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], context: int = 5) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int, last: bool = False) -> str:
        return self.push_many((token_id,), last)

    def push_many(self, token_ids, last: bool = False) -> str:
        """The text delta of several new tokens at once (one round's): two decodes, however many tokens. Text that
        ends in an incomplete character is held back, unless these are the output's last tokens (last): then it is
        the tokens' decode, U+FFFD for the incomplete character (vLLM's and TGI's last delta)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (last or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The text held back, at an end no token made (the context full)."""
        return self.push_many((), last=True)


class StopMatcher:
    """Finds the first stop string in a growing text and says how much text is safe to stream."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        """include: the text keeps the stop string (vLLM's include_stop_str_in_output); else it ends before it."""
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars that may start a stop

    def find(self, text: str, new_from: int) -> int:
        """Where the text ends at the first stop string (before it, or after it with include), searching only
        matches that end after `new_from`; -1 if none."""
        start = max(0, new_from - self.hold)
        hits = [(i, len(s)) for s in self.stops if (i := text.find(s, start)) >= 0]
        if not hits:
            return -1
        i, n = min(hits)
        return i + n if self.include else i

    def safe_len(self, text: str) -> int:
        """Length of the prefix of `text` that cannot be part of a future stop string."""
        return len(text) - self.hold if self.stops else len(text)
