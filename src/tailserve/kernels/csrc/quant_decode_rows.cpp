// quant_linear at decode rows on stored GGUF blocks (1 .. kFusedMaxRows rows of x; the dispatch
// is quant_linear.cpp's): every format is read block by block straight into vector registers
// (no buffer), kFusedRows x rows per pass over W, so a decode step reads each weight byte once
// or twice. The 32-value formats one block of 32 at a time (fused_rows), the K-quants one
// super-block at a time (fused_kquant_rows; at the VNNI level two weight rows a zmm,
// quant_kquant_pairs.cpp). AVX2 and up; VNNI's dpbusd where the CPU has it.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "quant_blocks.h"
#include "simd.h"
#include "work_pool.h"

#ifdef TS_AVX2

namespace tailserve_cpu {
namespace quant {
namespace {

constexpr int64_t kFusedRows = 4;

// Decode rows stream W from DRAM (a 135M model's 97 MB do not fit in L3), and one core's
// hardware prefetchers alone kept too few lines in flight: the LM head (Q8_0, 30 MB) ran at
// 6-8 GB/s per thread against 33 GB/s for the same kernel on a matrix held in L3. The fused
// loops prefetch the bytes ahead of the block they read (isa.h: how far and into which cache
// is the CPU's; on Zen 3, one thread, LM head: 1 KB 14, 4 KB 14-17, 8 KB 17 GB/s into L1; the
// down projection 6 -> 10-12 GB/s at 2-4 KB; 2 threads, LM head 3-4 -> 14-17 GB/s).

bool is_block32(Fmt f) {
  return f == Fmt::Q4_0 || f == Fmt::Q4_1 || f == Fmt::Q5_0 || f == Fmt::Q5_1 || f == Fmt::Q8_0;
}

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// One block of a 32-value format: its 32 integers (u8, or s8 for Q8_0), scale and offset.
template <Fmt F>
inline __m256i load_block32(const uint8_t* blk, float* d, float* off) {
  *d = f16_at(blk);
  if constexpr (F == Fmt::Q8_0) {
    *off = 0.f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    constexpr int kQs = F == Fmt::Q4_0 ? 2 : F == Fmt::Q4_1 ? 4 : F == Fmt::Q5_0 ? 6 : 8;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQs));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                                 _mm256_set1_epi8(0x0F));
    if constexpr (F == Fmt::Q5_0 || F == Fmt::Q5_1) {
      uint32_t qh;
      std::memcpy(&qh, blk + (F == Fmt::Q5_0 ? 2 : 4), 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    }
    if constexpr (F == Fmt::Q4_0) *off = -8.f * *d;
    else if constexpr (F == Fmt::Q5_0) *off = -16.f * *d;
    else *off = f16_at(blk + 2);
    return q;
  }
}

template <bool Vnni>
inline __m256i idot32(__m256i w, __m256i x, bool is_signed) {
  if (is_signed) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (Vnni) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// Rows [n0, n1) of W against MR rows of x; two weight rows at a time for two FMA chains.
template <Fmt F, bool Vnni, int MR>
void fused_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
                const float* dx, const float* xs32, float* y, int64_t N, const float* bias) {
  constexpr int64_t kTs = F == Fmt::Q4_0 ? 18 : F == Fmt::Q4_1 ? 20 : F == Fmt::Q5_0 ? 22
                          : F == Fmt::Q5_1 ? 24 : 34;
  constexpr bool kSigned = F == Fmt::Q8_0;
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;
    const uint8_t* r0 = w + n * nb * kTs;
    const uint8_t* r1 = two ? r0 + nb * kTs : r0;
    __m256 acc0[MR], acc1[MR];
    float off0[MR], off1[MR];
    for (int m = 0; m < MR; ++m) {
      acc0[m] = acc1[m] = _mm256_setzero_ps();
      off0[m] = off1[m] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      // Both rows' bytes ahead (the rows after them).
      isa::prefetch_weight(r0 + b * kTs);
      isa::prefetch_weight(r1 + b * kTs);
      float d0, o0, d1, o1;
      const __m256i w0 = load_block32<F>(r0 + b * kTs, &d0, &o0);
      const __m256i w1 = load_block32<F>(r1 + b * kTs, &d1, &o1);
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
        const float dm = dx[m * nb + b];
        acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(w0, xv, kSigned)),
                                  _mm256_set1_ps(d0 * dm), acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(w1, xv, kSigned)),
                                  _mm256_set1_ps(d1 * dm), acc1[m]);
        if constexpr (!kSigned) {
          off0[m] += o0 * xs32[m * nb + b];
          off1[m] += o1 * xs32[m * nb + b];
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[m * N + n] = hsum256(acc0[m]) + off0[m] + (bias ? bias[n] : 0.f);
      if (two) y[m * N + n + 1] = hsum256(acc1[m]) + off1[m] + (bias ? bias[n + 1] : 0.f);
    }
  }
}

