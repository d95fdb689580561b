// The Llama decoder's layers in one call (decoder.cpp has the loop and why; kernels.cpp exports the class).
#pragma once

#include <ATen/ATen.h>

#include <vector>

// One product: panels of float32 (fmt 0, skinny_linear) or of a GGUF's blocks (its ggml type, quant_linear).
struct DecoderLinear {
  at::Tensor packed;
  int64_t fmt;
  int64_t N;
  c10::optional<at::Tensor> bias;

  void check(int64_t K) const;  // the packed weights and bias fit inputs of K (what the tensor functions check)
  // y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) W^T + bias
  void into(const float* x, int64_t ldx, int64_t M, int64_t K, float* y, int64_t ldy) const;
};

struct DecoderLayer {
  at::Tensor norm1, norm2;  // RMSNorm weights [hidden]
  double eps1, eps2;
  // q, k and v as one product, or in parts where their weights are in different formats (a Q4_K_M GGUF's Q6_K
  // value projections beside Q4_K q and k), each writing its columns of the one [T, q + 2 kv] output
  std::vector<DecoderLinear> qkv;
  DecoderLinear o, gate_up, down;
  int64_t intermediate;
};

class Decoder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, at::Tensor final_norm, double final_eps);

  // A layer's weights, in order: its norms and four products (packed, format, bias where it has one; q / k / v as
  // one or more parts, each its packed weights, format, output size and bias, an empty tensor for none), with the
  // MLP's intermediate size and the hidden size.
  void add_layer(at::Tensor norm1, double eps1, const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_fmts,
                 const std::vector<int64_t>& qkv_sizes, const std::vector<at::Tensor>& qkv_biases,
                 at::Tensor o, int64_t o_fmt, c10::optional<at::Tensor> o_bias, at::Tensor norm2, double eps2,
                 at::Tensor gate_up, int64_t gate_up_fmt, int64_t intermediate, at::Tensor down, int64_t down_fmt,
                 int64_t hidden);

  // x [T, hidden] (the embeddings; the residual stream, updated in place), cos / sin [T, D], the cache's layers,
  // each token's slot and stored position, and the row attention's rows (every token one) -> the final norm's
  // output [T, hidden].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                     const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions, at::Tensor rows,
                     at::Tensor row_slots, at::Tensor base, at::Tensor bits) const;

  // forward(), also copying the residual stream after each layer in `taps` (ids, each below num_layers) into
  // tapped [len(taps), T, hidden] float32, contiguous: what a feature draft reads (specdec.engine.llama's taps).
  at::Tensor forward_tapped(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions,
                            at::Tensor rows, at::Tensor row_slots, at::Tensor base, at::Tensor bits,
                            const std::vector<int64_t>& taps, at::Tensor tapped) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  at::Tensor run(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                 const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions, at::Tensor rows,
                 at::Tensor row_slots, at::Tensor base, at::Tensor bits, const std::vector<int64_t>& taps,
                 float* tapped) const;
  int64_t heads_, kv_heads_, head_dim_, hidden_;
  double scaling_;
  at::Tensor final_norm_;
  double final_eps_;
  std::vector<DecoderLayer> layers_;
};
