// quant_linear and quant_embedding on tiled GGUF blocks (quant_tiled.h): one kernel family for
// decode rows and prefill rows alike.
//
// Stored blocks are a row's run of [d][m?][qh?][qs]. At many rows of x the GEMM wants 16
// output rows side by side (one dpbusd: 4 values x 16 rows), and interleaving them on every
// call was the fixed cost of every step with more than 8 rows (~0.09 ms per 1536 x 576 Q4_1
// call, most of a batched step). The tiled form does that interleave once, at load, in the
// same bytes: per tile of 16 output rows and per block of 32 values, 16 * type_size bytes
//
//   d[16]   fp16, the 16 rows' scales                               32 bytes
//   m[16]   fp16, their offsets (Q4_1, Q5_1)                        32 bytes
//   h[8]    Q5_0 / Q5_1: 64-bit masks, bit 4r+i of h[c] the 5th bit of value 4c+i of row r
//   qs      Q4 / Q5: 4 chunks of 64 bytes, byte 4r+i of chunk j the stored qs[4j+i] of row r
//           (low nibble value 4j+i, high nibble value 16+4j+i); Q8_0: 8 chunks, byte 4r+i of
//           chunk c the int8 value 4c+i of row r
//
// so one 64-byte load, split into nibbles with and/shift, feeds dpbusd directly and no buffer
// is built. At 1-8 rows of x the tiles stream from memory once (prefetched, as the stored-block
// decode rows are); above, each tile (~6 KB at K = 576) stays in L1 while every row of x
// passes. Q4_0 / Q5_0 / Q8_0's zero points (8, 16, and the 128 VNNI's unsigned weights add)
// come off the integer sums exactly (zero * sum of x's integers); Q4_1 / Q5_1's m is a float
// term, m * dx * sum. Every lane computes the same sequence of float operations in every ISA
// path (the scalar one with std::fma), so the paths agree bit for bit.

#include "quant_tiled.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "isa.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace {

template <int TS>
using Layout = TiledLayout<TS>;

constexpr int64_t kGemmRows = 8;  // rows of x per pass over a tile (VNNI: 8 + 8 accumulators)

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Value k (0..31) of row r (0..15) of one tile block, as an integer (q - zero for Q4_0 /
// Q5_0, signed for Q8_0, q for Q4_1 / Q5_1).
template <int TS>
inline int value_at(const uint8_t* blk, int r, int k) {
  using L = Layout<TS>;
  if constexpr (L::kQ8) {
    return static_cast<int8_t>(blk[L::kQs + 64 * (k / 4) + 4 * r + k % 4]);
  } else {
    const int j = (k % 16) / 4, i = k % 4;
    const uint8_t byte = blk[L::kQs + 64 * j + 4 * r + i];
    int q = k < 16 ? byte & 0xF : byte >> 4;
    if constexpr (L::kHigh) {
      uint64_t mask;
      std::memcpy(&mask, blk + L::kH + 8 * (k / 4), 8);
      q |= static_cast<int>((mask >> (4 * r + i)) & 1) << 4;
    }
    return q - L::kZero;
  }
}

// ----------------------------------------------------------------- scalar

template <int TS>
void tile_scalar(const uint8_t* tile, int64_t nb, int64_t K, int64_t M, const int8_t* xq,
                 const float* dx, const float* xs32, float* y, int64_t N, const float* bias) {
  using L = Layout<TS>;
  for (int64_t m = 0; m < M; ++m) {
    for (int r = 0; r < 16; ++r) {
      float acc = bias ? bias[r] : 0.f;
      for (int64_t g = 0; g < nb; ++g) {
        const uint8_t* blk = tile + g * L::kBytes;
        int32_t s = 0;
        for (int k = 0; k < 32; ++k) s += value_at<TS>(blk, r, k) * xq[m * K + g * 32 + k];
        const float d = half_at(blk + 2 * r);
        acc = std::fma(static_cast<float>(s), d * dx[m * nb + g], acc);
        if constexpr (L::kMin) acc = std::fma(half_at(blk + 32 + 2 * r), xs32[m * nb + g], acc);
      }
      y[m * N + r] = acc;
    }
  }
}

// ----------------------------------------------------------------- AVX2: two halves of 8 rows

#ifdef TS_AVX2
// Rows 8h..8h+7 of one tile against MR rows of x. maddubs' 16-bit pair sums hold 31 x 127 x 2;
// Q8_0 multiplies |w| by x with w's sign (w + 128 would overflow them).
template <int TS, int MR>
void tile_avx2(const uint8_t* tile, int h, int64_t nb, int64_t K, const int8_t* xq,
               const float* dx, const float* xs32, const int32_t* xi32, float* y, int64_t N,
               const float* bias, bool prefetch) {
  using L = Layout<TS>;
  __m256 accf[MR];
  const __m256 b0 = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) accf[m] = b0;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    if (prefetch && h == 0) {
      isa::prefetch_weights(blk, L::kBytes);
    }
    __m256i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm256_setzero_si256();
    const int8_t* xg = xq + g * 32;
    if constexpr (L::kQ8) {
      for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + L::kQs + 64 * c + 32 * h));
        const __m256i wa = _mm256_sign_epi8(w, w);
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(load4(xg + m * K + 4 * c)), w);
          acci[m] = _mm256_add_epi32(acci[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + L::kQs + 64 * j + 32 * h));
        __m256i lo = _mm256_and_si256(v, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (L::kHigh) {
          uint32_t m0, m1;
          std::memcpy(&m0, blk + L::kH + 8 * j + 4 * h, 4);
          std::memcpy(&m1, blk + L::kH + 8 * (j + 4) + 4 * h, 4);
          const __m256i fifth = _mm256_set1_epi8(0x10);  // the fifth bit, as value 16
          lo = _mm256_or_si256(lo, _mm256_and_si256(bits_to_bytes(m0), fifth));
          hi = _mm256_or_si256(hi, _mm256_and_si256(bits_to_bytes(m1), fifth));
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xl = _mm256_set1_epi32(load4(xg + m * K + 4 * j));
          const __m256i xh = _mm256_set1_epi32(load4(xg + m * K + 16 + 4 * j));
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                             _mm256_maddubs_epi16(hi, xh));  // <= 2 x 7874
          acci[m] = _mm256_add_epi32(acci[m], _mm256_madd_epi16(p, ones));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (L::kMin) {
      mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
    }
    for (int m = 0; m < MR; ++m) {
      __m256i a = acci[m];
      if constexpr (L::kZero != 0) a = _mm256_sub_epi32(a, _mm256_set1_epi32(L::kZero * xi32[m * nb + g]));
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(d, _mm256_set1_ps(dx[m * nb + g])),
                                accf[m]);
      if constexpr (L::kMin) accf[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs32[m * nb + g]), accf[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + m * N + 8 * h, accf[m]);
}

