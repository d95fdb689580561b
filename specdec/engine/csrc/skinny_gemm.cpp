// Skinny GEMM: y = x W^T (+ b) in float32 for the few rows of a decode or verify step (AVX-512 or AVX2,
// simd.h).
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
// Blocking. The rows of x go in blocks of at most 9 (AVX2: 6), as even as they come (17 = 9 + 8). A block of MB
// rows against NV panels at a time is the micro-kernel: MB x NV accumulators, NV weight vectors and one
// broadcast value of x in the vector registers (NV = the most that fit: 8 for 1-2 rows, 3 for 7-9; AVX2, whose
// 16 ymm registers hold 8 vectors of 16 lanes: 2 for 1-2 rows, 1 for 3-6, where 4 for one row spilled the
// accumulators and halved a GGUF product's speed). Per
// k it loads NV weight vectors and broadcasts MB values, then does MB x NV multiply-adds. One row block
// (M <= 9, a decode or verify step): each of torch's OpenMP threads takes an even share of the panels, NV at
// a time and the rest in one micro-kernel of its width. More rows: the row blocks take each group of NV
// panels in turn (from L2 after the first: W streams from memory once per product), the groups split among
// the threads.
//
// Quantised weights (quant_linear): a GGUF's Q4_0 / Q4_1 / Q8_0 blocks, and its K-quant super-blocks (Q2_K to Q6_K) cut
// into blocks of 32, packed into the same panels, are dequantised inside the micro-kernel to bitwise gguf-py's
// float32 values, and summed exactly as above.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "simd.h"

#include <cstdlib>
#include <type_traits>
#include <utility>