template <Fmt F, bool Vnni>
void fused_dispatch(int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                    const int8_t* xq, const float* dx, const float* xs32, float* y, int64_t N,
                    const float* bias) {
  switch (M) {
    case 1: return fused_rows<F, Vnni, 1>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case 2: return fused_rows<F, Vnni, 2>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case 3: return fused_rows<F, Vnni, 3>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    default: return fused_rows<F, Vnni, 4>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
  }
}

template <bool Vnni>
void fused_linear(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* dx, const float* xs32, float* y, int64_t N,
                  const float* bias) {
  switch (f) {
    case Fmt::Q4_0: return fused_dispatch<Fmt::Q4_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q4_1: return fused_dispatch<Fmt::Q4_1, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q5_0: return fused_dispatch<Fmt::Q5_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q5_1: return fused_dispatch<Fmt::Q5_1, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    default: return fused_dispatch<Fmt::Q8_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
  }
}

// The K-quants at decode rows, unpacked in registers the same way: a Q4_K / Q5_K super-block
// is 8 groups of 32 with 6-bit scales and mins, a Q6_K one 16 groups of 16 with int8 scales.
template <Fmt F, bool Vnni, int MR>
void fused_kquant_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
                       const float* dx, const float* xs16, const float* xs32, float* y,
                       int64_t N, const float* bias) {
  constexpr int64_t kTs = kquant_bytes(F);
  const int64_t nsb = K / 256, nb = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nsb * kTs;
    __m256 acc0[MR], acc1[MR], offv[MR];  // offv: the offsets, subtracted at the end
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = offv[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = row + sb * kTs;
      isa::prefetch_weights(blk, kTs);
      if constexpr (F == Fmt::Q4_K || F == Fmt::Q5_K) {
        // The 8 groups' scales d * sc and offsets dmin * mn as vectors, the six-bit fields
        // unpacked four at a time: the scalar unpacking, one scale product and one offset
        // product per group were most of this loop's instructions.
        uint64_t sc8, mn8;
        scales_mins_k4(blk + 4, &sc8, &mn8);
        const __m256 av = _mm256_mul_ps(
            _mm256_set1_ps(f16_at(blk)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc8)))));
        const __m256 mv = _mm256_mul_ps(
            _mm256_set1_ps(f16_at(blk + 2)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)))));
        __m256 adx[MR];  // d * sc * dx of each group, per row of x
        for (int m = 0; m < MR; ++m) {
          adx[m] = _mm256_mul_ps(av, _mm256_loadu_ps(dx + m * nb + sb * 8));
          offv[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs32 + m * nb + sb * 8), offv[m]);
        }
        const uint8_t* ql = blk + (F == Fmt::Q5_K ? 48 : 16);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (F == Fmt::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * j));
          __m256i lo = _mm256_and_si256(v, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (F == Fmt::Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
            qh = _mm256_srli_epi16(qh, 2);
          }
          const int64_t g0 = sb * 8 + 2 * j, g1 = g0 + 1;
          const __m256i lane0 = _mm256_set1_epi32(2 * j), lane1 = _mm256_set1_epi32(2 * j + 1);
          for (int m = 0; m < MR; ++m) {
            const int8_t* xr = xq + m * K;
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g0 * 32));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g1 * 32));
            acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(lo, x0, false)),
                                      _mm256_permutevar8x32_ps(adx[m], lane0), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(hi, x1, false)),
                                      _mm256_permutevar8x32_ps(adx[m], lane1), acc1[m]);
          }
        }
      } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d; q - 32 per group of 16
        const uint8_t* ql = blk;
        const uint8_t* qhp = blk + 128;
        const float d = f16_at(blk + 208);
        for (int h = 0; h < 2; ++h) {
          // This half's 8 int8 scales (groups of 16, in order) times d, as one vector; each
          // 32-block's dx serves its two groups. As for Q4_K: no scalar product per group.
          const __m256 sv = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * h)))));
          const __m256 sv32 = _mm256_mul_ps(sv, _mm256_set1_ps(32.f));  // q - 32: the offsets
          const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
          const int64_t b0 = sb * 8 + h * 4;  // this half's first 32-block of x
          __m256 sdx[MR];
          for (int m = 0; m < MR; ++m) {
            sdx[m] = _mm256_mul_ps(sv, _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_loadu_ps(dx + m * nb + b0)), pairs));
            offv[m] = _mm256_fmadd_ps(sv32, _mm256_loadu_ps(xs16 + m * 2 * nb + 2 * b0), offv[m]);
          }
          const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
          const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qhp + 32 * h));
          __m256i q[4];
          q6k_values(l0, l1, hv, q);
          for (int c = 0; c < 4; ++c) {
            const int64_t b = sb * 8 + h * 4 + c;  // the 32-block of x
            // Lanes 0-3 sum the block's first 16 values, 4-7 its second 16.
            const __m256i lanes = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1,
                                                    2 * c + 1, 2 * c + 1, 2 * c + 1);
            for (int m = 0; m < MR; ++m) {
              const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
              const __m256 s = _mm256_permutevar8x32_ps(sdx[m], lanes);
              __m256& acc = (c & 1) ? acc1[m] : acc0[m];
              acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(q[c], xv, false)), s, acc);
            }
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[m * N + n] = hsum256(_mm256_add_ps(acc0[m], acc1[m])) - hsum256(offv[m]) +
                     (bias ? bias[n] : 0.f);
    }
  }
}

