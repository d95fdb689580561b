"""KV memory laid out for batching: preallocated slots, one per live session.

Each layer holds keys and values as [num_slots, num_kv_heads, slot_tokens, head_dim]. A session owns
one slot for its lifetime and a length; a batched step writes only the step's new tokens (one indexed
copy per layer for the whole batch) and attends over each session's slot prefix in place, a view,
never a gathered copy. Rollback of speculative entries is a length change in the session table: the
stale positions are simply overwritten by the next write.

On a CPU the buffers are allocated with torch.empty, so the operating system commits a page only when
it is first written: resident_bytes counts what has been touched (every position below a slot's
`initialized` mark), which grows with the longest sessions each slot has held and is what the process
really uses. On a GPU the whole pool is taken at start, as vLLM does, and resident_bytes is all of it.
Either way the bound is known up front: capacity_bytes. A memory budget sizes the pool:
slots_for_budget().

CUDA-graph steps (specdec.engine.cuda_graphs) need one more slot that no session owns, where the
padding tokens of a captured step write: `scratch=True` adds it (scratch_slot).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from specdec.engine.longs import longs


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model) -> KVGeometry:
        c = model.config
        heads = c.num_attention_heads
        return cls(
            num_layers=c.num_hidden_layers,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            dtype=next(model.parameters()).dtype,
            device=next(model.parameters()).device,
        )

    @property
    def bytes_per_token(self) -> int:
        """Keys plus values of one token across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element


class SlotKVCache:
    """num_slots preallocated sessions of at most slot_tokens tokens each."""

    def __init__(self, geometry: KVGeometry, num_slots: int, slot_tokens: int, scratch: bool = False) -> None:
        if num_slots < 1 or slot_tokens < 1:
            raise ValueError(f"need at least one slot of one token, got {num_slots} x {slot_tokens}")
        self.geometry = geometry
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens
        self.scratch_slot = num_slots if scratch else None  # written by padding tokens only, never allocated
        shape = (num_slots + int(scratch), geometry.num_kv_heads, slot_tokens, geometry.head_dim)
        g = geometry
        self.keys = [torch.empty(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.values = [torch.empty(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self._free = list(range(num_slots))  # a heap: the lowest free slot first, so live sessions stay dense
        # Positions [0, initialized[s]) of slot s hold finite numbers (written or zeroed): a batched
        # attention over a range of slots may read (and mask out) anything below it.
        self.initialized = [0] * (num_slots + int(scratch))

    @staticmethod
    def slots_for_budget(geometry: KVGeometry, slot_tokens: int, budget_bytes: int) -> int:
        """How many slots of slot_tokens tokens fit in budget_bytes (at least one)."""
        return max(1, budget_bytes // (slot_tokens * geometry.bytes_per_token))

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * self.slot_tokens

    @property
    def capacity_bytes(self) -> int:
        """The sessions' bound: every slot full."""
        return self.capacity_tokens * self.geometry.bytes_per_token

    @property
    def resident_bytes(self) -> int:
        """Memory the pool really occupies now: all of it on a GPU; on a CPU the positions ever touched."""
        if self.geometry.device.type != "cpu":
            return len(self.initialized) * self.slot_tokens * self.geometry.bytes_per_token  # scratch slot included
        return sum(self.initialized) * self.geometry.bytes_per_token

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """The lowest free slot, or None when every slot is taken."""
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def initialize(self, first: int, last: int, length: int) -> None:
        """Make positions [0, length) of slots first..last finite (zero what was never written), so they
        can be read through a mask. Each position of each slot is zeroed at most once."""
        for slot in range(first, last + 1):
            done = self.initialized[slot]
            if done < length:
                for layer in range(self.geometry.num_layers):
                    self.keys[layer][slot, :, done:length] = 0
                    self.values[layer][slot, :, done:length] = 0
                self.initialized[slot] = length

    def mark_written(self, slot: int, end: int) -> None:
        """Positions below `end` of `slot` now hold written keys and values."""
        self.initialized[slot] = max(self.initialized[slot], end)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Positions [0, length) of slot src into slot dst, every layer (the prefix cache: a shared prefix's
        keys and values, no forward). The slots must differ; src must hold `length` written positions."""
        if src == dst or length > self.initialized[src]:
            raise ValueError(f"cannot copy {length} positions from slot {src} (initialized {self.initialized[src]}) to {dst}")
        for layer in range(self.geometry.num_layers):
            self.keys[layer][dst, :, :length] = self.keys[layer][src, :, :length]
            self.values[layer][dst, :, :length] = self.values[layer][src, :, :length]
        self.mark_written(dst, length)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [T] int64: the slot of each new token
        positions: torch.Tensor,  # [T] int64: its position in the session
        key: torch.Tensor,  # [num_kv_heads, T, head_dim]
        value: torch.Tensor,  # [num_kv_heads, T, head_dim]
    ) -> None:
        """Store a step's new keys and values for every session in the batch (one indexed copy)."""
        self.keys[layer][slots, :, positions] = key.transpose(0, 1)
        self.values[layer][slots, :, positions] = value.transpose(0, 1)

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        """Copy the keys and values at positions `source` of `slot` to positions `target` (same length),
        in every layer: a token tree's accepted path moved into place after verification. The sources
        are read before any target is written, so the two may overlap."""
        if source == target:
            return
        device = self.geometry.device
        src, dst = longs(source, device), longs(target, device)
        for layer in range(self.geometry.num_layers):
            self.keys[layer][slot, :, dst] = self.keys[layer][slot, :, src]
            self.values[layer][slot, :, dst] = self.values[layer][slot, :, src]

    def view(self, layer: int, first: int, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of slots first..first+count-1, in place:
        ([count, H_kv, length, D], same)."""
        return (self.keys[layer][first : first + count, :, :length], self.values[layer][first : first + count, :, :length])
