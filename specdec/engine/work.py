"""A unit of work a servicer hands to the engine: one request of one session.

A work feeds its session's new tokens (in prefill chunks when long), asks for the logits of its last
num_logits tokens, and then either finishes with a result or asks for another feed (the draft's
autoregressive steps). Its kind decides what happens with the logits, for all works of that kind in a
step at once (finish_step), so the math runs batched.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from specdec.engine.sessions import Session


def step_id_base() -> int:
    """Where an engine's step ids start: a random 64-bit number with room for 2^32 steps above it, so that
    ids of different replicas' steps do not meet (the coordinator counts each step once by its id)."""
    return random.SystemRandom().getrandbits(31) << 32


@dataclass(eq=False)
class Work:
    session_id: str
    prefix_len: int  # committed tokens the tier is asked to keep
    prefix_hash: int  # their fingerprint
    pending: list[int]  # tokens still to feed, in order
    num_logits: int  # logits rows wanted for the last pending tokens
    session: Session | None = None  # set when the work starts
    reused: int = 0  # leading pending tokens the prefix cache supplied when it started (never fed)
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: bool = False  # the caller went away
    answered: bool = False  # the caller has its answer (Engine.respond) while the work runs on
    result: Any = None  # set by finish_step when done
    compute_s: float = 0.0  # time in the forward steps this work took part in
    submitted_at: float = 0.0  # time.perf_counter() when the engine got it
    last_step: tuple[int, int, float] = (0, 0, 0.0)  # (sessions, tokens, seconds) of its last step
    step_started: float = 0.0  # time.perf_counter() when its last step's forward began
    step_id: int = 0  # its last step's id (step_ids): the same for every work that step batched
    first_step_at: float = 0.0  # time.perf_counter() when its first step's forward began (0: none yet)
    settled_at: float = 0.0  # time.perf_counter() when the engine thread answered it (the round trace)
    on_push: Callable[[list], None] | None = None  # given unasked results (specdec.engine.pushed), on the event loop
    inline: bool = True  # it may step on its submitter's thread (Engine._take_inline; False: its caller has other
    #                     work meanwhile, e.g. a draft drafting ahead while it waits for the target's verdict)
    chain_steps: int = 0  # > 0: steps the engine runs as one chain after this step (run_chain)
    taps: tuple[int, ...] | None = None  # decoder layers whose outputs it wants at every token it feeds (Feed.taps);
    #                                      such a work takes nothing from the prefix cache: every token is fed
    fed_features: list[torch.Tensor] = field(default_factory=list)  # with taps: each step's Feed.features, in order
    all_rows: bool = False  # it wants the logits of every token it feeds, prefill chunks included (prompt logprobs):
    #                         the rows before its feed's last num_logits go to score_fed; it takes nothing from the prefix cache

    kind: ClassVar[str] = "work"

    @property
    def done(self) -> bool:
        return self.result is not None

    def queue_ms(self) -> float:
        """Time since submission not spent in this work's own steps."""
        return max(0.0, (time.perf_counter() - self.submitted_at - self.compute_s) * 1e3)

    def finished_step(self) -> tuple[float, float, float]:
        """(step, compute, queue) in ms as the work's last step ends: the step is its forward and the
        batch's work on its rows so far (verification, sampling), the time a session's round costs the
        tier; compute counts that step whole, and queue the rest since submission."""
        now = time.perf_counter()
        _, _, forward_s = self.last_step
        step_s = max(forward_s, now - self.step_started)
        compute_ms = (self.compute_s - forward_s + step_s) * 1e3
        return step_s * 1e3, compute_ms, max(0.0, (now - self.submitted_at) * 1e3 - compute_ms)

    def on_start(self, engine) -> None:
        """The work has its session (cropped to prefix_len), before its first feed: it may change what it
        feeds, or set .result to be answered with no step (the draft's tree compaction and speculation
        cache, specdec.engine.propose_tree)."""

    def feed_tree(self) -> list[int] | None:
        """The parents of the token tree the feed ends with (its last feed), or None."""
        return None

    def score_fed(self, rows: torch.Tensor, complete: bool) -> torch.Tensor:
        """With all_rows: a step's logits rows of the tokens it fed. Consume those before the feed's last num_logits
        (all of a prefill chunk's; complete: the feed is done) and return the rest (its finish_step's)."""
        raise NotImplementedError

    @classmethod
    def finish_step(cls, works: list["Work"], logits: list[torch.Tensor], engine) -> None:
        """Consume the logits of works whose feed completed this step: set .result, or a new feed."""
        raise NotImplementedError


    @classmethod
    def run_chain(cls, works: list["Work"], engine) -> None:
        """Works that finish_step left with the same chain_steps > 0: run those steps on the device, without
        the engine's lock (specdec.engine.draft_chain); finish_chain then completes them with it."""
        raise NotImplementedError

    @classmethod
    def finish_chain(cls, works: list["Work"], engine) -> None:
        raise NotImplementedError


class WorkFailed(Exception):
    """A work's own failure (its status and message); the rest of its batch carries on."""

    def __init__(self, code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
