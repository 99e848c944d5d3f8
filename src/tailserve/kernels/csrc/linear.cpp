// torch.ops.tailserve.panel_linear and skinny_linear: y = x W^T (+ b) for decode-sized inputs.
//
//   panel_linear   decode batches (1-128 rows) on a panel copy of W; MKL and oneDNN are 1.3-3x
//                  slower at these row counts on AVX2.
//   skinny_linear  the same for a few rows on W as stored (weights whose output count is not a
//                  multiple of 16, so they have no panel copy).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {

// ------------------------------------------------------------------ skinny linear (float)

// y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]); x and w contiguous float32.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "skinny_linear: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::Tensor bc;  // keeps a contiguous copy of the bias alive while the kernel reads it
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bad bias");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  // Chunks of output rows: big enough to amortise the hand-out, small enough to balance.
  constexpr int64_t kRows = 64;
  const int64_t chunks = (N + kRows - 1) / kRows;
  parallel_dynamic(chunks, [&](int64_t c) {
    const int64_t n0 = c * kRows, n1 = std::min(N, n0 + kRows);
    int64_t n = n0;
#ifdef TS_AVX2
    // Tiles of 4 weight rows x 2 input rows: each loaded weight vector feeds two FMAs and each
    // input vector four, eight accumulators reduced together by hsum8.
    const int64_t K8 = K & ~int64_t(7);
    if (M == 1 && K8 == K) {
      // One input row: 8 weight rows per tile, one accumulator each. Measured 14 GB/s over
      // a layer's four weights vs 11 GB/s for the 4x2 tile, whose second column is wasted here.
      for (; n + 8 <= n1; n += 8) {
        const float* w0 = wp + n * K;
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xp + k);
          for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + r * K + k), xv, acc[r]);
          }
        }
        __m256 y8 = hsum8(acc);
        if (bp) y8 = _mm256_add_ps(y8, _mm256_loadu_ps(bp + n));
        _mm256_storeu_ps(yp + n, y8);
      }
    }
    for (; n + 4 <= n1; n += 4) {
      const float* w0 = wp + n * K;
      for (int64_t m = 0; m < M; m += 2) {
        const float* x0 = xp + m * K;
        const float* x1 = m + 1 < M ? x0 + K : x0;
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
          const __m256 a0 = _mm256_loadu_ps(x0 + k), a1 = _mm256_loadu_ps(x1 + k);
          for (int r = 0; r < 4; ++r) {
            const __m256 wv = _mm256_loadu_ps(w0 + r * K + k);
            acc[2 * r] = _mm256_fmadd_ps(wv, a0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(wv, a1, acc[2 * r + 1]);
          }
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, hsum8(acc));
        for (int64_t k = K8; k < K; ++k) {
          for (int r = 0; r < 4; ++r) {
            sums[2 * r] += w0[r * K + k] * x0[k];
            sums[2 * r + 1] += w0[r * K + k] * x1[k];
          }
        }
        for (int r = 0; r < 4; ++r) {
          const float b = bp ? bp[n + r] : 0.f;
          yp[m * N + n + r] = sums[2 * r] + b;
          if (m + 1 < M) yp[(m + 1) * N + n + r] = sums[2 * r + 1] + b;
        }
      }
    }
#endif
    for (; n < n1; ++n) {
      const float* wrow = wp + n * K;
      const float b = bp ? bp[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_f32(xp + m * K, wrow, K) + b;
    }
  });
  return y;
}

