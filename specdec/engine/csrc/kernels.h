// The kernels' entry points, one declaration each (their files define them; kernels.cpp exports them to Python).
#pragma once

#include <ATen/ATen.h>

// skinny_gemm.cpp: every linear, float32 panels or a GGUF's blocks (batch-invariant)
at::Tensor skinny_pack(const at::Tensor& w);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t N,
                           const c10::optional<at::Tensor>& bias);
at::Tensor quant_dequant(const at::Tensor& packed, int64_t fmt);
at::Tensor quant_rows(const at::Tensor& packed, int64_t fmt, const at::Tensor& rows, int64_t N);

// row_attention.cpp: each new token's attention over its own slot, and the step's keys and values stored
void row_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor rows, at::Tensor slots,
                   at::Tensor base, at::Tensor bits, double scale, at::Tensor out);
void store_rows(at::Tensor keys, at::Tensor values, at::Tensor slots, at::Tensor positions,
                at::Tensor key, at::Tensor value);

// row_ops.cpp: a Llama layer's small operators
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t head_dim);
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);
