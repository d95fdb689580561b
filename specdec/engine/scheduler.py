"""The scheduler: which works run in the next step, and how many of their tokens.

Works already running (a draft proposing its next token, a prefill part-way through) come first, then
waiting works in arrival order, within the step's budget of sessions and tokens. A work feeds at most
prefill_chunk_tokens per step, so a long prompt is spread over several steps and never holds up the
sessions that are decoding; its last chunk always holds every token whose logits it needs (a work that wants
the logits of every token, Work.all_rows, gets each chunk's too). A session
has at most one work running: a later request of the same session waits for the earlier one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.engine.config import BatchConfig
from specdec.engine.work import Work


STARTED, WAIT, DROPPED = "started", "wait", "dropped"


@dataclass
class Planned:
    work: Work
    take: int  # pending tokens fed this step
    num_logits: int  # logits rows wanted this step (0 unless the feed completes or the work wants all rows)
    complete: bool = False  # the step feeds the rest of the work's pending tokens


class Scheduler:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self.waiting: deque[Work] = deque()
        self.running: list[Work] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def plan(self, start) -> list[Planned]:
        """The next step. start(work) tries to start a waiting work (acquire its session) and says
        STARTED, WAIT (no free slot yet: it stays queued) or DROPPED (it was settled: failed or cancelled)."""
        c = self.config
        sessions_left, tokens_left = c.max_batch_sessions, c.max_batch_tokens
        planned: list[Planned] = []
        for work in self.running:
            if sessions_left == 0 or tokens_left == 0:
                break
            p = self._portion(work, tokens_left)
            if p is not None:
                planned.append(p)
                sessions_left -= 1
                tokens_left -= p.take
        busy = {w.session_id for w in self.running}
        still_waiting: deque[Work] = deque()
        while self.waiting:
            work = self.waiting.popleft()
            if work.session_id in busy or sessions_left == 0 or tokens_left == 0:
                still_waiting.append(work)
                continue
            p = self._portion(work, tokens_left)
            if p is None:
                still_waiting.append(work)
                continue
            outcome = start(work)
            if outcome == WAIT:
                still_waiting.append(work)
                continue
            if outcome == DROPPED:
                continue
            self.running.append(work)
            busy.add(work.session_id)
            p = self._portion(work, tokens_left)  # again: starting may take a cached prefix off pending
            if p is None:
                continue  # running; fed from the next step on
            planned.append(p)
            sessions_left -= 1
            tokens_left -= p.take
        self.waiting = still_waiting
        return planned

    def _portion(self, work: Work, tokens_left: int) -> Planned | None:
        n, m = len(work.pending), work.num_logits
        limit = min(max(self.config.prefill_chunk_tokens, m), tokens_left)
        if n <= limit:  # the whole feed: its logits come back this step
            return Planned(work, n, n if work.all_rows else m, complete=True)
        take = min(limit, n - m)  # a chunk; the last one must hold every row we need logits of
        return Planned(work, take, take if work.all_rows else 0) if take > 0 else None

    def finished(self, work: Work) -> None:
        self.running.remove(work)