namespace {

using simd::vec;
constexpr int64_t PANEL = simd::LANES;  // columns per packed panel (one vector)
// Rows per block, and panels per step for MB rows: MB x NV + NV + 1 vectors within the registers (AVX-512's 32;
// AVX2's 16 ymm hold 8 vectors of 16 lanes, and a GGUF tile's scales want 2 NV more). On AVX-512 a quantised
// tile's NV weight vectors come with NV vectors of quants and the lookup table: NV_FOR_Q keeps MB x NV + 2 NV + 2
// near 32 (measured on a Xeon, two threads, Q4_1 tiles in cache: 2 / 3 / 5 rows at NV 8 / 6 / 5 spilled and took
// 1.52x / 1.77x / 2.83x one row's time; at 6 / 5 / 4, 1.22x / 1.47x / 2.09x). Sums are the same either way.
constexpr int64_t MAX_MB = simd::REGISTERS == 32 ? 9 : 6;
constexpr int NV_FOR[10] = {0, 8, 8, 6, 6, 5, 4, 3, 3, 3};
constexpr int NV_FOR_Q[10] = {0, 8, 6, 5, 4, 4, 3, 3, 3, 3};
constexpr int NV_FOR_AVX2[10] = {0, 2, 2, 1, 1, 1, 1, 1, 1, 1};
constexpr int nv_for(int mb, bool quantised = false) {
  return simd::REGISTERS == 32 ? (quantised ? NV_FOR_Q : NV_FOR)[mb] : NV_FOR_AVX2[mb];
}

template <int MB, int NV>
inline void store(const vec (&acc)[MB][NV], const float* __restrict bias, float* __restrict y, int64_t ldy,
                  int64_t cols) {
  for (int v = 0; v < NV; ++v) {
    const int64_t left = cols - PANEL * v;
    if (left <= 0) break;
    const simd::mask mask = simd::tail(left);
    const vec b = bias ? simd::load_tail(mask, bias + PANEL * v) : simd::zero();
    for (int i = 0; i < MB; ++i) simd::store_tail(y + i * ldy + PANEL * v, mask, bias ? simd::add(acc[i][v], b) : acc[i][v]);
  }
}

template <int MB, int NV>
inline void kernel(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                   const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols) {
  vec acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    vec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = simd::load(w + v * K * PANEL + k * PANEL);
    for (int i = 0; i < MB; ++i) {
      const vec xb = simd::set1(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = simd::fmadd(xb, wv[v], acc[i][v]);
    }
  }
  store<MB, NV>(acc, bias, y, ldy, cols);
}

// Quantised weights: GGUF's blocks of 32 along k, kept as loaded and dequantised inside the product.
// Packed (specdec.engine.quant_gemm.pack) in the same panels of 16 columns: panel p, block b is one tile,
// the 16 columns' float16 scales (d; then m for Q4_1), then their quants. Q4: four groups of 64 bytes, group g
// one 32-bit word per column c holding its 8 nibbles for k = 8g .. 8g + 7 (nibble i, bits 4i .. 4i + 3: k =
// 8g + i), so one vector load serves 8 weight vectors; Q8: 16 bytes per k. A tile dequantises to float32
// [32][16] exactly as gguf-py's numpy does (what the reference model holds): float16 -> float32 is exact, the
// integers are exact, and so is every product d q (an 11-bit significand times at most 8 bits fits float32's
// 24), so Q4_1's (d q) + m is rounded once whether or not it is fused into one multiply-add, as gguf-py rounds
// it once.
//
// The K-quants (specdec.engine.quant_gemm.pack_k): a super-block of 256 k holds float16 factors and small integer
// scales per sub-block; the packer multiplies them out, exactly, into float32 scales per block of 32 (per 16 for
// Q6_K, Q3_K and Q2_K), which the tile then holds in place of float16 ones. Q4_K: D = d sc (11 bits times 6) and M = -(dmin m),
// so a weight is D q + M, one rounding as gguf-py's (d sc) q - dmin m has (D q is exact); Q6_K: a weight is
// D q with q = q6 - 32, exact (18 bits times 6); Q5_K: D q + M as Q4_K's, q of 5 bits; Q3_K: D q per 16 with q in
// [-4, 3], exact; Q2_K: D q + M per 16, q in [0, 3], one rounding. Tiles: Q4_K D [16], M [16] float32, then Q4's
// quant groups; Q6_K D [16] for k 0-15, D [16] for k 16-31, then a byte per quant as Q8_0's (signed); Q5_K D [16],
// M [16], then a byte per quant (0-31); Q3_K D, D (the halves) then Q4's groups of q + 8 (Q4_0's table); Q2_K D, D,
// M, M (the halves), then Q4's groups.
constexpr int64_t QK = 32;  // k per block
enum Format : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's ids
constexpr int SCALES = 4 * 16;  // a tile's float32 scales at most (Q2_K: D and M for each half), per column
// Where simd::NIBBLES_IN_PLACE (AVX2), a Q4_0 / Q4_1 / Q4_K tile's scale d (D) is also held as d 2^-4i for the quants
// of nibble i (i = 0 .. 6; d for the top nibble, i = 7), after the SCALES: one shift fewer a weight vector.
constexpr int SHIFTED = SCALES, ALL_SCALES = SCALES + (simd::NIBBLES_IN_PLACE ? 8 * 16 : 0);
constexpr bool in_place(int64_t fmt) { return simd::NIBBLES_IN_PLACE && (fmt == Q4_0 || fmt == Q4_1 || fmt == Q4_K); }

inline bool served(int64_t fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 || (fmt >= Q2_K && fmt <= Q6_K); }

inline int64_t tile_bytes(int64_t fmt) {
  switch (fmt) {
    case Q4_0: return 32 + 256;
    case Q4_1: return 64 + 256;
    case Q3_K:
    case Q4_K: return 128 + 256;
    case Q2_K: return 256 + 256;
    case Q5_K:
    case Q6_K: return 128 + 512;
    default: return 32 + 512;  // Q8_0
  }
}

constexpr bool k_quant(int64_t fmt) { return fmt >= Q2_K && fmt <= Q6_K; }
constexpr int64_t quants_at(int64_t fmt) { return fmt == Q2_K ? 256 : k_quant(fmt) ? 128 : fmt == Q4_1 ? 64 : 32; }

// f(std::integral_constant<int64_t, FMT>{}) for a served format `fmt` (Q8_0 for any other): the one list of the
// formats a kernel is instantiated for.
template <class F>
inline void by_format(int64_t fmt, F&& f) {
  switch (fmt) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q2_K: return f(std::integral_constant<int64_t, Q2_K>{});
    case Q3_K: return f(std::integral_constant<int64_t, Q3_K>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    default: return f(std::integral_constant<int64_t, Q8_0>{});
  }
}

// One weight vector (16 columns at k) of a tile, dequantised in registers as gguf-py computes it. s: the
// tile's scales as float32, d then m (the K-quants': D, then M, each per half where the format has two). A 4-bit
// quant is q for Q4_1, Q4_K and Q2_K, q - 8 for Q4_0 and Q3_K (whose tile holds q + 8).
template <int64_t FMT, int K>
inline vec weight(const uint8_t* __restrict t, const float* __restrict s) {
  if constexpr (FMT == Q8_0 || FMT == Q6_K) {  // q * d (Q6_K: the half's D)
    return simd::mul(simd::from_int8(t + quants_at(FMT) + 16 * K), simd::load(s + (FMT == Q6_K && K >= 16 ? PANEL : 0)));
  } else if constexpr (FMT == Q5_K) {  // D q + M, q unsigned
    return simd::fmadd(simd::load(s), simd::from_uint8(t + quants_at(FMT) + 16 * K), simd::load(s + PANEL));
  } else if constexpr (in_place(FMT)) {  // q 2^4i times d 2^-4i: d q, exactly
    const vec q = simd::nibble_in_place<4 * (K % 8), FMT == Q4_0>(t + quants_at(FMT) + 64 * (K / 8));
    const vec d = simd::load(s + SHIFTED + PANEL * (K % 8));
    if constexpr (FMT == Q4_0) return simd::mul(d, q);  // d (q - 8)
    return simd::fmadd(d, q, simd::load(s + PANEL));  // (d q) + m; Q4_K: D q + M
  } else {
    const vec q = simd::nibble<4 * (K % 8), FMT == Q4_0 || FMT == Q3_K>(t + quants_at(FMT) + 64 * (K / 8));
    if constexpr (FMT == Q4_1 || FMT == Q4_K)
      return simd::fmadd(simd::load(s), q, simd::load(s + PANEL));  // (d q) + m; Q4_K: D q + M
    constexpr int half = K >= 16 ? PANEL : 0;  // Q2_K, Q3_K: the half's scales
    if constexpr (FMT == Q2_K) return simd::fmadd(simd::load(s + half), q, simd::load(s + 2 * PANEL + half));
    if constexpr (FMT == Q3_K) return simd::mul(simd::load(s + half), q);  // D q, q in [-4, 3]
    return simd::mul(simd::load(s), q);  // d (q - 8)
  }
}

// The float kernel's sums, term for term, over the tiles' weights dequantised in registers as the k loop
// reaches them: each weight vector is dequantised once and used by all MB rows.
template <int MB, int NV, int64_t FMT, int K>
inline void qstep(vec (&acc)[MB][NV], const float* __restrict x, int64_t ldx, const uint8_t* const (&t)[NV],
                  const float (&scale)[NV][ALL_SCALES]) {
  vec wv[NV];
  for (int v = 0; v < NV; ++v) wv[v] = weight<FMT, K>(t[v], scale[v]);
  for (int i = 0; i < MB; ++i) {
    const vec xb = simd::set1(x[i * ldx + K]);
    for (int v = 0; v < NV; ++v) acc[i][v] = simd::fmadd(xb, wv[v], acc[i][v]);
  }
}

template <int MB, int NV, int64_t FMT, int... K>
inline void qsteps(vec (&acc)[MB][NV], const float* __restrict x, int64_t ldx, const uint8_t* const (&t)[NV],
                   const float (&scale)[NV][ALL_SCALES], std::integer_sequence<int, K...>) {
  (qstep<MB, NV, FMT, K>(acc, x, ldx, t, scale), ...);  // k = 0 .. 31 in order
}

template <int64_t FMT, int... K>
inline void dequant_tile(const uint8_t* __restrict t, const float* __restrict s, float* __restrict out,
                         std::integer_sequence<int, K...>) {
  (simd::store(out + PANEL * K, weight<FMT, K>(t, s)), ...);
}

// A tile's float16 scales as float32 into s: d, then m where the format has one (Q4_1); the K-quants' float32
// scales (2 vectors, Q2_K's 4) as they are.
inline void tile_scales(int64_t fmt, const uint8_t* __restrict t, float* __restrict s) {
  if (k_quant(fmt)) {
    for (int64_t v = 0; v < quants_at(fmt) / 64; ++v)
      simd::store(s + PANEL * v, simd::loadu(reinterpret_cast<const float*>(t + 64 * v)));
  } else {
    simd::store(s, simd::from_halves(t));
    if (fmt == Q4_1) simd::store(s + PANEL, simd::from_halves(t + 32));
  }
  if (in_place(fmt)) {  // d 2^-4i: exact (d, and Q4_K's D = d sc, is 0 or >= 2^-24, float16's least: d 2^-24 is normal)
    const vec d = simd::load(s);
    for (int i = 0; i < 7; ++i) simd::store(s + SHIFTED + PANEL * i, simd::mul(d, simd::set1(1.0f / static_cast<float>(1 << (4 * i)))));
    simd::store(s + SHIFTED + PANEL * 7, d);
  }
}

inline void dequant(int64_t fmt, const uint8_t* __restrict t, float* __restrict out) {  // tile -> [32][16]
  alignas(64) float s[ALL_SCALES];
  tile_scales(fmt, t, s);
  constexpr auto ks = std::make_integer_sequence<int, QK>{};
  by_format(fmt, [&](auto format) { dequant_tile<decltype(format)::value>(t, s, out, ks); });
}

template <int MB, int NV, int64_t FMT>
inline void qkernel(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w, int64_t nb,
                    const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols) {
  const int64_t tb = tile_bytes(FMT);
  alignas(64) float scale[NV][ALL_SCALES];
  vec acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = simd::zero();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* t[NV];
    for (int v = 0; v < NV; ++v) {
      t[v] = w + (v * nb + blk) * tb;
      tile_scales(FMT, t[v], scale[v]);
    }
    qsteps<MB, NV, FMT>(acc, x + blk * QK, ldx, t, scale, std::make_integer_sequence<int, QK>{});
  }
  store<MB, NV>(acc, bias, y, ldy, cols);
}

