// quant_linear at many rows of x on stored GGUF blocks (kPanelMinRows and up; the dispatch is
// quant_linear.cpp's): each tile of weight rows is unpacked once (quant_blocks.h, unpack_row)
// and interleaved for the integer dot, then reused by every row of x. 16-row tiles for AVX512
// VNNI's dpbusd, 8-row ones for AVX2's maddubs.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "simd.h"
#include "work_pool.h"

#ifdef TS_AVX2

namespace tailserve_cpu {
namespace quant {
namespace {

// 16 unpacked weight rows interleaved for dpbusd: for each 4 values k..k+3, the 16 rows'
// bytes side by side (64 bytes, one zmm); per group of G values (32, or 16 for Q6_K) the 16
// rows' scales a and offsets b. One dpbusd against x's 4 bytes broadcast is then 64 products
// into 16 outputs, and the unpacked tile is reused by every row of x.
struct PanelTile {
  std::vector<uint8_t> q;  // [K / 4][16][4]
  std::vector<float> a, b;  // [K / G][16]
};

// width: rows per tile (16 for AVX512 VNNI, 8 for AVX2); q8_unsigned: Q8_0 stored + 128.
void build_panel(const Packed& p, int64_t n0, int64_t rows, int64_t G, int64_t width,
                 bool q8_unsigned, PanelTile* t, std::vector<uint8_t>& qrow,
                 std::vector<float>& a4, std::vector<float>& b16) {
  const int64_t K = p.K, groups = K / G;
  t->q.assign(K * width, 0);
  t->a.assign(groups * width, 0.f);
  t->b.assign(groups * width, 0.f);
  qrow.resize(K);
  a4.resize(K / 4);
  b16.resize(K / 16);
  const int64_t row_bytes = (K / p.f.block) * p.type_size;
  const bool q8 = p.f.fmt == Fmt::Q8_0 && q8_unsigned;
  for (int64_t r = 0; r < rows; ++r) {
    unpack_row(p.f, p.data + (n0 + r) * row_bytes, K, p.type_size, qrow.data(), a4.data(),
               b16.data());
    uint32_t* dst = reinterpret_cast<uint32_t*>(t->q.data());
    for (int64_t k4 = 0; k4 < K / 4; ++k4) {
      uint32_t v;
      std::memcpy(&v, qrow.data() + 4 * k4, 4);
      if (q8) v ^= 0x80808080u;  // int8 -> uint8 + 128, the 128 moved into the offset
      dst[k4 * width + r] = v;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float a = a4[g * G / 4];
      t->a[g * width + r] = a;
      t->b[g * width + r] = q8 ? -128.f * a : b16[g * G / 16];
    }
  }
}

// AVX2: 8 rows per tile; maddubs + madd in place of dpbusd. Q8_0 stays signed: its products
// are |w| x (x with w's sign), as u8 + 128 would overflow maddubs' 16-bit pair sums.
template <int MR, int G, bool Signed>
void panel_rows_avx2(const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                     const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  __m256 accf[MR];
  alignas(32) float bias8[8] = {};
  for (int64_t c = 0; c < cols && bias; ++c) bias8[c] = bias[c];
  for (int m = 0; m < MR; ++m) accf[m] = _mm256_load_ps(bias8);
  const int64_t groups = K / G;
  const uint8_t* wq = t.q.data();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm256_setzero_si256();
    for (int k4 = 0; k4 < G / 4; ++k4, wq += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i wa = Signed ? _mm256_sign_epi8(wv, wv) : wv;
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * G + 4 * k4, 4);
        __m256i xb = _mm256_set1_epi32(xv);
        if constexpr (Signed) xb = _mm256_sign_epi8(xb, wv);
        acci[m] = _mm256_add_epi32(acci[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xb), ones));
      }
    }
    const __m256 av = _mm256_loadu_ps(t.a.data() + g * 8);
    const __m256 bv = _mm256_loadu_ps(t.b.data() + g * 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_mul_ps(av, _mm256_set1_ps(dx[m * (K / 32) + g * G / 32]));
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[m]), s, accf[m]);
      if constexpr (!Signed) {
        accf[m] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xsg[m * groups + g]), accf[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (cols == 8) {
      _mm256_storeu_ps(y + m * N, accf[m]);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, accf[m]);
      for (int64_t c = 0; c < cols; ++c) y[m * N + c] = out[c];
    }
  }
}

