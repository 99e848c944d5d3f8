// torch.ops.tailserve.panel16_linear: y = x W^T (+ b) with W stored in 16 bits (bfloat16 or
// float16), x and y float32. The weights stay 16-bit in memory, half the bytes a decode step
// streams; they are widened in registers, or, for bfloat16 on a CPU with AVX512-BF16, fed to
// its native dot product (vdpbf16ps) with x rounded to bfloat16 (chosen at run time, see
// set_bf16_dot).
//
// Layouts (made by model/transforms/linear16.py), in panels of 16 output columns:
//   bfloat16  wp [N/16, Kp/2, 32]: for each pair of k (K padded to even, Kp), the 16 columns'
//             (k, k+1) weights side by side, the operand layout of vdpbf16ps; the widening
//             path gets w[k] from a pair by a 16-bit shift and w[k+1] by a mask.
//   float16   wp [N/16, K, 16]: k by k, as panel_linear's float32 panels; F16C widens them.
//
// Every path sums each output as (bias + first half of k) + second half, each in k order,
// whatever M is, so a row's result does not depend on its batch mates (as panel_linear).

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "isa.h"
#include "simd.h"
#include "simd16.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace {

// Whether bfloat16 panels may use vdpbf16ps: TAILSERVE_CPU_BF16_DOT (declared in envs.py,
// default on), then set_bf16_dot (tests run both paths). Whether the CPU has the instruction
// is checked at run time, so one build serves hosts with or without AVX512-BF16.
bool bf16_dot_from_env() {
  const char* env = std::getenv("TAILSERVE_CPU_BF16_DOT");
  if (env == nullptr || *env == 0) return true;
  std::string v(env);
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return !(v == "0" || v == "false" || v == "no" || v == "off");
}
std::atomic<bool> g_bf16_dot{bf16_dot_from_env()};

bool cpu_has_bf16_dot() { return isa::has_avx512bf16(); }  // isa.h: CPU, build and level

// Rows of x kept hot while every panel of a work item runs over them: as many as fit in
// kRowBlockBytes (within L2 next to the panels), since every block re-reads all the weights
// (64-row blocks re-read them 8x for a 512-token chunk: 2.2x slower in a contended engine).
constexpr int64_t kRowBlockBytes = 512 * 1024;
// From this many rows in a block the widened-tile path runs (below: widening in registers);
// both sum alike, so the choice never changes a bit.
constexpr int64_t kTileMinRows = 8;

#ifdef TS_AVX2
// Each output is (bias + the sum over the first half of k) + (the sum over the second half),
// each half in k order (halves split at a pair of k for bfloat16), whatever M is, as in
// panel_linear: one row reads the halves as two interleaved streams (four FMA chains instead
// of two: 1.7x at one row in cache), more rows one half after the other.

// ------------------------------------------------------------------ bfloat16, widened
// w[k] and w[k + 1] of 16 columns from one pair-interleaved row of a panel.
struct Bf16Pair {
  __m256 lo0, lo1, hi0, hi1;
  explicit Bf16Pair(const uint16_t* w) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
    const __m256i mask = _mm256_set1_epi32(int(0xffff0000u));
    lo0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    lo1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    hi0 = _mm256_castsi256_ps(_mm256_and_si256(v0, mask));
    hi1 = _mm256_castsi256_ps(_mm256_and_si256(v1, mask));
  }
};

// Rows [0, MR) of x against pairs [q0, q1) of one bf16 panel (K real k; a last pair past K
// holds k = K - 1 and a zero pad). Accumulators start at the bias (or zero); with Accumulate
// they are added to y, else stored.
template <int MR, bool Accumulate>
inline void bf16_rows_widen(const float* x, int64_t ldx, int64_t K, const uint16_t* w,
                            int64_t q0, int64_t q1, float* y, int64_t N, const float* bias) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31;
  c00 = c10 = c20 = c30 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  c01 = c11 = c21 = c31 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    const Bf16Pair p(w + q * 32);
    const float* xk = x + 2 * q;
    const bool second = 2 * q + 1 < K;  // false only for the padded last pair
