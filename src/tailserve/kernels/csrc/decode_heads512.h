// paged_decode_attention's AVX512 kernel (attention.cpp chooses it at run time).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "decode_split.h"
#include "paged_rows.h"
#include "simd.h"

namespace tailserve_cpu {

#if defined(__AVX512F__) && defined(TS_AVX2)
// The AVX512 twin of decode_heads_avx2, bit for bit: every output lane runs the same float
// operations in the same order, so the instruction set never changes a token.
//
// Scores: a zmm holds two tokens' 8-lane partial dots side by side ([token j | token j + 1]),
// each lane the same FMA chain over head_dim / 8 as the AVX2 lane, and the horizontal sums
// follow hsum8's tree (hsum8x2). Weighted V rows: each lane is one dimension summed over the
// chunk's tokens in order, whatever the vector width, so 16 lanes do two AVX2 vectors' work.
// Half the FMAs and loads of the AVX2 kernel, which at 16-32 sequences x 256 tokens was
// compute-bound even with its K/V in L3 (benchmarks/notes/).

template <typename TKV>
inline __m512 load16_f32(const TKV* p);
template <>
inline __m512 load16_f32<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16_f32<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 load16_f32<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// [8 values from a | 8 values from b], widened as load8_f32 widens them.
template <typename TKV>
inline __m512 load8x2_f32(const TKV* a, const TKV* b);
template <>
inline __m512 load8x2_f32<float>(const float* a, const float* b) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
template <typename TKV>
inline __m256i load8x2_bits(const TKV* a, const TKV* b) {
  const __m256i lo = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  return _mm256_inserti128_si256(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
template <>
inline __m512 load8x2_f32<c10::BFloat16>(const c10::BFloat16* a, const c10::BFloat16* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load8x2_bits(a, b)), 16));
}
template <>
inline __m512 load8x2_f32<c10::Half>(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(load8x2_bits(a, b));
}

// hsum8 of v0..v7 given as P[k] = [v2k | v2k+1]: the same pairs added in the same tree, so
// [sum(v0), ..., sum(v7)] equals hsum8's bit for bit. Per 128-bit lane, shuffle 0x88 / 0xdd
// and an add are _mm256_hadd_ps; the last add joins each vector's two halves as hsum8's
// permute2f128 pair does.
inline __m256 hsum8x2(const __m512* P) {
  const __m512 a = _mm512_add_ps(_mm512_shuffle_ps(P[0], P[1], 0x88), _mm512_shuffle_ps(P[0], P[1], 0xdd));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(P[2], P[3], 0x88), _mm512_shuffle_ps(P[2], P[3], 0xdd));
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd));
  // Lane 0 (1): v2k's first (second) half, lane 2 (3): v2k+1's; add each vector's halves.
  const __m512 s = _mm512_add_ps(ab, _mm512_shuffle_f32x4(ab, ab, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s));
}

