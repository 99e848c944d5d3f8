// quant_linear on the K-quants as stored (Q4_K, Q5_K, Q6_K) with AMX int8 tiles, for prompt
// chunks and wide batches (9 rows of x and up, at the amx level): VNNI's panels
// (quant_panels.cpp) bit for bit, at the tiles' rate.
//
// The panels spent more time unpacking than multiplying: every product unpacks each weight row
// into bytes and interleaves 16 rows four bytes at a time (build_panel, scalar stores), and at
// 16 rows of x that cost 4-5x the product itself (3B shapes, 16,384 x 3,072 Q4_K: 15.5 ms at
// 16 rows, 3.1 at 8 on the decode rows). Here the weight is the tile product's A operand: a
// 16 x G-byte tile is 16 weight rows of one group of G values (32; Q6_K's scales are per 16),
// each row's bytes as they come out of its nibbles, so unpacking a row is a few vector ops a
// group and no interleave. x is B: its rows interleaved four bytes at a time (AMX's B order,
// [16 x rows][4 bytes] per line), once per call, and zero-padded to whole groups of 16 rows.
// The result tile is then 16 weight rows x 16 rows of x, the transpose of y's layout, and is
// transposed once per output tile after the last group.
//
// The integer sums are the panels' (dpbusd adds the same u8 x s8 products; the weight's bytes
// are below 64, so signed or unsigned they read the same), and the float epilogue is theirs
// element for element in the same group order: acc = fma(sum, a * dx, acc), then
// acc = fma(b, xs, acc), a and b each weight row's group scale and offset as unpack_block
// computes them, the sum over a group of x the panels use (xs per 16 for Q6_K, xs32 per 32).
// tests/test_amx.py holds the outputs equal to the panels'.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

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

using quant::Fmt;

// Values per scale group: 16 for Q6_K, 32 for Q4_K / Q5_K.
constexpr int64_t group_of(Fmt f) { return f == Fmt::Q6_K ? 16 : 32; }

// Palette 1: tmm0 / tmm1 the int32 results, tmm2 / tmm3 the weight's 16 x G bytes (A),
// tmm4 / tmm5 x's G / 4 lines of 64 bytes (B).
void load_tile_config(int64_t G) {
  amx::TileConfig cfg{};
  for (int t : {0, 1}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  for (int t : {2, 3}) { cfg.rows[t] = 16; cfg.colsb[t] = static_cast<uint16_t>(G); }
  for (int t : {4, 5}) { cfg.rows[t] = static_cast<uint8_t>(G / 4); cfg.colsb[t] = 64; }
  amx::load_config(cfg);
}

// Weight rows [n0, n0 + cols) unpacked into A tiles: q [K / G][16][G] bytes, a and b
// [16][K / G] (each row's group scales and offsets, unpack_block's expressions, eight or
// sixteen at a time: one at a time, the scales cost Q4_K's unpack a fifth and Q6_K's a third
// more). Rows past cols are zero, so their (discarded) outputs are finite. Prefetching the
// next tile's rows into L2 while this one was multiplied made 16 rows of x 15% slower: not
// done (cpu_kernels.md).
template <Fmt F>
void unpack_a(const uint8_t* w, int64_t n0, int64_t cols, int64_t K, uint8_t* q, float* a,
              float* b) {
  constexpr int64_t G = group_of(F), kTs = quant::kquant_bytes(F);
  const int64_t nsb = K / 256, ng = K / G;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t r = cols; r < 16; ++r) {
    for (int64_t g = 0; g < ng; ++g) std::memset(q + (g * 16 + r) * G, 0, G);
    std::memset(a + r * ng, 0, ng * sizeof(float));
    std::memset(b + r * ng, 0, ng * sizeof(float));
  }
  for (int64_t r = 0; r < cols; ++r) {
    const uint8_t* blk = w + (n0 + r) * nsb * kTs;
    float* ar = a + r * ng;
    float* br = b + r * ng;
    for (int64_t s = 0; s < nsb; ++s, blk += kTs) {
      if constexpr (F == Fmt::Q6_K) {
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const float d = quant::h2f(blk + 208);
        for (int h = 0; h < 2; ++h) {  // 128 values each: four runs of 32, two groups a run
          __m256i v[4];
          quant::q6k_values(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)), v);
          for (int i = 0; i < 4; ++i) {
            const int64_t g = s * 16 + 8 * h + 2 * i;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (g * 16 + r) * 16),
                             _mm256_castsi256_si128(v[i]));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + ((g + 1) * 16 + r) * 16),
                             _mm256_extracti128_si256(v[i], 1));
          }
        }
        // a = d * sc (int8 scales), b = -32 * a: unpack_block's products, 16 lanes at once.
        const __m512 av = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
        _mm512_storeu_ps(ar + s * 16, av);
        _mm512_storeu_ps(br + s * 16, _mm512_mul_ps(_mm512_set1_ps(-32.f), av));
      } else {
        const float d = quant::h2f(blk), dmin = quant::h2f(blk + 2);
        const uint8_t* ql = blk + (F == Fmt::Q5_K ? 48 : 16);
        [[maybe_unused]] const __m256i qh =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles then high nibbles of 32 bytes
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * j));
          __m256i lo = _mm256_and_si256(v, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (F == Fmt::Q5_K) {  // bit 2j (low run) and 2j + 1 (high run) of qh
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
          }
          const int64_t g = s * 8 + 2 * j;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (g * 16 + r) * 32), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + ((g + 1) * 16 + r) * 32), hi);
        }
        // a = d * sc, b = -dmin * m for the 8 sub-blocks (byte j of sc / mn: sub-block j).
        uint64_t sc, mn;
        quant::scales_mins_k4(blk + 4, &sc, &mn);
        auto widen = [](uint64_t v8) {
          return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v8))));
        };
        _mm256_storeu_ps(ar + s * 8, _mm256_mul_ps(_mm256_set1_ps(d), widen(sc)));
        _mm256_storeu_ps(br + s * 8, _mm256_mul_ps(_mm256_set1_ps(-dmin), widen(mn)));
      }
    }
  }
}

