"""Ragged attention over the slot KV cache, plugged into transformers' attention interface.

A batched step is one flat sequence of T tokens (batch dimension 1) holding every scheduled session's
new tokens back to back, with per-token positions for the rotary embedding. For each layer this
function stores the step's keys and values in the sessions' slots, then lets each session's queries
attend to its own slot prefix: causal within its new tokens, everything before them. Sessions never
see each other's tokens, so batching changes no session's attention inputs.

Two shapes of work, two ways to run them, neither copying a cache:

* a **group** of sessions with few new tokens each (decoding, verifying K + 1 drafts): their queries
  are padded to [slots, H, n_max, D] and attend, in ONE call, to a view of the contiguous range of
  slots that holds them, with a mask per slot (its own length, causal over its new tokens). Slots
  are handed out lowest-first, so live sessions sit in a dense range;
* a **long** segment (a prefill chunk) attends alone to its own slot prefix, also a view.

On an AVX-512 or AVX2 CPU in float32 (the packed step mode, `StepConfig.row_attention`), every chain feed,
prefill chunks included, and every few-token tree take a third way instead: **row attention**
(csrc/row_attention.cpp), a kernel in which each new token attends to its own slot's visible positions
(a chain's token: every position up to its own; a tree node: its prefix plus a bit mask of its
ancestors), with no padding and no mask tensor. A padded group scores every slot's rows against the
longest feed's: one 5-token verify among 15 one-token decodes made that step's attention 2.6x the
decodes' alone (measured on a 2-core CPU). Each row's sums run in one fixed order, so a token's attention
is bitwise the same whatever else shares its step and however its prompt was split: a prompt prefilled
in one chunk, in several (--prefill-chunk) or after a reused prefix gives the same bits.

**Token trees** (issue 17): a feed may end in a tree's nodes (`trees[i]`: their parents, -1 = the
root, the last committed token). Node j is stored at slot position cached + m + j (m: the feed's new
tokens before its nodes), in node order, but sits at position cached + m + depth(j) for the rotary
embedding, and sees its committed prefix plus its ancestors only: the causal mask with the pairs
(node, earlier non-ancestor) switched off. A chain's nodes are a plain causal feed.

The step's layout reaches the attention through `active(layout)` (the engine thread's current step),
not through the model's keyword arguments, so that the decoder's forward can be compiled: inside a
torch.compile'd forward the attention is one opaque custom op (`specdec::ragged_attention`), and the
rest of the layer (norms, rotary, projections, MLP) is fused and runs with prepacked weights around it.
A `StaticLayout` (specdec.engine.static_attention) takes the other path: fixed shapes and device
buffers only, the attention a CUDA graph captures.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.engine import cpu_kernels
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.longs import longs

ATTENTION = "specdec_ragged"  # the name registered with transformers' AttentionInterface
GROUP_MAX_NEW = 32  # sessions feeding at most this many tokens in a step attend as one group
GROUP_MAX_SPREAD = 2.0  # ...if the slot range they span is at most this many times their count (else alone)
ROW_SPAN = 64  # row attention: a row sees its prefix whole and these many positions after it by bit mask


def row_kernel():
    """The row attention kernel's module, or None where it cannot be built (neither AVX-512 nor AVX2, no compiler)."""
    return cpu_kernels.load("row_attention")[0]


def row_attention_applies(cache: SlotKVCache, enabled: bool = True) -> str | None:
    """Why a step over this cache cannot use row attention, or None if it can."""
    if not enabled:
        return "turned off"
    if cache.geometry.device.type != "cpu" or cache.geometry.dtype != torch.float32:
        return "row attention is a float32 CPU kernel"
    if cache.geometry.head_dim % 16 or cache.geometry.head_dim > 256:
        return f"row attention needs a head size that is a multiple of 16, at most 256 (not {cache.geometry.head_dim})"
    return cpu_kernels.load("row_attention")[1]


