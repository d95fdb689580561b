"""The model runner's ragged forward against transformers' own forward, sequence by sequence.

Several sessions with different cached lengths share each step, through both attention paths (the
group of short feeds over a slot-range view, and long feeds alone), with every unused position of the
KV pool filled with NaN first: nothing outside a session's own prefix may leak into its logits.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine.runner import Feed, _finite_rows
from specdec.models import load_model
from tests.helpers import device_model
from tests.step_modes import MODES, assert_close, make_runner


@pytest.fixture(scope="module", params=MODES)
def runner(tiny_target, request):
    """A runner in every step mode over a pool of NaN garbage: only what the runner writes may ever be
    read unmasked."""
    return make_runner(tiny_target, request.param)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0]


@pytest.mark.parametrize("chunks", [
    [[3, 40, 7], [2, 2, 2]],  # prefill together, then short feeds: the group path
    [[50, 40, 45], [1, 5, 1]],  # long feeds (alone), then verify-sized feeds (group)
    [[1, 1, 1], [60, 1, 70]],  # a mix in one step
])
def test_ragged_steps_equal_full_forwards(tiny_target, runner, chunks):
    reference_model = load_model(device_model(tiny_target))  # plain sdpa attention
    g = torch.Generator().manual_seed(sum(map(sum, chunks)))
    sessions = [torch.randint(3, 5000, (sum(c[i] for c in chunks),), generator=g).tolist() for i in range(3)]
    slots = [runner.cache.allocate() for _ in sessions]
    try:
        fed = [0, 0, 0]
        for step in chunks:
            feeds = []
            for i, n in enumerate(step):
                feeds.append(Feed(slots[i], fed[i], sessions[i][fed[i] : fed[i] + n], n))
            logits = runner.forward(feeds)
            for i, n in enumerate(step):
                want = full_logits(reference_model, sessions[i][: fed[i] + n])[fed[i] : fed[i] + n]
                assert torch.isfinite(logits[i]).all()
                assert_close(logits[i], want, i)
                fed[i] += n
    finally:
        for s in slots:
            runner.cache.release(s)


def test_rollback_is_a_length_change(runner, tiny_target):
    """Feed drafts, keep only some, feed a different continuation: logits equal the full forward of
    the kept sequence; nothing of the dropped drafts survives."""
    reference_model = load_model(device_model(tiny_target))
    slot = runner.cache.allocate()
    try:
        prefix, drafts, other = [5, 6, 7, 8], [9, 10, 11], [12, 13]
        runner.forward([Feed(slot, 0, prefix + drafts, 4)])
        keep = len(prefix) + 1  # one draft accepted
        got = runner.forward([Feed(slot, keep, other, 2)])[0]
        want = full_logits(reference_model, prefix + drafts[:1] + other)[-2:]
        assert_close(got, want, "rollback")
    finally:
        runner.cache.release(slot)


@pytest.fixture(scope="module")
def eager(tiny_target):
    return make_runner(tiny_target, "eager")


def random_steps(seed: int, sessions: int, steps: int):
    """Per step, per session: tokens to feed (prefill-sized first, then verify-sized)."""
    g = torch.Generator().manual_seed(seed)
    plan = [[int(torch.randint(1, 40, (1,), generator=g)) for _ in range(sessions)]]
    for _ in range(steps):
        plan.append([int(torch.randint(0, 10, (1,), generator=g)) for _ in range(sessions)])  # 0: not in this step
    return plan


@pytest.mark.parametrize("seed", range(6))
def test_ragged_batches_equal_the_eager_forward(eager, runner, seed):
    """Random ragged batches (prefills, then 1..9-token feeds, sessions skipping steps, rollbacks): every
    mode's logits equal eager's and pick the same argmax."""
    fast = runner
    g = torch.Generator().manual_seed(100 + seed)
    n = 5
    seqs = [torch.randint(3, 5000, (400,), generator=g).tolist() for _ in range(n)]
    pairs = [(r.cache.allocate(), r) for r in (eager, fast) for _ in range(n)]
    slots = {id(r): [s for s, owner in pairs if owner is r] for r in (eager, fast)}
    try:
        fed = [0] * n
        for step in random_steps(seed, n, 6):
            feeds = {id(r): [] for r in (eager, fast)}
            for i, take in enumerate(step):
                if take == 0:
                    continue
                if fed[i] > 4 and int(torch.randint(0, 3, (1,), generator=g)) == 0:
                    fed[i] -= int(torch.randint(1, 4, (1,), generator=g))  # a rollback: drafts rejected
                for r in (eager, fast):
                    feeds[id(r)].append(Feed(slots[id(r)][i], fed[i], seqs[i][fed[i] : fed[i] + take], take))
                fed[i] += take
            if not feeds[id(eager)]:
                continue
            want = eager.forward(feeds[id(eager)])
            got = fast.forward(feeds[id(fast)])
            for w, o in zip(want, got):
                assert torch.isfinite(o).all()
                assert_close(o, w, (seed, step))
    finally:
        for s, r in pairs:
            r.cache.initialized[s] = 0
            r.cache.release(s)


def test_the_steps_finiteness_check_is_torchs():
    """The one check of a step's logits (forward_checked), through numpy on a CPU: the same verdict per row as
    torch.isfinite(x).all(dim=-1) with NaN, +inf and -inf anywhere, on contiguous rows and a strided view."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 49152, generator=g)
    x[1, 3], x[2, -1], x[3, 100], x[4] = float("nan"), float("inf"), float("-inf"), float("-inf")
    for rows in (x, x[:, ::2], x[5:6], x.double()):
        with torch.inference_mode():
            assert _finite_rows(rows) == torch.isfinite(rows).all(dim=-1).tolist()
    assert _finite_rows(x) == [True, False, False, False, False, True, True]