// x for the B tiles, per group of 16 rows (rows past M zero): xb [groups][K / 4][16][4]
// (a group of G values is G / 4 lines of 64 bytes), dxb [groups][K / 32][16] and xsb
// [groups][K / G][16], the panels' dx and per-group sums of x.
void pack_b(const quant::QuantizedRows& x, int64_t K, int64_t G, int64_t groups, int8_t* xb,
            float* dxb, float* xsb) {
  const int64_t nb = K / 32, ng = K / G;
  const float* xs = G == 16 ? x.xs : x.xs32;
  parallel_dynamic(groups, [&](int64_t m) {
    int32_t* dst = reinterpret_cast<int32_t*>(xb + m * 16 * K);
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t row = 16 * m + i;
      if (row < x.M) {
        const int8_t* src = x.xq + row * K;
        for (int64_t k4 = 0; k4 < K / 4; ++k4) std::memcpy(dst + k4 * 16 + i, src + 4 * k4, 4);
        for (int64_t g = 0; g < nb; ++g) dxb[(m * nb + g) * 16 + i] = x.dx[row * nb + g];
        for (int64_t g = 0; g < ng; ++g) xsb[(m * ng + g) * 16 + i] = xs[row * ng + g];
      } else {
        for (int64_t k4 = 0; k4 < K / 4; ++k4) dst[k4 * 16 + i] = 0;
        for (int64_t g = 0; g < nb; ++g) dxb[(m * nb + g) * 16 + i] = 0.f;
        for (int64_t g = 0; g < ng; ++g) xsb[(m * ng + g) * 16 + i] = 0.f;
      }
    }
  });
}

// The panels' epilogue for one group g, transposed: acc[n] (16 rows of x in lanes) for each of
// the 16 weight rows n; a and b are the group's column of [16][ng].
__attribute__((always_inline)) inline void epilogue(const int32_t* c, const float* a,
                                                    const float* b, int64_t ng, __m512 dx,
                                                    __m512 xs, __m512* acc) {
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * n));
    acc[n] = _mm512_fmadd_ps(sum, _mm512_mul_ps(_mm512_set1_ps(a[n * ng]), dx), acc[n]);
    acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(b[n * ng]), xs, acc[n]);
  }
}

