// quant_linear on tiled GGUF blocks with AMX bf16 tiles: the opt-in amx-bf16 level (isa.h).
//
// Why a second AMX product: the int8 one (quant_amx.cpp) keeps VNNI's answers, so each block
// of 32 values ends in its own int32 tile, stored and scaled into float32 — the tile unit idles
// behind those stores and epilogues (~1.4x VNNI, under 10% of the tile peak). Here each tile of
// 16 weight rows is dequantized once per pass of rows (in_row_passes: as many rows as keep
// packed x in L2) to bf16 (d * q + m, rounded to nearest even) in AMX's B order, x is rounded
// to bf16, and TDPBF16PS sums all of K in float32 inside the tile registers: 2 x 2 result
// tiles (32 rows of x by 32 weight rows) per tile pass, one store at the end. The weights
// are read as stored, every call; the bf16 copy of a tile lives in one thread's
// buffer while the rows of x pass. Weights not tiled (the K-quants: super-blocks of 256 with
// 6-bit or 8-bit sub-block scales) take the same passes, each 16-row tile unpacked from the
// stored rows as the panels unpack them (stored_linear_amx_bf16).
//
// Numerics: not VNNI's. x keeps 8 significant bits (VNNI: int8 per block of 32, about the
// same), and each weight is rounded to 8 bits where d * q + m was exact in float32. The tests
// bound the error against float64 (tests/test_amx.py); greedy tokens may move on near ties,
// which is why the level is opt-in, as avx512bf16 is.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "isa.h"
#include "prefill_vec.h"
#include "quant_blocks.h"
#include "quant_tiled.h"
#include "scratch.h"
#include "work_pool.h"

namespace tailserve_cpu {

#ifdef TS_AMX
namespace {

// 64 values (16 rows x 4 consecutive k, byte 4r + i) as integers -> B rows p0 and p0 + 1 of
// one block: row p holds, for each of the 16 rows r, (w(r, 2p), w(r, 2p + 1)) in bf16.
template <bool kSigned, int kZero, bool kMin>
inline void emit_pairs(__m512i bytes, const __m512* dq, const __m512* mq, uint16_t* row_even,
                       uint16_t* row_odd) {
  __m512 f[4];
  const __m128i p0 = _mm512_castsi512_si128(bytes);
  const __m128i p1 = _mm512_extracti32x4_epi32(bytes, 1);
  const __m128i p2 = _mm512_extracti32x4_epi32(bytes, 2);
  const __m128i p3 = _mm512_extracti32x4_epi32(bytes, 3);
  const __m128i parts[4] = {p0, p1, p2, p3};
  for (int q = 0; q < 4; ++q) {
    __m512i v = kSigned ? _mm512_cvtepi8_epi32(parts[q]) : _mm512_cvtepu8_epi32(parts[q]);
    if constexpr (kZero != 0) v = _mm512_sub_epi32(v, _mm512_set1_epi32(kZero));
    const __m512 vf = _mm512_cvtepi32_ps(v);
    f[q] = kMin ? _mm512_fmadd_ps(vf, dq[q], mq[q]) : _mm512_mul_ps(vf, dq[q]);
  }
  // Rows 0-7's pairs, then rows 8-15's: dwords P(r, 0), P(r, 1) for r in order.
  const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
  const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  _mm512_store_si512(row_even, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_store_si512(row_odd, _mm512_permutex2var_epi32(lo, odd, hi));
}

// One tile of 16 weight rows -> b: per block of 32 values, 16 B rows of 32 bf16 (1 KiB).
template <int TS>
void dequant_tile(const uint8_t* tile, int64_t nb, uint16_t* b) {
  using L = TiledLayout<TS>;
  __m512i quarter[4];  // lane i of quarter q reads row 4q + i / 4
  for (int q = 0; q < 4; ++q) {
    alignas(64) int32_t idx[16];
    for (int i = 0; i < 16; ++i) idx[i] = 4 * q + i / 4;
    quarter[q] = _mm512_load_si512(idx);
  }
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    uint16_t* out = b + g * 512;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (L::kMin) {
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    }
    __m512 dq[4], mq[4];
    for (int q = 0; q < 4; ++q) {
      dq[q] = _mm512_permutexvar_ps(quarter[q], d);
      mq[q] = _mm512_permutexvar_ps(quarter[q], m);
    }
    if constexpr (L::kQ8) {
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + L::kQs + 64 * c);
        emit_pairs<true, 0, false>(v, dq, mq, out + 64 * c, out + 64 * c + 32);
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        split_chunk512<TS>(blk, j, lo, hi);
        // lo: values 4j..4j+3 -> B rows 2j, 2j + 1; hi: 16 + 4j.. -> rows 8 + 2j, 9 + 2j
        emit_pairs<false, L::kZero, L::kMin>(lo, dq, mq, out + 64 * j, out + 64 * j + 32);
        emit_pairs<false, L::kZero, L::kMin>(hi, dq, mq, out + 256 + 64 * j,
                                             out + 256 + 64 * j + 32);
      }
    }
  }
}

