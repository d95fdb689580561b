"""Skinny GEMM: float32 linears of a few rows on an AVX-512 or AVX2 CPU, batch-invariant (csrc/skinny_gemm.cpp).

A decode step multiplies 1 row by every weight matrix, a verify K + 1 rows, a batched step a few dozen.
The libraries' float32 products handle those shapes badly on a CPU: measured on this project's 2-core
AMD EPYC (torch 2.13's F.linear; per product of the default target), 2 rows cost 2.0x 1 row and 3 rows
3.0x, and even at one row they reach a third of what the memory can stream (the 49152 x 576 LM head:
11 ms against ~3.5 ms); oneDNN's packed weights (specdec.engine.packed) fix the growth at 2-3 rows but
not the cost of one. This kernel is the textbook register-blocked micro-kernel over weights packed once
at start in 16-column panels, one sequential stream each: at 1-3 rows it takes 0.1-0.5x the time of
either library, at 9 rows 0.3-0.8x, and it is level with oneDNN at 64-512 rows (prefill chunks).

**Batch-invariant by construction.** Each output is one sum over k in order, one fused multiply-add per
term, in a register lane of its own; the blocking decides which sums share registers, never their order.
So a row's result is bitwise the same alone or among 500 others, and a product of concatenated weights
(q, k, v in one) gives bitwise what separate products give. In a tier that means a verify of K + 1
tokens, a batched step and a one-token decode compute every linear identically: the argmax of a step
cannot depend on its shape through the products. Against transformers' own float32 forward (the
library's products, another summation order) the logits differ in the last bits, as any two BLAS do;
greedy output differs only at an exact near-tie (bench/exactness.py counts them).

The same kernel runs a GGUF's quantised matrices in their blocks (specdec.engine.quant_gemm), bitwise what
it gives over their dequantised float32 weights. The kernel is built once with the host's C++ compiler and then imported with none (specdec.engine.cpu_kernels,
which `make setup` runs). Without AVX-512 or AVX2, or without a compiler, kernel() is None, unavailable() says why, and
the packed step mode keeps oneDNN's products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.engine import cpu_kernels, quant_gemm


def kernel():
    """The kernel's module (skinny_pack, skinny_linear), built on first call; None where unavailable."""
    return cpu_kernels.load("skinny_gemm")[0]


def unavailable() -> str | None:
    """Why kernel() is None, or None when it is there."""
    return cpu_kernels.load("skinny_gemm")[1]


class SkinnyLinear(torch.nn.Module):
    """y = x W^T + b for one linear or several side by side (their weights concatenated: one product, whose
    output split() cuts back into theirs), W packed once. float32 on the CPU."""

    def __init__(self, linears: Sequence[torch.nn.Linear]) -> None:
        super().__init__()
        ops = kernel()
        if ops is None:
            raise RuntimeError(f"skinny GEMM kernel unavailable: {unavailable()}")
        weights = [lin.weight.detach() for lin in linears]
        if len({w.shape[1] for w in weights}) != 1 or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
            raise ValueError("SkinnyLinear: float32 CPU linears with the same in_features")
        self.sizes = [w.shape[0] for w in weights]  # each linear's out_features, in order
        self.in_features, self.out_features = weights[0].shape[1], sum(self.sizes)
        self.packed = ops.skinny_pack(torch.cat(weights) if len(weights) > 1 else weights[0].contiguous())
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
        self._linear = ops.skinny_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self._linear(rows, self.packed, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """forward()'s output cut into each linear's (views)."""
        return y.split_with_sizes(self.sizes, dim=-1)


class FusedProduct:
    """Linears sharing an input as one product on the kernel: x -> each one's output (views of one result).
    `linear` is the product (a SkinnyLinear, or a QuantLinear in a GGUF's blocks), `sizes` each linear's
    out_features in order: what specdec.engine.llama's native decoder reads to run the same product."""

    def __init__(self, linear: torch.nn.Module, sizes: Sequence[int]) -> None:
        self.linear, self.sizes = linear, list(sizes)

    def __call__(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return self.linear.forward(x).split_with_sizes(self.sizes, dim=-1)  # forward: no module call per product

    @property
    def format(self) -> int:
        """The native decoder's format id: 0 for float32 panels, else the GGUF block format's ggml type."""
        return self.linear.fmt.ggml_type if isinstance(self.linear, quant_gemm.QuantLinear) else 0


class Products:
    """Linears sharing an input that cannot be one product (GGUF blocks of different formats, blocks beside float32
    weights): each run of neighbours that can, one FusedProduct, in turn; x -> each linear's output. `parts` is
    what specdec.engine.llama's native decoder reads (it concatenates their outputs)."""

    def __init__(self, parts: Sequence[FusedProduct]) -> None:
        self.parts = list(parts)
        self.sizes = [n for part in self.parts for n in part.sizes]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [y for part in self.parts for y in part(x)]


def fused_product(linears: Sequence[torch.nn.Module]):
    """A decoder's product over several linears as one skinny GEMM (a FusedProduct), or, where they cannot be one,
    one per run of neighbours in the same GGUF block format (Products): x -> each linear's output. Linears kept in
    a GGUF's blocks (specdec.engine.quant_gemm.QuantLinear) fuse as blocks."""
    sizes = [lin.out_features for lin in linears]
    if all(isinstance(lin, quant_gemm.QuantLinear) for lin in linears):
        fused = quant_gemm.fused(linears)
        if fused is not None:
            return FusedProduct(fused, sizes)
    if any(isinstance(lin, quant_gemm.QuantLinear) for lin in linears):  # some in blocks, or blocks that do not fuse
        runs: list[list[torch.nn.Module]] = []
        for lin in linears:
            if runs and isinstance(lin, quant_gemm.QuantLinear) and isinstance(runs[-1][0], quant_gemm.QuantLinear) \
                    and lin.fmt == runs[-1][0].fmt:
                runs[-1].append(lin)
            else:
                runs.append([lin])
        parts = []
        for run in runs:
            fused = quant_gemm.fused(run) if isinstance(run[0], quant_gemm.QuantLinear) else None
            if fused is not None:
                parts.append(FusedProduct(fused, [lin.out_features for lin in run]))
            else:  # float32 weights, or blocks that do not fuse: one product each
                parts += [FusedProduct(lin if isinstance(lin, quant_gemm.QuantLinear) else SkinnyLinear([lin]),
                                       [lin.out_features]) for lin in run]
        return Products(parts)
    return FusedProduct(SkinnyLinear(linears), sizes)
