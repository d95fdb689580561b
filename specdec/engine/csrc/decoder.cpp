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
// The kernels run on raw pointers into one workspace allocated a step (kernels.h, namespace raw): the tensor
// functions' checks are made once, the weights' at add_layer and the step's index tensors at the top of forward,
// where a layer had made ~20 tensors (outputs, views) and repeated every check: ~10-15 us a layer.
//
// Only the form of step the row kernel covers whole (every token a row-attention row: chain feeds, prefill
// chunks, few-token trees) runs here, taps included (forward_tapped); the Python decoder keeps every other (a
// padded group, a long tree).

#include <cstring>
#include "decoder.h"

#include "kernels.h"

void DecoderLinear::check(int64_t K) const {
  const auto x = at::zeros({1, K}, at::kFloat);
  fmt == 0 ? skinny_linear(x, packed, N, bias) : quant_linear(x, packed, fmt, N, bias);
}

void DecoderLinear::into(const float* x, int64_t ldx, int64_t M, int64_t K, float* y, int64_t ldy) const {
  raw::linear(x, ldx, M, K, packed, fmt, N, bias.has_value() ? bias->data_ptr<float>() : nullptr, y, ldy);
}

Decoder::Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, at::Tensor final_norm,
                 double final_eps)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), hidden_(final_norm.numel()), scaling_(scaling),
      final_norm_(final_norm), final_eps_(final_eps) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "Decoder: heads / head_dim");
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous(), "Decoder: final norm [hidden] float32");
}

void Decoder::add_layer(at::Tensor norm1, double eps1, const std::vector<at::Tensor>& qkv,
                        const std::vector<int64_t>& qkv_fmts, const std::vector<int64_t>& qkv_sizes,
                        const std::vector<at::Tensor>& qkv_biases, at::Tensor o, int64_t o_fmt,
                        c10::optional<at::Tensor> o_bias, at::Tensor norm2, double eps2, at::Tensor gate_up,
                        int64_t gate_up_fmt, int64_t intermediate, at::Tensor down, int64_t down_fmt, int64_t hidden) {
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  TORCH_CHECK(hidden == hidden_, "Decoder: hidden size ", hidden, ", the final norm's ", hidden_);
  TORCH_CHECK(!qkv.empty() && qkv_fmts.size() == qkv.size() && qkv_sizes.size() == qkv.size() &&
              qkv_biases.size() == qkv.size(), "Decoder: one format, size and bias per q / k / v part");
  for (const at::Tensor& w : {norm1, norm2})
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden, "Decoder: norm weights [hidden]");
  DecoderLayer layer{norm1, norm2, eps1, eps2, {}, DecoderLinear{o, o_fmt, hidden, o_bias},
                     DecoderLinear{gate_up, gate_up_fmt, 2 * intermediate, {}}, DecoderLinear{down, down_fmt, hidden, {}},
                     intermediate};
  int64_t total = 0;
  for (size_t i = 0; i < qkv.size(); ++i) {
    const at::Tensor& b = qkv_biases[i];
    layer.qkv.push_back(DecoderLinear{qkv[i], qkv_fmts[i], qkv_sizes[i], b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt});
    layer.qkv.back().check(hidden);
    total += qkv_sizes[i];
  }
  TORCH_CHECK(total == q + 2 * kv, "Decoder: q / k / v parts give ", total, " outputs, not ", q + 2 * kv);
  layer.o.check(q);
  layer.gate_up.check(hidden);
  layer.down.check(intermediate);
  layers_.push_back(std::move(layer));
}

at::Tensor Decoder::forward(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions,
                            at::Tensor rows, at::Tensor row_slots, at::Tensor base, at::Tensor bits) const {
  return run(x, cos, sin, keys, values, slots, kv_positions, rows, row_slots, base, bits, {}, nullptr);
}

at::Tensor Decoder::forward_tapped(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                                   const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions,
                                   at::Tensor rows, at::Tensor row_slots, at::Tensor base, at::Tensor bits,
                                   const std::vector<int64_t>& taps, at::Tensor tapped) const {
  const int64_t n = static_cast<int64_t>(taps.size());
  TORCH_CHECK(tapped.scalar_type() == at::kFloat && tapped.dim() == 3 && tapped.size(0) == n &&
              tapped.size(1) == x.size(0) && tapped.size(2) == hidden_ && tapped.is_contiguous(),
              "Decoder: tapped [len(taps), T, hidden] float32, contiguous");
  for (int64_t id : taps) TORCH_CHECK(id >= 0 && id < num_layers(), "Decoder: tap ", id, " is not a layer");
  return run(x, cos, sin, keys, values, slots, kv_positions, rows, row_slots, base, bits, taps,
             tapped.data_ptr<float>());
}