#define TS_BF16_ROW(r)                                              \
  if constexpr (MR > r) {                                           \
    const __m256 a = _mm256_broadcast_ss(xk + r * ldx);             \
    c##r##0 = _mm256_fmadd_ps(a, p.lo0, c##r##0);                   \
    c##r##1 = _mm256_fmadd_ps(a, p.lo1, c##r##1);                   \
    if (second) {                                                   \
      const __m256 b = _mm256_broadcast_ss(xk + r * ldx + 1);       \
      c##r##0 = _mm256_fmadd_ps(b, p.hi0, c##r##0);                 \
      c##r##1 = _mm256_fmadd_ps(b, p.hi1, c##r##1);                 \
    }                                                               \
  }
    TS_BF16_ROW(0)
    TS_BF16_ROW(1)
    TS_BF16_ROW(2)
    TS_BF16_ROW(3)
#undef TS_BF16_ROW
  }
#define TS_STORE(r)                                                               \
  if constexpr (MR > r) {                                                         \
    if constexpr (Accumulate) {                                                   \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(y + r * N), c##r##0);               \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(y + r * N + 8), c##r##1);           \
    }                                                                             \
    _mm256_storeu_ps(y + r * N, c##r##0);                                         \
    _mm256_storeu_ps(y + r * N + 8, c##r##1);                                     \
  }
  TS_STORE(0)
  TS_STORE(1)
  TS_STORE(2)
  TS_STORE(3)
#undef TS_STORE
}

// One row, both halves at once.
inline void bf16_row_two_streams(const float* x, int64_t K, const uint16_t* w, float* y,
                                 const float* bias) {
  const int64_t P = (K + 1) / 2, h = P / 2;
  __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 a1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  auto step = [&](int64_t q, __m256& c0, __m256& c1) {
    const Bf16Pair p(w + q * 32);
    const __m256 xa = _mm256_broadcast_ss(x + 2 * q);
    c0 = _mm256_fmadd_ps(xa, p.lo0, c0);
    c1 = _mm256_fmadd_ps(xa, p.lo1, c1);
    if (2 * q + 1 < K) {
      const __m256 xb = _mm256_broadcast_ss(x + 2 * q + 1);
      c0 = _mm256_fmadd_ps(xb, p.hi0, c0);
      c1 = _mm256_fmadd_ps(xb, p.hi1, c1);
    }
  };
  for (int64_t q = 0; q < h; ++q) {
    step(q, a0, a1);
    step(h + q, b0, b1);
  }
  for (int64_t q = 2 * h; q < P; ++q) step(q, b0, b1);  // the second half's extra pair
  _mm256_storeu_ps(y, _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, b1));
}

// ------------------------------------------------------------------ float16, widened
template <int MR, bool Accumulate>
inline void f16_rows_widen(const float* x, int64_t ldx, const uint16_t* w, int64_t k0,
                           int64_t k1, float* y, int64_t N, const float* bias) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  c00 = c10 = c20 = c30 = c40 = c50 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  c01 = c11 = c21 = c31 = c41 = c51 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16));
    const __m256 w1 = load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16 + 8));
    const float* xk = x + k;
#define TS_F16_ROW(r)                                               \
  if constexpr (MR > r) {                                           \
    const __m256 a = _mm256_broadcast_ss(xk + r * ldx);             \
    c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                      \
    c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                      \
  }
    TS_F16_ROW(0)
    TS_F16_ROW(1)
    TS_F16_ROW(2)
    TS_F16_ROW(3)
    TS_F16_ROW(4)
    TS_F16_ROW(5)
  }
  // TS_F16_ROW and TS_STORE stay defined: tile_rows below uses them too.
