// The Llama decoder's layers in one call: the packed step's decoder with no Python between its kernels.
//
// specdec.engine.llama runs a layer as ~20 Python-level calls around the kernels (the row ops, the skinny GEMM,
// row attention), each a pybind11 crossing and a few tensor views: ~50 us a layer, ~1.5 ms of the default
// target's 30-layer step, a fifth of it once its weights stream as GGUF blocks. Here the same kernels run in the
// same order from C++, so the hidden states are bitwise the Python decoder's (a test compares them), and the
// interpreter's lock is released for the whole decoder, so the tier's gRPC threads run beside its step.
//
//   for each layer:  h = add_rms_norm(x, down, w1);  q, k, v = h Wqkv;  rotary_(q and k)
//                    store_rows(k, v);  o = row_attention(q)
//                    h = add_rms_norm(x, o Wo, w2);  g, u = h Wgu;  down = silu_mul(g, u) Wd
//   return add_rms_norm(x, down, w_final)
//
// Only the form of step the row kernel covers whole (every token a row-attention row: chain feeds, prefill
// chunks, few-token trees) runs here; the Python decoder keeps every other (a padded group, a long tree, taps).

#include "decoder.h"

#include "kernels.h"

at::Tensor DecoderLinear::operator()(const at::Tensor& x) const {
  return fmt == 0 ? skinny_linear(x, packed, N, bias) : quant_linear(x, packed, fmt, N, bias);
}

Decoder::Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, at::Tensor final_norm,
                 double final_eps)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scaling_(scaling), final_norm_(final_norm),
      final_eps_(final_eps) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "Decoder: heads / head_dim");
}

at::Tensor DecoderProducts::operator()(const at::Tensor& x) const {
  if (parts.size() == 1) return parts[0](x);
  std::vector<at::Tensor> outs;
  for (const DecoderLinear& part : parts) outs.push_back(part(x));
  return at::cat(outs, 1);
}

void Decoder::add_layer(at::Tensor norm1, double eps1, const std::vector<at::Tensor>& qkv,
                        const std::vector<int64_t>& qkv_fmts, const std::vector<int64_t>& qkv_sizes,
                        const std::vector<at::Tensor>& qkv_biases, at::Tensor o, int64_t o_fmt,
                        c10::optional<at::Tensor> o_bias, at::Tensor norm2, double eps2, at::Tensor gate_up,
                        int64_t gate_up_fmt, int64_t intermediate, at::Tensor down, int64_t down_fmt, int64_t hidden) {
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  TORCH_CHECK(!qkv.empty() && qkv_fmts.size() == qkv.size() && qkv_sizes.size() == qkv.size() &&
              qkv_biases.size() == qkv.size(), "Decoder: one format, size and bias per q / k / v part");
  DecoderProducts qkv_parts;
  int64_t total = 0;
  for (size_t i = 0; i < qkv.size(); ++i) {
    const at::Tensor& b = qkv_biases[i];
    qkv_parts.parts.push_back(DecoderLinear{qkv[i], qkv_fmts[i], qkv_sizes[i],
                                            b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt});
    total += qkv_sizes[i];
  }
  TORCH_CHECK(total == q + 2 * kv, "Decoder: q / k / v parts give ", total, " outputs, not ", q + 2 * kv);
  layers_.push_back(DecoderLayer{norm1, norm2, eps1, eps2, qkv_parts,
                                 DecoderLinear{o, o_fmt, hidden, o_bias},
                                 DecoderLinear{gate_up, gate_up_fmt, 2 * intermediate, {}},
                                 DecoderLinear{down, down_fmt, hidden, {}}});
}

at::Tensor Decoder::forward(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions,
                            at::Tensor rows, at::Tensor row_slots, at::Tensor base, at::Tensor bits) const {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "Decoder: one cache layer per layer");
  TORCH_CHECK(x.dim() == 2 && rows.numel() == x.size(0), "Decoder: every token one row");
  const int64_t T = x.size(0), D = head_dim_, q = heads_ * D, kv = kv_heads_ * D;
  at::Tensor down;  // the last product of the layer before, added into x by the next norm
  auto residual = [&]() { return down.defined() ? c10::optional<at::Tensor>(down) : c10::nullopt; };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer& layer = layers_[i];
    auto h = add_rms_norm(x, residual(), layer.norm1, layer.eps1);
    auto qkv = layer.qkv(h);
    auto qs = qkv.narrow(1, 0, q), ks = qkv.narrow(1, q, kv), vs = qkv.narrow(1, q + kv, kv);
    rotary_(qkv.narrow(1, 0, q + kv), cos, sin, D);  // q's heads and k's, side by side: one call, each head as alone
    store_rows(keys[i], values[i], slots, kv_positions, ks.view({T, kv_heads_, D}).transpose(0, 1),
               vs.view({T, kv_heads_, D}).transpose(0, 1));
    auto out = at::empty({T, heads_, D}, x.options());
    row_attention(qs.view({T, heads_, D}), keys[i], values[i], rows, row_slots, base, bits, scaling_, out);
    h = add_rms_norm(x, layer.o(out.view({T, q})), layer.norm2, layer.eps2);
    auto gate_up = layer.gate_up(h);
    const int64_t I = gate_up.size(1) / 2;
    down = layer.down(silu_mul(gate_up.narrow(1, 0, I), gate_up.narrow(1, I, I)));
  }
  return add_rms_norm(x, residual(), final_norm_, final_eps_);
}