// MT groups of 16 rows of x against NT tiles of 16 weight rows, all of K: tmm0-3 the results
// (m, n), tmm4-5 x's rows, tmm6-7 the weights' B. Results go straight to y.
// xb: x packed as [K / 32][rows][32] bf16, so each A tile is 1 KiB in one run (rows of x apart
// by K put every tile row in its own page region: 0.6 -> 0.5 ms a 512-row product); `xb` points
// at the group's first row in block 0, `rows` is the packed row count.
template <int MT, int NT>
void tile_pass(const uint16_t* xb, int64_t rows, const uint16_t* b0, const uint16_t* b1,
               int64_t nb, float* y, int64_t N) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  for (int64_t g = 0; g < nb; ++g) {
    const uint16_t* a = xb + g * rows * 32;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b0 + g * 512, 64);
    if constexpr (MT == 2) _tile_loadd(5, a + 16 * 32, 64);
    if constexpr (NT == 2) _tile_loadd(7, b1 + g * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t ystride = N * 4;
  _tile_stored(0, y, ystride);
  if constexpr (NT == 2) _tile_stored(1, y + 16, ystride);
  if constexpr (MT == 2) _tile_stored(2, y + 16 * N, ystride);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, y + 16 * N + 16, ystride);
}

// y = x W^T over pairs of 16-row weight tiles: dequant(t, b) writes tile t's B (K / 32 runs
// of 512 bf16) into b, once per pass, then every group of 16 rows of x passes against it.
template <typename Dequant>
void linear_bf16(const Dequant& dequant, int64_t N, int64_t K, int64_t groups, const uint16_t* xb,
                 float* y, const float* bias) {
  const int64_t nb = K / 32, tiles = N / 16, pairs = (tiles + 1) / 2;
  parallel_dynamic(pairs, [&](int64_t pair) {
    amx::load_full_config();
    thread_local Scratch<uint16_t> storage;  // two tiles' B (scratch.h)
    uint16_t* b0 = storage.get(2 * nb * 512);
    uint16_t* b1 = b0 + nb * 512;
    const int64_t t0 = 2 * pair;
    const bool two = t0 + 1 < tiles;
    dequant(t0, b0);
    if (two) dequant(t0 + 1, b1);
    const int64_t rows = 16 * groups;
    // Pairs of row groups, the last one alone when their count is odd.
    for (int64_t m = 0; m < groups; m += 2) {
      float* yt = y + 16 * m * N + 16 * t0;
      const uint16_t* xt = xb + 16 * m * 32;
      const bool pair = m + 1 < groups;
      if (pair && two) tile_pass<2, 2>(xt, rows, b0, b1, nb, yt, N);
      if (pair && !two) tile_pass<2, 1>(xt, rows, b0, b1, nb, yt, N);
      if (!pair && two) tile_pass<1, 2>(xt, rows, b0, b1, nb, yt, N);
      if (!pair && !two) tile_pass<1, 1>(xt, rows, b0, b1, nb, yt, N);
    }
    _tile_release();
    if (bias) {
      const int64_t cols = two ? 32 : 16;
      for (int64_t r = 0; r < 16 * groups; ++r) {
        for (int64_t c = 0; c < cols; c += 16) {
          float* yr = y + r * N + 16 * t0 + c;
          _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr),
                                             _mm512_loadu_ps(bias + 16 * t0 + c)));
        }
      }
    }
  });
}

