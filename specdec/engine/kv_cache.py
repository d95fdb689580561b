"""KV memory laid out for batching: preallocated slots, one per live session.

Each layer holds keys and values as [num_slots, num_kv_heads, slot_tokens, head_dim]. A session owns
one slot for its lifetime and a length; a batched step writes only the step's new tokens (one indexed
copy per layer for the whole batch) and attends over each session's slot prefix in place, a view,
never a gathered copy. Rollback of speculative entries is a length change in the session table: the
stale positions are simply overwritten by the next write.

On a CPU the buffers are allocated with torch.empty, so the operating system commits a page only when
it is first written; on a GPU the whole pool is taken at start, as vLLM does. Either way the bound is
known up front: capacity_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model) -> "KVGeometry":
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

    def __init__(self, geometry: KVGeometry, num_slots: int, slot_tokens: int) -> None:
        if num_slots < 1 or slot_tokens < 1:
            raise ValueError(f"need at least one slot of one token, got {num_slots} x {slot_tokens}")
        self.geometry = geometry
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens
        shape = (num_slots, geometry.num_kv_heads, slot_tokens, geometry.head_dim)
        g = geometry
        self.keys = [torch.empty(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.values = [torch.empty(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * self.slot_tokens

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.geometry.bytes_per_token

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

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

    def view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A session's first `length` keys and values, in place: ([1, H_kv, length, D], same)."""
        return self.keys[layer][slot : slot + 1, :, :length], self.values[layer][slot : slot + 1, :, :length]
