"""Row attention (csrc/row_attention.cpp through specdec.engine.attention): each chain feed's tokens (prefill
chunks too) and each few-token tree's attend to their own slot's visible positions. Exact visibility cases,
equality with PyTorch's attention over padded groups (chains, trees, a tree grown over several feeds), batch
invariance (a feed's output is bitwise the same alone or among others), query heads that share a key / value head
computed together as each alone, a prompt split anyhow giving the same bits, a step through the packed mode, and a
bad row refused."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import attention
from specdec.engine.attention import ROW_SPAN, build_layout, row_attention_applies, row_kernel, row_visibility
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import Feed
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels("the row attention kernel")

H, H_KV, D, L = 9, 3, 64, 256  # the default target's heads


def test_the_kernel_is_built():
    assert attention.row_kernel() is not None, row_attention_applies(cache())


def test_visibility_of_chains_and_trees():
    assert row_visibility(10, 1, None) == ([11], [0])  # a chain's token sees every position up to its own
    assert row_visibility(10, 3, None) == ([11, 12, 13], [0, 0, 0])  # causal over the new tokens
    assert row_visibility(0, 4 * ROW_SPAN, None) == (list(range(1, 4 * ROW_SPAN + 1)), [0] * 4 * ROW_SPAN)  # any length
    # a tree after one committed token: nodes 1, 2 children of 0 (the new token before the tree)... node 2
    # must not see node 1 (its sibling): pair (2, 1) hidden
    assert row_visibility(5, 3, [(2, 1)]) == ([5] * 3, [0b1, 0b11, 0b101])
    # a tree grown over feeds: cached node at position cached - 1 hidden from new token 0 (j = -1)
    assert row_visibility(8, 2, [(0, -1)]) == ([7] * 2, [0b10, 0b111])
    assert row_visibility(0, ROW_SPAN, [(1, 0)]) is not None
    assert row_visibility(0, ROW_SPAN + 1, [(1, 0)]) is None  # a tree wider than the bit mask: the padded path


def cache(slots: int = 8, seed: int = 1) -> SlotKVCache:
    c = SlotKVCache(KVGeometry(num_layers=1, num_kv_heads=H_KV, head_dim=D, dtype=torch.float32,
                               device=torch.device("cpu")), slots, L)
    g = torch.Generator().manual_seed(seed)
    c.keys[0].copy_(torch.randn(c.keys[0].shape, generator=g))
    c.values[0].copy_(torch.randn(c.values[0].shape, generator=g))
    return c


def step(feeds, trees, rows: bool, queries: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Attend one layer over `feeds` (slot, cached, new); queries / keys / values of each feed's new tokens
    are fixed per slot (queries[slot]: [H + 2 H_KV, new, D]), so a feed's inputs are the same in any batch.
    Returns each slot's output [new, H, D]."""
    c = cache()
    for slot, cached, _ in feeds:
        c.mark_written(slot, cached)
    parts = [queries[slot] for slot, _, _ in feeds]
    qkv = torch.cat(parts, dim=1)  # [H + 2 H_KV, T, D]
    q, k, v = qkv[:H][None], qkv[H : H + H_KV][None], qkv[H + H_KV :][None]
    layout = build_layout(c, feeds, torch.device("cpu"), trees=trees, row_attention=rows)
    assert (layout.rows is not None) == rows and (layout.group is None or not rows)
    out = attention.attend(layout, 0, q, k, v, None)
    result, start = {}, 0
    for slot, _, new in feeds:
        result[slot] = out[start : start + new]
        start += new
    return result


FEEDS = [(0, 40, 1), (1, 17, 3), (3, 100, 5), (4, 7, 1), (6, 60, 4), (7, 0, 2)]
TREES = [None, None, [-1, 0, 0, 1, 2], None, [-1, 0, 1, 0], None]


def inputs(seed: int = 2) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {slot: torch.randn(H + 2 * H_KV, new, D, generator=g) for slot, _, new in FEEDS}


@pytest.mark.parametrize("trees", [None, TREES], ids=["chains", "trees"])
def test_equal_to_attention_over_padded_groups(trees):
    x = inputs()
    want, got = step(FEEDS, trees, False, x), step(FEEDS, trees, True, x)
    for slot in want:
        torch.testing.assert_close(got[slot], want[slot], rtol=1e-5, atol=1e-5)


