// The tile passes of the AMX prefill attention (prefill_amx.cpp): exp2 at bf16's and at
// float32's precision, S^T = K Q^T and O^T += V^T P^T with one bf16 rounding per operand, and
// the same with split operands (hi + lo, three tile products) for the default amx level.
// Included by prefill_amx.cpp alone; empty where the build has no AMX (TS_AMX).

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"

#ifdef TS_AMX
namespace tailserve_cpu {
namespace prefill_tiles {

// x rounded to bf16 (nearest even, as the conversions round), as float32: the split's hi.
inline __m512 bf16_hi(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x))), 16));
}

// The split's operand tiles: hi at +0, lo at +512 bf16 (one tile further).
constexpr int64_t kLo = 512;

// exp2(t) for t <= 0: 2^round(t) x the Taylor polynomial of 2^f for the rest (|f| <= 1/2).
// One rounding (the result is rounded to bf16 next): degree 4, relative error < 5e-5 against
// bf16's 3.9e-3, 9 vector operations with the subtraction of the max where the float32
// kernels' exp takes 15. Split: degree 6, ~1.2e-7, float32's precision. t is clamped (a
// masked key's -inf included) where the result stays a normal float32: a denormal costs a
// microcode assist per lane (measured: 55% of a short chunk's time), and 2^-120 of a key's
// value is nothing beside the row's largest probability, 1 or more; the split clamps at -100
// so its remainder p - hi (~2^-9 of p) stays normal too.
template <bool kSplit>
inline __m512 exp2_of(__m512 t) {
  constexpr float kTaylor[7] = {1.f,           6.9314718e-1f, 2.4022651e-1f, 5.5504109e-2f,
                                9.6181291e-3f, 1.3333558e-3f, 1.5403530e-4f};  // ln2^k / k!
  constexpr int kDegree = kSplit ? 6 : 4;
  t = _mm512_max_ps(t, _mm512_set1_ps(kSplit ? -100.f : -120.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kTaylor[kDegree]);
  for (int k = kDegree - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kTaylor[k]));
  return _mm512_scalef_ps(p, n);
}

// S^T of up to 64 keys (N blocks of 16 from key block kb16): result tiles 0 .. N-1 hold
// independent chains (a tile's TDPBF16PS waits for the previous one on the same tile), the
// Q^T half in tile 4, K blocks alternating in tiles 5 and 7.
template <int N>
inline void scores(const uint32_t (*qt)[16][16], const uint16_t* k, int64_t kb16, int64_t halves,
                   float (*s)[16]) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int64_t h = 0; h < halves; ++h) {
    const uint16_t* kh = k + (kb16 * halves + h) * 512;
    _tile_loadd(4, qt[h][0], 64);
    _tile_loadd(5, kh, 64);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (N > 1) {
      _tile_loadd(7, kh + halves * 512, 64);
      _tile_dpbf16ps(1, 7, 4);
    }
    if constexpr (N > 2) {
      _tile_loadd(5, kh + 2 * halves * 512, 64);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (N > 3) {
      _tile_loadd(7, kh + 3 * halves * 512, 64);
      _tile_dpbf16ps(3, 7, 4);
    }
  }
  _tile_stored(0, s[0], 64);
  if constexpr (N > 1) _tile_stored(1, s[16], 64);
  if constexpr (N > 2) _tile_stored(2, s[32], 64);
  if constexpr (N > 3) _tile_stored(3, s[48], 64);
}