// All 16 rows of one tile in one pass, against MR = 1-2 rows of x (decode). On a core without
// AVX512 computing a tile is about as slow as reading it (Zen 3: one-row products 16-22 GB/s
// from L3, ~12 from memory), so instructions per byte count. Here x's broadcasts and the
// block's scales serve both halves (L3-resident one-row products: 15-22 -> 19-26 GB/s), and
// the prefetches run through the whole tile, where the two-pass form above computed its
// second half from L1 with no read in flight. Per lane, the same operations in the same order
// as tile_avx2: the results are bit for bit the same.
template <int TS, int MR>
void tile_avx2_16(const uint8_t* tile, int64_t nb, int64_t K, const int8_t* xq, const float* dx,
                  const float* xs32, const int32_t* xi32, float* y, int64_t N, const float* bias,
                  bool prefetch) {
  using L = Layout<TS>;
  __m256 accf[2][MR];
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
    for (int m = 0; m < MR; ++m) accf[h][m] = b;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    if (prefetch) {
      isa::prefetch_weights(blk, L::kBytes);
    }
    __m256i acci[2][MR];
    for (int h = 0; h < 2; ++h) {
      for (int m = 0; m < MR; ++m) acci[h][m] = _mm256_setzero_si256();
    }
    const int8_t* xg = xq + g * 32;
    if constexpr (L::kQ8) {
      for (int c = 0; c < 8; ++c) {
        __m256i w[2], wa[2];
        for (int h = 0; h < 2; ++h) {
          w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kQs + 64 * c + 32 * h));
          wa[h] = _mm256_sign_epi8(w[h], w[h]);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xb = _mm256_set1_epi32(load4(xg + m * K + 4 * c));
          for (int h = 0; h < 2; ++h) {
            const __m256i xv = _mm256_sign_epi8(xb, w[h]);
            acci[h][m] = _mm256_add_epi32(acci[h][m],
                                          _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], xv), ones));
          }
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + L::kQs + 64 * j + 32 * h));
          lo[h] = _mm256_and_si256(v, low4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (L::kHigh) {
            uint32_t m0, m1;
            std::memcpy(&m0, blk + L::kH + 8 * j + 4 * h, 4);
            std::memcpy(&m1, blk + L::kH + 8 * (j + 4) + 4 * h, 4);
            const __m256i fifth = _mm256_set1_epi8(0x10);
            lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(bits_to_bytes(m0), fifth));
            hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(bits_to_bytes(m1), fifth));
          }
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xl = _mm256_set1_epi32(load4(xg + m * K + 4 * j));
          const __m256i xh = _mm256_set1_epi32(load4(xg + m * K + 16 + 4 * j));
          for (int h = 0; h < 2; ++h) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                               _mm256_maddubs_epi16(hi[h], xh));
            acci[h][m] = _mm256_add_epi32(acci[h][m], _mm256_madd_epi16(p, ones));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      __m256 mv = _mm256_setzero_ps();
      if constexpr (L::kMin) {
        mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
      }
      for (int m = 0; m < MR; ++m) {
        __m256i a = acci[h][m];
        if constexpr (L::kZero != 0) a = _mm256_sub_epi32(a, _mm256_set1_epi32(L::kZero * xi32[m * nb + g]));
        accf[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a),
                                     _mm256_mul_ps(d, _mm256_set1_ps(dx[m * nb + g])), accf[h][m]);
        if constexpr (L::kMin) {
          accf[h][m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs32[m * nb + g]), accf[h][m]);
        }
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + m * N + 8 * h, accf[h][m]);
  }
}
#endif

