"""What every proposer returns: tokens plus their q rows, which the target verifies the same way, losslessly."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.core.proposer_names import Proposer
from specdec.proto import common_pb2


@dataclass
class Proposal:
    source: Proposer  # DRAFT_MODEL, PROMPT_LOOKUP or SUFFIX
    tokens: list[int]  # d_1..d_K (possibly fewer than asked, or none); a tree's nodes in node order
    q: list[common_pb2.DraftDistribution] = field(default_factory=list)  # empty = one-hot on tokens
    probs: list[float] = field(default_factory=list)  # the source's own estimate: P(d_1..d_i all accepted); empty = none
    wall_ms: float = 0.0  # time the proposal kept the round waiting, as seen here
    compute_ms: float = 0.0  # model compute on the draft tier
    queue_ms: float = 0.0  # the rest of the draft tier's time (waiting for steps, sampling, bookkeeping)
    overlapped: bool = False  # drafted during the previous round's verification
    k: int = 0  # tokens asked for (the proposer may offer fewer)
    catch_up: int = 0  # draft model: committed tokens it had to be fed first (1-2 when it drafts every round)
    fallback: bool = False  # prompt lookup standing in for an unreachable draft model
    parents: list[int] = field(default_factory=list)  # a token tree: each node's parent (-1 = root); empty = a chain
    tree_scheme: int = 0  # a tree's target_pb2.TreeScheme (0: candidates without q, IID with q)
    run_on: int = 0  # tokens the target may decode by itself after the verdict (the ramp's; none at a request's K > 0)
    run_on_part: int = 0  # stream the round's tokens in parts of this many as the target decodes them, where it has more (0: with the verdict)