// One output tile: weight rows [n0, n0 + cols) (unpacked in q, a, b) against x's group m,
// into y rows [16 m, 16 m + rows).
template <int64_t G>
void tile_group(const uint8_t* q, const float* a, const float* b, int64_t K, const int8_t* xb,
                const float* dxb, const float* xsb, float* y, int64_t N, int64_t rows,
                int64_t cols, const float* bias) {
  const int64_t ng = K / G;
  alignas(64) int32_t c[2][2][256];  // [set][group of the pair]
  __m512 acc[16];
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n) acc[n] = _mm512_set1_ps(bias && n < cols ? bias[n] : 0.f);
  // Groups g, g + 1 into c[set], the next pair's products running while the epilogue reads
  // the pair before (quant_amx.cpp's pipeline: tile registers are not renamed).
  auto products = [&](int64_t g, int set) {
    _tile_zero(0);
    _tile_loadd(2, q + g * 16 * G, G);
    _tile_loadd(4, xb + g * G * 16, 64);
    _tile_dpbusd(0, 2, 4);
    _tile_stored(0, c[set][0], 64);
    if (g + 1 < ng) {
      _tile_zero(1);
      _tile_loadd(3, q + (g + 1) * 16 * G, G);
      _tile_loadd(5, xb + (g + 1) * G * 16, 64);
      _tile_dpbusd(1, 3, 5);
      _tile_stored(1, c[set][1], 64);
    }
  };
  auto finish = [&](int64_t g, const int32_t* cg) {
    const __m512 dx = _mm512_load_ps(dxb + (g * G / 32) * 16);
    const __m512 xs = _mm512_load_ps(xsb + g * 16);
    epilogue(cg, a + g, b + g, ng, dx, xs, acc);
  };
  products(0, 0);
  for (int64_t g = 0, set = 0; g < ng; g += 2, set ^= 1) {
    if (g + 2 < ng) products(g + 2, set ^ 1);
    finish(g, c[set][0]);
    if (g + 1 < ng) finish(g + 1, c[set][1]);
  }
  alignas(64) float t[16][16];
  const float* src[16];
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n) {
    _mm512_store_ps(t[n], acc[n]);
    src[n] = t[n];
  }
  if (rows == 16 && cols == 16) return prefill_vec::transpose16_store(src, y, N);
  alignas(64) float yt[16][16];
  prefill_vec::transpose16_store(src, yt[0], 16);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(y + m * N, yt[m], cols * sizeof(float));
}

template <Fmt F>
void kquant_amx(const uint8_t* w, int64_t N, int64_t K, const int8_t* xb, const float* dxb,
                const float* xsb, int64_t M, float* y, const float* bias) {
  constexpr int64_t G = group_of(F);
  const int64_t groups = (M + 15) / 16, tiles = (N + 15) / 16, ng = K / G, nb = K / 32;
  const int64_t per_item = std::max<int64_t>(
      1, tiles / (runs_per_thread(false) * at::get_num_threads()));
  parallel_dynamic((tiles + per_item - 1) / per_item, [&](int64_t item) {
    load_tile_config(G);  // per thread state; cheap beside an item's work
    thread_local Scratch<uint8_t> q_buf;  // the unpacked A tiles (scratch.h)
    thread_local Scratch<float> a_buf, b_buf;
    uint8_t* q = q_buf.get(16 * K);
    float* a = a_buf.get(16 * ng);
    float* b = b_buf.get(16 * ng);
    const int64_t t1 = std::min(tiles, (item + 1) * per_item);
    for (int64_t t = item * per_item; t < t1; ++t) {
      const int64_t n0 = 16 * t, cols = std::min<int64_t>(16, N - n0);
      unpack_a<F>(w, n0, cols, K, q, a, b);
      for (int64_t m = 0; m < groups; ++m) {
        tile_group<G>(q, a, b, K, xb + m * 16 * K, dxb + m * nb * 16, xsb + m * ng * 16,
                      y + 16 * m * N + n0, N, std::min<int64_t>(16, M - 16 * m), cols,
                      bias ? bias + n0 : nullptr);
      }
    }
    _tile_release();
  });
}

}  // namespace
#endif

namespace quant {

bool kquant_linear_amx(const Packed& p, const QuantizedRows& x, float* y, const float* bias) {
#ifdef TS_AMX
  const Fmt f = p.f.fmt;
  if (p.tiled || !(f == Fmt::Q4_K || f == Fmt::Q5_K || f == Fmt::Q6_K) || p.K % 256 != 0 ||
      !isa::amx_status().permitted) {
    return false;
  }
  const int64_t K = p.K, G = group_of(f), groups = (x.M + 15) / 16;
  // Kept between calls (scratch.h: pack_b writes every element it reads).
  thread_local Scratch<int8_t> xb_buf;
  thread_local Scratch<float> dxb_buf, xsb_buf;
  int8_t* xb = xb_buf.get(groups * 16 * K);
  float* dxb = dxb_buf.get(groups * 16 * (K / 32));
  float* xsb = xsb_buf.get(groups * 16 * (K / G));
  pack_b(x, K, G, groups, xb, dxb, xsb);
  switch (f) {
    case Fmt::Q4_K: kquant_amx<Fmt::Q4_K>(p.data, p.N, K, xb, dxb, xsb, x.M, y, bias); break;
    case Fmt::Q5_K: kquant_amx<Fmt::Q5_K>(p.data, p.N, K, xb, dxb, xsb, x.M, y, bias); break;
    default: kquant_amx<Fmt::Q6_K>(p.data, p.N, K, xb, dxb, xsb, x.M, y, bias); break;
  }
  return true;
#else
  (void)p, (void)x, (void)y, (void)bias;
  return false;
#endif
}

}  // namespace quant
}  // namespace tailserve_cpu
