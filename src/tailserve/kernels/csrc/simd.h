// SIMD helpers shared by the kernels of several files (attention, linear, elementwise).
//
// TS_AVX2 is defined where the compiler targets AVX2 + FMA (-march=native on such a CPU); every
// kernel has a scalar path for other machines.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1
#endif

namespace tailserve_cpu {

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

#ifdef TS_AVX2
// 32 bits -> 32 bytes, 0xFF where the bit is set (byte j from bit j): the Q5 formats' fifth
// bits, in stored blocks (quant_decode_rows.cpp) and in tiles (quant_tiled.cpp).
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
}
#endif

inline float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef TS_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  float r = _mm_cvtss_f32(lo);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
#else
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
#endif
}

#ifdef TS_AVX2
// Horizontal sums of eight vectors, as one vector [sum(v0), ..., sum(v7)].
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r in [-ln2/2, ln2/2], relative
// error ~2e-7; inputs below -87 flush to 0 as expf would underflow there anyway.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One head's online-softmax step over a chunk of up to 8 scores s (masked lanes -inf): p gets
// exp(s - m'), l adds their sum, and when the max rises (m' > m) what acc [D] summed against
// the old max is scaled by exp(m - m') first. The decode kernel calls it at both widths
// (decode_heads.h), so the instruction set never changes these bits (a scale is one float
// multiply an element at any vector width).
inline void softmax_chunk8(__m256 s, float& m, float& l, float* p, float* acc, int64_t D) {
  __m256 mx = _mm256_max_ps(s, _mm256_permute2f128_ps(s, s, 1));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
  const float m_new = std::max(m, _mm256_cvtss_f32(mx));
  const __m256 e = exp_neg(_mm256_sub_ps(s, _mm256_set1_ps(m_new)));
  _mm256_store_ps(p, e);
  __m256 sum = _mm256_add_ps(e, _mm256_permute2f128_ps(e, e, 1));
  sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0x4e));
  sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0xb1));
  if (m_new > m) {  // rescale what was summed against the old max (exp(-inf) = 0)
    const float c = std::exp(m - m_new);
    l *= c;
    const __m256 cv = _mm256_set1_ps(c);
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc + d, _mm256_mul_ps(cv, _mm256_load_ps(acc + d)));
    m = m_new;
  }
  l += _mm256_cvtss_f32(sum);
}
#endif

}  // namespace tailserve_cpu
