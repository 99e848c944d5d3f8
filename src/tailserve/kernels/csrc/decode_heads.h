// paged_decode_attention's vector kernel, written once over prefill_vec.h's 16-lane vectors:
// VecAvx2 (two ymm) and Vec512 (one zmm); attention.cpp chooses the ISA at run time.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "decode_split.h"
#include "paged_rows.h"
#include "prefill_vec.h"
#include "simd.h"

namespace tailserve_cpu {

#ifdef TS_AVX2
// q and out float32, the pool float32 or 16-bit (TKV, widened in registers), head_dim = 8 * NV,
// KV heads [g0, g0 + num_g) of one sequence (their query heads are num_g * group consecutive
// heads of q). One pass over the context with an online softmax, eight tokens of one block at
// a time: the chunk's K rows give the scores of every query head of their group, the running
// max and sum are updated, then its V rows are added in while they are still in L1. The
// prefetches ahead of each chunk, and why: paged_rows.h.
//
// Every output lane runs the same float operations in the same order at either width, so the
// instruction set never changes a token. Scores: a vector holds two tokens' 8-lane partial
// dots side by side ([token j | token j + 1]), each lane one FMA chain over head_dim / 8, and
// the horizontal sums follow hsum8's tree (hsum8x2). Weighted V rows: each lane is one
// dimension summed over the chunk's tokens in order. On AVX512 that is half the FMAs and loads
// of AVX2's, which at 16-32 sequences x 256 tokens was compute-bound even with its K/V in L3
// (benchmarks/notes/).
template <typename V, int NV, typename TKV>
void decode_heads(const float* qp, int64_t q_s1, float* op, int64_t o_s1, const TKV* kp,
                  const TKV* vp, const PagedRows& rows, int64_t t_begin, int64_t t_end,
                  int64_t num_g, int64_t group, float scale, const DecodePartial* partial) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 16");
  constexpr int64_t D = 8 * NV;
  constexpr int NW = NV / 2;  // vectors per row
  const int64_t heads = num_g * group;
  const int64_t span = num_g * D * int64_t(sizeof(TKV));  // bytes of one token this item reads, K or V
  alignas(64) float qs2[kMaxItemHeads * NV * 16];  // head h, part v: q[8v, 8v + 8) * scale, twice
  alignas(64) float acc[kMaxItemHeads * D];
  alignas(32) float p[kMaxItemHeads][8];
  V part[kMaxItemHeads][4];
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
  const TKV* pk[8];  // rows kPrefetchTokens ahead
  const TKV* pv[8];
  const TKV* fk[8];  // rows kFarTokens ahead
  const TKV* fv[8];
  for (int64_t t0 = t_begin; t0 < t_end;) {
    // A chunk never crosses a block: its rows are tok_stride apart.
    const int64_t n = std::min<int64_t>({8, rows.block_size - t0 % rows.block_size, t_end - t0});
    const TKV* k0 = rows.row(kp, t0);
    const TKV* v0 = rows.row(vp, t0);
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(8, t_end - t0 - kPrefetchTokens));
    const int64_t far = std::max<int64_t>(0, std::min<int64_t>(8, t_end - t0 - kFarTokens));
    chunk_rows(rows, kp, vp, t0 + kPrefetchTokens, ahead, pk, pv);
    chunk_rows(rows, kp, vp, t0 + kFarTokens, far, fk, fv);
    // Scores, two tokens at a time so the chunk's rows are read in address order.
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
        V kk[NV];
        for (int v = 0; v < NV; ++v) kk[v] = V::widen2(ka + g * D + 8 * v, kb + g * D + 8 * v);
        for (int64_t hg = 0; hg < group; ++hg) {
          const int64_t h = g * group + hg;
          const float* qh = qs2 + h * NV * 16;
          V a = V::mul(V::load(qh), kk[0]);
          for (int v = 1; v < NV; ++v) a = V::fma(V::load(qh + 16 * v), kk[v], a);
          part[h][jp] = a;
        }
      }
    }
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
    for (int64_t h = 0; h < heads; ++h) {
      softmax_chunk8(_mm256_blendv_ps(ninf, V::hsum8x2(part[h]), valid), m[h], l[h], p[h],
                     acc + h * D, D);
    }
    // Weighted V rows, head by head; the chunk's V rows stay in L1 across the heads.
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = h * 8 / heads; j < (h + 1) * 8 / heads; ++j) {
        if (j < ahead) prefetch_span<_MM_HINT_T0>(pv[j], span);
      }
      const TKV* vr = v0 + (h / group) * D;
      float* a = acc + h * D;
      V av[NW];
      for (int u = 0; u < NW; ++u) av[u] = V::load(a + 16 * u);
      for (int64_t j = 0; j < n; ++j) {
        const V w = V::set1(p[h][j]);
        const TKV* r = vr + j * rows.tok_stride;
        for (int u = 0; u < NW; ++u) av[u] = V::fma(w, V::widen(r + 16 * u), av[u]);
      }
      for (int u = 0; u < NW; ++u) av[u].store(a + 16 * u);
    }
    t0 += n;
  }
  if (partial != nullptr) {  // one part of the context: kept unnormalized for merge_parts
    store_partial(*partial, acc, m, l, heads, D);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const V inv = V::set1(1.f / l[h]);
    for (int u = 0; u < NW; ++u) V::mul(V::load(acc + h * D + 16 * u), inv).store(op + h * o_s1 + 16 * u);
  }
}
#endif

}  // namespace tailserve_cpu
