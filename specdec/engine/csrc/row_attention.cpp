// Row attention: each new token of a step attends to its own session's slot of the KV cache, in float32
// (AVX-512 or AVX2, simd.h), with no padding and no mask tensor.
//
// A step's chain feeds (decoding 1 token, verifying K + 1, a prefill chunk) and few-token trees have a query
// row per new token. Row r belongs to the session in slot slots[r] and sees base[r] positions of it whole
// (a chain's token: every position up to and including its own) and, of the positions base[r] .. base[r] + 63,
// those whose bit is set in bits[r] (a tree node: its ancestors and itself). Keys and values of the step's
// tokens are in the cache already (store_rows puts them there: one call a layer, where PyTorch's indexed copy
// of a one-token step took ~24 us, 0.7 ms of the default target's step).
//
// Each (row, head) computes the scores q.k * scale over the visible positions, 16 at a time, their maximum,
// exp(score - max) (a vectorised exp: range reduction by ln 2 and a degree-6 polynomial, ~1 ulp), the sum of
// those in a fixed lane order, then the weighted sum of the values (even and odd positions in two chains, added
// at the end) and one division: every sum in an order fixed by the visible positions alone. A task is one row's
// query heads that share a key / value head (up to 3-4 of them at the default head size), which take each block
// of keys and each pair of values in turn while it is in L1: at 1,000 positions of context the keys and values
// are a layer's largest read, and the heads of a group had each read them again.
// Nothing in a task depends on the other rows of the step, so a row's output is bitwise the same alone or
// among any others (batch invariance), and no row pays for another's length: padded attention
// scores every session's rows against the longest feed's (measured on a 2-core CPU: one 5-token verify
// among 15 one-token decodes made the step's attention 2.6x the decodes' alone). Tasks are split among
// torch's OpenMP threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernels.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using simd::vec;
constexpr int64_t V = simd::LANES;  // floats per vector

// GQ heads of one row that share a key / value head (grouped-query attention; GQ = 1 without it): for each,
// out[0, D) = softmax(q K^T * scale) V over the positions in `pos` (n of them). Each head's arithmetic is the
// same whatever GQ is: its scores 16 positions at a time (blocks aligned to the start of `pos`, so a position's
// score is computed the same way in every row that sees it), then its exponentials and their sum, then its
// weighted sum of the values. The heads only share the loads: the group's heads take each block of keys and
// each pair of values in turn while they are in L1, where one head at a time read them all from L2 or memory.
// NV = D / 16 vectors a row, a template parameter so that q and the sums stay in registers.
template <int NV, int GQ>
inline void attend_group(const float* q, int64_t q_stride, const float* keys, const float* values, int64_t stride_pos,
                         const int64_t* pos, int64_t n, float scale, float* scores, int64_t scores_stride, float* out,
                         int64_t out_stride) {
  vec most[GQ];
  for (int g = 0; g < GQ; ++g) most[g] = simd::set1(-INFINITY);
  for (int64_t i = 0; i < n; i += V) {
    const int64_t m = n - i < V ? n - i : V;
    const simd::mask mask = simd::tail(m);
    for (int g = 0; g < GQ; ++g) {
      vec qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = simd::mul(simd::loadu(q + g * q_stride + v * V), simd::set1(scale));
      const vec block = simd::lane_sums([&](int j) {  // lane j: key j's score
        if (j >= m) return simd::zero();
        const float* k = keys + pos[i + j] * stride_pos;
        vec a = simd::mul(qv[0], simd::loadu(k));
        for (int v = 1; v < NV; ++v) a = simd::fmadd(qv[v], simd::loadu(k + v * V), a);
        return a;
      });
      simd::store_tail(scores + g * scores_stride + i, mask, block);
      most[g] = simd::max_where(most[g], mask, most[g], block);
    }
  }
  float inv[GQ];
  for (int g = 0; g < GQ; ++g) {
    float* sc = scores + g * scores_stride;
    const vec topv = simd::set1(simd::reduce_max(most[g]));
    vec sumv = simd::zero();
    for (int64_t i = 0; i < n; i += V) {
      const int64_t left = n - i;
      const simd::mask m = simd::tail(left);
      const vec e = simd::exp(simd::sub(simd::load_tail(m, sc + i), topv));
      simd::store_tail(sc + i, m, e);
      sumv = simd::add(sumv, simd::keep(m, e));
    }
    inv[g] = 1.0f / simd::reduce_add(sumv);
  }
  // The weighted sum of the values in two interleaved halves (even and odd positions of `pos`, added at the
  // end): two independent chains of multiply-adds per vector where one would wait on each add's latency.
  vec even[GQ][NV], odd[GQ][NV];
  for (int g = 0; g < GQ; ++g)
    for (int v = 0; v < NV; ++v) even[g][v] = odd[g][v] = simd::zero();
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    const float* a = values + pos[i] * stride_pos;
    const float* b = values + pos[i + 1] * stride_pos;
    for (int g = 0; g < GQ; ++g) {
      const vec wa = simd::set1(scores[g * scores_stride + i]), wb = simd::set1(scores[g * scores_stride + i + 1]);
      for (int v = 0; v < NV; ++v) {
        even[g][v] = simd::fmadd(wa, simd::loadu(a + v * V), even[g][v]);
        odd[g][v] = simd::fmadd(wb, simd::loadu(b + v * V), odd[g][v]);
      }
    }
  }
  if (i < n) {
    const float* a = values + pos[i] * stride_pos;
    for (int g = 0; g < GQ; ++g) {
      const vec wa = simd::set1(scores[g * scores_stride + i]);
      for (int v = 0; v < NV; ++v) even[g][v] = simd::fmadd(wa, simd::loadu(a + v * V), even[g][v]);
    }
  }
  for (int g = 0; g < GQ; ++g) {
    const vec invv = simd::set1(inv[g]);
    for (int v = 0; v < NV; ++v)
      simd::storeu(out + g * out_stride + v * V, simd::mul(simd::add(even[g][v], odd[g][v]), invv));
  }
}

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*, int64_t, float,
                          float*, int64_t, float*, int64_t);