template <int TS>
void linear_bf16_as(const uint8_t* w, int64_t N, int64_t K, int64_t groups, const uint16_t* xb,
                    float* y, const float* bias) {
  const int64_t nb = K / 32, tile_bytes = nb * TiledLayout<TS>::kBytes;
  linear_bf16([&](int64_t t, uint16_t* b) { dequant_tile<TS>(w + t * tile_bytes, nb, b); }, N, K,
              groups, xb, y, bias);
}

// 16 rows [n0, n0 + 16) of a weight as stored ([N, K / block, type_size], any format; the
// K-quants are why) -> B as dequant_tile writes it. Each block of each row is unpacked as the
// panels unpack it (quant_blocks.h: bytes q, a scale per 4 values, an offset per 16), the
// values w = a * q + b in float32 (exact: a and b are products of a half and a small integer),
// then each run of 32 of the 16 rows is rounded to bf16 pairs and transposed into B's order.
void dequant_stored_tile(quant::Fmt fmt, int64_t block, int64_t type_size, const uint8_t* w,
                         int64_t n0, int64_t K, uint16_t* b) {
  const int64_t per_row = K / block;
  alignas(64) float vals[16][256];
  alignas(64) uint32_t pairs[16][16];
  alignas(64) uint8_t q[256];
  alignas(64) float a4[64 + 16], b16[16];
  const float* rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = reinterpret_cast<const float*>(pairs[r]);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const bool is_signed = fmt == quant::Fmt::Q8_0;
  for (int64_t kb = 0; kb < per_row; ++kb) {
    for (int64_t r = 0; r < 16; ++r) {
      quant::unpack_block(fmt, w + ((n0 + r) * per_row + kb) * type_size, q, a4, b16);
      for (int64_t i = 0; i < block; i += 16) {
        const __m128i qb = _mm_load_si128(reinterpret_cast<const __m128i*>(q + i));
        const __m512i qi = is_signed ? _mm512_cvtepi8_epi32(qb) : _mm512_cvtepu8_epi32(qb);
        const __m512 a = _mm512_permutexvar_ps(spread, _mm512_loadu_ps(a4 + i / 4));
        _mm512_store_ps(vals[r] + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), a,
                                                     _mm512_set1_ps(b16[i / 16])));
      }
    }
    for (int64_t g = 0; g < block / 32; ++g) {  // dword p of row r: (w(r, 2p), w(r, 2p + 1))
      for (int64_t r = 0; r < 16; ++r) {
        _mm512_store_si512(pairs[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
            _mm512_load_ps(vals[r] + 32 * g + 16), _mm512_load_ps(vals[r] + 32 * g))));
      }
      float* dst = reinterpret_cast<float*>(b + ((kb * block) / 32 + g) * 512);
      prefill_vec::transpose16_store(rows, dst, 16);
    }
  }
}

// x to bf16 (nearest even), packed [K / 32][rows][32] (tile_pass) into xp.
void pack_x(const float* x, int64_t rows, int64_t K, uint16_t* xp) {
  parallel_dynamic((rows + 15) / 16, [&](int64_t item) {
    const int64_t r1 = std::min(rows, item * 16 + 16);
    for (int64_t r = item * 16; r < r1; ++r) {
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * K + k + 16),
                                               _mm512_loadu_ps(x + r * K + k));
        _mm512_store_si512(xp + ((k / 32) * rows + r) * 32, reinterpret_cast<__m512i>(v));
      }
    }
  });
}

