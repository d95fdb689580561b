"""Decode and verify steps replayed from CUDA graphs, captured per shape bucket.

An eager step of a 30-layer model launches ~1,000 kernels from Python; on a GPU that, not the GPU,
sets the step's time (25-35 ms for a model whose weights stream in ~0.2 ms). A CUDA graph launches
them all at once. A graph holds fixed shapes and addresses, so a step is padded up to a bucket
(sessions S, query tokens per session n, keys L: each the next captured size up) and its indices go
into preallocated buffers (specdec.engine.static_attention); the graph runs the decoder, and the LM
head then runs eager on just the rows someone needs (one product). Graphs are captured on first use
(or at start for `capture_sessions` x `capture_tokens` at the shortest L), at most `max_graphs`; a
step that fits no bucket (a prefill chunk, more sessions or tokens than any bucket) runs eager, the
same function.

The draft's chain (specdec.engine.draft_chain) is captured too: its K - 1 steps (decoder, LM head, the
keyed draw, and advancing the buffers to the next position) as one graph per (bucket, steps, sampler
shape), so a Propose replays one graph.

Model: vLLM's CUDA-graph runner (capture_model, padding a batch up to a captured size) and gpt-fast's
`reduce-overhead` decode step. With `capture=False` the same static step runs without capture: that
is how the CPU tests check its arithmetic against the eager one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.engine.attention import active, tree_layout
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.longs import longs
from specdec.engine.static_attention import StaticBuffers, StaticLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    sessions: int  # S
    tokens: int  # n, query tokens per session
    kv_len: int  # L


def next_size(sizes: tuple[int, ...], x: int) -> int | None:
    """The smallest of the sorted `sizes` >= x, or None."""
    i = bisect.bisect_left(sizes, x)
    return sizes[i] if i < len(sizes) else None


def kv_sizes(slot_tokens: int, smallest: int = 128) -> tuple[int, ...]:
    """Key lengths captured: powers of two from `smallest`, and the slot's length."""
    sizes, size = [], smallest
    while size < slot_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, slot_tokens)