// O^T += V^T P^T for N slices of 16 dims (ot: the first slice's rows; v0, v1: its V^T tiles of
// the step's two 32-key runs, v1 null when there is one): P^T in tiles 5 and 7, O^T in tiles
// 0 .. N-1 (independent chains), V^T alternating in tiles 4 and 6.
template <int N>
inline void values(float (*ot)[16], const uint32_t* v0, const uint32_t* v1) {
  _tile_loadd(0, ot[0], 64);
  if constexpr (N > 1) _tile_loadd(1, ot[16], 64);
  if constexpr (N > 2) _tile_loadd(2, ot[32], 64);
  if constexpr (N > 3) _tile_loadd(3, ot[48], 64);
  for (const uint32_t* v : {v0, v1}) {
    if (v == nullptr) break;
    const bool second = v == v1;
    _tile_loadd(4, v, 64);
    if (second) _tile_dpbf16ps(0, 4, 7); else _tile_dpbf16ps(0, 4, 5);
    if constexpr (N > 1) {
      _tile_loadd(6, v + 256, 64);
      if (second) _tile_dpbf16ps(1, 6, 7); else _tile_dpbf16ps(1, 6, 5);
    }
    if constexpr (N > 2) {
      _tile_loadd(4, v + 512, 64);
      if (second) _tile_dpbf16ps(2, 4, 7); else _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (N > 3) {
      _tile_loadd(6, v + 768, 64);
      if (second) _tile_dpbf16ps(3, 6, 7); else _tile_dpbf16ps(3, 6, 5);
    }
  }
  _tile_stored(0, ot[0], 64);
  if constexpr (N > 1) _tile_stored(1, ot[16], 64);
  if constexpr (N > 2) _tile_stored(2, ot[32], 64);
  if constexpr (N > 3) _tile_stored(3, ot[48], 64);
}

// The split scores of two key blocks into result tiles C0 and C1 (TWO: C1 too), one half of
// the dims: Q^T's hi in tile 4, its lo in tile 6, K's hi then lo in tiles 5 and 7. The two
// chains alternate so a tile product rarely waits for the one before it on the same tile.
// (Macros: the tile intrinsics take their tile numbers as literals.)
#define TS_SPLIT_SCORE_PAIR(C0, C1, TWO, k0, k1) \
  do {                                           \
    _tile_loadd(5, (k0), 64);                    \
    _tile_dpbf16ps(C0, 5, 4);                    \
    if (TWO) {                                   \
      _tile_loadd(7, (k1), 64);                  \
      _tile_dpbf16ps(C1, 7, 4);                  \
    }                                            \
    _tile_dpbf16ps(C0, 5, 6);                    \
    if (TWO) _tile_dpbf16ps(C1, 7, 6);           \
    _tile_loadd(5, (k0) + kLo, 64);              \
    _tile_dpbf16ps(C0, 5, 4);                    \
    if (TWO) {                                   \
      _tile_loadd(7, (k1) + kLo, 64);            \
      _tile_dpbf16ps(C1, 7, 4);                  \
    }                                            \
  } while (0)

// scores<N> with split operands: S^T = Khi Qhi^T + Khi Qlo^T + Klo Qhi^T.
template <int N>
inline void split_scores(const uint32_t (*qt)[16][16], const uint32_t (*qtl)[16][16],
                         const uint16_t* k, int64_t kb16, int64_t halves, float (*s)[16]) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  const int64_t step = halves * 2 * kLo;  // one key block of 16
  for (int64_t h = 0; h < halves; ++h) {
    const uint16_t* kh = k + (kb16 * halves + h) * 2 * kLo;
    _tile_loadd(4, qt[h][0], 64);
    _tile_loadd(6, qtl[h][0], 64);
    TS_SPLIT_SCORE_PAIR(0, 1, N > 1, kh, kh + step);
    if constexpr (N > 2) TS_SPLIT_SCORE_PAIR(2, 3, N > 3, kh + 2 * step, kh + 3 * step);
  }
  _tile_stored(0, s[0], 64);
  if constexpr (N > 1) _tile_stored(1, s[16], 64);
  if constexpr (N > 2) _tile_stored(2, s[32], 64);
  if constexpr (N > 3) _tile_stored(3, s[48], 64);
}

// One 32-key run of the split O^T += V^T P^T into O^T tiles 0 (and 1: TWO): P^T's hi in tile
// PH, its lo in PL; V^T's hi then lo of the two slices in tiles 4 and 6 (v: the first slice's
// hi; a slice is 512 words, hi then lo).
#define TS_SPLIT_VALUE_RUN(PH, PL, TWO, v)  \
  do {                                      \
    _tile_loadd(4, (v), 64);                \
    _tile_dpbf16ps(0, 4, PH);               \
    if (TWO) {                              \
      _tile_loadd(6, (v) + 512, 64);        \
      _tile_dpbf16ps(1, 6, PH);             \
    }                                       \
    _tile_dpbf16ps(0, 4, PL);               \
    if (TWO) _tile_dpbf16ps(1, 6, PL);      \
    _tile_loadd(4, (v) + 256, 64);          \
    _tile_dpbf16ps(0, 4, PH);               \
    if (TWO) {                              \
      _tile_loadd(6, (v) + 512 + 256, 64);  \
      _tile_dpbf16ps(1, 6, PH);             \
    }                                       \
  } while (0)

// values<N> with split operands, N <= 2 slices of 16 dims (tiles 2 and 3 hold P^T's lo): P^T's
// hi of the step's two 32-key runs in tiles 5 and 7, its lo in 2 and 3.
template <int N>
inline void split_values(float (*ot)[16], const uint32_t* v0, const uint32_t* v1) {
  _tile_loadd(0, ot[0], 64);
  if constexpr (N > 1) _tile_loadd(1, ot[16], 64);
  TS_SPLIT_VALUE_RUN(5, 2, N > 1, v0);
  if (v1 != nullptr) TS_SPLIT_VALUE_RUN(7, 3, N > 1, v1);
  _tile_stored(0, ot[0], 64);
  if constexpr (N > 1) _tile_stored(1, ot[16], 64);
}

#undef TS_SPLIT_SCORE_PAIR
#undef TS_SPLIT_VALUE_RUN

}  // namespace prefill_tiles
}  // namespace tailserve_cpu
#endif
