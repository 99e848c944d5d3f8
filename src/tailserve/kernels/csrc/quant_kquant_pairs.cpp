// quant_linear's decode rows on the K-quants (Q4_K, Q5_K, Q6_K as stored) with AVX512-VNNI: two
// weight rows side by side in one zmm, row n in lanes 0-7 and row n + 1 in lanes 8-15, each
// half running quant_decode_rows.cpp's 8-lane fused_kquant_rows lane for lane (the same dpbusd
// sums, the same scale products and FMAs in the same order, the same horizontal sums at the
// end), so the outputs are that kernel's bit for bit (tests/test_quant_kernels.py) and every
// level still gives the same answers.
//
// Why: half the instructions per weight byte. On the Xeon with AMX the Llama-3.2-1B shape's
// Q4_K_M decode step took 39.7 ms against the 8-lane kernel's 42.4 (in process, alternated
// five times; benchmarks/notes/decode.md). The K-quant products stay below the tiled Q4_0
// ones' read rate (one-row products beyond the L3: 23 GB/s against 27), and the issue slots
// are not what holds them there: the products alone read 23.1 GB/s with this kernel and 23.5
// with the 8-lane one, measured minutes apart.

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "isa.h"
#include "quant_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)

namespace tailserve_cpu {
namespace quant {
namespace {

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
inline __m512i join(const uint8_t* lo, const uint8_t* hi) {  // 32 bytes from each
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
inline __m512 twice(__m256 v) { return join(v, v); }
inline __m512i twice(const int8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 twice(const float* p) { return twice(_mm256_loadu_ps(p)); }
inline __m256 lower(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 upper(__m512 v) { return _mm512_extractf32x8_ps(v, 1); }
inline __m512 cvt_dot(__m512i w, __m512i x) {
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
}
// Lanes 0-7 read lane i of the lower half, 8-15 lane i of the upper one (the 8-lane kernel's
// _mm256_permutevar8x32_ps with index i in every lane, per half).
inline __m512i both_halves(int i0, int i1, int i2, int i3, int i4, int i5, int i6, int i7) {
  return _mm512_setr_epi32(i0, i1, i2, i3, i4, i5, i6, i7, 8 + i0, 8 + i1, 8 + i2, 8 + i3,
                           8 + i4, 8 + i5, 8 + i6, 8 + i7);
}

template <Fmt F, int MR>
void pair_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
               const float* dx, const float* xs16, const float* xs32, float* y, int64_t N,
               const float* bias) {
  constexpr int64_t kTs = kquant_bytes(F);
  const int64_t nsb = K / 256, nb = K / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t n = n0; n + 1 < n1; n += 2) {
    const uint8_t* row0 = w + n * nsb * kTs;
    const uint8_t* row1 = row0 + nsb * kTs;
    __m512 acc0[MR], acc1[MR], offv[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = offv[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b0 = row0 + sb * kTs;
      const uint8_t* b1 = row1 + sb * kTs;
      isa::prefetch_weights(b0, kTs);
      isa::prefetch_weights(b1, kTs);
      if constexpr (F == Fmt::Q4_K || F == Fmt::Q5_K) {
        uint64_t sc0, mn0, sc1, mn1;
        scales_mins_k4(b0 + 4, &sc0, &mn0);
        scales_mins_k4(b1 + 4, &sc1, &mn1);
        const __m512 av = _mm512_mul_ps(
            join(_mm256_set1_ps(h2f(b0)), _mm256_set1_ps(h2f(b1))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<int64_t>(sc1),
                                                                   static_cast<int64_t>(sc0)))));
        const __m512 mv = _mm512_mul_ps(
            join(_mm256_set1_ps(h2f(b0 + 2)), _mm256_set1_ps(h2f(b1 + 2))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<int64_t>(mn1),
                                                                   static_cast<int64_t>(mn0)))));
        __m512 adx[MR];
        for (int m = 0; m < MR; ++m) {
          adx[m] = _mm512_mul_ps(av, twice(dx + m * nb + sb * 8));
          offv[m] = _mm512_fmadd_ps(mv, twice(xs32 + m * nb + sb * 8), offv[m]);
        }
        constexpr int64_t kQl = F == Fmt::Q5_K ? 48 : 16;
        __m512i qh = _mm512_setzero_si512();
        if constexpr (F == Fmt::Q5_K) qh = join(b0 + 16, b1 + 16);
        const __m512i one = _mm512_set1_epi8(1);
        for (int j = 0; j < 4; ++j) {
          const __m512i v = join(b0 + kQl + 32 * j, b1 + kQl + 32 * j);
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (F == Fmt::Q5_K) {
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srli_epi16(qh, 1), one), 4));
            qh = _mm512_srli_epi16(qh, 2);
          }
          const int64_t g0 = sb * 8 + 2 * j, g1 = g0 + 1;
          const int l0 = 2 * j, l1 = 2 * j + 1;
          const __m512i lane0 = both_halves(l0, l0, l0, l0, l0, l0, l0, l0);
          const __m512i lane1 = both_halves(l1, l1, l1, l1, l1, l1, l1, l1);
          for (int m = 0; m < MR; ++m) {
            const int8_t* xr = xq + m * K;
            acc0[m] = _mm512_fmadd_ps(cvt_dot(lo, twice(xr + g0 * 32)),
                                      _mm512_permutexvar_ps(lane0, adx[m]), acc0[m]);
            acc1[m] = _mm512_fmadd_ps(cvt_dot(hi, twice(xr + g1 * 32)),
                                      _mm512_permutexvar_ps(lane1, adx[m]), acc1[m]);
          }
        }
      } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d; q - 32 per group of 16
        const __m512 d = join(_mm256_set1_ps(h2f(b0 + 208)), _mm256_set1_ps(h2f(b1 + 208)));
        for (int h = 0; h < 2; ++h) {
          int64_t s0, s1;
          std::memcpy(&s0, b0 + 192 + 8 * h, 8);
          std::memcpy(&s1, b1 + 192 + 8 * h, 8);
          const __m512 sv = _mm512_mul_ps(
              d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(s1, s0))));
          const __m512 sv32 = _mm512_mul_ps(sv, _mm512_set1_ps(32.f));
          const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
          const int64_t bx = sb * 8 + h * 4;
          __m512 sdx[MR];
          for (int m = 0; m < MR; ++m) {
            sdx[m] = _mm512_mul_ps(sv, twice(_mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_loadu_ps(dx + m * nb + bx)), pairs)));
            offv[m] = _mm512_fmadd_ps(sv32, twice(xs16 + m * 2 * nb + 2 * bx), offv[m]);
          }
          const __m512i l0 = join(b0 + 64 * h, b1 + 64 * h);
          const __m512i l1 = join(b0 + 64 * h + 32, b1 + 64 * h + 32);
          const __m512i hv = join(b0 + 128 + 32 * h, b1 + 128 + 32 * h);
          __m512i q[4];
          q6k_values(l0, l1, hv, q);
          for (int c = 0; c < 4; ++c) {
            const int64_t b = sb * 8 + h * 4 + c;
            const int e = 2 * c, o = 2 * c + 1;
            const __m512i lanes = both_halves(e, e, e, e, o, o, o, o);
            for (int m = 0; m < MR; ++m) {
              const __m512 s = _mm512_permutexvar_ps(lanes, sdx[m]);
              __m512& acc = (c & 1) ? acc1[m] : acc0[m];
              acc = _mm512_fmadd_ps(cvt_dot(q[c], twice(xq + m * K + b * 32)), s, acc);
            }
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[m * N + n] = hsum256(_mm256_add_ps(lower(acc0[m]), lower(acc1[m]))) -
                     hsum256(lower(offv[m])) + (bias ? bias[n] : 0.f);
      y[m * N + n + 1] = hsum256(_mm256_add_ps(upper(acc0[m]), upper(acc1[m]))) -
                         hsum256(upper(offv[m])) + (bias ? bias[n + 1] : 0.f);
    }
  }
}

