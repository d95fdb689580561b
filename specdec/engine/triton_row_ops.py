"""The row ops (residual add with RMSNorm, rotary in place, SiLU times up) as three Triton kernels: the GPU's
counterpart of csrc/row_ops.cpp, behind the same interface (specdec.engine.llama.TorchRowOps).

On a GPU a small model's step is bound by the number of kernels it launches, not by its weights' bytes:
the default target's 30 layers stream 540 MB in ~0.2 ms on an H100, but PyTorch's operators for one
layer's norms, rotary and MLP activation are ~30 kernels of a few microseconds each, ~2 ms a step even
replayed from a CUDA graph. Here each is one kernel, one program per row (or per row and head), reading
and writing the row once:

    add_rms_norm   x += delta (in place, the residual stream); out = w * rms(x)   (norm in float32)
    rotary_        x[:, h] = x[:, h] cos + rotate_half(x[:, h]) sin, in place on each head
    silu_mul       silu(gate) * up, each rounded to the model's dtype as PyTorch rounds it

They compute what transformers' operators compute, in the same precision; the float32 sums of a norm are
added in another order, so results may differ from PyTorch's in the last bit (bench/exactness.py counts
argmax flips per device and dtype). The kernels need Triton and a CUDA device (`available`); elsewhere the
decoder runs PyTorch's operators.
"""

from __future__ import annotations

import functools

import torch

from specdec.engine import triton_env

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs): the decoder uses TorchRowOps
    triton = None


def available(device: torch.device) -> str | None:
    """Why the Triton row ops cannot run on `device`, or None if they can (their first compile, tried
    once per device: specdec.engine.triton_env)."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"the kernels run on CUDA devices, not {device.type}"
    return _compiled(device)


@functools.cache
def _compiled(device: torch.device) -> str | None:
    return triton_env.compile_first("the Triton row ops", lambda: _first_launch(device))


def _first_launch(device: torch.device) -> None:
    """Each kernel once on two rows (compiling it), then a sync: a failure raises here, not in a step."""
    x, w = torch.ones(2, 64, device=device), torch.ones(64, device=device)
    TritonRowOps.add_rms_norm(x, x.clone(), w, 1e-6)
    TritonRowOps.rotary_(x, torch.ones(2, 16, device=device), torch.zeros(2, 16, device=device), 16)
    TritonRowOps.silu_mul(x, x)
    torch.cuda.synchronize(device)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, x_stride, delta_stride, out_stride, n, eps,
                             HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            x = x + tl.load(delta_ptr + row * delta_stride + cols, mask=mask, other=0.0)
            tl.store(x_ptr + row * x_stride + cols, x, mask=mask)
        h = x.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / n
        h = (h * tl.rsqrt(variance + eps)).to(x.dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * out_stride + cols, w * h, mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, x_stride, cs_stride, HALF: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, HALF)
        base = x_ptr + row * x_stride + head * 2 * HALF
        x1 = tl.load(base + cols)
        x2 = tl.load(base + HALF + cols)
        c1 = tl.load(cos_ptr + row * cs_stride + cols)
        c2 = tl.load(cos_ptr + row * cs_stride + HALF + cols)
        s1 = tl.load(sin_ptr + row * cs_stride + cols)
        s2 = tl.load(sin_ptr + row * cs_stride + HALF + cols)
        # transformers: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); products rounded first
        tl.store(base + cols, x1 * c1 + (-x2) * s1)
        tl.store(base + HALF + cols, x2 * c2 + x1 * s2)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, out_stride, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0)
        u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
        g32 = g.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # F.silu: computed in float32, rounded to the dtype
        tl.store(out_ptr + row * out_stride + cols, silu * u, mask=mask)


def _rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"row ops take [T, n] tensors with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


class TritonRowOps:
    """csrc/row_ops.cpp's three calls as Triton kernels (CUDA): the interface of specdec.engine.llama.TorchRowOps."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (the residual, in place), then LlamaRMSNorm(x)."""
        _rows(x)
        t, n = x.shape
        out = torch.empty_like(x)
        if delta is not None:
            _rows(delta)
        _add_rms_norm_kernel[(t,)](x, delta if delta is not None else x, weight, out, x.stride(0),
                                   delta.stride(0) if delta is not None else 0, out.stride(0), n, eps,
                                   HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
        return out

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        """Rotary embedding in place on each head of x [T, heads * D] (cos, sin [T, D])."""
        _rows(x)
        t = x.shape[0]
        heads = x.shape[1] // head_dim
        if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
            raise ValueError(f"the rotary kernel needs a head dim of twice a power of two, got {head_dim}")
        cos, sin = cos.contiguous(), sin.contiguous()
        _rotary_kernel[(t, heads)](x, cos, sin, x.stride(0), cos.stride(0), HALF=head_dim // 2)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _rows(gate)
        _rows(up)
        t, n = gate.shape
        out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
                                                     BLOCK=block)
        return out