// ----------------------------------------------------------------- AVX512 VNNI: 16 rows

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
template <int TS, int MR>
void tile_vnni(const uint8_t* tile, int64_t nb, int64_t K, const int8_t* xq, const float* dx,
               const float* xs32, const int32_t* xi32, float* y, int64_t N, const float* bias,
               bool prefetch) {
  using L = Layout<TS>;
  __m512 accf[MR];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) accf[m] = b0;
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    if (prefetch) {
      isa::prefetch_weights(blk, L::kBytes);
    }
    __m512i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * 32;
    if constexpr (L::kQ8) {  // int8 + 128 as dpbusd's unsigned operand; the 128 comes off below
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int c = 0; c < 8; ++c) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(blk + L::kQs + 64 * c), flip);
        for (int m = 0; m < MR; ++m) {
          acci[m] = _mm512_dpbusd_epi32(acci[m], w, _mm512_set1_epi32(load4(xg + m * K + 4 * c)));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        split_chunk512<TS>(blk, j, lo, hi);
        for (int m = 0; m < MR; ++m) {
          acci[m] = _mm512_dpbusd_epi32(acci[m], lo, _mm512_set1_epi32(load4(xg + m * K + 4 * j)));
          acci[m] = _mm512_dpbusd_epi32(acci[m], hi,
                                        _mm512_set1_epi32(load4(xg + m * K + 16 + 4 * j)));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (L::kMin) {
      mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    }
    constexpr int kZero = L::kQ8 ? 128 : L::kZero;
    for (int m = 0; m < MR; ++m) {
      __m512i a = acci[m];
      if constexpr (kZero != 0) a = _mm512_sub_epi32(a, _mm512_set1_epi32(kZero * xi32[m * nb + g]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(d, _mm512_set1_ps(dx[m * nb + g])),
                                accf[m]);
      if constexpr (L::kMin) accf[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs32[m * nb + g]), accf[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * N, accf[m]);
}
#endif

// One tile (16 output rows) against all M rows of x, kGemmRows at a time. The first pass
// prefetches the tiles ahead (it reads the tile from memory; the later ones find it in L1):
// without it the LM head at 16 rows took 5x its 8-row time.
template <int TS>
void tile_all_rows(int isa, const uint8_t* tile, int64_t nb, int64_t K, int64_t M,
                   const int8_t* xq, const float* dx, const float* xs32, const int32_t* xi32,
                   float* y, int64_t N, const float* bias) {
  for (int64_t m = 0; m < M; m += kGemmRows) {
    const int64_t rows = std::min(kGemmRows, M - m);
    const bool prefetch = m == 0;
    const int8_t* xr = xq + m * K;
    const float* dr = dx + m * nb;
    const float* sr = xs32 + m * nb;
    const int32_t* ir = xi32 + m * nb;
    float* yr = y + m * N;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    if (isa >= 3) {
      switch (rows) {
#define TS_CASE(r) \
        case r: tile_vnni<TS, r>(tile, nb, K, xr, dr, sr, ir, yr, N, bias, prefetch); continue;
        TS_CASE(1) TS_CASE(2) TS_CASE(3) TS_CASE(4) TS_CASE(5) TS_CASE(6) TS_CASE(7)
#undef TS_CASE
        default: tile_vnni<TS, 8>(tile, nb, K, xr, dr, sr, ir, yr, N, bias, prefetch); continue;
      }
    }
#endif
#ifdef TS_AVX2
    if (isa >= 1) {  // 4 rows of x per pass: 8 accumulators + weights in 16 registers
      for (int64_t m4 = 0; m4 < rows; m4 += 4) {
        const int64_t r4 = std::min<int64_t>(4, rows - m4);
        const int8_t* x4 = xr + m4 * K;
        const float* d4 = dr + m4 * nb;
        const float* s4 = sr + m4 * nb;
        const int32_t* i4 = ir + m4 * nb;
        float* y4 = yr + m4 * N;
        if (r4 <= 2) {  // both halves in one pass (tile_avx2_16)
          if (r4 == 1) {
            tile_avx2_16<TS, 1>(tile, nb, K, x4, d4, s4, i4, y4, N, bias, prefetch);
          } else {
            tile_avx2_16<TS, 2>(tile, nb, K, x4, d4, s4, i4, y4, N, bias, prefetch);
          }
          continue;
        }
        for (int h = 0; h < 2; ++h) {
          switch (r4) {
            case 3: tile_avx2<TS, 3>(tile, h, nb, K, x4, d4, s4, i4, y4, N, bias, prefetch); break;
            default: tile_avx2<TS, 4>(tile, h, nb, K, x4, d4, s4, i4, y4, N, bias, prefetch);
          }
        }
      }
      continue;
    }
#endif
    tile_scalar<TS>(tile, nb, K, rows, xr, dr, sr, yr, N, bias);
  }
}

template <int TS>
void linear_as(int isa, const uint8_t* w, int64_t N, int64_t K, int64_t M, const int8_t* xq,
               const float* dx, const float* xs32, const int32_t* xi32, float* y,
               const float* bias) {
  const int64_t nb = K / 32, tiles = N / 16;
  const int64_t tile_bytes = nb * Layout<TS>::kBytes;
  // Runs of tiles per hand-out: each thread's reads stay sequential (and prefetchable).
  const int64_t per_item = std::max<int64_t>(
      1, tiles / (runs_per_thread(M <= kGemmRows) * at::get_num_threads()));
  parallel_dynamic((tiles + per_item - 1) / per_item, [&](int64_t item) {
    const int64_t t1 = std::min(tiles, (item + 1) * per_item);
    for (int64_t t = item * per_item; t < t1; ++t) {
      tile_all_rows<TS>(isa, w + t * tile_bytes, nb, K, M, xq, dx, xs32, xi32, y + t * 16, N,
                        bias ? bias + t * 16 : nullptr);
    }
  });
}

template <int TS>
void row_as(const uint8_t* w, int64_t K, int64_t n, float* out) {
  using L = Layout<TS>;
  const int64_t nb = K / 32;
  const uint8_t* tile = w + (n / 16) * nb * L::kBytes;
  const int r = static_cast<int>(n % 16);
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    const float d = half_at(blk + 2 * r);
    const float m = L::kMin ? half_at(blk + 32 + 2 * r) : 0.f;
    // d x (q - zero) is exact in float32 (11 x 8 bits): one rounding, as gguf's own.
    for (int k = 0; k < 32; ++k) out[g * 32 + k] = d * static_cast<float>(value_at<TS>(blk, r, k)) + m;
  }
}

}  // namespace

void tiled_linear(int isa, int64_t type_size, const uint8_t* w, int64_t N, int64_t K, int64_t M,
                  const int8_t* xq, const float* dx, const float* xs32, const int32_t* xi32,
                  float* y, const float* bias) {
  switch (type_size) {
    case 18: return linear_as<18>(isa, w, N, K, M, xq, dx, xs32, xi32, y, bias);
    case 20: return linear_as<20>(isa, w, N, K, M, xq, dx, xs32, xi32, y, bias);
    case 22: return linear_as<22>(isa, w, N, K, M, xq, dx, xs32, xi32, y, bias);
    case 24: return linear_as<24>(isa, w, N, K, M, xq, dx, xs32, xi32, y, bias);
    default: return linear_as<34>(isa, w, N, K, M, xq, dx, xs32, xi32, y, bias);
  }
}

void tiled_row(int64_t type_size, const uint8_t* w, int64_t K, int64_t n, float* out) {
  switch (type_size) {
    case 18: return row_as<18>(w, K, n, out);
    case 20: return row_as<20>(w, K, n, out);
    case 22: return row_as<22>(w, K, n, out);
    case 24: return row_as<24>(w, K, n, out);
    default: return row_as<34>(w, K, n, out);
  }
}

}  // namespace tailserve_cpu