#define TS_STORE(r)                                                               \
  if constexpr (MR > r) {                                                         \
    if constexpr (Accumulate) {                                                   \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(y + r * N), c##r##0);               \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(y + r * N + 8), c##r##1);           \
    }                                                                             \
    _mm256_storeu_ps(y + r * N, c##r##0);                                         \
    _mm256_storeu_ps(y + r * N + 8, c##r##1);                                     \
  }
  TS_STORE(0)
  TS_STORE(1)
  TS_STORE(2)
  TS_STORE(3)
  TS_STORE(4)
  TS_STORE(5)
}

inline void f16_row_two_streams(const float* x, int64_t K, const uint16_t* w, float* y,
                                const float* bias) {
  const int64_t h = K / 2;
  __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 a1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  auto step = [&](int64_t k, __m256& c0, __m256& c1) {
    const __m256 xk = _mm256_broadcast_ss(x + k);
    c0 = _mm256_fmadd_ps(xk, load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16)), c0);
    c1 = _mm256_fmadd_ps(xk, load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16 + 8)), c1);
  };
  for (int64_t k = 0; k < h; ++k) {
    step(k, a0, a1);
    step(h + k, b0, b1);
  }
  if (K - h > h) step(K - 1, b0, b1);
  _mm256_storeu_ps(y, _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, b1));
}

// ------------------------------------------------------------------ widened tile, many rows
// For a block of many rows the widening is paid once per panel instead of once per four
// rows: the panel is widened into a float32 tile [K, 16] (L1/L2-resident) and a float32
// microkernel of six rows (12 accumulators, as panel_linear's) runs over it. Same sums in the
// same order as the widening kernels above, so the bits do not depend on which path ran.
inline void widen_tile(bool bf16, const uint16_t* w, int64_t K, float* tile) {
  if (bf16) {
    const int64_t P = (K + 1) / 2;
    for (int64_t q = 0; q < P; ++q) {
      const Bf16Pair p(w + q * 32);
      _mm256_storeu_ps(tile + 2 * q * 16, p.lo0);
      _mm256_storeu_ps(tile + 2 * q * 16 + 8, p.lo1);
      if (2 * q + 1 < K) {
        _mm256_storeu_ps(tile + (2 * q + 1) * 16, p.hi0);
        _mm256_storeu_ps(tile + (2 * q + 1) * 16 + 8, p.hi1);
      }
    }
    return;
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm256_storeu_ps(tile + k * 16, load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16)));
    _mm256_storeu_ps(tile + k * 16 + 8,
                    load8_f32(reinterpret_cast<const c10::Half*>(w + k * 16 + 8)));
  }
}

template <int MR, bool Accumulate>
inline void tile_rows(const float* x, int64_t ldx, const float* t, int64_t k0, int64_t k1,
                      float* y, int64_t N, const float* bias) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  c00 = c10 = c20 = c30 = c40 = c50 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  c01 = c11 = c21 = c31 = c41 = c51 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_loadu_ps(t + k * 16), w1 = _mm256_loadu_ps(t + k * 16 + 8);
    const float* xk = x + k;
    TS_F16_ROW(0)
    TS_F16_ROW(1)
    TS_F16_ROW(2)
    TS_F16_ROW(3)
    TS_F16_ROW(4)
    TS_F16_ROW(5)
  }
  TS_STORE(0)
  TS_STORE(1)
  TS_STORE(2)
  TS_STORE(3)
  TS_STORE(4)
  TS_STORE(5)
}

template <int MR>
inline void tile_halves(const float* x, int64_t K, int64_t h, const float* t, float* y,
                        int64_t N, const float* bias) {
  tile_rows<MR, false>(x, K, t, 0, h, y, N, bias);
  tile_rows<MR, true>(x, K, t, h, K, y, N, nullptr);
}