class CudaGraphStep:
    """Runs steps that fit a bucket through a captured graph (or, capture=False, the same static
    step uncaptured). The cache must have a scratch slot: cache.scratch_slot."""

    def __init__(self, decoder, cache: SlotKVCache, capture_sessions: tuple[int, ...], capture_tokens: tuple[int, ...],
                 max_graphs: int, capture: bool = True, max_capture_tokens: int = 512, kernel: bool = False) -> None:
        """kernel: attend on specdec.engine.triton_attention's kernel (StaticLayout.kernel)."""
        if cache.scratch_slot is None:
            raise ValueError("CUDA-graph steps need a KV cache with a scratch slot")
        self.decoder = decoder
        self.cache = cache
        self.sessions = tuple(sorted(set(capture_sessions)))
        self.tokens = tuple(sorted(set(capture_tokens)))
        self.kv_lens = kv_sizes(cache.slot_tokens)
        self.max_graphs = max_graphs
        self.max_capture_tokens = max_capture_tokens  # capture_at_start skips buckets of more padded tokens
        self.capture = capture
        self.kernel = kernel
        self.device = cache.geometry.device
        self.buffers = StaticBuffers.allocate(self.sessions[-1], self.tokens[-1], self.device)
        # Decode / verify graphs by (bucket, the layers it taps: () for none): (graph, (hidden, taps), layout)
        self.graphs: OrderedDict[tuple[Bucket, tuple[int, ...]], tuple[object, tuple, StaticLayout]] = OrderedDict()
        self.chains: OrderedDict[tuple, tuple[object, tuple, object]] = OrderedDict()  # draft chains, by shape
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s = 0.0  # time spent capturing
        self.replays = 0

    def bucket(self, feeds) -> Bucket | None:
        """The bucket a step of these feeds (slot, cached, tokens) fits, or None (run it eager)."""
        if any(f.tree is not None and len(f.tree) > len(f.tokens) for f in feeds):
            return None  # a tree grown over several feeds hides cached keys: the eager path's mask does that
        s = next_size(self.sessions, len(feeds))
        n = next_size(self.tokens, max(len(f.tokens) for f in feeds))
        length = next_size(self.kv_lens, max(f.cached + len(f.tokens) for f in feeds))
        if s is None or n is None or length is None:
            return None
        return Bucket(s, n, length)

    def run(self, feeds, bucket: Bucket, taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """The decoder's hidden states of every feed's tokens: [sum of new tokens, H], feed order. taps: layer
        ids -> filled with each one's output at the same tokens (a bucket's tapping steps replay a graph of
        their own, which writes those layers' outputs too)."""
        s_b, n_b = bucket.sessions, bucket.tokens
        scratch = self.cache.scratch_slot
        ids, positions, slots = [0] * (s_b * n_b), [i % n_b for i in range(s_b * n_b)], [scratch] * (s_b * n_b)
        kv_positions = list(positions)
        session_slots, cached, new = [scratch] * s_b, [0] * s_b, [0] * s_b
        hidden = [0] * (s_b * n_b * n_b)
        rows = []
        for s, f in enumerate(feeds):
            base = s * n_b
            rope, pairs = tree_layout(f.cached, len(f.tokens), f.tree)
            for i, token in enumerate(f.tokens):
                ids[base + i], positions[base + i], slots[base + i] = token, rope[i], f.slot
                kv_positions[base + i] = f.cached + i
            for i, j in pairs:
                hidden[(base + i) * n_b + j] = 1
            rows.extend(range(base, base + len(f.tokens)))
            session_slots[s], cached[s], new[s] = f.slot, f.cached, len(f.tokens)
        for slot in {f.slot for f in feeds} | {scratch}:  # every key the graph reads is finite
            self.cache.initialize(slot, slot, bucket.kv_len)
        self.buffers.fill([ids, positions, slots, session_slots, cached, new, kv_positions, hidden])
        layers = tuple(sorted(taps)) if taps else ()
        hidden, tapped = self._replay(bucket, layers)
        for f in feeds:
            self.cache.mark_written(f.slot, f.cached + len(f.tokens))
        index = longs(rows).to(self.device, non_blocking=True)
        if taps:
            taps.update((i, tapped[i][index]) for i in layers)
        return hidden[index]

    def _replay(self, bucket: Bucket, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        key = (bucket, layers)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(bucket, layers)
        self.graphs.move_to_end(key)
        graph, out, layout = entry
        if graph is None:  # uncaptured: run the static step now
            return self._static_step(layout, layers)
        graph.replay()
        self.replays += 1
        return out

    def _static_step(self, layout: StaticLayout, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict]:
        """(the decoder's output [S * n, H], layer id -> that layer's output [S * n, H] for each of `layers`)."""
        t = layout.num_tokens
        b = self.buffers
        taps = dict.fromkeys(layers) if layers else None
        with active(layout):
            layout.prepare()
            return self.decoder(b.input_ids[:t], b.positions[:t], taps), taps or {}

    def _capture(self, bucket: Bucket, layers: tuple[int, ...] = ()):
        layout = StaticLayout(self.cache, self.buffers, bucket.sessions, bucket.tokens, bucket.kv_len, self.kernel)
        if not self.capture:
            entry = (None, None, layout)
        else:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)  # the least recently used graph
            t0 = time.perf_counter()
            saved = [buf.clone() for buf in self._buffer_list()]
            self._fill_padding(bucket)  # warm-up and capture write only the scratch slot
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                layout = self._warm_up(layout, bucket, layers)  # lazy initialisation stays out of the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another engine thread of this process (a draft beside its target) may launch
            # kernels while this one captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._static_step(layout, layers)
            for buf, old in zip(self._buffer_list(), saved):
                buf.copy_(old)
            self.capture_s += time.perf_counter() - t0
            entry = (graph, out, layout)
        self.graphs[(bucket, layers)] = entry
        return entry

    def _warm_up(self, layout: StaticLayout, bucket: Bucket, layers: tuple[int, ...]) -> StaticLayout:
        """A bucket's first step, outside the graph; the Triton attention kernel compiles here, at its first
        launch. Where that fails (specdec.engine.triton_env: a read-only cache, no compiler, a driver that
        refuses it), every bucket attends through PyTorch from now on: logged, never a crash."""
        try:
            self._static_step(layout, layers)
            return layout
        except Exception as e:
            if not self.kernel:
                raise
            log.warning("the Triton attention kernel failed its first compile (%s: %s): attending through PyTorch",
                        type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        self.kernel = False
        layout = StaticLayout(self.cache, self.buffers, bucket.sessions, bucket.tokens, bucket.kv_len, False)
        self._static_step(layout, layers)
        return layout

    def _buffer_list(self) -> list[torch.Tensor]:
        return self.buffers.all()

    def _fill_padding(self, bucket: Bucket) -> None:
        scratch = self.cache.scratch_slot
        t = bucket.sessions * bucket.tokens
        self.cache.initialize(scratch, scratch, bucket.kv_len)
        self.buffers.fill([[0] * t, [i % bucket.tokens for i in range(t)], [scratch] * t, [scratch] * bucket.sessions,
                           [0] * bucket.sessions, [0] * bucket.sessions, [i % bucket.tokens for i in range(t)],
                           [0] * (t * bucket.tokens)])

    def chain_bucket(self, feeds, steps: int) -> Bucket | None:
        """The one-token bucket a draft chain of these feeds fits for `steps` steps, or None."""
        s = next_size(self.sessions, len(feeds))
        length = next_size(self.kv_lens, max(f.cached for f in feeds) + steps)
        if s is None or length is None or 1 not in self.tokens:
            return None
        return Bucket(s, 1, length)

    def chain(self, feeds, steps: int, sampler, head):
        """A draft chain (specdec.engine.draft_chain.run_chain) replayed from one graph: -> (tokens [B, steps],
        q ids [steps, S, n] | None, q probs | None), device tensors valid until the next chain."""
        bucket = self.chain_bucket(feeds, steps)
        key = (bucket, steps, len(feeds), sampler.signature)
        entry = self.chains.get(key)
        if entry is None:
            entry = self._capture_chain(key, bucket, steps, len(feeds), sampler, head)
        self.chains.move_to_end(key)
        graph, out, captured = entry
        captured.load(sampler)  # this batch's seeds and truncations into the graph's own tensors
        self._fill_chain(bucket, feeds)
        for f in feeds:
            self.cache.initialize(f.slot, f.slot, bucket.kv_len)
        if graph is None:
            out = self._chain_steps(captured, bucket, steps, len(feeds), head)
        else:
            graph.replay()
            self.replays += 1
        for f in feeds:
            self.cache.mark_written(f.slot, f.cached + steps)
        return out

    def _fill_chain(self, bucket: Bucket, feeds) -> None:
        scratch, pad = self.cache.scratch_slot, bucket.sessions - len(feeds)
        cached = [f.cached for f in feeds] + [0] * pad
        slots = [f.slot for f in feeds] + [scratch] * pad
        self.buffers.fill([[f.first for f in feeds] + [0] * pad, cached, slots, slots, cached,
                           [1] * len(feeds) + [0] * pad, cached, [0] * bucket.sessions])

    def _chain_steps(self, sampler, bucket: Bucket, steps: int, rows: int, head):
        """The chain's device work: each step the decoder, the head on the real rows, the draw, and every
        real session moved on by one token (padding sessions stay on the scratch slot's key 0)."""
        b, s = self.buffers, bucket.sessions
        layout = StaticLayout(self.cache, self.buffers, s, 1, bucket.kv_len, self.kernel)
        drawn, q_ids, q_probs = [], [], []
        for _ in range(steps):
            logits = head(self._static_step(layout)[0][:rows]).float()  # [B, V]
            token, ids, probs = sampler(logits, b.positions[:rows] + 1)
            drawn.append(token)
            if ids is not None:
                q_ids.append(ids)
                q_probs.append(probs)
            b.input_ids[:rows].copy_(token)
            step = b.new[:s]
            for buf in (b.positions, b.kv_positions, b.cached):
                buf[:s].add_(step)
        tokens = torch.stack(drawn, dim=1)
        return (tokens, torch.stack(q_ids), torch.stack(q_probs)) if q_ids else (tokens, None, None)

    def _capture_chain(self, key, bucket: Bucket, steps: int, rows: int, sampler, head):
        if not self.capture:
            entry = (None, None, sampler)
        else:
            if len(self.chains) >= self.max_graphs:
                self.chains.popitem(last=False)
            t0 = time.perf_counter()
            saved = [buf.clone() for buf in self._buffer_list()]

            def padding() -> None:  # warm-up and capture write only the scratch slot
                self._fill_padding(bucket)
                self.buffers.new[: bucket.sessions].zero_()

            padding()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._chain_steps(sampler, bucket, steps, rows, head)
            torch.cuda.current_stream().wait_stream(stream)
            padding()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._chain_steps(sampler, bucket, steps, rows, head)
            for buf, old in zip(self._buffer_list(), saved):
                buf.copy_(old)
            self.capture_s += time.perf_counter() - t0
            entry = (graph, out, sampler)
        self.chains[key] = entry
        return entry

    def capture_at_start(self) -> None:
        """Capture the decode / verify buckets at the shortest key length, so the first requests pay none."""
        for s in self.sessions:
            for n in self.tokens:
                if len(self.graphs) < self.max_graphs and s * n <= self.max_capture_tokens:
                    self._capture(Bucket(s, n, self.kv_lens[0]))
        if self.capture:
            torch.cuda.synchronize()
            log.info("captured %d CUDA graphs in %.1fs", len(self.graphs), self.capture_s)