// Heads a group call takes at most for NV vectors a head: its sums (2 NV vectors a head) within three quarters of
// the registers (AVX-512: 24 vectors, 4 heads at NV <= 3; AVX2: 6, 3 heads at NV = 1, else 1), at least 1 and at most 4.
constexpr int most_heads(int nv) {
  const int fit = simd::REGISTERS * 3 / 4 / (2 * nv);
  return fit < 1 ? 1 : fit > 4 ? 4 : fit;
}

template <int NV, int... GQ>
constexpr AttendFn group_fn(int gq, std::integer_sequence<int, GQ...>) {
  AttendFn fns[] = {attend_group<NV, (GQ + 1 <= most_heads(NV) ? GQ + 1 : 1)>...};
  return fns[gq - 1];
}

template <int... NV>
constexpr AttendFn attend_for(int64_t nv, int gq, std::integer_sequence<int, NV...>) {
  AttendFn fns[] = {group_fn<NV + 1>(gq, std::make_integer_sequence<int, 4>{})...};
  return fns[nv - 1];
}

}  // namespace

namespace raw {

void row_attention(const float* q, int64_t q0, int64_t q1, int64_t H, int64_t D, const float* keys, const float* values,
                   int64_t Hkv, int64_t L, const int64_t* row, const int64_t* slot, const int64_t* prefix,
                   const int64_t* mask, int64_t G, double scale, float* out, int64_t o0, int64_t o1) {
  int64_t most = 0;
  for (int64_t g = 0; g < G; ++g) most = std::max(most, prefix[g] + __builtin_popcountll(static_cast<uint64_t>(mask[g])));
  // A task: one row's query heads that share a key / value head, as many as one call takes (most_heads)
  const int64_t group = H / Hkv, nv = D / V, per_call = std::min<int64_t>(group, most_heads(static_cast<int>(nv)));
  const int64_t calls = (group + per_call - 1) / per_call, slot_stride = Hkv * L * D, head_stride = L * D;
  const int64_t scores_stride = most + V, last_call = group - (calls - 1) * per_call;  // heads in a group's last call
  constexpr auto nvs = std::make_integer_sequence<int, 16>{};
  const AttendFn full = attend_for(nv, static_cast<int>(per_call), nvs), last = attend_for(nv, static_cast<int>(last_call), nvs);
  at::parallel_for(0, G * Hkv * calls, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(per_call * scores_stride);
    std::vector<int64_t> pos(most + 1);
    int64_t last_row = -1;
    int64_t n = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / (Hkv * calls), kvh = t / calls % Hkv, call = t % calls, h0 = kvh * group + call * per_call;
      const bool is_last = call == calls - 1;
      const int64_t heads = is_last ? last_call : per_call;
      if (g != last_row) {  // the visible positions of this row
        n = 0;
        for (int64_t p = 0; p < prefix[g]; ++p) pos[n++] = p;
        for (uint64_t b = static_cast<uint64_t>(mask[g]); b; b &= b - 1) pos[n++] = prefix[g] + __builtin_ctzll(b);
        last_row = g;
      }
      float* o = out + row[g] * o0 + h0 * o1;
      if (n == 0) {
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < D; ++d) o[h * o1 + d] = 0.0f;
        continue;
      }
      const int64_t off = slot[g] * slot_stride + kvh * head_stride;
      (is_last ? last : full)(q + row[g] * q0 + h0 * q1, q1, keys + off, values + off, D, pos.data(), n,
                              static_cast<float>(scale), scores.data(), scores_stride, o, o1);
    }
  });
}