struct Floats {  // packed float32 panels [count, K, 16]
  const float* w;
  int64_t K;
  template <int MB, int NV>
  void run(const float* x, int64_t ldx, int64_t p, const float* bias, float* y, int64_t ldy, int64_t cols) const {
    kernel<MB, NV>(x, ldx, w + p * K * PANEL, K, bias, y, ldy, cols);
  }
};

struct Blocks {  // packed quantised tiles [count, nb, tile]
  const uint8_t* w;
  int64_t nb, fmt;
  template <int MB, int NV>
  void run(const float* x, int64_t ldx, int64_t p, const float* bias, float* y, int64_t ldy, int64_t cols) const {
    const uint8_t* panel = w + p * nb * tile_bytes(fmt);
    by_format(fmt, [&](auto format) { qkernel<MB, NV, decltype(format)::value>(x, ldx, panel, nb, bias, y, ldy, cols); });
  }
};

// The last `rest` (< NV) panels from p as one micro-kernel of that many.
template <int MB, int NV, class W>
inline void rest_of(const W& w, const float* x, int64_t ldx, const float* bias, float* y, int64_t ldy, int64_t N,
                    int64_t p, int64_t rest) {
  if constexpr (NV > 0) {
    if (rest < NV) return rest_of<MB, NV - 1>(w, x, ldx, bias, y, ldy, N, p, rest);
    w.template run<MB, NV>(x, ldx, p, bias ? bias + p * PANEL : nullptr, y + p * PANEL, ldy, N - p * PANEL);
  }
}

