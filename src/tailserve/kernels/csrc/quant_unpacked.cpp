// quant_linear's general path on stored GGUF blocks (quant_linear.cpp dispatches): weight rows
// unpacked into a per-thread buffer (quant_blocks.h, unpack_row) that stays in L1/L2, then one
// dot product per (x row, weight row), in lanes of 4 as the SIMD paths group them. The
// dispatch sends it what no faster path takes.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace quant {
namespace {

// Rows of one x row (xq, dx) against R unpacked weight rows: out[r] = the a-part of the dot.
template <int R, bool Signed>
void dot_rows_scalar(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                     const float* const* a4, float* out) {
  for (int r = 0; r < R; ++r) {
    double acc = 0.0;
    for (int64_t b = 0; b < K / 32; ++b) {
      float blk = 0.f;
      for (int l = 0; l < 8; ++l) {  // lanes of 4, as the SIMD paths group them
        int32_t s = 0;
        for (int i = 0; i < 4; ++i) {
          const int64_t k = b * 32 + l * 4 + i;
          const int w = Signed ? static_cast<int8_t>(q[r][k]) : q[r][k];
          s += w * xq[k];
        }
        blk += static_cast<float>(s) * a4[r][b * 8 + l];
      }
      acc += static_cast<double>(blk * dx[b]);
    }
    out[r] = static_cast<float>(acc);
  }
}

#ifdef TS_AVX2
inline __m256i dot32_avx2(__m256i w, __m256i x, bool is_signed) {
  const __m256i p = is_signed
                        ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                        : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}


template <int R, bool Signed>
void dot_rows_avx2(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                   const float* const* a4, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256 d = _mm256_broadcast_ss(dx + k / 32);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + k));
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv, Signed)),
                                     _mm256_loadu_ps(a4[r] + k / 4));
      acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
template <bool Vnni, bool Signed>
inline __m512i dot64_avx512(__m512i w, __m512i x) {
  if constexpr (Signed) {  // |w| x (x with w's sign): u8 x s8 as the instructions want
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    w = _mm512_abs_epi8(w);
  }
#ifdef __AVX512VNNI__
  if constexpr (Vnni) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#endif
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
}

template <int R, bool Signed, bool Vnni>
void dot_rows_avx512(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                     const float* const* a4, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i xv = _mm512_loadu_si512(xq + k);
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(dx[k / 32]),
                                        _mm256_set1_ps(dx[k / 32 + 1]), 1);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(q[r] + k);
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot64_avx512<Vnni, Signed>(wv, xv)),
                                     _mm512_loadu_ps(a4[r] + k / 4));
      acc[r] = _mm512_fmadd_ps(s, d, acc[r]);
    }
  }
  float tail[R] = {};
  if (k < K) {  // one block of 32 left (K is a multiple of 32)
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256 d = _mm256_broadcast_ss(dx + k / 32);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + k));
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv, Signed)),
                                     _mm256_loadu_ps(a4[r] + k / 4));
      tail[r] = hsum256(_mm256_mul_ps(s, d));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}
#endif

template <int R, bool Signed>
void dot_rows(int isa, const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
              const float* const* a4, float* out) {
  switch (isa) {
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#ifdef __AVX512VNNI__
    case kAvx512Vnni: return dot_rows_avx512<R, Signed, true>(xq, dx, K, q, a4, out);
#endif
    case kAvx512: return dot_rows_avx512<R, Signed, false>(xq, dx, K, q, a4, out);
#endif
#ifdef TS_AVX2
    case kAvx2: return dot_rows_avx2<R, Signed>(xq, dx, K, q, a4, out);
#endif
    default: return dot_rows_scalar<R, Signed>(xq, dx, K, q, a4, out);
  }
}

// Weight rows unpacked per hand-out: their buffers (~2.3 bytes a value) stay in L2.
constexpr int64_t kTileRows = 16;
constexpr int kDotRows = 4;  // weight rows per x-row pass: each x load feeds four dots

}  // namespace

void unpacked_linear(int isa, const Packed& p, const QuantizedRows& x, float* yp,
                     const float* bp) {
  const int64_t M = x.M, K = p.K, N = p.N;
  const bool is_signed = p.f.fmt == Fmt::Q8_0;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  parallel_dynamic(tiles, [&](int64_t t) {
    thread_local std::vector<uint8_t> qbuf;
    thread_local std::vector<float> abuf, bbuf;
    const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
    qbuf.resize(kTileRows * K);
    abuf.resize(kTileRows * K / 4);
    bbuf.resize(kTileRows * K / 16);
    const int64_t row_bytes = (K / p.f.block) * p.type_size;
    for (int64_t r = 0; r < rows; ++r) {
      unpack_row(p.f, p.data + (n0 + r) * row_bytes, K, p.type_size, qbuf.data() + r * K,
                 abuf.data() + r * K / 4, bbuf.data() + r * K / 16);
    }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = x.xq + m * K;
      const float* dr = x.dx + m * (K / 32);
      const float* sr = x.xs + m * (K / 16);
      for (int64_t r = 0; r < rows; r += kDotRows) {
        const uint8_t* qs[kDotRows];
        const float* as[kDotRows];
        for (int i = 0; i < kDotRows; ++i) {  // past the tile's end: repeat its last row
          const int64_t rr = std::min(r + i, rows - 1);
          qs[i] = qbuf.data() + rr * K;
          as[i] = abuf.data() + rr * K / 4;
        }
        float out[kDotRows];
        if (is_signed) dot_rows<kDotRows, true>(isa, xr, dr, K, qs, as, out);
        else dot_rows<kDotRows, false>(isa, xr, dr, K, qs, as, out);
        for (int i = 0; i < kDotRows && r + i < rows; ++i) {
          float off = 0.f;
          if (!is_signed) {
            const float* b = bbuf.data() + (r + i) * K / 16;
            for (int64_t g = 0; g < K / 16; ++g) off += b[g] * sr[g];
          }
          yp[m * N + n0 + r + i] = out[i] + off + (bp ? bp[n0 + r + i] : 0.f);
        }
      }
    }
  });
}

}  // namespace quant
}  // namespace tailserve_cpu