template <bool Vnni>
void fused_kquant(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* dx, const float* xs16, const float* xs32,
                  float* y, int64_t N, const float* bias) {
#define TS_KQ(F)                                                                            \
  switch (M) {                                                                              \
    case 1: return fused_kquant_rows<F, Vnni, 1>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    case 2: return fused_kquant_rows<F, Vnni, 2>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    case 3: return fused_kquant_rows<F, Vnni, 3>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    default: return fused_kquant_rows<F, Vnni, 4>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
  }
  if (f == Fmt::Q4_K) { TS_KQ(Fmt::Q4_K) }
  if (f == Fmt::Q5_K) { TS_KQ(Fmt::Q5_K) }
  TS_KQ(Fmt::Q6_K)
#undef TS_KQ
}

}  // namespace

void decode_rows_linear(int isa, const Packed& p, const QuantizedRows& x, float* yp,
                        const float* bp) {
  const int64_t M = x.M, K = p.K, N = p.N;
  // Runs of rows per hand-out: each thread's reads stay sequential.
  const int64_t per_item = std::max<int64_t>(
      16, (N / (runs_per_thread(true) * at::get_num_threads()) + 15) / 16 * 16);
  parallel_dynamic((N + per_item - 1) / per_item, [&](int64_t item) {
    const int64_t n0 = item * per_item, n1 = std::min(N, n0 + per_item);
    for (int64_t m = 0; m < M; m += kFusedRows) {
      const int64_t mr = std::min(kFusedRows, M - m);
      const int8_t* xr = x.xq + m * K;
      const float* dr = x.dx + m * (K / 32);
      const float* s16 = x.xs + m * (K / 16);
      const float* s32 = x.xs32 + m * (K / 32);
      float* yr = yp + m * N;
      const bool vnni = isa >= kAvx512Vnni;
      if (is_block32(p.f.fmt)) {
        if (vnni) fused_linear<true>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s32, yr, N, bp);
        else fused_linear<false>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s32, yr, N, bp);
      } else if (vnni) {
        int64_t done = n0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
        done = kquant_pairs_vnni(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s16, s32, yr, N, bp);
#endif
        if (done < n1) fused_kquant<true>(p.f.fmt, mr, p.data, done, n1, K, xr, dr, s16, s32, yr, N, bp);
      } else {
        fused_kquant<false>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s16, s32, yr, N, bp);
      }
    }
  });
}

}  // namespace quant
}  // namespace tailserve_cpu

#endif  // TS_AVX2
