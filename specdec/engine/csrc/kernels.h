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

// The same kernels on raw pointers (sizes and row strides, no checks, no tensors made): what the functions above
// call once they have checked their arguments, and what the decoder calls, having checked its own once a step.
namespace raw {
void linear(const float* x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& packed, int64_t fmt, int64_t N,
            const float* bias, float* y, int64_t ldy);  // fmt 0: skinny_pack's panels; else quant_linear's tiles
void row_attention(const float* q, int64_t q0, int64_t q1, int64_t H, int64_t D, const float* keys, const float* values,
                   int64_t Hkv, int64_t L, const int64_t* rows, const int64_t* slots, const int64_t* base,
                   const int64_t* bits, int64_t G, double scale, float* out, int64_t o0, int64_t o1);
void store_rows(float* keys, float* values, int64_t Hkv, int64_t L, int64_t D, const int64_t* slots,
                const int64_t* positions, int64_t T, const float* key, int64_t k0, int64_t k1, const float* value,
                int64_t v0, int64_t v1);  // key / value [H_kv, T, D]: head stride k0 / v0, token stride k1 / v1
void add_rms_norm(float* x, int64_t ldx, const float* delta, int64_t ldd, const float* weight, double eps, float* h,
                  int64_t ldh, int64_t T, int64_t N);  // delta nullptr: none
void rotary(float* x, int64_t ldx, const float* cos, int64_t ldc, const float* sin, int64_t lds, int64_t T, int64_t N,
            int64_t head_dim);
void silu_mul(const float* gate, int64_t ldg, const float* up, int64_t ldu, float* out, int64_t ldo, int64_t T,
              int64_t I);
}  // namespace raw

// The checks row_attention and store_rows make of their index tensors (the decoder makes them once a step).
void check_row_attention(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& base, const at::Tensor& bits,
                         int64_t S, int64_t L);
void check_store_rows(const at::Tensor& slots, const at::Tensor& positions, int64_t T, int64_t S, int64_t L);
