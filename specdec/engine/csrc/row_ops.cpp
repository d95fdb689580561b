// Row ops: the small operators of a Llama layer, one call each, row by row, in float32 (AVX-512 or AVX2,
// simd.h).
//
// Around its products and its attention a decoder layer runs ~30 small operators (casts, powers, means,
// rsqrt, products with cos and sin, a concatenation for rotate_half, SiLU, sums): at decode sizes each is a
// dispatch and a pass over a few kilobytes, ~3.7 ms a one-token step of the default target and ~7 ms a
// 16-session step on a 2-core CPU. Here they are three:
//
//   add_rms_norm(x, delta, w, eps) -> h   x += delta (the residual; delta may be absent), then
//                                         h = w * x / sqrt(mean(x^2) + eps)       (LlamaRMSNorm)
//   rotary_(x, cos, sin, head_dim)        in place on each head of x: x cos + rotate_half(x) sin
//   silu_mul(gate, up) -> a               silu(gate) * up                         (the MLP's activation)
//
// Every output element depends on its own row only, and each row's sums run in one fixed order, so a row
// gives bitwise the same result alone or among any others (batch invariance). Rows are split among
// torch's OpenMP threads when there are enough of them to pay for it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "simd.h"

namespace {

using simd::vec;
constexpr int64_t V = simd::LANES;

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              what, ": a float32 CPU tensor [rows, n] with contiguous rows");
}

// Rows t0..t1 of a [T, n] float32 job in parallel only when the whole job is large enough.
template <typename F>
void rows(int64_t T, int64_t n, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(n, 1));  // ~64k floats a task
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

}  // namespace

namespace raw {

void add_rms_norm(float* x, int64_t ldx, const float* d, int64_t ldd, const float* w, double eps, float* h,
                  int64_t ldh, int64_t T, int64_t N) {
  rows(T, N, [&](int64_t t) {
    float* xr = x + t * ldx;
    vec ss = simd::zero();
    for (int64_t j = 0; j < N; j += V) {
      const simd::mask m = simd::tail(N - j);
      vec v = simd::load_tail(m, xr + j);
      if (d) {
        v = simd::add(v, simd::load_tail(m, d + t * ldd + j));
        simd::store_tail(xr + j, m, v);
      }
      ss = simd::fmadd(v, v, ss);
    }
    const float scale = 1.0f / std::sqrt(simd::reduce_add(ss) / static_cast<float>(N) + static_cast<float>(eps));
    const vec s = simd::set1(scale);
    for (int64_t j = 0; j < N; j += V) {
      const simd::mask m = simd::tail(N - j);
      const vec v = simd::mul(simd::load_tail(m, xr + j), s);
      simd::store_tail(h + t * ldh + j, m, simd::mul(simd::load_tail(m, w + j), v));
    }
  });
}

void rotary(float* x, int64_t ldx, const float* cos, int64_t ldc, const float* sin, int64_t lds, int64_t T, int64_t N,
            int64_t head_dim) {
  const int64_t half = head_dim / 2;
  rows(T, N, [&](int64_t t) {
    const float* c = cos + t * ldc;
    const float* s = sin + t * lds;
    for (int64_t h = 0; h < N; h += head_dim) {
      float* a = x + t * ldx + h;  // first half
      float* b = a + half;         // second half
      for (int64_t j = 0; j < half; j += V) {
        const simd::mask m = simd::tail(half - j);
        const vec x1 = simd::load_tail(m, a + j), x2 = simd::load_tail(m, b + j);
        // x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
        const vec o1 = simd::sub(simd::mul(x1, simd::load_tail(m, c + j)), simd::mul(x2, simd::load_tail(m, s + j)));
        const vec o2 = simd::add(simd::mul(x2, simd::load_tail(m, c + half + j)), simd::mul(x1, simd::load_tail(m, s + half + j)));
        simd::store_tail(a + j, m, o1);
        simd::store_tail(b + j, m, o2);
      }
    }
  });
}

void silu_mul(const float* gate, int64_t ldg, const float* up, int64_t ldu, float* out, int64_t ldo, int64_t T,
              int64_t I) {
  const vec one = simd::set1(1.0f);
  rows(T, I, [&](int64_t t) {
    const float* g = gate + t * ldg;
    const float* u = up + t * ldu;
    for (int64_t j = 0; j < I; j += V) {
      const simd::mask m = simd::tail(I - j);
      const vec gv = simd::load_tail(m, g + j);
      const vec silu = simd::div(gv, simd::add(one, simd::exp(simd::sub(simd::zero(), gv))));
      simd::store_tail(out + t * ldo + j, m, simd::mul(silu, simd::load_tail(m, u + j)));
    }
  });
}

}  // namespace raw

at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  const int64_t T = x.size(0), N = x.size(1);
  const float* d = nullptr;
  int64_t ldd = 0;
  if (delta.has_value() && delta->defined()) {
    check_rows(*delta, "add_rms_norm: delta");
    TORCH_CHECK(delta->size(0) == T && delta->size(1) == N, "add_rms_norm: delta's shape");
    d = delta->data_ptr<float>();
    ldd = delta->stride(0);
  }
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.is_contiguous() && weight.numel() == N, "add_rms_norm: weight [n]");
  auto h = at::empty({T, N}, x.options());
  raw::add_rms_norm(x.data_ptr<float>(), x.stride(0), d, ldd, weight.data_ptr<float>(), eps, h.data_ptr<float>(), N, T, N);
  return h;
}

void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t head_dim) {
  check_rows(x, "rotary_: x");
  check_rows(cos, "rotary_: cos");
  check_rows(sin, "rotary_: sin");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && N % head_dim == 0, "rotary_: an even head_dim dividing the row");
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && cos.size(1) == head_dim && sin.size(1) == head_dim,
              "rotary_: cos, sin [rows, head_dim]");
  raw::rotary(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(),
              sin.stride(0), T, N, head_dim);
}

at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  check_rows(gate, "silu_mul: gate");
  check_rows(up, "silu_mul: up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up of one shape");
  const int64_t T = gate.size(0), I = gate.size(1);
  auto out = at::empty({T, I}, gate.options());
  raw::silu_mul(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), out.data_ptr<float>(), I, T, I);
  return out;
}
