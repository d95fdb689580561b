"""Attention of a captured step (specdec.engine.static_attention) as one Triton kernel per layer: the GPU's
counterpart of csrc/row_attention.cpp.

PyTorch's path for a StaticLayout gathers each session's keys and values out of the pool (two copies),
builds an additive mask, expands the KV heads for grouped-query attention and runs SDPA's math kernels:
~10 launches a layer, more than the layer's products. Here one program per (token, head) reads its
session's slot in place, applies the layout's rule (query i of a session sees key j iff j <= cached + i
and (i, j - cached) is not hidden, and every query sees key 0, so padding rows stay finite) and keeps an
online softmax in float32 over blocks of keys. The keys are read from the bucket's first L positions only,
so the work is what the bucket holds, and the launch's arguments (pointers, L) are fixed: it captures.
"""

from __future__ import annotations

import functools

import torch

from specdec.engine import triton_env

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: StaticLayout attends through PyTorch's SDPA
    triton = None

BLOCK_KEYS = 64


if triton is not None:

    @triton.jit
    def _static_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, session_slots_ptr, cached_ptr, new_ptr, hidden_ptr,
                                 q_stride_t, q_stride_h, o_stride_t, o_stride_h, kv_heads, slot_tokens, n, group,
                                 scale, KV_LEN: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)  # token s * n + i
        h = tl.program_id(1)  # query head
        s = t // n
        i = t % n
        slot = tl.load(session_slots_ptr + s)  # int64
        cached = tl.load(cached_ptr + s)
        new = tl.load(new_ptr + s)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t * q_stride_t + h * q_stride_h + d).to(tl.float32)
        base = (slot * kv_heads + h // group) * slot_tokens  # the slot's first key of this KV head
        m = tl.full([1], float("-inf"), tl.float32)  # running max and sum: 1-element vectors
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for start in range(0, KV_LEN, BLOCK_N):  # L is a bucket's: a few values, each compiled once
            j = start + tl.arange(0, BLOCK_N)
            rel = j - cached  # key j as an index among the session's new tokens
            among_new = (rel >= 0) & (rel < n)
            hidden = tl.load(hidden_ptr + t * n + rel, mask=among_new, other=0)
            allowed = (((j <= cached + i) & (i < new) & (hidden == 0)) | (j == 0)) & (j < KV_LEN)
            offsets = (base + j)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + offsets, mask=allowed[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]
            scores = tl.where(allowed, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new)
            v = tl.load(v_ptr + offsets, mask=allowed[:, None], other=0.0).to(tl.float32)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(out_ptr + t * o_stride_t + h * o_stride_h + d, (acc / total).to(out_ptr.dtype.element_ty))


def available(device: torch.device, head_dim: int) -> str | None:
    """Why the kernel cannot run here, or None if it can."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"the kernel runs on CUDA devices, not {device.type}"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head dim {head_dim} is not a power of two >= 16"
    return _toolchain()


@functools.cache
def _toolchain() -> str | None:
    """Whether Triton can compile here at all (specdec.engine.triton_env), checked once; the kernel's
    own first compile comes in the CUDA graphs' warm-up, which falls back to PyTorch's attention."""
    return triton_env.compile_first("the Triton attention kernel", lambda: None)


def static_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, session_slots: torch.Tensor,
                     cached: torch.Tensor, new: torch.Tensor, hidden: torch.Tensor, n: int, kv_len: int,
                     scaling: float) -> torch.Tensor:
    """query [H, S * n, D] (any strides with contiguous D); keys / values: a layer's pool [slots, H_kv,
    slot_tokens, D]; session_slots, cached, new [>= S]; hidden [>= S * n * n] -> [S * n, H, D]."""
    heads, tokens, dim = query.shape
    kv_heads, slot_tokens = keys.shape[1], keys.shape[2]
    if query.stride(2) != 1 or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError("static_attention needs contiguous head dims and a contiguous KV pool")
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    _static_attention_kernel[(tokens, heads)](
        query, keys, values, out, session_slots, cached, new, hidden, query.stride(1), query.stride(0),
        out.stride(0), out.stride(1), kv_heads, slot_tokens, n, heads // kv_heads, scaling,
        KV_LEN=kv_len, D=dim, BLOCK_N=BLOCK_KEYS)
    return out
