// torch.ops.tailserve.rms_norm, fused_add_rms_norm, silu_and_mul and rope_: one pass each
// instead of several torch ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_ops.h"
#include "prefill_vec.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {

// ------------------------------------------------------------------ fused elementwise ops
//
// A decode step of one sequence runs ~300 small elementwise ops; in torch each costs a
// dispatch plus, for some, a wake-up of the thread pool. These do the whole thing in one pass,
// serially for few rows (no fork/join) and over rows in parallel for many, on the kernels'
// work pool like the products around them: on OpenMP's threads a prefill step had two pools
// spinning for two cores (benchmarks/notes/, "Prefill on one pool").

template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& fn) {
  if (rows * row_elems < (1 << 16)) {
    for (int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    const int64_t per_item = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, row_elems));
    parallel_dynamic((rows + per_item - 1) / per_item, [&](int64_t item) {
      const int64_t e = std::min(rows, (item + 1) * per_item);
      for (int64_t r = item * per_item; r < e; ++r) fn(r);
    });
  }
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": float32 CPU only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, n] with contiguous rows");
}

inline void rms_apply(float* out, const float* in, const float* w, int64_t n, float eps, float ss) {
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * inv * w[i];
}

inline void rms_row(float* out, const float* in, const float* w, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  rms_apply(out, in, w, n, eps, ss);
}

#if defined(__AVX512F__)
// The sums of squares of rows in[0 .. rows) (rows <= 16, n a multiple of 16), one row per lane
// of ss16. A row's sum is a serial chain of n float adds (the loop above adds each rounded
// square in index order, and so must this, or the bits change): on one row that chain is n x
// the add latency, ~2,300 cycles at n = 576, a norm of a 512-token chunk ~1 ms per layer. Here
// 16 rows' chains advance side by side: each 16 x 16 block of squares is transposed (column i
// of 16 rows in one register) and added in index order, the same adds per row.
inline void sum_squares16(const float* const* in, int64_t rows, int64_t n, float* ss16) {
  alignas(64) float sq[16][16];
  alignas(64) float col[16][16];
  const float* sq_rows[16];
  for (int r = 0; r < 16; ++r) sq_rows[r] = r < rows ? sq[r] : nullptr;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_loadu_ps(in[r] + i);
      _mm512_store_ps(sq[r], _mm512_mul_ps(v, v));
    }
    prefill_vec::transpose16_store(sq_rows, col[0], 16);
    for (int c = 0; c < 16; ++c) ss = _mm512_add_ps(ss, _mm512_load_ps(col[c]));
  }
  _mm512_storeu_ps(ss16, ss);
}
#endif

// Rows [r0, r1) of a norm: out(r) = rms_norm(in(r)) * w, the bits of rms_row on every row.
template <typename In, typename Out>
inline void rms_rows(int64_t r0, int64_t r1, int64_t n, const float* w, float eps, const In& in,
                     const Out& out) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    for (int64_t b = r0; b < r1; b += 16) {
      const int64_t rows = std::min<int64_t>(16, r1 - b);
      const float* rp[16];
      alignas(64) float ss[16];
      for (int64_t r = 0; r < rows; ++r) rp[r] = in(b + r);
      sum_squares16(rp, rows, n, ss);
      for (int64_t r = 0; r < rows; ++r) rms_apply(out(b + r), rp[r], w, n, eps, ss[r]);
    }
    return;
  }
#endif
  for (int64_t r = r0; r < r1; ++r) rms_row(out(r), in(r), w, n, eps);
}

// fn(r0, r1) over row blocks: serially for few elements, else on the work pool, blocks of
// whole multiples of 16 rows (rms_rows' blocks).
template <typename F>
void for_row_blocks(int64_t rows, int64_t row_elems, const F& fn) {
  if (rows * row_elems < (1 << 16)) {
    fn(0, rows);
    return;
  }
  const int64_t per_item = std::max<int64_t>(16, (1 << 14) / std::max<int64_t>(1, row_elems) / 16 * 16);
  parallel_dynamic((rows + per_item - 1) / per_item, [&](int64_t item) {
    fn(item * per_item, std::min(rows, (item + 1) * per_item));
  });
}

