"""min_tokens (vLLM's): the output's end refused until it holds that many tokens. At every position before then the
target's mask (VerifyRequest.token_masks, as structured output's) refuses EOS and the request's stop tokens, so p is
0 there and the output is the target's own under that rule: greedy, its argmax among the other tokens; sampled, its
distribution renormalised over them (transformers' min_new_tokens, vLLM's min_tokens). A round with masks does not
run on (its later positions would need masks of their own); once the output holds min_tokens the masks stop."""

from __future__ import annotations

import dataclasses

from coordinator.proposers.base import Proposal


class MinTokens:
    """The round loop's constraint (coordinator.constraint's interface) for a request with min_tokens."""

    def __init__(self, least: int, banned: set[int], vocab_size: int) -> None:
        """least: min_tokens; banned: EOS and the stop tokens; vocab_size: the target's (the masks' width)."""
        self.least, self.generated = least, 0
        width = (vocab_size + 7) // 8
        self.open = b"\xff" * width  # every token allowed
        closed = bytearray(self.open)
        for t in banned:
            if 0 <= t < vocab_size:
                closed[t // 8] &= ~(1 << (t % 8)) & 0xFF
        self.closed, self.banned = bytes(closed), set(banned)

    def forced(self, limit: int) -> list[int]:
        return []

    def check(self, proposal: Proposal, greedy: bool) -> tuple[Proposal, list[bytes]]:
        """The proposal and a mask per scored position (a chain's K + 1, a tree's root and nodes), or none once the
        output is long enough. A chain's drafts from its first refused one on are cut where that is exact (greedy,
        or deterministic drafts with no q: the target takes a refused token never); a tree's stay, their rows masked."""
        if self.generated >= self.least:
            return proposal, []
        if proposal.run_on:
            proposal = dataclasses.replace(proposal, run_on=0)
        if proposal.parents:
            depth: list[int] = []
            for parent in proposal.parents:  # parents come before their children
                depth.append(1 if parent < 0 else depth[parent] + 1)
            return proposal, [self._mask(0)] + [self._mask(d) for d in depth]
        tokens = proposal.tokens
        cut = next((i for i, t in enumerate(tokens) if t in self.banned and self.generated + i < self.least), None)
        if cut is not None and (greedy or not proposal.q):
            proposal = dataclasses.replace(proposal, tokens=tokens[:cut], q=proposal.q[:cut], probs=proposal.probs[:cut])
        return proposal, [self._mask(i) for i in range(len(proposal.tokens) + 1)]

    def _mask(self, ahead: int) -> bytes:
        """The mask of the position `ahead` tokens after the committed ones."""
        return self.closed if self.generated + ahead < self.least else self.open

    def commit(self, tokens: list[int]) -> None:
        self.generated += len(tokens)
