"""The scheduler's plan, case by case: a long feed in prefill chunks whose last one holds every row the work needs
logits of; a work that wants every row's logits (prompt logprobs) gets each chunk's rows too; the step budget."""

from __future__ import annotations

from specdec.engine.config import BatchConfig
from specdec.engine.scheduler import STARTED, Scheduler
from specdec.engine.work import Work


def plans(n: int, num_logits: int, *, all_rows: bool = False, chunk: int = 4, tokens: int = 512):
    """(take, num_logits, complete) of each step until the work's feed is done, fed as the engine feeds it."""
    scheduler = Scheduler(BatchConfig(prefill_chunk_tokens=chunk, max_batch_tokens=tokens))
    work = Work(session_id="s", prefix_len=0, prefix_hash=0, pending=list(range(n)), num_logits=num_logits,
                all_rows=all_rows)
    scheduler.waiting.append(work)
    out = []
    while work.pending:
        (p,) = scheduler.plan(lambda w: STARTED)
        out.append((p.take, p.num_logits, p.complete))
        del work.pending[: p.take]
    return out


def test_a_long_feed_gets_its_logits_in_its_last_chunk():
    assert plans(10, 3) == [(4, 0, False), (3, 0, False), (3, 3, True)]
    assert plans(3, 3) == [(3, 3, True)]
    assert plans(5, 4, chunk=2) == [(1, 0, False), (4, 4, True)]  # (a chunk never splits the rows it needs logits of)


def test_a_work_wanting_every_row_gets_each_chunks_rows():
    assert plans(10, 3, all_rows=True) == [(4, 4, False), (3, 3, False), (3, 3, True)]
    assert plans(9, 1, all_rows=True, chunk=5) == [(5, 5, False), (4, 4, True)]


def test_the_steps_token_budget_cuts_a_chunk():
    assert plans(10, 1, chunk=8, tokens=3) == [(3, 0, False), (3, 0, False), (3, 0, False), (1, 1, True)]
    assert plans(10, 1, all_rows=True, chunk=8, tokens=3) == [(3, 3, False), (3, 3, False), (3, 3, False), (1, 1, True)]