template <int G, bool Signed>
void panel_chunk_avx2(int64_t rows, const PanelTile& t, int64_t K, const int8_t* xq,
                      const float* dx, const float* xsg, float* y, int64_t N, int64_t cols,
                      const float* bias) {
  switch (rows) {  // 4 rows: 8 accumulators + weights within the 16 AVX2 registers
    case 1: return panel_rows_avx2<1, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    case 2: return panel_rows_avx2<2, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    case 3: return panel_rows_avx2<3, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    default: return panel_rows_avx2<4, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// MR rows of x against one tile; y rows are N apart, `cols` (<= 16) outputs stored.
template <int MR, int G>
void panel_rows_vnni(const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                     const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  __m512 accf[MR];
  const __m512 bv0 = bias ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), bias)
                          : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) accf[m] = bv0;
  const int64_t groups = K / G;
  const uint8_t* wq = t.q.data();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < G / 4; ++k4, wq += 64) {
      const __m512i wv = _mm512_loadu_si512(wq);
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * G + 4 * k4, 4);
        acci[m] = _mm512_dpbusd_epi32(acci[m], wv, _mm512_set1_epi32(xv));
      }
    }
    const __m512 av = _mm512_loadu_ps(t.a.data() + g * 16);
    const __m512 bv = _mm512_loadu_ps(t.b.data() + g * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_mul_ps(av, _mm512_set1_ps(dx[m * (K / 32) + g * G / 32]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[m]), s, accf[m]);
      accf[m] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xsg[m * groups + g]), accf[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * N, mask, accf[m]);
}

template <int G>
void panel_chunk_vnni(int64_t rows, const PanelTile& t, int64_t K, const int8_t* xq,
                      const float* dx, const float* xsg, float* y, int64_t N, int64_t cols,
                      const float* bias) {
  switch (rows) {
#define TS_CASE(r) \
    case r: return panel_rows_vnni<r, G>(t, K, xq, dx, xsg, y, N, cols, bias);
    TS_CASE(1) TS_CASE(2) TS_CASE(3) TS_CASE(4) TS_CASE(5) TS_CASE(6) TS_CASE(7)
#undef TS_CASE
    default: return panel_rows_vnni<8, G>(t, K, xq, dx, xsg, y, N, cols, bias);
  }
}
#endif

}  // namespace

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
void panel_linear_vnni(const Packed& p, const QuantizedRows& x, float* yp, const float* bp) {
  const int64_t M = x.M, K = p.K, N = p.N;
  const int64_t G = p.f.fmt == Fmt::Q6_K ? 16 : 32;
  const float* xsg = G == 16 ? x.xs : x.xs32;
  parallel_dynamic((N + 15) / 16, [&](int64_t tile) {
    thread_local PanelTile t;
    thread_local std::vector<uint8_t> qrow;
    thread_local std::vector<float> a4, b16;
    const int64_t n0 = tile * 16, cols = std::min<int64_t>(16, N - n0);
    build_panel(p, n0, cols, G, 16, true, &t, qrow, a4, b16);
    const float* b = bp ? bp + n0 : nullptr;
    for (int64_t m = 0; m < M; m += 8) {
      const int64_t rows = std::min<int64_t>(8, M - m);
      const int8_t* xr = x.xq + m * K;
      const float* dr = x.dx + m * (K / 32);
      if (G == 16) {
        panel_chunk_vnni<16>(rows, t, K, xr, dr, xsg + m * (K / 16), yp + m * N + n0, N,
                             cols, b);
      } else {
        panel_chunk_vnni<32>(rows, t, K, xr, dr, xsg + m * (K / 32), yp + m * N + n0, N,
                             cols, b);
      }
    }
  });
}
#endif

void panel_linear_avx2(const Packed& p, const QuantizedRows& x, float* yp, const float* bp) {
  const int64_t M = x.M, K = p.K, N = p.N;
  const bool is_signed = p.f.fmt == Fmt::Q8_0;
  const int64_t G = p.f.fmt == Fmt::Q6_K ? 16 : 32;
  const float* xsg = G == 16 ? x.xs : x.xs32;
  parallel_dynamic((N + 7) / 8, [&](int64_t tile) {
    thread_local PanelTile t;
    thread_local std::vector<uint8_t> qrow;
    thread_local std::vector<float> a4, b16;
    const int64_t n0 = tile * 8, cols = std::min<int64_t>(8, N - n0);
    build_panel(p, n0, cols, G, 8, false, &t, qrow, a4, b16);
    const float* b = bp ? bp + n0 : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m);
      const int8_t* xr = x.xq + m * K;
      const float* dr = x.dx + m * (K / 32);
      float* yr = yp + m * N + n0;
      if (is_signed) {
        panel_chunk_avx2<32, true>(rows, t, K, xr, dr, xsg + m * (K / 32), yr, N, cols, b);
      } else if (G == 16) {
        panel_chunk_avx2<16, false>(rows, t, K, xr, dr, xsg + m * (K / 16), yr, N, cols, b);
      } else {
        panel_chunk_avx2<32, false>(rows, t, K, xr, dr, xsg + m * (K / 32), yr, N, cols, b);
      }
    }
  });
}

}  // namespace quant
}  // namespace tailserve_cpu

#endif  // TS_AVX2