// Rows [0, rows) (any number) of x against one panel through a widened tile.
inline void rows_through_tile(bool bf16, int64_t rows, const float* x, int64_t K,
                              const uint16_t* w, float* y, int64_t N, const float* bias,
                              float* tile) {
  widen_tile(bf16, w, K, tile);
  const int64_t h = bf16 ? 2 * (((K + 1) / 2) / 2) : K / 2;
  int64_t m = 0;
  for (; m + 6 <= rows; m += 6) tile_halves<6>(x + m * K, K, h, tile, y + m * N, N, bias);
  switch (rows - m) {
    case 5: return tile_halves<5>(x + m * K, K, h, tile, y + m * N, N, bias);
    case 4: return tile_halves<4>(x + m * K, K, h, tile, y + m * N, N, bias);
    case 3: return tile_halves<3>(x + m * K, K, h, tile, y + m * N, N, bias);
    case 2: return tile_halves<2>(x + m * K, K, h, tile, y + m * N, N, bias);
    case 1: return tile_halves<1>(x + m * K, K, h, tile, y + m * N, N, bias);
    default: return;
  }
}
#endif

// Scalar fallback for either layout, with the same halves as the SIMD paths.
inline float weight_at(bool bf16, const uint16_t* panel, int64_t k, int64_t c) {
  if (bf16) {
    return static_cast<float>(
        c10::BFloat16(panel[(k / 2) * 32 + c * 2 + (k & 1)], c10::BFloat16::from_bits()));
  }
  return static_cast<float>(c10::Half(panel[k * 16 + c], c10::Half::from_bits()));
}

// Where the second half of k starts: at a pair boundary for bfloat16.
inline int64_t half_k(bool bf16, int64_t K) { return bf16 ? 2 * (((K + 1) / 2) / 2) : K / 2; }

void rows_scalar(bool bf16, int64_t rows, const float* x, int64_t ldx, int64_t K,
                 const uint16_t* w, float* y, int64_t N, const float* bias) {
  const int64_t h = half_k(bf16, K);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 16; ++c) {
      float lo = bias ? bias[c] : 0.f, hi = 0.f;
      for (int64_t k = 0; k < h; ++k) lo += x[r * ldx + k] * weight_at(bf16, w, k, c);
      for (int64_t k = h; k < K; ++k) hi += x[r * ldx + k] * weight_at(bf16, w, k, c);
      y[r * N + c] = lo + hi;
    }
  }
}

#ifdef TS_AVX2
template <int MR>
inline void bf16_halves(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N,
                        const float* bias) {
  const int64_t P = (K + 1) / 2, h = P / 2;
  bf16_rows_widen<MR, false>(x, K, K, w, 0, h, y, N, bias);
  bf16_rows_widen<MR, true>(x, K, K, w, h, P, y, N, nullptr);
}
template <int MR>
inline void f16_halves(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N,
                       const float* bias) {
  f16_rows_widen<MR, false>(x, K, w, 0, K / 2, y, N, bias);
  f16_rows_widen<MR, true>(x, K, w, K / 2, K, y, N, nullptr);
}
#endif

// Rows [0, rows) of x against one panel, widened in registers.
inline void chunk_widen(bool bf16, int64_t rows, const float* x, int64_t K, const uint16_t* w,
                        float* y, int64_t N, const float* bias) {
#ifdef TS_AVX2
  if (bf16) {
    switch (rows) {
      case 4: return bf16_halves<4>(x, K, w, y, N, bias);
      case 3: return bf16_halves<3>(x, K, w, y, N, bias);
      case 2: return bf16_halves<2>(x, K, w, y, N, bias);
      default: return bf16_row_two_streams(x, K, w, y, bias);
    }
  }
  if constexpr (has_load8<c10::Half>()) {
    switch (rows) {
      case 6: return f16_halves<6>(x, K, w, y, N, bias);
      case 5: return f16_halves<5>(x, K, w, y, N, bias);
      case 4: return f16_halves<4>(x, K, w, y, N, bias);
      case 3: return f16_halves<3>(x, K, w, y, N, bias);
      case 2: return f16_halves<2>(x, K, w, y, N, bias);
      default: return f16_row_two_streams(x, K, w, y, bias);
    }
  }
#endif
  rows_scalar(bf16, rows, x, K, K, w, y, N, bias);
}