// Rows of x per pass of linear_bf16: each pass dequantizes every weight tile again, so few
// passes; but a pass's packed x must stay in L2 (2 MiB a core here) while the tiles stream
// it, or the tile loop halves (x of 2,048 rows x 576 past L2: 0.9-1.0 TFLOP/s a thread
// against 1.7-2.0 from L2, cpu_kernels.md). Up to 1.5 MiB of packed x a pass, never under
// 256 rows (where the dequantization would cost more than L2 saves), multiples of 32.
int64_t rows_per_pass(int64_t rows, int64_t K) {
  const int64_t fit = ((3 * 512 * 1024) / (K * 2)) & ~int64_t{31};
  return std::min(rows, std::max<int64_t>(256, fit));
}

// y = x W^T in passes of rows_per_pass rows: x packed to bf16 (pack_x) a pass at a time,
// then linear(groups, xp, y) for that pass's 16-row groups.
template <typename Linear>
void in_row_passes(const float* x, int64_t rows, int64_t K, int64_t N, float* y,
                   const Linear& linear) {
  const int64_t per = rows_per_pass(rows, K);
  thread_local Scratch<uint16_t> xb;  // pack_x writes every element (scratch.h)
  uint16_t* xp = xb.get(per * K);
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t n = std::min(per, rows - r0);
    pack_x(x + r0 * K, n, K, xp);
    linear(n / 16, xp, y + r0 * N);
  }
}

}  // namespace
#endif

int64_t tiled_linear_amx_bf16(int64_t type_size, const uint8_t* w, int64_t N, int64_t K,
                              int64_t M, const float* x, float* y, const float* bias) {
#ifdef TS_AMX
  const int64_t groups = M / 16;
  if (groups == 0 || !isa::amx_status().permitted || !isa::amx_status().bf16) return 0;
  const int64_t rows = 16 * groups;
  in_row_passes(x, rows, K, N, y, [&](int64_t g, const uint16_t* xp, float* yp) {
    switch (type_size) {
      case 18: linear_bf16_as<18>(w, N, K, g, xp, yp, bias); break;
      case 20: linear_bf16_as<20>(w, N, K, g, xp, yp, bias); break;
      case 22: linear_bf16_as<22>(w, N, K, g, xp, yp, bias); break;
      case 24: linear_bf16_as<24>(w, N, K, g, xp, yp, bias); break;
      default: linear_bf16_as<34>(w, N, K, g, xp, yp, bias); break;
    }
  });
  return rows;
#else
  (void)type_size, (void)w, (void)N, (void)K, (void)M, (void)x, (void)y, (void)bias;
  return 0;
#endif
}

int64_t stored_linear_amx_bf16(int64_t type_size, const uint8_t* w, int64_t N, int64_t K,
                               int64_t M, const float* x, float* y, const float* bias) {
#ifdef TS_AMX
  quant::FmtInfo f;
  const int64_t groups = M / 16;
  if (groups == 0 || N % 16 != 0 || !quant::fmt_of(type_size, &f) || K % f.block != 0 ||
      !isa::amx_status().permitted || !isa::amx_status().bf16) {
    return 0;
  }
  const int64_t rows = 16 * groups;
  in_row_passes(x, rows, K, N, y, [&](int64_t g, const uint16_t* xp, float* yp) {
    linear_bf16([&](int64_t t, uint16_t* b) {
      dequant_stored_tile(f.fmt, f.block, type_size, w, 16 * t, K, b);
    }, N, K, g, xp, yp, bias);
  });
  return rows;
#else
  (void)type_size, (void)w, (void)N, (void)K, (void)M, (void)x, (void)y, (void)bias;
  return 0;
#endif
}

}  // namespace tailserve_cpu
