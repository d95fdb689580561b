"""Pushed proposals: the next rounds the speculation cache pre-drafted (specdec.engine.propose_tree), each
as the answer a request for its outcome would get, with the fingerprint of the committed prefix it holds
for. The tier sends them unasked (ProposeRequest.push), so the coordinator may hold the next proposal when
the target's verdict reaches it; it uses one only when its prefix is exactly the committed one."""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class PushedProposal:
    prefix_len: int  # the committed length it holds for: the session's tokens, then the outcome's
    prefix_hash: int  # that prefix's fingerprint (specdec.core.prefix)
    result: object  # the TreeProposeResult a request over that prefix (same shape) is answered with


def pushed_proposals(work, answer_of) -> list[PushedProposal]:
    """The finished pre-drafted rounds of a ProposeTreeWork whose speculation just ended (its session cropped
    to work.base). answer_of(growth, base) builds the TreeProposeResult of a proposal grown below an outcome,
    as the cache hit would (on a copy: the cache keeps its growths untouched)."""
    hashes = work.session.hashes
    pushed = []
    for slot, growth in work.spec.items():
        if not growth.done:
            continue
        outcome, node = [], slot
        while node >= 0:  # the outcome's tokens: the accepted drafts, then the target's next token
            outcome.append(work.slot_tokens[node])
            node = work.slot_parents[node]
        outcome.reverse()
        length = work.base + len(outcome)
        pushed.append(PushedProposal(length, hashes.extended(outcome).at(length),
                                     answer_of(copy.copy(growth), length)))
    return pushed