at::Tensor Decoder::run(at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& keys,
                        const std::vector<at::Tensor>& values, at::Tensor slots, at::Tensor kv_positions,
                        at::Tensor rows, at::Tensor row_slots, at::Tensor base, at::Tensor bits,
                        const std::vector<int64_t>& taps, float* tapped) const {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "Decoder: one cache layer per layer");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_ && x.stride(1) == 1,
              "Decoder: x [T, hidden] float32 with contiguous rows");
  TORCH_CHECK(rows.numel() == x.size(0), "Decoder: every token one row");
  TORCH_CHECK(head_dim_ % 16 == 0 && head_dim_ <= 256, "row_attention: head dim / heads");
  const int64_t T = x.size(0), D = head_dim_, H = hidden_, q = heads_ * D, kv = kv_heads_ * D, qkv_n = q + 2 * kv;
  for (const at::Tensor& t : {cos, sin})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == T && t.size(1) == D && t.stride(1) == 1,
                "Decoder: cos, sin [T, head_dim] float32");
  int64_t S = 0, L = 0, I = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const at::Tensor &k = keys[i], &v = values[i];
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 4 && k.sizes() == v.sizes() &&
                k.is_contiguous() && v.is_contiguous() && k.size(1) == kv_heads_ && k.size(3) == D &&
                (i == 0 || (k.size(0) == S && k.size(2) == L)), "Decoder: cache layers [S, H_kv, L, D] float32, contiguous");
    S = k.size(0), L = k.size(2), I = std::max(I, layers_[i].intermediate);
  }
  check_store_rows(slots, kv_positions, T, S, L);
  check_row_attention(rows, row_slots, base, bits, S, L);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(row[t] >= 0 && row[t] < T, "Decoder: row out of range");

  // The step's workspace: h (a norm's output), q | k | v, attention's output, o's, gate | up, the activation, down's
  auto work = at::empty({T * (H + qkv_n + q + H + 3 * I + H)}, x.options());
  float* h = work.data_ptr<float>();
  float *qkv = h + T * H, *att = qkv + T * qkv_n, *o = att + T * q, *gu = o + T * H, *act = gu + T * 2 * I;
  float* down = act + T * I;
  auto out = at::empty({T, H}, x.options());
  float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *pos = kv_positions.data_ptr<int64_t>();
  const int64_t *row_slot = row_slots.data_ptr<int64_t>(), *prefix = base.data_ptr<int64_t>(), *mask = bits.data_ptr<int64_t>();
  // Layer l's output is x once its last product is added, which the next norm does (the final one for the last
  // layer): copied out for each tap of l, as the Python decoder copies it.
  auto tap = [&](int64_t l) {
    for (size_t j = 0; j < taps.size(); ++j)
      if (taps[j] == l)
        for (int64_t t = 0; t < T; ++t) std::memcpy(tapped + (j * T + t) * H, xp + t * ldx, H * sizeof(float));
  };
  const float* residual = nullptr;  // the last product of the layer before, added into x by the next norm
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer& layer = layers_[i];
    const int64_t Ii = layer.intermediate;
    float *kp = keys[i].data_ptr<float>(), *vp = values[i].data_ptr<float>();
    raw::add_rms_norm(xp, ldx, residual, H, layer.norm1.data_ptr<float>(), layer.eps1, h, H, T, H);
    if (i > 0) tap(static_cast<int64_t>(i) - 1);
    int64_t col = 0;
    for (const DecoderLinear& part : layer.qkv) {
      part.into(h, H, T, H, qkv + col, qkv_n);
      col += part.N;
    }
    raw::rotary(qkv, qkv_n, cp, cos.stride(0), sp, sin.stride(0), T, q + kv, D);  // q's heads and k's: each as alone
    raw::store_rows(kp, vp, kv_heads_, L, D, slot, pos, T, qkv + q, D, qkv_n, qkv + q + kv, D, qkv_n);
    raw::row_attention(qkv, qkv_n, D, heads_, D, kp, vp, kv_heads_, L, row, row_slot, prefix, mask, T, scaling_, att, q, D);
    layer.o.into(att, q, T, q, o, H);
    raw::add_rms_norm(xp, ldx, o, H, layer.norm2.data_ptr<float>(), layer.eps2, h, H, T, H);
    layer.gate_up.into(h, H, T, H, gu, 2 * Ii);
    raw::silu_mul(gu, 2 * Ii, gu + Ii, 2 * Ii, act, Ii, T, Ii);
    layer.down.into(act, Ii, T, Ii, down, H);
    residual = down;
  }
  raw::add_rms_norm(xp, ldx, residual, H, final_norm_.data_ptr<float>(), final_eps_, out.data_ptr<float>(), H, T, H);
  tap(num_layers() - 1);
  return out;
}