template <int NV, typename TKV>
void decode_heads_avx512(const float* qp, int64_t q_s1, float* op, int64_t o_s1, const TKV* kp,
                         const TKV* vp, const PagedRows& rows, int64_t t_begin, int64_t t_end,
                         int64_t num_g, int64_t group, float scale,
                         const DecodePartial* partial) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 16");
  constexpr int64_t D = 8 * NV;
  constexpr int NW = NV / 2;  // zmm per row
  const int64_t heads = num_g * group;
  const int64_t span = num_g * D * int64_t(sizeof(TKV));
  alignas(64) float qs2[kMaxItemHeads * NV * 16];  // head h, part v: q[8v, 8v + 8) * scale, twice
  alignas(64) float acc[kMaxItemHeads * D];
  alignas(32) float p[kMaxItemHeads][8];
  __m512 part[kMaxItemHeads][4];
  float m[kMaxItemHeads], l[kMaxItemHeads];
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t h = 0; h < heads; ++h) {
    for (int v = 0; v < NV; ++v) {
      const __m256 qv = _mm256_mul_ps(_mm256_loadu_ps(qp + h * q_s1 + 8 * v), vscale);
      _mm256_store_ps(qs2 + (h * NV + v) * 16, qv);
      _mm256_store_ps(qs2 + (h * NV + v) * 16 + 8, qv);
    }
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  std::fill(acc, acc + heads * D, 0.f);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const TKV* pk[8];
  const TKV* pv[8];
  const TKV* fk[8];
  const TKV* fv[8];
  for (int64_t t0 = t_begin; t0 < t_end;) {
    const int64_t n = std::min<int64_t>({8, rows.block_size - t0 % rows.block_size, t_end - t0});
    const TKV* k0 = rows.row(kp, t0);
    const TKV* v0 = rows.row(vp, t0);
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(8, t_end - t0 - kPrefetchTokens));
    const int64_t far = std::max<int64_t>(0, std::min<int64_t>(8, t_end - t0 - kFarTokens));
    chunk_rows(rows, kp, vp, t0 + kPrefetchTokens, ahead, pk, pv);
    chunk_rows(rows, kp, vp, t0 + kFarTokens, far, fk, fv);
    for (int64_t jp = 0; jp < 4; ++jp) {
      for (int64_t j = 2 * jp; j < 2 * jp + 2; ++j) {
        if (j < ahead) prefetch_span<_MM_HINT_T0>(pk[j], span);
        if (j < far) {
          prefetch_span<_MM_HINT_T1>(fk[j], span);
          prefetch_span<_MM_HINT_T1>(fv[j], span);
        }
      }
      const TKV* ka = k0 + std::min(2 * jp, n - 1) * rows.tok_stride;  // lanes >= n are masked
      const TKV* kb = k0 + std::min(2 * jp + 1, n - 1) * rows.tok_stride;
      for (int64_t g = 0; g < num_g; ++g) {
        __m512 kk[NV];
        for (int v = 0; v < NV; ++v) kk[v] = load8x2_f32(ka + g * D + 8 * v, kb + g * D + 8 * v);
        for (int64_t hg = 0; hg < group; ++hg) {
          const int64_t h = g * group + hg;
          const float* qh = qs2 + h * NV * 16;
          __m512 a = _mm512_mul_ps(_mm512_load_ps(qh), kk[0]);
          for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_load_ps(qh + 16 * v), kk[v], a);
          part[h][jp] = a;
        }
      }
    }
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
    for (int64_t h = 0; h < heads; ++h) {  // as decode_heads_avx2
      softmax_chunk8(_mm256_blendv_ps(ninf, hsum8x2(part[h]), valid), m[h], l[h], p[h],
                     acc + h * D, D);
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = h * 8 / heads; j < (h + 1) * 8 / heads; ++j) {
        if (j < ahead) prefetch_span<_MM_HINT_T0>(pv[j], span);
      }
      const TKV* vr = v0 + (h / group) * D;
      float* a = acc + h * D;
      __m512 av[NW];
      for (int u = 0; u < NW; ++u) av[u] = _mm512_load_ps(a + 16 * u);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 w = _mm512_set1_ps(p[h][j]);
        const TKV* r = vr + j * rows.tok_stride;
        for (int u = 0; u < NW; ++u) av[u] = _mm512_fmadd_ps(w, load16_f32(r + 16 * u), av[u]);
      }
      for (int u = 0; u < NW; ++u) _mm512_store_ps(a + 16 * u, av[u]);
    }
    t0 += n;
  }
  if (partial != nullptr) {  // as decode_heads_avx2
    store_partial(*partial, acc, m, l, heads, D);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / l[h]);
    for (int u = 0; u < NW; ++u) {
      _mm512_storeu_ps(op + h * o_s1 + 16 * u, _mm512_mul_ps(_mm512_load_ps(acc + h * D + 16 * u), inv));
    }
  }
}
#endif

}  // namespace tailserve_cpu