@dataclass
class Segment:
    """One session's part of a step that attends alone."""

    slot: int
    start: int  # first of its tokens in the flat step
    end: int  # one past its last token
    kv_len: int  # tokens in its slot after this step (cached before + new)
    mask: torch.Tensor | None  # [new, kv_len] bool, True = may attend; None for a single new token


@dataclass
class Group:
    """Sessions with few new tokens each, attending together over slots first..first+count-1."""

    first: int
    count: int
    token_index: torch.Tensor  # [G] the group's tokens in the flat step
    slot_index: torch.Tensor  # [G] each token's slot - first
    query_index: torch.Tensor  # [G] each token's place among its session's new tokens
    n_max: int  # most new tokens of one session
    kv_len: int  # longest slot prefix read
    mask: torch.Tensor  # [count, 1, n_max, kv_len] additive: 0 where a query may attend, -inf elsewhere


@dataclass
class Rows:
    """Query rows for row attention: row g is token token_index[g] of the step; it sees
    positions [0, base[g]) of slot slot[g] and base[g] + b for each bit b set in bits[g]."""

    token_index: torch.Tensor  # [G] int64, CPU
    slot: torch.Tensor
    base: torch.Tensor
    bits: torch.Tensor


def row_visibility(cached: int, new: int, hidden: list[tuple[int, int]] | None) -> tuple[list[int], list[int]] | None:
    """(base, bits) per new token of a feed for row attention: token i sees positions < cached + i + 1
    except the hidden pairs' (i, j): position cached + j (j < 0: a tree node cached by an earlier feed).
    A chain's token i is (cached + i + 1, no bits), whatever the feed's length, so a prefill chunk's rows are
    computed as decoding computes them; a tree's tokens share a base and mask their span in bits. None where a
    tree's span does not fit ROW_SPAN bits."""
    if not hidden:
        return [cached + i + 1 for i in range(new)], [0] * new
    low = min([j for _, j in hidden] + [0])
    if new - low > ROW_SPAN:
        return None
    bits = [(1 << (i - low + 1)) - 1 for i in range(new)]
    for i, j in hidden:
        bits[i] &= ~(1 << (j - low))
    return [cached + low] * new, [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # as int64


@dataclass
class StepLayout:
    cache: SlotKVCache
    slots: torch.Tensor  # [T] int64 slot of each token
    positions: torch.Tensor  # [T] int64 position of each token in its session (the rotary embedding's)
    segments: list[Segment]
    group: Group | None
    extra: list[torch.Tensor]  # the caller's own int lists (build_layout's `extra`), on the device
    kv_positions: torch.Tensor | None = None  # [T] int64 where each token's key and value are stored; None = positions
    rows: Rows | None = None  # the rows that attend by row attention (then group is None)


def tree_layout(cached: int, new: int, parents: list[int] | None) -> tuple[list[int], list[tuple[int, int]]]:
    """A feed of `new` tokens ending in a tree's nodes (parents: local, -1 = root; None = no tree):
    (rotary positions [new], hidden pairs (i, j), j < i, where new token i must not see the key at
    position cached + j although the causal mask would let it: an earlier node that is not its ancestor).

    A tree may also grow over several feeds (the draft drafts one level per step): when parents holds
    more entries than there are new tokens, its first len(parents) - new nodes are already cached (at
    positions cached - done .. cached - 1, in node order) and the feed is the rest; j is then negative
    for a hidden cached node."""
    if not parents:
        return list(range(cached, cached + new)), []
    done = max(len(parents) - new, 0)  # nodes of the tree already cached
    m = new - (len(parents) - done)  # new tokens before the tree's nodes (committed tokens)
    depth: list[int] = []
    ancestors: list[set[int]] = []
    for j, parent in enumerate(parents):
        depth.append(0 if parent < 0 else depth[parent] + 1)
        ancestors.append({j} if parent < 0 else ancestors[parent] | {j})
    root = cached + m - done  # the position of the tree's first node in the slot
    positions = list(range(cached, cached + m)) + [root + d for d in depth[done:]]
    hidden = [(m + i - done, m + j - done) for i in range(done, len(parents)) for j in range(i) if j not in ancestors[i]]
    return positions, hidden


def causal_mask(cached: int, new: int, device: torch.device) -> torch.Tensor | None:
    """[new, cached + new]: query i (at position cached + i) sees positions <= cached + i."""
    if new == 1:
        return None
    keys = torch.arange(cached + new, device=device)
    return keys[None, :] <= (cached + torch.arange(new, device=device))[:, None]


def to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Int lists as int64 tensors on `device`: one host-to-device copy for all of them (from pinned
    memory, asynchronous, on a GPU) rather than one small synchronous copy each."""
    device = torch.device(device)
    flat = longs([x for xs in lists for x in xs])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    return split_flat(flat, [len(xs) for xs in lists])


def split_flat(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """torch.split(flat, sizes) along dim 0 as basic slices (views): the same tensors, without torch.split's
    Python dispatch (~10 us a call, a few times a step)."""
    out, start = [], 0
    for n in sizes:
        out.append(flat[start : start + n])
        start += n
    return out


def build_layout(cache: SlotKVCache, feeds: list[tuple[int, int, int]], device: torch.device,
                 extra: tuple[list[int], ...] = (), trees: list[list[int] | None] | None = None,
                 row_attention: bool = False) -> StepLayout:
    """feeds: (slot, cached, new) per session, in flat-step order. `extra` int lists travel to the device
    in the same copy as the layout's own indices (StepLayout.extra). trees: per feed, the parents of the
    tree nodes its new tokens end with, or None (tree_layout). row_attention: every chain feed (prefill
    chunks too) and the few-token trees attend by row attention (the caller checked row_attention_applies)
    instead of as a padded group or alone."""
    device = torch.device(device)
    trees = trees if trees is not None and any(trees) else None
    slots, positions, kv_positions = [], [], []
    small, long_feeds, start = [], [], 0
    hidden: dict[int, list[tuple[int, int]]] = {}  # feed start -> its tree's hidden pairs
    for f, (slot, cached, new) in enumerate(feeds):
        slots.extend([slot] * new)
        if trees is None:
            positions.extend(range(cached, cached + new))
        else:
            rope, pairs = tree_layout(cached, new, trees[f])
            positions.extend(rope)
            kv_positions.extend(range(cached, cached + new))
            if pairs:
                hidden[start] = pairs
        if new <= GROUP_MAX_NEW or (row_attention and (trees is None or not trees[f])):
            small.append((slot, cached, new, start))  # with row attention: every chain, prefill chunks too
        else:
            long_feeds.append((slot, cached, new, start))
        start += new
    lists = [slots, positions, *extra]
    if trees is not None:
        lists.append(kv_positions)
    rows = None
    if row_attention and small:
        seen = [(f, row_visibility(f[1], f[2], hidden.get(f[3]))) for f in small]
        rows = _rows([(f, v) for f, v in seen if v is not None])
        small = [f for f, v in seen if v is None]  # a tree too wide for the bit mask: the group, or alone
    group_spec = None
    if len(small) > 1:
        first, last = min(s[0] for s in small), max(s[0] for s in small)
        if last - first + 1 <= GROUP_MAX_SPREAD * len(small):
            group_spec = (first, last, small)
            lists.extend(_group_lists(small, first, last))
            small = []
    long_feeds.extend(small)  # small feeds that did not form a group attend alone
    long_feeds.sort(key=lambda f: f[3])
    group_hidden = None
    if group_spec is not None and hidden:
        first, last, members = group_spec
        n_max, kv_len = max(s[2] for s in members), max(s[1] + s[2] for s in members)
        group_hidden = [((slot - first) * n_max + i) * kv_len + cached + j  # flat index into [count, n_max, kv_len]
                        for slot, cached, new, begin in members for i, j in hidden.get(begin, ())]
        lists.append(group_hidden)
    tensors = to_device(lists, device)
    segments = [Segment(slot, begin, begin + new, cached + new, _tree_mask(causal_mask(cached, new, device), cached,
                                                                           hidden.get(begin), device))
                for slot, cached, new, begin in long_feeds]
    group = None
    if group_spec is not None:
        first, last, members = group_spec
        end = len(lists) - (group_hidden is not None)
        token_index, slot_index, query_index, slot_cached, slot_new = tensors[end - 5 : end]
        group = _group(cache, members, first, last, token_index, slot_index, query_index, slot_cached, slot_new, device,
                       tensors[-1] if group_hidden is not None else None)
    for slot, cached, new in feeds:
        cache.mark_written(slot, cached + new)
    kv = tensors[2 + len(extra)] if trees is not None else None
    return StepLayout(cache, tensors[0], tensors[1], segments, group, tensors[2 : 2 + len(extra)], kv, rows)


def _rows(feeds) -> Rows | None:
    """Row attention's rows: ((slot, cached, new, start in the step), (base per token, bits per token)) per feed."""
    if not feeds:
        return None
    token_index, slot_of, base_of, bits_of = [], [], [], []
    for (slot, cached, new, begin), (base, bits) in feeds:
        token_index.extend(range(begin, begin + new))
        slot_of.extend([slot] * new)
        base_of.extend(base)
        bits_of.extend(bits)
    table = longs([token_index, slot_of, base_of, bits_of])  # one copy for the four
    return Rows(*table.unbind(0))


def _tree_mask(mask: torch.Tensor | None, cached: int, pairs: list[tuple[int, int]] | None,
               device: torch.device) -> torch.Tensor | None:
    """A segment's causal mask [new, cached + new] with a tree's hidden pairs switched off (a one-token
    feed has no causal mask: it gets a full one when a cached node is hidden from it)."""
    if not pairs:
        return mask
    if mask is None:
        mask = torch.ones(1, cached + 1, dtype=torch.bool, device=device)
    rows = torch.tensor([i for i, _ in pairs], device=mask.device)
    cols = torch.tensor([cached + j for _, j in pairs], device=mask.device)
    mask[rows, cols] = False
    return mask


def _group_lists(small, first: int, last: int) -> list[list[int]]:
    """token_index, slot_index, query_index of the group's tokens; each slot's cached and new counts
    (0 and 0 for a slot in the range that holds no member)."""
    count = last - first + 1
    token_index, slot_index, query_index = [], [], []
    slot_cached, slot_new = [0] * count, [0] * count
    for slot, cached, new, begin in small:
        token_index.extend(range(begin, begin + new))
        slot_index.extend([slot - first] * new)
        query_index.extend(range(new))
        slot_cached[slot - first], slot_new[slot - first] = cached, new
    return [token_index, slot_index, query_index, slot_cached, slot_new]


def _group(cache: SlotKVCache, small, first: int, last: int, token_index, slot_index, query_index, slot_cached,
           slot_new, device, hidden: torch.Tensor | None = None) -> Group:
    count = last - first + 1
    n_max = max(s[2] for s in small)
    kv_len = max(s[1] + s[2] for s in small)
    cache.initialize(first, last, kv_len)  # everything the view reads is finite, masked or not
    # Query i of a slot (at position cached + i) sees keys j <= cached + i, and only if i < new; built on
    # the device from two small vectors (no [count, n_max, kv_len] host tensor to copy each step).
    keys = torch.arange(kv_len, device=device)
    queries = torch.arange(n_max, device=device)
    allowed = ((keys[None, None, :] <= slot_cached[:, None, None] + queries[None, :, None])
               & (queries[None, :, None] < slot_new[:, None, None]))  # [count, n_max, kv_len]
    if hidden is not None:  # token trees: a node sees only its ancestors among the nodes
        allowed.view(-1)[hidden] = False
    additive = torch.full(allowed.shape, float("-inf"), dtype=cache.geometry.dtype, device=device)
    additive.masked_fill_(allowed, 0.0)  # an additive mask: cheaper than a bool one in SDPA
    return Group(first, count, token_index, slot_index, query_index, n_max, kv_len, additive[:, None])


_current = threading.local()  # .layout: the step being run on this thread (the engine thread)


@contextmanager
def active(layout) -> Iterator[None]:
    """Run a forward over `layout` (a StepLayout, or a StaticLayout for captured steps)."""
    previous = getattr(_current, "layout", None)
    _current.layout = layout
    try:
        yield
    finally:
        _current.layout = previous


def current_layout():
    layout = getattr(_current, "layout", None)
    if layout is None:
        raise RuntimeError("a specdec forward ran outside attention.active(layout)")
    return layout


def attend(step: StepLayout, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """query [1, H, T, D], key / value [1, H_kv, T, D] (the step's new tokens, rotary applied) ->
    [T, H, D]. Stores the step's keys and values in the sessions' slots, then attends."""
    kv_positions = step.positions if step.kv_positions is None else step.kv_positions
    kernel = row_kernel() if step.rows is not None else None  # a float32 CPU step on the row kernel
    if kernel is not None:  # the cache's indexed copy, in one kernel call
        kernel.store_rows(step.cache.keys[layer], step.cache.values[layer], step.slots, kv_positions, key[0], value[0])
    else:
        step.cache.write(layer, step.slots, kv_positions, key[0], value[0])
    heads, dim = query.shape[1], query.shape[3]
    out = query.new_empty(query.shape[2], heads, dim)  # [T, H, D]
    tokens = query[0].transpose(0, 1)  # [T, H, D]
    if kernel is not None:
        r = step.rows
        kernel.row_attention(tokens, step.cache.keys[layer], step.cache.values[layer], r.token_index, r.slot,
                             r.base, r.bits, scaling if scaling is not None else dim ** -0.5, out)
    g = step.group
    if g is not None:
        padded = query.new_zeros(g.count, g.n_max, heads, dim)
        padded[g.slot_index, g.query_index] = tokens[g.token_index]
        k, v = step.cache.view(layer, g.first, g.count, g.kv_len)  # [count, H_kv, kv_len, D], in place
        o = F.scaled_dot_product_attention(padded.transpose(1, 2), k, v, attn_mask=g.mask, scale=scaling,
                                           enable_gqa=True)  # [count, H, n_max, D]
        out[g.token_index] = o.transpose(1, 2)[g.slot_index, g.query_index]
    for seg in step.segments:
        k, v = step.cache.view(layer, seg.slot, 1, seg.kv_len)
        o = F.scaled_dot_product_attention(query[:, :, seg.start : seg.end], k, v, attn_mask=seg.mask,
                                           scale=scaling, enable_gqa=True)  # [1, H, new, D]
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out


@torch.library.custom_op("specdec::ragged_attention", mutates_args=())
def ragged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                        scaling: float) -> torch.Tensor:
    """attend() over the active step, as one op a compiled forward calls without tracing into it (it
    writes the KV pool, a side effect the compiler never sees: its output is always used)."""
    return attend(current_layout(), layer, query, key, value, scaling)


@ragged_attention_op.register_fake
def _(query, key, value, layer, scaling):
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


def step_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scaling: float | None) -> torch.Tensor:
    """A layer's attention over the active step, whatever its form: query [1, H, T, D], key / value
    [1, H_kv, T, D] (rotary applied) -> [T, H, D]."""
    if torch.compiler.is_compiling():  # the compiled step: never look at the layout while tracing
        return ragged_attention_op(query, key, value, layer, float(scaling))
    layout = current_layout()
    if not isinstance(layout, StepLayout):  # a StaticLayout: fixed shapes, capturable
        return layout.attend(layer, query, key, value, scaling)
    return attend(layout, layer, query, key, value, scaling)


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: ([1, T, H, D], None) over the active step."""
    return step_attention(module.layer_idx, query, key, value, scaling)[None], None


def use_step_attention(model) -> None:
    """A transformers model's attention layers attend through the active step (ragged_attention, registered
    with transformers' AttentionInterface here: importing it loads transformers' modeling code, which a model
    in specdec.engine.llama_weights' container, run by LlamaDecoder alone, does without)."""
    if not hasattr(model, "set_attn_implementation"):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ragged_attention)
    model.set_attn_implementation(ATTENTION)
