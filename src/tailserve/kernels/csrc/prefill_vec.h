// The 16-lane float vectors paged_prefill_attention (prefill_attention.cpp) and the decode
// attention's vector kernel (decode_heads.h) are written over, one per ISA (scalar, AVX2,
// AVX512), and AVX512's widening loads and 16 x 16 transpose for staging K. Kept apart so the
// kernel files hold the work split and the loops.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "simd.h"
#include "simd16.h"

namespace tailserve_cpu {
namespace prefill_vec {

// 16 float lanes: one AVX512 register, two AVX2 ones, or a plain array. The kernel is written
// once over this and instantiated per ISA (chosen at run time: quant_isa()). kKeyGroup: score
// vectors (of 16 keys) per register tile; kDimGroup: output vectors (of 16 dims) per tile.
struct VecScalar {
  static constexpr int64_t kKeyGroup = 1, kDimGroup = 1;
  float v[16];
  static VecScalar load(const float* p) { VecScalar r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
  static VecScalar set1(float x) { VecScalar r; for (float& e : r.v) e = x; return r; }
  static VecScalar pinned(VecScalar x) { return x; }
  void store(float* p) const { for (int i = 0; i < 16; ++i) p[i] = v[i]; }
  static VecScalar fma(VecScalar a, VecScalar b, VecScalar c) {
    for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static VecScalar mul(VecScalar a, VecScalar b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
  static VecScalar add(VecScalar a, VecScalar b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
  static VecScalar max(VecScalar a, VecScalar b) { for (int i = 0; i < 16; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
  // Lanes >= valid set to -inf (before a max) or 0 (after the exp).
  VecScalar neg_inf_past(int64_t valid) const {
    VecScalar r = *this;
    for (int64_t i = std::max<int64_t>(valid, 0); i < 16; ++i) r.v[i] = -std::numeric_limits<float>::infinity();
    return r;
  }
  VecScalar zero_past(int64_t valid) const {
    VecScalar r = *this;
    for (int64_t i = std::max<int64_t>(valid, 0); i < 16; ++i) r.v[i] = 0.f;
    return r;
  }
  VecScalar exp_sub(float m) const { VecScalar r; for (int i = 0; i < 16; ++i) r.v[i] = std::exp(v[i] - m); return r; }
  float hmax() const { float mx = v[0]; for (int i = 1; i < 16; ++i) mx = std::max(mx, v[i]); return mx; }
  float hsum() const { float s = 0.f; for (float e : v) s += e; return s; }
};

#ifdef TS_AVX2
struct VecAvx2 {
  static constexpr int64_t kKeyGroup = 1, kDimGroup = 1;  // 6 rows x 2 ymm = 12 accumulators
  __m256 lo, hi;
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static VecAvx2 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static VecAvx2 pinned(VecAvx2 x) {
    asm("" : "+x"(x.lo), "+x"(x.hi));
    return x;
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  static VecAvx2 fma(VecAvx2 a, VecAvx2 b, VecAvx2 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static VecAvx2 mul(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static VecAvx2 add(VecAvx2 a, VecAvx2 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static VecAvx2 max(VecAvx2 a, VecAvx2 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  // Lane masks: lanes < valid all ones.
  static void keep(int64_t valid, __m256& lo_m, __m256& hi_m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i n = _mm256_set1_epi32(static_cast<int>(valid));
    lo_m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
    hi_m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
  }
  VecAvx2 neg_inf_past(int64_t valid) const {
    __m256 kl, kh;
    keep(valid, kl, kh);
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    return {_mm256_blendv_ps(ninf, lo, kl), _mm256_blendv_ps(ninf, hi, kh)};
  }
  VecAvx2 zero_past(int64_t valid) const {
    __m256 kl, kh;
    keep(valid, kl, kh);
    return {_mm256_and_ps(kl, lo), _mm256_and_ps(kh, hi)};
  }
  VecAvx2 exp_sub(float m) const {
    const __m256 mv = _mm256_set1_ps(m);
    return {exp_neg(_mm256_sub_ps(lo, mv)), exp_neg(_mm256_sub_ps(hi, mv))};
  }
  float hmax() const {
    const __m256 m8 = _mm256_max_ps(lo, hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
  }
  float hsum() const {
    const __m256 v = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // The decode kernel's: 16 elements of a K/V row widened to float32; 8 from row a beside 8
  // from row b; and hsum8 of v0..v7 given as P[k] = [v2k | v2k+1] (hsum8 itself here).
  template <typename T>
  static VecAvx2 widen(const T* p) { return {load8_f32(p), load8_f32(p + 8)}; }
  template <typename T>
  static VecAvx2 widen2(const T* a, const T* b) { return {load8_f32(a), load8_f32(b)}; }
  static __m256 hsum8x2(const VecAvx2* P) {
    const __m256 v[8] = {P[0].lo, P[0].hi, P[1].lo, P[1].hi, P[2].lo, P[2].hi, P[3].lo, P[3].hi};
    return hsum8(v);
  }
};
#endif

#if defined(__AVX512F__)
// exp(x) for x <= 0, the AVX512 twin of exp_neg (simd.h): same polynomial, same flush.
inline __m512 exp_neg512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Sixteen 16-bit values as float32 (bf16: a shift; fp16: vcvtph2ps); sixteen consecutive
// elements of a row as float32.
template <typename T>
inline __m512 widen16_f32(__m256i h) {
  static_assert(std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>);
  if constexpr (std::is_same_v<T, c10::Half>) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
inline __m512 load16_f32(const T* p) {
  return widen16_f32<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Vec512 {
  static constexpr int64_t kKeyGroup = 4, kDimGroup = 4;  // 6 rows x 4 zmm = 24 accumulators
  __m512 a;
  static Vec512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec512 set1(float x) { return {_mm512_set1_ps(x)}; }
  // Keeps a value used by several FMAs in a register (the compiler would fold a load into each).
  static Vec512 pinned(Vec512 x) {
    asm("" : "+v"(x.a));
    return x;
  }
  void store(float* p) const { _mm512_storeu_ps(p, a); }
  static Vec512 fma(Vec512 x, Vec512 y, Vec512 z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
  static Vec512 mul(Vec512 x, Vec512 y) { return {_mm512_mul_ps(x.a, y.a)}; }
  static Vec512 add(Vec512 x, Vec512 y) { return {_mm512_add_ps(x.a, y.a)}; }
  static Vec512 max(Vec512 x, Vec512 y) { return {_mm512_max_ps(x.a, y.a)}; }
  static __mmask16 keep(int64_t valid) {
    return valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << std::max<int64_t>(valid, 0)) - 1);
  }
  Vec512 neg_inf_past(int64_t valid) const {
    return {_mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), keep(valid), a)};
  }
  Vec512 zero_past(int64_t valid) const { return {_mm512_maskz_mov_ps(keep(valid), a)}; }
  Vec512 exp_sub(float m) const { return {exp_neg512(_mm512_sub_ps(a, _mm512_set1_ps(m)))}; }
  float hmax() const { return _mm512_reduce_max_ps(a); }
  float hsum() const { return _mm512_reduce_add_ps(a); }
  // As VecAvx2's. hsum8x2 adds the same pairs in hsum8's tree, so its sums are hsum8's bit for
  // bit: per 128-bit lane, shuffles 0x88 / 0xdd and an add are _mm256_hadd_ps; the last add
  // joins each vector's two halves as hsum8's permute2f128 pair does.
  template <typename T>
  static Vec512 widen(const T* p) { return {load16_f32(p)}; }
  template <typename T>
  static Vec512 widen2(const T* a, const T* b) {
    if constexpr (std::is_same_v<T, float>) {
      const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
      return {_mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)), 1))};
    } else {
      const __m256i lo = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
      return {widen16_f32<T>(
          _mm256_inserti128_si256(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1))};
    }
  }
  static __m256 hsum8x2(const Vec512* P) {
    const auto hadd = [](__m512 x, __m512 y) {
      return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xdd));
    };
    const __m512 ab = hadd(hadd(P[0].a, P[1].a), hadd(P[2].a, P[3].a));
    // Lane 0 (1): v2k's first (second) half, lane 2 (3): v2k+1's; add each vector's halves.
    const __m512 s = _mm512_add_ps(ab, _mm512_shuffle_f32x4(ab, ab, 0xB1));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s));
  }
};

// dst[col * stride + i] = rows[i][col] for a 16 x 16 block (rows[i] null: zeros), in registers:
// the scalar transpose was 16 loads and 16 strided stores per key and 16 dims.
template <typename T>
inline void transpose16_store(const T* const* rows, float* dst, int64_t stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i] != nullptr ? load16_f32(rows[i]) : _mm512_setzero_ps();
  // Pairs, then quads of rows interleaved within each 128-bit lane: t[4g + c] lane L holds
  // rows 4g .. 4g + 3 at column 4L + c.
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    r[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  // Then a 4 x 4 transpose of 128-bit lanes among r[c], r[4 + c], r[8 + c], r[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 x2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 x3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_ps(dst + (0 + c) * stride, _mm512_shuffle_f32x4(x0, x2, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * stride, _mm512_shuffle_f32x4(x0, x2, 0xDD));
    _mm512_storeu_ps(dst + (8 + c) * stride, _mm512_shuffle_f32x4(x1, x3, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * stride, _mm512_shuffle_f32x4(x1, x3, 0xDD));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// Two float32 vectors -> 16 lanes of bf16 pairs, lo's value in bits 0-15 and hi's in 16-31 (the
// pair one vdpbf16ps lane multiplies), each rounded to nearest even.
inline __m512i pair_bf16(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i h = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// 32 float32 values -> 32 bf16 in order (round to nearest even), at dst.
inline void store32_bf16(const float* src, uint16_t* dst) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(v));
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}
#endif

}  // namespace prefill_vec
}  // namespace tailserve_cpu
