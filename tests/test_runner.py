"""The model runner's ragged forward against transformers' own forward, sequence by sequence.

Several sessions with different cached lengths share each step, through both attention paths (the
group of short feeds over a slot-range view, and long feeds alone), with every unused position of the
KV pool filled with NaN first: nothing outside a session's own prefix may leak into its logits.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import Feed, ModelRunner
from specdec.models import load_model
from tests.helpers import TEST_DTYPE, device_model

# float32 (CI's dtype): the ragged forward equals transformers' to 1e-4 and picks the same argmax. In
# bfloat16 / float16 (SPECDEC_TEST_DTYPE on a GPU) two attention implementations round differently:
# the logits must agree to a few percent of their scale, and near-tie argmaxes may differ
# (bench/exactness.py counts how often).
EXACT = TEST_DTYPE == "float32"


def assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    got, want = got.float(), want.float()
    if EXACT:
        assert torch.allclose(got, want, atol=1e-4), (what, float((got - want).abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1)), what
    else:
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max()), (what, float((got - want).abs().max()))


@pytest.fixture(scope="module")
def runner(tiny_target):
    model = load_model(device_model(tiny_target))
    cache = SlotKVCache(KVGeometry.of(model), num_slots=8, slot_tokens=256)
    for t in cache.keys + cache.values:
        t.fill_(float("nan"))  # garbage: only what the runner writes may ever be read unmasked
    return ModelRunner(model, cache)


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