// Rows [0, MB) of x against panels [p0, p1): NV at a time, the rest in one micro-kernel of its width.
template <int MB, class W>
inline void panels(const W& w, const float* x, int64_t ldx, const float* bias, float* y, int64_t ldy, int64_t N,
                   int64_t p0, int64_t p1) {
  constexpr int NV = nv_for(MB, std::is_same_v<W, Blocks>);
  int64_t p = p0;
  for (; p + NV <= p1; p += NV)
    w.template run<MB, NV>(x, ldx, p, bias ? bias + p * PANEL : nullptr, y + p * PANEL, ldy, N - p * PANEL);
  rest_of<MB, NV - 1>(w, x, ldx, bias, y, ldy, N, p, p1 - p);
}

template <class W>
inline void block(int64_t mb, const W& w, const float* x, int64_t ldx, const float* bias, float* y, int64_t ldy,
                  int64_t N, int64_t p0, int64_t p1) {
  switch (mb) {
    case 1: panels<1>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 2: panels<2>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 3: panels<3>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 4: panels<4>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 5: panels<5>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 6: panels<6>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 7: panels<7>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    case 8: panels<8>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
    default: panels<9>(w, x, ldx, bias, y, ldy, N, p0, p1); break;
  }
}

// y [M, N] = x [M, K] W^T + bias over `count` panels. One row block: the panels split evenly among the
// threads. More: the row blocks take each group of panels in turn, the groups split among the threads, and
// quantised weights are dequantised a group at a time into a float buffer (L2) that all the row blocks read.
template <class W>
void product(const W& w, const float* x, int64_t ldx, int64_t M, int64_t K, int64_t N, int64_t count,
             const float* bias, float* y, int64_t ldy) {
  const int64_t blocks = (M + MAX_MB - 1) / MAX_MB;
  if (blocks == 1) {  // one row block: each thread an even share of the panels (a matrix of few panels stays balanced)
    at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) { block(M, w, x, ldx, bias, y, ldy, N, p0, p1); });
    return;
  }
  const int64_t group = nv_for(static_cast<int>((M + blocks - 1) / blocks));  // panels per group: the first (largest) block's NV
  const int64_t groups = (count + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    constexpr bool quantised = std::is_same_v<W, Blocks>;
    float* buffer = quantised ? static_cast<float*>(std::aligned_alloc(64, group * K * PANEL * sizeof(float))) : nullptr;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * group, p1 = std::min(count, p0 + group);
      if constexpr (quantised)  // the group's panels dequantised once, for every row block
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t blk = 0; blk < w.nb; ++blk)
            dequant(w.fmt, w.w + (p * w.nb + blk) * tile_bytes(w.fmt), buffer + ((p - p0) * K + blk * QK) * PANEL);
      int64_t m = 0;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t mb = (M - m + (blocks - i) - 1) / (blocks - i);  // the remaining rows, shared out evenly
        if constexpr (quantised)
          block(mb, Floats{buffer, K}, x + m * ldx, ldx, bias ? bias + p0 * PANEL : nullptr, y + m * ldy + p0 * PANEL,
                ldy, N - p0 * PANEL, 0, p1 - p0);
        else
          block(mb, w, x + m * ldx, ldx, bias, y + m * ldy, ldy, N, p0, p1);
        m += mb;
      }
    }
    std::free(buffer);
  });
}

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "skinny_linear: bias [N]");
  return bias->data_ptr<float>();
}

}  // namespace