def test_a_tree_grown_over_feeds_sees_only_its_ancestors():
    """The draft drafts a tree a level per step: the second feed's nodes must not see the first feed's
    nodes that are not their ancestors (hidden pairs with j < 0)."""
    x = {2: torch.randn(H + 2 * H_KV, 2, D, generator=torch.Generator().manual_seed(3))}
    feeds, trees = [(2, 30, 2)], [[-1, -1, 0, 1]]  # two roots cached; now a child of each
    want, got = step(feeds, trees, False, x), step(feeds, trees, True, x)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_batch_invariant_bitwise():
    x = inputs()
    together = step(FEEDS, TREES, True, x)
    for i, feed in enumerate(FEEDS):
        alone = step([feed], [TREES[i]], True, x)
        assert torch.equal(alone[feed[0]], together[feed[0]]), feed
    reordered = step(FEEDS[::-1], TREES[::-1], True, x)
    assert all(torch.equal(reordered[s], together[s]) for s in together)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (12, 3, 32), (6, 2, 128), (16, 1, 16)])
def test_query_heads_that_share_a_kv_head_give_what_each_gives_alone(heads, kv_heads, head_dim):
    """A task takes the query heads that share a key / value head together (their loads shared); each head's
    output is bitwise what it is with a key / value head of its own (the cache's heads repeated: one head a
    task), for chains and tree rows over a long context."""
    kernel = row_kernel()
    torch.manual_seed(0)
    keys, values = torch.randn(3, kv_heads, 1100, head_dim), torch.randn(3, kv_heads, 1100, head_dim)
    q = torch.randn(5, heads, head_dim)
    rows, slots = torch.arange(5), torch.tensor([0, 1, 1, 2, 2])
    base, bits = torch.tensor([0, 1000, 37, 17, 1050]), torch.tensor([0, 0, 0b1011, 0b1, 0b111])
    grouped, alone = torch.empty_like(q), torch.empty_like(q)
    kernel.row_attention(q, keys, values, rows, slots, base, bits, 0.125, grouped)
    group = heads // kv_heads
    kernel.row_attention(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), rows, slots, base,
                         bits, 0.125, alone)
    assert torch.equal(grouped, alone)


def test_a_row_past_the_cache_is_refused():
    c = cache()
    out = torch.empty(1, H, D)
    q = torch.randn(1, H, D)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="row_attention"):
        attention.row_kernel().row_attention(q, c.keys[0], c.values[0], one, torch.tensor([99]), one, torch.tensor([1]),
                                             0.125, out)
    with pytest.raises(RuntimeError, match="past the cache"):
        attention.row_kernel().row_attention(q, c.keys[0], c.values[0], one, one, torch.tensor([L]), torch.tensor([1]),
                                             0.125, out)
    with pytest.raises(RuntimeError, match="past the cache"):  # a chain's token one past the slot
        attention.row_kernel().row_attention(q, c.keys[0], c.values[0], one, one, torch.tensor([L + 1]), torch.tensor([0]),
                                             0.125, out)
    # a chain's token at the slot's last position sees all L positions (no bits): allowed
    attention.row_kernel().row_attention(q, c.keys[0], c.values[0], one, one, torch.tensor([L]), torch.tensor([0]), 0.125, out)
    assert torch.isfinite(out).all()


def test_the_kernel_stores_a_steps_keys_and_values_as_the_indexed_copy_does():
    """store_rows (the step's keys and values into their slots, from strided views of the fused product, as the
    decoder hands them) leaves bitwise the cache SlotKVCache.write leaves; a slot or position out of range is
    refused and writes nothing."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, (H + 2 * H_KV) * D, generator=g)  # four tokens of three sessions, as one product
    key = qkv[:, H * D:(H + H_KV) * D].view(4, H_KV, D).transpose(0, 1)  # [H_kv, T, D], strided
    value = qkv[:, (H + H_KV) * D:].view(4, H_KV, D).transpose(0, 1)
    slots, positions = torch.tensor([0, 2, 2, 1]), torch.tensor([7, 0, 1, L - 1])
    indexed, kernel = cache(), cache()
    indexed.write(0, slots, positions, key, value)
    attention.row_kernel().store_rows(kernel.keys[0], kernel.values[0], slots, positions, key, value)
    assert torch.equal(kernel.keys[0], indexed.keys[0]) and torch.equal(kernel.values[0], indexed.values[0])
    assert kernel.keys[0].abs().sum() > 0
    for bad_slots, bad_positions in (([0, 2, 2, 8], [7, 0, 1, 2]), ([0, 2, 2, 1], [7, 0, 1, L])):
        before = kernel.keys[0].clone()
        with pytest.raises(RuntimeError, match="store_rows: slot or position out of range"):
            attention.row_kernel().store_rows(kernel.keys[0], kernel.values[0], torch.tensor(bad_slots),
                                              torch.tensor(bad_positions), key, value)
        assert torch.equal(kernel.keys[0], before)


def test_a_feed_that_fills_its_slot_to_the_last_position():
    """A chain whose last token takes the slot's last position (a context at its limit) attends like any other:
    equal to PyTorch's attention over the padded group."""
    g = torch.Generator().manual_seed(3)
    feeds = [(0, L - 5, 5), (1, L - 40, 40)]  # a verify and a prefill chunk, each ending at position L - 1
    x = {slot: torch.randn(H + 2 * H_KV, new, D, generator=g) for slot, _, new in feeds}
    rows, padded = step(feeds, None, True, x), step(feeds, None, False, x)
    for slot in (0, 1):
        assert torch.allclose(rows[slot], padded[slot], atol=1e-5), slot


