// Skinny GEMM: y = x W^T (+ b) in float32 for the few rows of a decode or verify step (AVX-512).
//
// Batch invariance. Every output y[m, n] is one sum over k = 0 .. K-1 in order, one fused multiply-add
// per term, in its own register lane; the bias is added after. How rows and columns are blocked decides
// which sums share a register, never the order of any one of them, so a row's result is bitwise the same
// whether it is multiplied alone or among many others, and whatever the other columns are (weights
// concatenated into one product give what separate products give).
//
// Layout. W [N, K] is packed once into tiles of TILE = 64 columns: tile t holds W[64t .. 64t+63, :]
// transposed, [K][64] contiguous (columns past N are zeros), so a tile's weights are one sequential
// stream. A tile times a block of up to 6 rows of x is the micro-kernel: 6 x 4 accumulators of 16 lanes,
// 4 weight vectors and 1 broadcast value stay in the 32 vector registers; per k it loads 4 weight
// vectors and broadcasts MB values of x. The rows' blocks read the tile in turn (from L2 after the
// first); tiles are split among torch's OpenMP threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t TILE = 64;  // columns per packed tile (4 vectors of 16)
constexpr int NV = TILE / 16;
constexpr int MAX_MB = 6;     // rows per micro-kernel block: 6 x 4 accumulators + 4 + 1 registers

template <int MB>
inline void kernel(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                   const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols) {
  __m512 acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_load_ps(w + k * TILE + 16 * v);
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(xb, wv[v], acc[i][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) {
      const __m512 out = bias ? _mm512_add_ps(acc[i][v], b) : acc[i][v];
      _mm512_mask_storeu_ps(y + i * ldy + 16 * v, mask, out);
    }
  }
}

// Every row of x against one tile, in blocks of at most MAX_MB rows, as even as they come.
inline void tile_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, const float* bias, float* y,
                      int64_t ldy, int64_t cols) {
  const int64_t blocks = (M + MAX_MB - 1) / MAX_MB;
  int64_t m = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t mb = (M - m) / (blocks - b);  // the remaining rows shared out: 9 = 5 + 4, 13 = 5 + 4 + 4
    const int64_t rows = mb + ((M - m) % (blocks - b) ? 1 : 0);
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (rows) {
      case 1: kernel<1>(xm, ldx, w, K, bias, ym, ldy, cols); break;
      case 2: kernel<2>(xm, ldx, w, K, bias, ym, ldy, cols); break;
      case 3: kernel<3>(xm, ldx, w, K, bias, ym, ldy, cols); break;
      case 4: kernel<4>(xm, ldx, w, K, bias, ym, ldy, cols); break;
      case 5: kernel<5>(xm, ldx, w, K, bias, ym, ldy, cols); break;
      default: kernel<6>(xm, ldx, w, K, bias, ym, ldy, cols); break;
    }
    m += rows;
  }
}

}  // namespace

// W [N, K] float32 -> its packed tiles [ceil(N / 64), K, 64] (64-byte aligned, zero-padded).
torch::Tensor skinny_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "skinny_pack: float32 CPU W [N, K]");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  auto padded = torch::zeros({tiles * TILE, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({tiles, TILE, K}).transpose(1, 2).contiguous();  // [tiles, K, 64]
}

// y [M, N] = x [M, K] W^T + bias [N], W given packed (skinny_pack) with its N.
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "skinny_linear: x [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == TILE && packed.size(1) == x.size(1) && packed.is_contiguous() &&
              packed.size(0) * TILE >= N && (packed.size(0) - 1) * TILE < N, "skinny_linear: packed W does not fit x / N");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0, "skinny_linear: packed W not 64-byte aligned");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), tiles = packed.size(0);
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
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile_rows(xp, ldx, M, wp + t * K * TILE, K, b ? b + t * TILE : nullptr, yp + t * TILE, N,
                std::min(TILE, N - t * TILE));
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_pack", &skinny_pack, "pack W [N, K] float32 for skinny_linear");
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b in float32, batch-invariant (AVX-512)");
}
