// Sixteen float32 lanes, the one vector specdec's CPU kernels are written in, on either instruction set the
// build targets (specdec.engine.cpu_kernels picks the flags from what torch reports of the CPU):
//
//   AVX-512 (-mavx512f)            one zmm register a vector; masks are __mmask16
//   AVX2 + FMA + F16C (-mavx2 ...)  two ymm registers a vector, low lanes 0-7, high 8-15; masks a pair of lane masks
//
// The kernels' layouts (16-column panels, a GGUF tile's quants) and the order of every sum (one fused multiply-add
// per term, in its lane) are the same on both, so a kernel's batch invariance holds on each; what differs is how
// many vectors fit in registers (REGISTERS: the kernels size their micro-kernels from it) and the order within a
// horizontal reduction (reduce_add, lane_sums: fixed on each, not the same across the two).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace simd {

constexpr int64_t LANES = 16;

#if defined(__AVX512F__)

constexpr int REGISTERS = 32;  // vectors that fit in the register file
constexpr bool NIBBLES_IN_PLACE = false;  // nibble() as the kernels' 4-bit path (below; AVX2: nibble_in_place)
using vec = __m512;
using mask = __mmask16;

inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float a) { return _mm512_set1_ps(a); }
inline vec load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline vec loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec a) { _mm512_store_ps(p, a); }
inline void storeu(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline mask tail(int64_t left) {  // the first min(left, 16) lanes
  return left >= LANES ? static_cast<mask>(0xFFFF) : static_cast<mask>((1u << left) - 1);
}
inline vec load_tail(mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // lanes outside m: 0, not read
inline void store_tail(float* p, mask m, vec a) { _mm512_mask_storeu_ps(p, m, a); }
inline vec keep(mask m, vec a) { return _mm512_maskz_mov_ps(m, a); }                     // lanes outside m: 0
inline vec max_where(vec src, mask m, vec a, vec b) { return _mm512_mask_max_ps(src, m, a, b); }

inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c, one rounding
inline vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
inline float reduce_add(vec a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vec a) { return _mm512_reduce_max_ps(a); }
inline vec round_nearest(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec scale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral

inline vec from_halves(const void* p) {  // 16 float16 -> float32 (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}
inline vec from_int8(const void* p) {  // 16 signed bytes -> float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
}
inline vec from_uint8(const void* p) {  // 16 unsigned bytes -> float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
}
// Of 16 32-bit words (64 bytes), nibble SHIFT / 4 of each as a float, minus 8 where MINUS8: a table lookup on each
// lane's low 4 bits (vpermps ignores the rest, so the nibble needs no mask and no conversion).
template <int SHIFT, bool MINUS8>
inline vec nibble(const void* p) {
  const __m512i words = _mm512_loadu_si512(p);
  const vec table = MINUS8 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                           : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(SHIFT ? _mm512_srli_epi32(words, SHIFT) : words, table);
}

// AVX2's 4-bit path (below), declared so that code naming it under `if constexpr (NIBBLES_IN_PLACE)` compiles
// here too; never called on AVX-512.
template <int SHIFT, bool MINUS8>
vec nibble_in_place(const void* p);

// One vector whose lane j is the sum of sums(j)'s 16 lanes, j = 0 .. 15 (a block of keys' scores, each from its
// partial sums): the sixteen vectors' halves added pairwise (256-bit, 128-bit, then 64- and 32-bit lanes), one
// fixed order per lane, ~3 instructions a vector where a horizontal sum per vector takes ~8. Vector j goes to
// acc[SLOT[j]], the place from which the shuffles bring its sum to lane j.
template <class F>
inline vec lane_sums(F&& sums) {
  constexpr int SLOT[LANES] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  vec acc[LANES];
#pragma GCC unroll 16
  for (int j = 0; j < LANES; ++j) acc[SLOT[j]] = sums(j);
  vec r[8], s[4], t[2];
  for (int j = 0; j < 8; ++j)
    r[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[j], acc[j + 8], 0x44), _mm512_shuffle_f32x4(acc[j], acc[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(r[j], r[j + 4], 0x88), _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)
    t[j] = _mm512_add_ps(_mm512_shuffle_ps(s[j], s[j + 2], 0x44), _mm512_shuffle_ps(s[j], s[j + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int REGISTERS = 8;  // 16 ymm registers, two a vector
constexpr bool NIBBLES_IN_PLACE = true;  // a 4-bit quant as nibble_in_place() gives it, its scale 2^-SHIFT (below)
struct vec {
  __m256 lo, hi;
};
struct mask {
  __m256i lo, hi;  // a lane's bits all set where it is in the mask
};

inline vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vec load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }  // 32-byte aligned
inline vec loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, vec a) {
  _mm256_store_ps(p, a.lo);
  _mm256_store_ps(p + 8, a.hi);
}
inline void storeu(float* p, vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline mask tail(int64_t left) {  // the first min(left, 16) lanes: lane i where i < left
  const __m256i n = _mm256_set1_epi32(static_cast<int>(left < LANES ? left : LANES));
  return {_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline vec load_tail(mask m, const float* p) {  // lanes outside m: 0, not read (vmaskmovps does not fault on them)
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
inline void store_tail(float* p, mask m, vec a) {
  _mm256_maskstore_ps(p, m.lo, a.lo);
  _mm256_maskstore_ps(p + 8, m.hi, a.hi);
}
inline vec keep(mask m, vec a) {  // lanes outside m: 0
  return {_mm256_and_ps(_mm256_castsi256_ps(m.lo), a.lo), _mm256_and_ps(_mm256_castsi256_ps(m.hi), a.hi)};
}
inline vec max_where(vec src, mask m, vec a, vec b) {  // max(a, b) in m, src elsewhere
  return {_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(m.hi))};
}

inline vec add(vec a, vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec sub(vec a, vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec mul(vec a, vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec div(vec a, vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec min(vec a, vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vec max(vec a, vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec fmadd(vec a, vec b, vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vec fnmadd(vec a, vec b, vec c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }

inline __m128 half_sum(__m256 a) { return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); }
inline float reduce_add(vec a) {  // halves added pairwise: 256-bit, 128-bit, 64-bit, 32-bit
  __m128 x = half_sum(_mm256_add_ps(a.lo, a.hi));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float reduce_max(vec a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline vec round_nearest(vec a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// p 2^n for integral n in [-126, 127] (all exp() asks): 2^n is a normal float, exact, so the one rounding of the
// product is vscalefps's.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec scale2(vec p, vec n) { return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))}; }

inline vec from_halves(const void* p) {  // 16 float16 -> float32 (exact)
  const __m128i* h = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}
inline vec from_int8(const void* p) {  // 16 signed bytes -> float32 (exact)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline vec from_uint8(const void* p) {  // 16 unsigned bytes -> float32 (exact)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
// Of 16 32-bit words (64 bytes), nibble SHIFT / 4 of each as a float, minus 8 where MINUS8 (exact integers).
template <int SHIFT, bool MINUS8>
inline __m256 nibble8(const void* p) {
  __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  if (SHIFT) w = _mm256_srli_epi32(w, SHIFT);
  w = _mm256_and_si256(w, _mm256_set1_epi32(0xF));
  if (MINUS8) w = _mm256_sub_epi32(w, _mm256_set1_epi32(8));
  return _mm256_cvtepi32_ps(w);
}
template <int SHIFT, bool MINUS8>
inline vec nibble(const void* p) {
  return {nibble8<SHIFT, MINUS8>(p), nibble8<SHIFT, MINUS8>(static_cast<const uint8_t*>(p) + 32)};
}

// Of 16 32-bit words, nibble SHIFT / 4 of each (minus 8 where MINUS8) times 2^SHIFT, exact: the nibble masked
// where it lies and converted, one shift fewer than nibble() (vcvtdq2ps takes any int32; q 2^SHIFT has 4
// significant bits), for a scale the caller has multiplied by 2^-SHIFT (exact too). The top nibble (SHIFT 28,
// whose bits reach the sign) is shifted down as nibble() does and comes with no factor.
template <int SHIFT, bool MINUS8>
inline __m256 nibble8_in_place(const void* p) {
  __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  constexpr int at = SHIFT == 28 ? 0 : SHIFT;
  w = SHIFT == 28 ? _mm256_srli_epi32(w, 28) : _mm256_and_si256(w, _mm256_set1_epi32(0xF << at));
  if (MINUS8) w = _mm256_sub_epi32(w, _mm256_set1_epi32(8 << at));
  return _mm256_cvtepi32_ps(w);
}
template <int SHIFT, bool MINUS8>
inline vec nibble_in_place(const void* p) {
  return {nibble8_in_place<SHIFT, MINUS8>(p), nibble8_in_place<SHIFT, MINUS8>(static_cast<const uint8_t*>(p) + 32)};
}

// One vector whose lane j is the sum of sums(j)'s 16 lanes, j = 0 .. 15: eight vectors at a time (eight of 8 lanes
// in registers, where sixteen pairs would spill), each its halves added, then pairwise horizontal adds (one fixed
// order per lane).
template <class F>
inline __m256 lane_sums8(F&& sums, int first) {
  __m256 h[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const vec a = sums(first + j);
    h[j] = _mm256_add_ps(a.lo, a.hi);
  }
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [0-3 low halves, 0-3 high] [4-7 ...]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
template <class F>
inline vec lane_sums(F&& sums) {
  const __m256 lo = lane_sums8(sums, 0);
  return {lo, lane_sums8(sums, 8)};
}

#else
#error "specdec's CPU kernels need AVX-512 (-mavx512f) or AVX2 with FMA and F16C (-mavx2 -mfma -mf16c)"
#endif

// exp(x) on 16 lanes, for row attention's softmax and the row ops' SiLU: x clamped to [-87, 88], x = n ln2 + r with
// |r| <= ln2 / 2 (ln 2 in two parts, so n * hi is exact), exp(r) by its degree-6 Taylor polynomial (relative error
// below 2e-7 on that range), times 2^n.
inline vec exp(vec x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vec p = set1(1.0f / 720.0f);
  p = fmadd(p, r, set1(1.0f / 120.0f));
  p = fmadd(p, r, set1(1.0f / 24.0f));
  p = fmadd(p, r, set1(1.0f / 6.0f));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return scale2(p, n);
}

}  // namespace simd
