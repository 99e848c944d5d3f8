// x to int8 for the products on GGUF blocks (quant_linear.cpp): each row of x in blocks of 32,
// scale dx = max|x| / 127, round to nearest, with the sums the formats' offsets need
// (quant_blocks.h, quantize_rows).

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant_blocks.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace quant {
namespace {

// One block of 32: xq, dx, the sums over each 16 and over the 32. Every path (and the torch
// reference) rounds the same float32 products x * (1 / d) to nearest even, so they agree on
// every integer.
inline void quantize_block(const float* v, int8_t* o, float* d_out, float* s16, float* s32,
                           int32_t* i32) {
#ifdef TS_AVX2
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256 r[4];
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_round_ps(_mm256_mul_ps(x[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(r[i]);
  }
  const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), b);
  const float lo = hsum256(_mm256_add_ps(r[0], r[1])), hi = hsum256(_mm256_add_ps(r[2], r[3]));
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int lo_i = 0, hi_i = 0;
  for (int i = 0; i < 32; ++i) {
    const int qv = static_cast<int>(std::nearbyint(v[i] * id));
    o[i] = static_cast<int8_t>(qv);
    (i < 16 ? lo_i : hi_i) += qv;
  }
  const float lo = static_cast<float>(lo_i), hi = static_cast<float>(hi_i);
#endif
  *d_out = d;
  s16[0] = d * lo;
  s16[1] = d * hi;
  *s32 = d * (lo + hi);
  *i32 = static_cast<int32_t>(lo + hi);  // sums of at most 32 x 127: exact in float
}

}  // namespace

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs,
                   float* xs32, int32_t* xi32) {
  const int64_t nb = K / 32;
  parallel_dynamic((M + 7) / 8, [&](int64_t item) {
    const int64_t m1 = std::min(M, item * 8 + 8);
    for (int64_t m = item * 8; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        quantize_block(x + m * K + b * 32, xq + m * K + b * 32, dx + m * nb + b,
                       xs + m * (K / 16) + 2 * b, xs32 + m * nb + b, xi32 + m * nb + b);
      }
    }
  });
}

}  // namespace quant
}  // namespace tailserve_cpu
