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

// The two integer dots a panel runs, each with its tile width and the float ops at that
// width. AVX2: 8 rows per tile; maddubs + madd in place of dpbusd. Q8_0 stays signed there
// (kSignedQ8): its products are |w| x (x with w's sign), as u8 + 128 would overflow maddubs'
// 16-bit pair sums. VNNI's dpbusd takes Q8_0 as u8 + 128 with the 128 moved into the offset.
struct PanelAvx2 {
  static constexpr int64_t kWidth = 8, kMaxRows = 4;  // 8 accumulators + weights in 16 ymm
  static constexpr bool kSignedQ8 = true;
  using F = __m256;
  struct W { __m256i v, a; };  // the weight bytes and, when signed, their absolute values
  template <bool Signed>
  static W weights(const uint8_t* wq) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
    return {v, Signed ? _mm256_sign_epi8(v, v) : v};
  }
  template <bool Signed>
  static __m256i dot(__m256i acc, W w, int32_t xv) {
    __m256i xb = _mm256_set1_epi32(xv);
    if constexpr (Signed) xb = _mm256_sign_epi8(xb, w.v);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, xb), _mm256_set1_epi16(1)));
  }
  static __m256i zero() { return _mm256_setzero_si256(); }
  static F bias(const float* b, int64_t cols) {
    alignas(32) float b8[8] = {};
    for (int64_t c = 0; c < cols && b; ++c) b8[c] = b[c];
    return _mm256_load_ps(b8);
  }
  static void store(float* y, F v, int64_t cols) {
    if (cols == 8) return _mm256_storeu_ps(y, v);
    alignas(32) float out[8];
    _mm256_store_ps(out, v);
    for (int64_t c = 0; c < cols; ++c) y[c] = out[c];
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
struct PanelVnni {
  static constexpr int64_t kWidth = 16, kMaxRows = 8;
  static constexpr bool kSignedQ8 = false;
  using F = __m512;
  template <bool Signed>
  static __m512i weights(const uint8_t* wq) { return _mm512_loadu_si512(wq); }
  template <bool Signed>
  static __m512i dot(__m512i acc, __m512i w, int32_t xv) {
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(xv));
  }
  static __m512i zero() { return _mm512_setzero_si512(); }
  static __mmask16 mask(int64_t cols) { return static_cast<__mmask16>((1u << cols) - 1); }
  static F bias(const float* b, int64_t cols) {
    return b ? _mm512_maskz_loadu_ps(mask(cols), b) : _mm512_setzero_ps();
  }
  static void store(float* y, F v, int64_t cols) { _mm512_mask_storeu_ps(y, mask(cols), v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
};
#endif

// MR rows of x against one tile of P::kWidth weight rows; y rows are N apart, `cols` outputs
// stored. Signed: Q8_0 on AVX2 (no offset term).
template <typename P, int MR, int G, bool Signed>
void panel_rows(const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  using F = typename P::F;
  F accf[MR];
  const F b0 = P::bias(bias, cols);
  for (int m = 0; m < MR; ++m) accf[m] = b0;
  const int64_t groups = K / G;
  const uint8_t* wq = t.q.data();
  for (int64_t g = 0; g < groups; ++g) {
    decltype(P::zero()) acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = P::zero();
    for (int k4 = 0; k4 < G / 4; ++k4, wq += 4 * P::kWidth) {
      const auto w = P::template weights<Signed>(wq);
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * G + 4 * k4, 4);
        acci[m] = P::template dot<Signed>(acci[m], w, xv);
      }
    }
    const F av = P::load(t.a.data() + g * P::kWidth);
    const F bv = P::load(t.b.data() + g * P::kWidth);
    for (int m = 0; m < MR; ++m) {
      const F s = P::mul(av, P::set1(dx[m * (K / 32) + g * G / 32]));
      accf[m] = P::fma(P::cvt(acci[m]), s, accf[m]);
      if constexpr (!Signed) accf[m] = P::fma(bv, P::set1(xsg[m * groups + g]), accf[m]);
    }
  }
  for (int m = 0; m < MR; ++m) P::store(y + m * N, accf[m], cols);
}

// Rows [0, rows) of x against one tile, P::kMaxRows at most (rows past it: the caller's next
// chunk); MR from 1, the count known at compile time.
template <typename P, int G, bool Signed, int MR = 1>
void panel_chunk(int64_t rows, const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                 const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  if constexpr (MR < P::kMaxRows) {
    if (rows > MR) return panel_chunk<P, G, Signed, MR + 1>(rows, t, K, xq, dx, xsg, y, N, cols, bias);
  }
  panel_rows<P, MR, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
}

// Tiles of P::kWidth weight rows, one per work item, each unpacked once and run against every
// P::kMaxRows rows of x.
template <typename P>
void panel_linear(const Packed& p, const QuantizedRows& x, float* yp, const float* bp) {
  const int64_t M = x.M, K = p.K, N = p.N, width = P::kWidth;
  const int64_t G = p.f.fmt == Fmt::Q6_K ? 16 : 32;
  const float* xsg = G == 16 ? x.xs : x.xs32;
  parallel_dynamic((N + width - 1) / width, [&](int64_t tile) {
    thread_local PanelTile t;
    thread_local std::vector<uint8_t> qrow;
    thread_local std::vector<float> a4, b16;
    const int64_t n0 = tile * width, cols = std::min<int64_t>(width, N - n0);
    build_panel(p, n0, cols, G, width, !P::kSignedQ8, &t, qrow, a4, b16);
    const float* b = bp ? bp + n0 : nullptr;
    for (int64_t m = 0; m < M; m += P::kMaxRows) {
      const int64_t rows = std::min<int64_t>(P::kMaxRows, M - m);
      const int8_t* xr = x.xq + m * K;
      const float* dr = x.dx + m * (K / 32);
      const float* xs = xsg + m * (K / G);
      float* yr = yp + m * N + n0;
      if constexpr (P::kSignedQ8) {
        if (p.f.fmt == Fmt::Q8_0) {
          panel_chunk<P, 32, true>(rows, t, K, xr, dr, xs, yr, N, cols, b);
          continue;
        }
      }
      if (G == 16) {
        panel_chunk<P, 16, false>(rows, t, K, xr, dr, xs, yr, N, cols, b);
      } else {
        panel_chunk<P, 32, false>(rows, t, K, xr, dr, xs, yr, N, cols, b);
      }
    }
  });
}

}  // namespace

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
void panel_linear_vnni(const Packed& p, const QuantizedRows& x, float* yp, const float* bp) {
  panel_linear<PanelVnni>(p, x, yp, bp);
}
#endif

void panel_linear_avx2(const Packed& p, const QuantizedRows& x, float* yp, const float* bp) {
  panel_linear<PanelAvx2>(p, x, yp, bp);
}

}  // namespace quant
}  // namespace tailserve_cpu

#endif  // TS_AVX2