// y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) W^T + bias, W packed as skinny_pack's float32 panels (fmt
// 0) or quant_linear's tiles of ggml type fmt, already checked by the caller (the decoder, at add_layer).
void raw::linear(const float* x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& packed, int64_t fmt, int64_t N,
                 const float* bias, float* y, int64_t ldy) {
  if (M == 0 || N == 0) return;
  if (fmt == 0)
    product(Floats{packed.data_ptr<float>(), K}, x, ldx, M, K, N, packed.size(0), bias, y, ldy);
  else
    product(Blocks{packed.data_ptr<uint8_t>(), packed.size(1), fmt}, x, ldx, M, K, N, packed.size(0), bias, y, ldy);
}

// W [N, K] float32 -> its packed panels [ceil(N / 16), K, 16] (zero-padded).
at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "skinny_pack: float32 CPU W [N, K]");
  const int64_t N = w.size(0), K = w.size(1), count = (N + PANEL - 1) / PANEL;
  auto padded = at::zeros({count * PANEL, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({count, PANEL, K}).transpose(1, 2).contiguous();  // [panels, K, 16]
}

// y [M, N] = x [M, K] W^T + bias [N], W given packed (skinny_pack) with its N.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "skinny_linear: x [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == x.size(1) && packed.is_contiguous() &&
              packed.size(0) * PANEL >= N && (packed.size(0) - 1) * PANEL < N, "skinny_linear: packed W does not fit x / N");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0, "skinny_linear: packed W not 64-byte aligned");
  const float* b = checked_bias(bias, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  product(Floats{packed.data_ptr<float>(), K}, x.data_ptr<float>(), x.stride(0), M, K, N, packed.size(0), b,
          y.data_ptr<float>(), N);
  return y;
}