void store_rows(float* keys, float* values, int64_t Hkv, int64_t L, int64_t D, const int64_t* slot, const int64_t* pos,
                int64_t T, const float* key, int64_t k0, int64_t k1, const float* value, int64_t v0, int64_t v1) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = ((slot[t] * Hkv + h) * L + pos[t]) * D;
      std::copy_n(key + h * k0 + t * k1, D, keys + at);
      std::copy_n(value + h * v0 + t * v1, D, values + at);
    }
}

}  // namespace raw

void check_row_attention(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& base, const at::Tensor& bits,
                         int64_t S, int64_t L) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && base.scalar_type() == at::kLong &&
              bits.scalar_type() == at::kLong && rows.is_contiguous() && slots.is_contiguous() && base.is_contiguous() &&
              bits.is_contiguous() && slots.numel() == rows.numel() && base.numel() == rows.numel() &&
              bits.numel() == rows.numel(), "row_attention: rows / slots / base / bits [G] int64");
  const int64_t G = rows.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* prefix = base.data_ptr<int64_t>();
  const int64_t* mask = bits.data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(slot[g] >= 0 && slot[g] < S && prefix[g] >= 0, "row_attention: row out of range");
    const uint64_t b = static_cast<uint64_t>(mask[g]);
    const int64_t top = b ? 64 - __builtin_clzll(b) : 0;  // highest set bit + 1 (a chain's token: none)
    TORCH_CHECK(prefix[g] + top <= L, "row_attention: visible positions past the cache");
  }
}

void check_store_rows(const at::Tensor& slots, const at::Tensor& positions, int64_t T, int64_t S, int64_t L) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.is_contiguous() &&
              positions.is_contiguous() && slots.numel() == T && positions.numel() == T,
              "store_rows: slots / positions [T] int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < S && pos[t] >= 0 && pos[t] < L, "store_rows: slot or position out of range");
}

// q [T, H, D] (any strides but a contiguous last dim), keys / values [S, H_kv, L, D] (one layer of the
// cache, contiguous), rows / slots / base / bits [G] int64 on the CPU: the query rows to compute and their
// slot, prefix and visibility bits. Writes out[rows[g], h, :] for every g and head h.
void row_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor rows, at::Tensor slots,
                   at::Tensor base, at::Tensor bits, double scale, at::Tensor out) {
  TORCH_CHECK(q.dtype() == at::kFloat && keys.dtype() == at::kFloat && values.dtype() == at::kFloat &&
              out.dtype() == at::kFloat, "row_attention: float32 tensors");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes(), "row_attention: shapes");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "row_attention: contiguous cache");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "row_attention: contiguous head dim");
  const int64_t H = q.size(1), D = q.size(2), Hkv = keys.size(1), L = keys.size(2), S = keys.size(0);
  TORCH_CHECK(D % V == 0 && D <= 16 * V && keys.size(3) == D && H % Hkv == 0, "row_attention: head dim / heads");
  check_row_attention(rows, slots, base, bits, S, L);
  raw::row_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), H, D, keys.data_ptr<float>(), values.data_ptr<float>(),
                     Hkv, L, rows.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), base.data_ptr<int64_t>(),
                     bits.data_ptr<int64_t>(), rows.numel(), scale, out.data_ptr<float>(), out.stride(0), out.stride(1));
}

// A step's new keys and values into their slots: key / value [H_kv, T, D] (any strides but a contiguous last
// dim) -> keys / values [slots[t], :, positions[t], :] (the cache's layer, contiguous), what
// SlotKVCache.write's indexed copy does, in one call instead of two indexing operators.
void store_rows(at::Tensor keys, at::Tensor values, at::Tensor slots, at::Tensor positions,
                at::Tensor key, at::Tensor value) {
  TORCH_CHECK(keys.dtype() == at::kFloat && values.dtype() == at::kFloat && key.dtype() == at::kFloat &&
              value.dtype() == at::kFloat, "store_rows: float32 tensors");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "store_rows: a contiguous cache layer [S, H_kv, L, D]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(0) == keys.size(1) && key.size(2) == keys.size(3) &&
              key.stride(2) == 1 && value.stride(2) == 1, "store_rows: key / value [H_kv, T, D] with contiguous rows");
  const int64_t S = keys.size(0), Hkv = keys.size(1), L = keys.size(2), D = keys.size(3), T = key.size(1);
  check_store_rows(slots, positions, T, S, L);
  raw::store_rows(keys.data_ptr<float>(), values.data_ptr<float>(), Hkv, L, D, slots.data_ptr<int64_t>(),
                  positions.data_ptr<int64_t>(), T, key.data_ptr<float>(), key.stride(0), key.stride(1),
                  value.data_ptr<float>(), value.stride(0), value.stride(1));
}