// y [M, N] = x [M, K] @ W^T (+ bias) with W stored in panels, wp [N/16, K, 16]: for each group
// of 16 output columns, the K rows of 16 weights are one contiguous stream. The inner step
// broadcasts one x element per row, loads 16 weights and does two FMAs per row (no
// horizontal sums); each panel is streamed from memory once and reused from L1/L2 for every
// chunk of up to six rows. One kernel for every decode batch: at M = 1 it reads the weights
// at ~15-19 GB/s, at M = 9-64 it does 1.3-1.55x the GFLOPS of oneDNN's prepacked sgemm on
// this AVX2 machine.
//
// Every output is (bias + the sum over k < K/2) + (the sum over k >= K/2), each half summed in
// k order, whatever M is: a row's result does not depend on its batch mates. At M = 1 the two
// halves are read as two interleaved streams, which the hardware prefetchers keep further
// ahead than one (+7-10% GB/s over the model's weights, benchmarks/notes/); at M > 1 the kernel is
// arithmetic-bound and sums the halves one after the other.
#ifdef TS_AVX2
// Rows [0, MR) of x (row stride ldx) against k in [0, kn) of one panel. Accumulators start
// at the bias (or zero); with Accumulate they are added to y, else stored.
template <int MR, bool Accumulate>
inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t kn, float* y,
                       int64_t N, const float* bias) {
  // Named accumulators, not arrays: GCC 12 kept __m256 arrays on the stack here and stored
  // all twelve every step, which halved the speed.
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  c00 = c10 = c20 = c30 = c40 = c50 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  c01 = c11 = c21 = c31 = c41 = c51 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  const float* x0 = x;
  for (int64_t k = 0; k < kn; ++k, ++x0, w += 16) {
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
#define TS_PANEL_ROW(r)                                          \
  if constexpr (MR > r) {                                        \
    const __m256 a = _mm256_broadcast_ss(x0 + r * ldx);          \
    c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                   \
    c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                   \
  }
    TS_PANEL_ROW(0)
    TS_PANEL_ROW(1)
    TS_PANEL_ROW(2)
    TS_PANEL_ROW(3)
    TS_PANEL_ROW(4)
    TS_PANEL_ROW(5)
#undef TS_PANEL_ROW
  }
#define TS_PANEL_STORE(r)                                                        \
  if constexpr (MR > r) {                                                        \
    if constexpr (Accumulate) {                                                  \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(y + r * N), c##r##0);              \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(y + r * N + 8), c##r##1);          \
    }                                                                            \
    _mm256_storeu_ps(y + r * N, c##r##0);                                        \
    _mm256_storeu_ps(y + r * N + 8, c##r##1);                                    \
  }
  TS_PANEL_STORE(0)
  TS_PANEL_STORE(1)
  TS_PANEL_STORE(2)
  TS_PANEL_STORE(3)
  TS_PANEL_STORE(4)
  TS_PANEL_STORE(5)
#undef TS_PANEL_STORE
}

// One row, both halves at once: k and h + k advance together, two streams through the panel.
inline void panel_row_two_streams(const float* x, int64_t K, const float* w, float* y,
                                  const float* bias) {
  const int64_t h = K / 2;
  __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 a1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  const float* wb = w + h * 16;
  for (int64_t k = 0; k < h; ++k, w += 16, wb += 16) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + h + k);
    a0 = _mm256_fmadd_ps(xa, _mm256_load_ps(w), a0);
    a1 = _mm256_fmadd_ps(xa, _mm256_load_ps(w + 8), a1);
    b0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + 8), b1);
  }
  if (K - h > h) {  // odd K: the second half has one more k
    const __m256 xb = _mm256_broadcast_ss(x + K - 1);
    b0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + 8), b1);
  }
  _mm256_storeu_ps(y, _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, b1));
}

template <int MR>
inline void panel_rows_halves(const float* x, int64_t K, const float* w, float* y, int64_t N,
                              const float* bias) {
  const int64_t h = K / 2;
  panel_rows<MR, false>(x, K, w, h, y, N, bias);
  panel_rows<MR, true>(x + h, K, w + h * 16, K - h, y, N, nullptr);
}
#endif

// Rows [0, rows) of x (rows <= 6) against one panel.
inline void panel_chunk(int64_t rows, const float* x, int64_t K, const float* w, float* y,
                        int64_t N, const float* bias) {
#ifdef TS_AVX2
  switch (rows) {
    case 6: return panel_rows_halves<6>(x, K, w, y, N, bias);
    case 5: return panel_rows_halves<5>(x, K, w, y, N, bias);
    case 4: return panel_rows_halves<4>(x, K, w, y, N, bias);
    case 3: return panel_rows_halves<3>(x, K, w, y, N, bias);
    case 2: return panel_rows_halves<2>(x, K, w, y, N, bias);
    default: return panel_row_two_streams(x, K, w, y, bias);
  }
#else
  const int64_t h = K / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 16; ++c) {
      float lo = bias ? bias[c] : 0.f, hi = 0.f;
      for (int64_t k = 0; k < h; ++k) lo += x[r * K + k] * w[k * 16 + c];
      for (int64_t k = h; k < K; ++k) hi += x[r * K + k] * w[k * 16 + c];
      y[r * N + c] = lo + hi;
    }
  }
#endif
}

// Six rows keep 12 accumulators + 2 weight vectors + 1 broadcast in the 16 AVX2 registers.
constexpr int64_t kPanelRows = 6;

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat,
              "panel_linear: float32 CPU tensors only");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.is_contiguous(),
              "panel_linear: weight must be panels [N/16, K, 16], contiguous");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == wp.size(1), "panel_linear: x is ", x.sizes(),
              " for panels of K = ", wp.size(1));
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = wp.size(0), N = P * 16;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "panel_linear: bad bias");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Consecutive panels per hand-out: a thread's reads stay one sequential stream, and there
  // are still ~8 hand-outs per thread to even out the threads' speeds.
  const int64_t per_item = std::max<int64_t>(1, P / (8 * at::get_num_threads()));
  parallel_dynamic((P + per_item - 1) / per_item, [&](int64_t item) {
    const int64_t p1 = std::min(P, (item + 1) * per_item);
    for (int64_t p = item * per_item; p < p1; ++p) {
      const float* panel = w + p * K * 16;
      const float* b = bp ? bp + p * 16 : nullptr;
      for (int64_t m = 0; m < M; m += kPanelRows) {
        panel_chunk(std::min(kPanelRows, M - m), xp + m * K, K, panel, yp + m * N + p * 16, N, b);
      }
    }
  });
  return y;
}

}  // namespace tailserve_cpu