inline int64_t widen_rows(bool bf16) {
#ifdef TS_AVX2
  // bf16: 8 accumulators + 4 widened vectors + mask + broadcast fit the 16 registers; f16
  // keeps panel_linear's six rows.
  return bf16 ? 4 : 6;
#else
  (void)bf16;
  return 4;
#endif
}

// ------------------------------------------------------------------ bfloat16, native
// x rounded to bfloat16 pairs: xb [M, Kp/2] uint32 (low half k, high half k + 1), zero pad.
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))
void pack_x_bf16(const float* x, int64_t M, int64_t K, uint32_t* xb, int64_t P) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    uint16_t* out = reinterpret_cast<uint16_t*>(xb + m * P);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)b);
    }
    for (; k < K; ++k) out[k] = c10::BFloat16(xr[k]).x;  // round to nearest even, as above
    if (K & 1) out[K] = 0;
  }
}

// Rows [0, MR) of packed x against pairs [q0, q1) of one bf16 panel: 16 columns in one
// register per row; added to y with Accumulate, else stored.
template <int MR, bool Accumulate>
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))
void bf16_rows_dot(const uint32_t* xb, int64_t P, const uint16_t* w, int64_t q0, int64_t q1,
                   float* y, int64_t N, const float* bias) {
  __m512 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + q * 32);
    for (int r = 0; r < MR; ++r) {
      c[r] = _mm512_dpbf16_ps(c[r], wv, (__m512bh)_mm512_set1_epi32(int(xb[r * P + q])));
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (Accumulate) c[r] = _mm512_add_ps(_mm512_loadu_ps(y + r * N), c[r]);
    _mm512_storeu_ps(y + r * N, c[r]);
  }
}

__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))
void bf16_row_dot_two_streams(const uint32_t* xb, int64_t P, const uint16_t* w, float* y,
                              const float* bias) {
  const int64_t h = P / 2;
  __m512 a = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  __m512 b = _mm512_setzero_ps();
  for (int64_t q = 0; q < h; ++q) {
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + q * 32),
                         (__m512bh)_mm512_set1_epi32(int(xb[q])));
    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + (h + q) * 32),
                         (__m512bh)_mm512_set1_epi32(int(xb[h + q])));
  }
  for (int64_t q = 2 * h; q < P; ++q) {
    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + q * 32),
                         (__m512bh)_mm512_set1_epi32(int(xb[q])));
  }
  _mm512_storeu_ps(y, _mm512_add_ps(a, b));
}

template <int MR>
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))
void bf16_dot_halves(const uint32_t* xb, int64_t P, const uint16_t* w, float* y, int64_t N,
                     const float* bias) {
  bf16_rows_dot<MR, false>(xb, P, w, 0, P / 2, y, N, bias);
  bf16_rows_dot<MR, true>(xb, P, w, P / 2, P, y, N, nullptr);
}

__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))
void chunk_dot(int64_t rows, const uint32_t* xb, int64_t P, const uint16_t* w, float* y,
               int64_t N, const float* bias) {
  switch (rows) {
    case 8: return bf16_dot_halves<8>(xb, P, w, y, N, bias);
    case 7: return bf16_dot_halves<7>(xb, P, w, y, N, bias);
    case 6: return bf16_dot_halves<6>(xb, P, w, y, N, bias);
    case 5: return bf16_dot_halves<5>(xb, P, w, y, N, bias);
    case 4: return bf16_dot_halves<4>(xb, P, w, y, N, bias);
    case 3: return bf16_dot_halves<3>(xb, P, w, y, N, bias);
    case 2: return bf16_dot_halves<2>(xb, P, w, y, N, bias);
    default: return bf16_row_dot_two_streams(xb, P, w, y, bias);
  }
}
constexpr int64_t kDotRows = 8;  // 8 accumulators + weights + broadcast of 32 zmm registers

}  // namespace

bool set_bf16_dot(bool enabled) {
  g_bf16_dot.store(enabled);
  return enabled && cpu_has_bf16_dot();
}