// out = rms_norm(x) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight size");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for_row_blocks(rows, n, [&](int64_t r0, int64_t r1) {
    rms_rows(r0, r1, n, wp, float(eps), [&](int64_t r) { return xp + r * xs; },
             [&](int64_t r) { return op + r * n; });
  });
  return out;
}

// residual += x, then x = rms_norm(residual) * weight; both in place (vLLM's fused form).
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "fused_add_rms_norm: shapes");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "fused_add_rms_norm: weight size");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  for_row_blocks(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = xp + r * xs;
      const float* xc = xr;
      float* rr = rp + r * rs;
      for (int64_t i = 0; i < n; ++i) rr[i] += xc[i];
    }
    rms_rows(r0, r1, n, wp, float(eps), [&](int64_t r) -> const float* { return rp + r * rs; },
             [&](int64_t r) { return xp + r * xs; });
  });
}

// [rows, 2 * I] -> [rows, I]: silu(gate) * up, gate the first half of each row.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");  // before x.size(1) is read; silu_and_mul_out checks again
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_out(x, out);
  return out;
}

void silu_and_mul_out(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "silu_and_mul");
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == rows && out.size(1) == half,
              "silu_and_mul: out must be a contiguous float32 [", rows, ", ", half, "]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for_rows(rows, half, [&](int64_t r) {
    const float* g = xp + r * xs;
    const float* u = g + half;
    float* o = op + r * half;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    // The AVX2 loop's operations below, lane for lane (the same bits), 16 lanes at a time,
    // and one division: the numerator (g, or g * e where g < 0) is chosen before it, where the
    // AVX2 loop divides both and blends (two divisions, the costliest instruction here).
    const __m512 one16 = _mm512_set1_ps(1.f);
    for (; i + 16 <= half; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 e = prefill_vec::exp_neg512(_mm512_min_ps(gv, _mm512_sub_ps(_mm512_setzero_ps(), gv)));
      const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(gv));  // g's sign bit
      const __m512 num = _mm512_mask_mul_ps(gv, neg, gv, e);
      const __m512 silu = _mm512_div_ps(num, _mm512_add_ps(one16, e));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
    }
#endif
#ifdef TS_AVX2
    // silu(g) = g / (1 + exp(-g)); exp of -|g| keeps exp_neg in its domain:
    // for g >= 0 that is exp(-g); for g < 0, g / (1 + 1/e) = g * e / (1 + e) with e = exp(g).
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= half; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp_neg(_mm256_min_ps(gv, _mm256_sub_ps(_mm256_setzero_ps(), gv)));
      const __m256 pos = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      const __m256 neg = _mm256_div_ps(_mm256_mul_ps(gv, e), _mm256_add_ps(one, e));
      const __m256 silu = _mm256_blendv_ps(pos, neg, gv);  // sign bit of g selects
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < half; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
}

// Rotate-half rope, in place, on x [tokens, heads, head_dim] (head_dim contiguous);
// cos, sin [tokens, head_dim / 2] float32.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.stride(2) == 1, "rope_: float32 CPU [tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope_: float32 tables");
  TORCH_CHECK(cos.numel() == tokens * half && sin.numel() == tokens * half && cos.is_contiguous() &&
                  sin.is_contiguous(), "rope_: cos/sin must be [tokens, head_dim / 2]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for_rows(tokens, heads * half * 2, [&](int64_t t) {
    const float* c = cp + t * half;
    const float* sn = sp + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = xp + t * s0 + h * s1;
      float* b = a + half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * sn[i];
        b[i] = x2 * c[i] + x1 * sn[i];
      }
    }
  });
}

}  // namespace tailserve_cpu
