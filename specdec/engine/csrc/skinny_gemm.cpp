// Skinny GEMM: y = x W^T (+ b) in float32 for the few rows of a decode or verify step (AVX-512).
//
// Batch invariance. Every output y[m, n] is one sum over k = 0 .. K-1 in order, one fused multiply-add
// per term, in a register lane of its own; the bias is added after. How rows and columns are blocked decides
// which sums share registers, never the order of any one of them, so a row's result is bitwise the same
// whether it is multiplied alone or among many others, and whatever the other columns are (weights
// concatenated into one product give what separate products give).
//
// Layout. W [N, K] is packed once into panels of 16 columns: panel p holds W[16p .. 16p+15, :] transposed,
// [K][16] contiguous (columns past N are zeros), so each panel is one sequential stream.
//
// Blocking. The rows of x go in blocks of at most 9, as even as they come (17 = 9 + 8). A block of MB rows
// against NV panels at a time is the micro-kernel: MB x NV accumulators, NV weight vectors and one
// broadcast value of x in the 32 vector registers (NV = the most that fit: 8 for 1-2 rows, 3 for 7-9). Per
// k it loads NV weight vectors and broadcasts MB values, then does MB x NV multiply-adds. The row blocks
// take each group of NV panels in turn (from L2 after the first: W streams from memory once per product);
// the groups are split among torch's OpenMP threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t PANEL = 16;   // columns per packed panel (one vector)
constexpr int64_t MAX_MB = 9;   // rows per block
constexpr int NV_FOR[MAX_MB + 1] = {0, 8, 8, 6, 6, 5, 4, 3, 3, 3};  // panels per step: MB x NV + NV + 1 <= 32

template <int MB, int NV>
inline void kernel(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                   const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols) {
  __m512 acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_load_ps(w + v * K * PANEL + k * PANEL);
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(xb, wv[v], acc[i][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = cols - PANEL * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= PANEL ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + PANEL * v) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + PANEL * v, mask, bias ? _mm512_add_ps(acc[i][v], b) : acc[i][v]);
  }
}

// Rows [0, MB) of x against panels [p0, p1): NV at a time, then one at a time.
template <int MB>
inline void panels(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                   int64_t N, int64_t p0, int64_t p1) {
  constexpr int NV = NV_FOR[MB];
  int64_t p = p0;
  for (; p + NV <= p1; p += NV)
    kernel<MB, NV>(x, ldx, w + p * K * PANEL, K, bias ? bias + p * PANEL : nullptr, y + p * PANEL, ldy, N - p * PANEL);
  for (; p < p1; ++p)
    kernel<MB, 1>(x, ldx, w + p * K * PANEL, K, bias ? bias + p * PANEL : nullptr, y + p * PANEL, ldy, N - p * PANEL);
}

inline void block(int64_t mb, const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ldy, int64_t N, int64_t p0, int64_t p1) {
  switch (mb) {
    case 1: panels<1>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 2: panels<2>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 3: panels<3>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 4: panels<4>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 5: panels<5>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 6: panels<6>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 7: panels<7>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    case 8: panels<8>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
    default: panels<9>(x, ldx, w, K, bias, y, ldy, N, p0, p1); break;
  }
}

}  // namespace

// W [N, K] float32 -> its packed panels [ceil(N / 16), K, 16] (zero-padded).
torch::Tensor skinny_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "skinny_pack: float32 CPU W [N, K]");
  const int64_t N = w.size(0), K = w.size(1), count = (N + PANEL - 1) / PANEL;
  auto padded = torch::zeros({count * PANEL, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({count, PANEL, K}).transpose(1, 2).contiguous();  // [panels, K, 16]
}

// y [M, N] = x [M, K] W^T + bias [N], W given packed (skinny_pack) with its N.
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "skinny_linear: x [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == x.size(1) && packed.is_contiguous() &&
              packed.size(0) * PANEL >= N && (packed.size(0) - 1) * PANEL < N, "skinny_linear: packed W does not fit x / N");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0, "skinny_linear: packed W not 64-byte aligned");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), count = packed.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "skinny_linear: bias [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (M + MAX_MB - 1) / MAX_MB;
  const int64_t group = NV_FOR[(M + blocks - 1) / blocks];  // panels per group: the first (largest) block's NV
  const int64_t groups = (count + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * group, p1 = std::min(count, p0 + group);
      int64_t m = 0;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t mb = (M - m + (blocks - i) - 1) / (blocks - i);  // the remaining rows, shared out evenly
        block(mb, xp + m * ldx, ldx, wp, K, b, yp + m * N, N, N, p0, p1);
        m += mb;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_pack", &skinny_pack, "pack W [N, K] float32 for skinny_linear");
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b in float32, batch-invariant (AVX-512)");
}