at::Tensor panel16_linear(const at::Tensor& x, const at::Tensor& wp,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "panel16_linear: x must be float32 on CPU, got ", x.scalar_type());
  const bool bf16 = wp.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || wp.scalar_type() == at::kHalf,
              "panel16_linear: weight panels must be bfloat16 or float16, got ", wp.scalar_type());
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.size(2) == (bf16 ? 32 : 16),
              "panel16_linear: weight must be contiguous panels ",
              bf16 ? "[N/16, Kp/2, 32] (bfloat16)" : "[N/16, K, 16] (float16)", ", got ",
              wp.sizes());
  TORCH_CHECK(x.dim() == 2, "panel16_linear: x must be [M, K]");
  const int64_t K = x.size(1), P = wp.size(1), np = wp.size(0), N = np * 16;
  TORCH_CHECK(bf16 ? (P == (K + 1) / 2) : (P == K), "panel16_linear: x is ", x.sizes(),
              " for panels of ", bf16 ? "K pairs = " : "K = ", P);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "panel16_linear: bad bias (want float32 [", N, "])");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t panel_elems = P * (bf16 ? 32 : 16);
  const bool dot = bf16 && g_bf16_dot.load() && cpu_has_bf16_dot();
  at::Tensor packed;
  const uint32_t* xb = nullptr;
  if (dot) {
    packed = at::empty({M, P}, x.options().dtype(at::kInt));
    pack_x_bf16(xp, M, K, reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()), P);
    xb = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  }
  // Work items: (block of rows, run of consecutive panels); the rows of a block are reused
  // from cache by every panel of the run, each panel's weights by every row of the block.
  const int64_t x_bytes = dot ? 2 : 4;  // the native path reads x rounded to bf16
  const int64_t row_block =
      std::max<int64_t>(8, std::min<int64_t>(M, kRowBlockBytes / (K * x_bytes)) / 8 * 8);
  const int64_t row_blocks = (M + row_block - 1) / row_block;
  const int64_t per_item = std::max<int64_t>(1, np * row_blocks / (8 * at::get_num_threads()));
  const int64_t runs = (np + per_item - 1) / per_item;
  const int64_t mr = dot ? kDotRows : widen_rows(bf16);
  parallel_dynamic(row_blocks * runs, [&](int64_t item) {
    const int64_t rb = item / runs, run = item % runs;
    const int64_t m0 = rb * row_block, m1 = std::min(M, m0 + row_block);
    const int64_t p1 = std::min(np, (run + 1) * per_item);
#ifdef TS_AVX2
    const bool tiled = !dot && m1 - m0 >= kTileMinRows && (bf16 || has_load8<c10::Half>());
    thread_local std::vector<float> tile;
    if (tiled && static_cast<int64_t>(tile.size()) < K * 16) tile.resize(K * 16);
#endif
    for (int64_t p = run * per_item; p < p1; ++p) {
      const uint16_t* panel = w + p * panel_elems;
      const float* b = bp ? bp + p * 16 : nullptr;
#ifdef TS_AVX2
      if (tiled) {
        rows_through_tile(bf16, m1 - m0, xp + m0 * K, K, panel, yp + m0 * N + p * 16, N, b,
                          tile.data());
        continue;
      }
#endif
      for (int64_t m = m0; m < m1; m += mr) {
        const int64_t rows = std::min(mr, m1 - m);
        float* yo = yp + m * N + p * 16;
        if (dot) {
          chunk_dot(rows, xb + m * P, P, panel, yo, N, b);
        } else {
          chunk_widen(bf16, rows, xp + m * K, K, panel, yo, N, b);
        }
      }
    }
  });
  return y;
}

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& wp,
                         const c10::optional<at::Tensor>& bias) {
  if (wp.scalar_type() == at::kFloat) return panel_linear(x, wp, bias);
  return panel16_linear(x, wp, bias);
}

}  // namespace tailserve_cpu