// y [M, N] = x [M, K] W^T + bias [N], W given as packed quantised tiles [ceil(N / 16), K / 32, tile] of ggml
// type `fmt` (Q4_0, Q4_1, Q8_0, Q2_K to Q6_K), with its N: bitwise skinny_linear over W dequantised.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t N,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(served(fmt), "quant_linear: format must be Q4_0, Q4_1, Q8_0 or a K-quant Q2_K to Q6_K (ggml type 2, 3, 8, 10-14)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "quant_linear: x [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == tile_bytes(fmt) && packed.size(1) * QK == x.size(1) &&
              packed.size(0) * PANEL >= N && (packed.size(0) - 1) * PANEL < N,
              "quant_linear: packed W does not fit x / N / the format");
  const float* b = checked_bias(bias, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  product(Blocks{packed.data_ptr<uint8_t>(), packed.size(1), fmt}, x.data_ptr<float>(), x.stride(0), M, K, N,
          packed.size(0), b, y.data_ptr<float>(), N);
  return y;
}

// Rows `rows` [T] (int64, each < N) of a packed quantised matrix, dequantised: [T, K] float32, bitwise gguf-py's
// values (the embedding lookup of a table kept in blocks: each row's tiles dequantised whole, its lane kept).
at::Tensor quant_rows(const at::Tensor& packed, int64_t fmt, const at::Tensor& rows, int64_t N) {
  TORCH_CHECK(served(fmt), "quant_rows: format must be Q4_0, Q4_1, Q8_0 or Q2_K to Q6_K");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == tile_bytes(fmt) && packed.size(0) * PANEL >= N, "quant_rows: packed tiles of this format");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "quant_rows: rows [T] int64");
  const int64_t T = rows.numel(), nb = packed.size(1), K = nb * QK;
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(r[t] >= 0 && r[t] < N, "quant_rows: row ", r[t], " out of range [0, ", N, ")");
  auto out = at::empty({T, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    alignas(64) float tile[QK * PANEL];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t panel = r[t] / PANEL, lane = r[t] % PANEL;
      for (int64_t blk = 0; blk < nb; ++blk) {
        dequant(fmt, w + (panel * nb + blk) * tile_bytes(fmt), tile);
        for (int64_t k = 0; k < QK; ++k) o[t * K + blk * QK + k] = tile[k * PANEL + lane];
      }
    }
  });
  return out;
}

// The packed tiles of quant_linear dequantised: [ceil(N / 16), K, 16] float32, skinny_linear's layout.
at::Tensor quant_dequant(const at::Tensor& packed, int64_t fmt) {
  TORCH_CHECK(served(fmt), "quant_dequant: format must be Q4_0, Q4_1, Q8_0 or Q2_K to Q6_K");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(2) == tile_bytes(fmt), "quant_dequant: packed tiles of this format");
  const int64_t count = packed.size(0), nb = packed.size(1);
  auto out = at::empty({count, nb * QK, PANEL}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count * nb, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) dequant(fmt, w + t * tile_bytes(fmt), o + t * QK * PANEL);
  });
  return out;
}
