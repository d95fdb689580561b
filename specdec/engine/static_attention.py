"""Attention over the slot KV cache with every shape fixed and every index in a device buffer.

A CUDA graph replays the kernels it captured on the addresses it captured, so a captured step cannot
take a Python list of segments or a view whose offset moves. This layout is the shape a graph can
hold: S sessions x n query tokens each (session-major: token s * n + i), attending to the first L keys
of their slots, where S, n and L are the bucket's (padded) sizes and everything that changes from step
to step (which slot, how many tokens cached, how many new) lives in preallocated buffers:

    slots, kv_positions [S * n]  where each token's key and value are written
    positions          [S * n]  each token's position for the rotary embedding
    session_slots      [S]      each session's slot (its L keys are gathered from there)
    cached, new        [S]      tokens cached before the step, and new tokens (<= n)
    hidden             [S * n * n]  1 where new token i of a session must not see its new token j < i
                                (token trees: a node sees only its ancestors among the nodes; 0 for chains)

Padding tokens (i >= new, or a padding session) write into a scratch slot no session owns and attend
only to key 0, so they are finite and change nothing. Query i of session s sees key j iff
j <= cached + i and (i, j - cached) is not hidden: the same rule as specdec.engine.attention (trees
included: a node is stored at cached + its index, at position cached + its depth), so the result is the
same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.engine.attention import split_flat
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.longs import longs
from specdec.engine.triton_attention import static_attention


@dataclass
class StaticBuffers:
    """The device buffers of every bucket (a bucket uses their leading parts)."""

    input_ids: torch.Tensor  # [S_max * n_max] int64
    positions: torch.Tensor  # [S_max * n_max] int64
    slots: torch.Tensor  # [S_max * n_max] int64
    session_slots: torch.Tensor  # [S_max] int64
    cached: torch.Tensor  # [S_max] int64
    new: torch.Tensor  # [S_max] int64
    kv_positions: torch.Tensor  # [S_max * n_max] int64
    hidden: torch.Tensor  # [S_max * n_max * n_max] int64 (0 / 1)

    @classmethod
    def allocate(cls, max_sessions: int, max_new: int, device) -> StaticBuffers:
        tokens = max_sessions * max_new
        z = lambda n: torch.zeros(n, dtype=torch.long, device=device)
        return cls(z(tokens), z(tokens), z(tokens), z(max_sessions), z(max_sessions), z(max_sessions), z(tokens),
                   z(tokens * max_new))

    def all(self) -> list[torch.Tensor]:
        """The buffers in field order."""
        return [self.input_ids, self.positions, self.slots, self.session_slots, self.cached, self.new,
                self.kv_positions, self.hidden]

    def fill(self, host: list[list[int]]) -> None:
        """Copy eight host lists (in field order, each no longer than its buffer) in with one transfer."""
        flat = longs([x for xs in host for x in xs])
        device = self.input_ids.device
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        parts = split_flat(flat, [len(xs) for xs in host])
        for buf, part in zip(self.all(), parts):
            buf[: part.shape[0]].copy_(part, non_blocking=True)


@dataclass
class StaticLayout:
    """One bucket's view of the buffers: S sessions x n tokens over L keys."""

    cache: SlotKVCache
    buffers: StaticBuffers
    num_sessions: int  # S
    tokens_per_session: int  # n
    kv_len: int  # L
    kernel: bool = False  # attend on specdec.engine.triton_attention's kernel (CUDA), no gather and no mask
    mask: torch.Tensor | None = None  # [S, 1, n, L] additive, computed by prepare() from the buffers

    @property
    def num_tokens(self) -> int:
        return self.num_sessions * self.tokens_per_session

    def prepare(self) -> None:
        """Build the mask on the device from cached / new (inside a captured graph: no host work). The
        kernel applies the same rule itself."""
        if self.kernel:
            return
        b, s, n, length = self.buffers, self.num_sessions, self.tokens_per_session, self.kv_len
        device = b.cached.device
        keys = torch.arange(length, device=device)[None, None, :]  # [1, 1, L]
        queries = torch.arange(n, device=device)[None, :, None]  # [1, n, 1]
        cached, new = b.cached[:s, None, None], b.new[:s, None, None]  # [S, 1, 1]
        rel = keys - cached  # [S, 1, L] key j as an index among the new tokens
        block = b.hidden[: s * n * n].view(s, n, n)  # [S, n, n]
        hidden = (block.gather(2, rel.clamp(0, n - 1).expand(s, n, length)) != 0) & (rel >= 0) & (rel < n)  # [S, n, L]
        allowed = ((keys <= cached + queries) & (queries < new) & ~hidden) | (keys == 0)  # [S, n, L]; key 0: no empty row
        additive = torch.zeros(allowed.shape, dtype=self.cache.geometry.dtype, device=device)
        self.mask = additive.masked_fill_(~allowed, float("-inf"))[:, None]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """query [1, H, S * n, D], key / value [1, H_kv, S * n, D] -> [S * n, H, D]."""
        b, s, n = self.buffers, self.num_sessions, self.tokens_per_session
        t = s * n
        self.cache.write(layer, b.slots[:t], b.kv_positions[:t], key[0], value[0])
        heads, dim = query.shape[1], query.shape[3]
        if self.kernel:
            return static_attention(query[0], self.cache.keys[layer], self.cache.values[layer], b.session_slots,
                                    b.cached, b.new, b.hidden, n, self.kv_len, scaling if scaling is not None else dim ** -0.5)
        q = query[0].reshape(heads, s, n, dim).transpose(0, 1)  # [S, H, n, D]
        k = self.cache.keys[layer][:, :, : self.kv_len].index_select(0, b.session_slots[:s])  # [S, H_kv, L, D]
        v = self.cache.values[layer][:, :, : self.kv_len].index_select(0, b.session_slots[:s])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scaling, enable_gqa=True)  # [S, H, n, D]
        return o.transpose(1, 2).reshape(t, heads, dim)