def test_the_packed_step_uses_it_and_decodes_as_the_eager_step(tiny_target):
    """A packed runner attends by rows; its greedy continuation equals the eager runner's (transformers'
    attention)."""
    runners = {mode: runner(tiny_target, mode) for mode in ("eager", "packed")}
    assert runners["packed"].row_attention and not runners["eager"].row_attention
    prompt = [5, 17, 42, 9, 33, 2, 71]
    outs = {}
    for mode, r in runners.items():
        tokens, cached = list(prompt), 0
        for _ in range(12):
            logits = r.forward([Feed(0, cached, tokens[cached:], 1)])[0]
            cached = len(tokens)
            tokens.append(int(logits[-1].argmax()))
        outs[mode] = tokens
    assert outs["packed"] == outs["eager"]


def test_a_packed_verify_computes_bitwise_what_decoding_computes(tiny_target):
    """Every operator of the packed float32 step is row-wise with sums in a fixed order (skinny GEMM, row
    attention, row ops), on all of torch's threads: so the logits of a verify's K + 1 rows, batched with
    another session, are bitwise those of decoding the same tokens one step at a time. Greedy verification
    then accepts exactly what greedy decoding would emit, whatever the batch and K."""
    r = runner(tiny_target, "packed")
    prompt, drafts = [5, 17, 42, 9, 33, 2, 71], [8, 120, 3, 77, 14]
    for slot in (0, 1):
        r.forward([Feed(slot, 0, prompt, 1)])
    r.forward([Feed(2, 0, prompt[:4], 1)])
    decoded = [r.forward([Feed(0, len(prompt) + i, [t], 1)])[0][0] for i, t in enumerate(drafts)]
    verified = r.forward([Feed(2, 4, [8, 9], 2), Feed(1, len(prompt), drafts, len(drafts))])[1]
    for i in range(len(drafts)):
        assert torch.equal(verified[i], decoded[i]), i


def test_a_prompt_split_anyhow_gives_the_same_bits(tiny_target):
    """Every chain feed attends by rows, prefill chunks too (longer than the padded group's 32 tokens): so a
    prompt prefilled whole, in chunks (--prefill-chunk) or after a reused prefix leaves bitwise the same
    logits and cache, and the same greedy continuation: prefix reuse changes no session's output."""
    r = runner(tiny_target, "packed")
    prompt = [(7 * i + 3) % 200 for i in range(90)]

    def run(slot: int, splits: list[int]) -> list[torch.Tensor]:
        cached, logits = 0, None
        for end in splits + [len(prompt)]:
            logits = r.forward([Feed(slot, cached, prompt[cached:end], 1)])[0][-1]
            cached = end
        rows, token = [logits], int(logits.argmax())
        for i in range(6):
            rows.append(r.forward([Feed(slot, len(prompt) + i, [token], 1)])[0][-1])
            token = int(rows[-1].argmax())
        return rows

    whole = run(0, [])
    for slot, splits in ((1, [50]), (2, [10, 45]), (3, [89])):
        assert all(torch.equal(a, b) for a, b in zip(run(slot, splits), whole)), splits


def runner(path: str, mode: str):
    from specdec.engine.config import StepConfig
    from specdec.engine.runner import ModelRunner
    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(path, device="cpu", dtype="float32"))
    return ModelRunner(model, SlotKVCache(KVGeometry.of(model), 4, 128), StepConfig(mode=mode))