template <Fmt F>
void pair_dispatch(int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                   const int8_t* xq, const float* dx, const float* xs16, const float* xs32,
                   float* y, int64_t N, const float* bias) {
  switch (M) {
    case 1: return pair_rows<F, 1>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias);
    case 2: return pair_rows<F, 2>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias);
    case 3: return pair_rows<F, 3>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias);
    default: return pair_rows<F, 4>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias);
  }
}

}  // namespace

int64_t kquant_pairs_vnni(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1,
                          int64_t K, const int8_t* xq, const float* dx, const float* xs16,
                          const float* xs32, float* y, int64_t N, const float* bias) {
  const int64_t end = n0 + (n1 - n0) / 2 * 2;
  if (f == Fmt::Q4_K) pair_dispatch<Fmt::Q4_K>(M, w, n0, end, K, xq, dx, xs16, xs32, y, N, bias);
  if (f == Fmt::Q5_K) pair_dispatch<Fmt::Q5_K>(M, w, n0, end, K, xq, dx, xs16, xs32, y, N, bias);
  if (f == Fmt::Q6_K) pair_dispatch<Fmt::Q6_K>(M, w, n0, end, K, xq, dx, xs16, xs32, y, N, bias);
  return end;
}

}  // namespace quant
}  // namespace tailserve_cpu

#endif
