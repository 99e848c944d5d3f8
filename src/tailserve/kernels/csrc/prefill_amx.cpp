// paged_prefill_attention on AMX bf16 tiles: the opt-in amx-bf16 level (isa.h).
//
// Two phases per call. Staging: each (sequence, KV head)'s context is read once from the paged
// pool and written in AMX's B order as bf16 — K as [16 keys][D / 32][16 dim pairs x 16 keys]
// (a transpose), V as [32 keys][D / 16][16 key pairs x 16 dims] — shared by every query head of
// the GQA group and every query block. Compute: an item is 16 query tokens of one head. Per 32
// keys, QK^T is D / 16 TDPBF16PS into two 16 x 16 score tiles; the online softmax (max, exp,
// sums, the rescale of the output) runs in float32 on AVX512 as in the float32 path; the
// probabilities, rounded to bf16, are one A tile, and PV is D / 16 TDPBF16PS accumulated onto
// the output rows loaded from memory. Rounding q (scaled), K, p and V to bf16 is the only
// difference from the float32 path (tests/test_prefill_attention.py states the tolerance),
// which is why the level is opt-in.
//
// Why not the float32 kernel's vdpbf16ps route on this level: on the Intel core measured here
// vdpbf16ps issues at half the rate of the FMAs it replaces, and the avx512bf16 level's
// attention ran at 0.65x the float32 one (benchmarks/notes/cpu_kernels.md).

#include "prefill_amx.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "isa.h"
#include "prefill_vec.h"
#include "work_pool.h"

namespace tailserve_cpu {

#ifdef TS_AMX
namespace {

using prefill_vec::exp_neg512;
using prefill_vec::load16_f32;
using prefill_vec::transpose16_store;

constexpr int64_t kStageKeys = 256;  // keys per staging item

struct Staged {
  const uint32_t* kt;  // [ceil(ctx / 16)][D / 32][16][16]
  const uint32_t* v;   // [ceil(ctx / 32)][D / 16][16][16]
};

// Keys [k0, k1) of one (sequence, KV head) into the staged layouts (k1 - k0 a multiple of 32
// except at the end of the context; keys past ctx are written as zeros up to the next 32).
template <typename T>
void stage(const T* kp, const T* vp, const int64_t* table, int64_t block_size, int64_t tok_stride,
           int64_t blk_stride, int64_t head_off, int64_t ctx, int64_t D, int64_t k0, int64_t k1,
           uint32_t* kt, uint32_t* v) {
  alignas(64) uint32_t pairs[16][16];
  const float* rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const float*>(pairs[i]);
  auto key_row = [&](const T* base, int64_t t) -> const T* {
    return base + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
  };
  const int64_t halves = D / 32, slices = D / 16;
  for (int64_t b = k0; b < k1; b += 16) {  // K: 16 keys, transposed per half of 32 dims
    for (int64_t h = 0; h < halves; ++h) {
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t t = b + c;
        __m512i d = _mm512_setzero_si512();
        if (t < ctx) {
          const T* kr = key_row(kp, t) + 32 * h;
          d = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(load16_f32(kr + 16), load16_f32(kr)));
        }
        _mm512_store_si512(pairs[c], d);
      }
      transpose16_store(rows, reinterpret_cast<float*>(kt + ((b / 16) * halves + h) * 256), 16);
    }
  }
  for (int64_t b = k0; b < k1; b += 32) {  // V: 32 keys, two per 32-bit lane
    for (int64_t j = 0; j < slices; ++j) {
      uint32_t* out = v + ((b / 32) * slices + j) * 256;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t t = b + 2 * r;
        const __m512 lo = t < ctx ? load16_f32(key_row(vp, t) + 16 * j) : _mm512_setzero_ps();
        const __m512 hi = t + 1 < ctx ? load16_f32(key_row(vp, t + 1) + 16 * j)
                                      : _mm512_setzero_ps();
        _mm512_store_si512(out + 16 * r, prefill_vec::pair_bf16(lo, hi));
      }
    }
  }
}

// 16 query tokens [i0, i1) of the chunk (positions p0 + i), one head: out rows.
void compute(const float* q, int64_t q_s0, float* out, int64_t o_s0, const Staged& st, int64_t D,
             int64_t ctx, int64_t p0, int64_t i0, int64_t i1, float scale) {
  const int64_t rows = i1 - i0, halves = D / 32, slices = D / 16;
  alignas(64) uint16_t qb[16 * 256];  // [16][D] bf16, D <= 256
  alignas(64) float s[16][64];
  alignas(64) uint16_t p[16][64];
  alignas(64) float o[16 * 256];
  float m[16], l[16];
  for (int64_t r = 0; r < 16; ++r) {
    const float* qr = q + (i0 + std::min(r, rows - 1)) * q_s0;  // padding rows repeat the last
    for (int64_t k = 0; k < D; k += 32) {
      const __m512 sc = _mm512_set1_ps(scale);
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + k + 16), sc),
                                             _mm512_mul_ps(_mm512_loadu_ps(qr + k), sc));
      _mm512_store_si512(qb + r * D + k, reinterpret_cast<__m512i>(v));
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(o, 0, sizeof(float) * 16 * D);
  const int64_t last = p0 + i1 - 1;  // the last row's position: keys [0, last] are read
  const int64_t kend = std::min(ctx, last + 1);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // 64 keys per softmax step (two staged blocks of 32): half the per-row reductions and
  // output rescales of 32-key steps (a 512-token prompt: 314 -> 356 GFLOPS, 1,000: 377 -> 435).
  for (int64_t kb = 0; kb < kend; kb += 64) {
    const bool second = kb + 32 < kend;
    for (int64_t hh = 0; hh < (second ? 2 : 1); ++hh) {
      const int64_t k32 = kb + 32 * hh;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t h = 0; h < halves; ++h) {
        _tile_loadd(2, qb + 32 * h, D * 2);
        _tile_loadd(4, st.kt + ((k32 / 16) * halves + h) * 256, 64);
        _tile_dpbf16ps(0, 2, 4);
        if (k32 + 16 < kend) {
          _tile_loadd(5, st.kt + ((k32 / 16 + 1) * halves + h) * 256, 64);
          _tile_dpbf16ps(1, 2, 5);
        }
      }
      _tile_stored(0, s[0] + 32 * hh, 256);
      _tile_stored(1, s[0] + 32 * hh + 16, 256);
    }
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t pos = p0 + i0 + std::min(r, rows - 1);
      const int64_t valid = std::min(pos + 1, ctx) - kb;  // keys of this step the row reads
      __mmask16 keep[4];
      __m512 v[4];
      __m512 mx = ninf;
      for (int c = 0; c < 4; ++c) {
        const int64_t n = valid - 16 * c;
        keep[c] = n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
        v[c] = _mm512_mask_mov_ps(ninf, keep[c], _mm512_load_ps(s[r] + 16 * c));
        mx = _mm512_max_ps(mx, v[c]);
      }
      const float mnew = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(mnew);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = _mm512_maskz_mov_ps(keep[c], exp_neg512(_mm512_sub_ps(v[c], mv)));
        sum = _mm512_add_ps(sum, v[c]);
      }
      const float alpha = m[r] == -std::numeric_limits<float>::infinity()
                              ? 0.f : std::exp(m[r] - mnew);
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = mnew;
      _mm512_store_si512(p[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[1], v[0])));
      _mm512_store_si512(p[r] + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[3], v[2])));
      if (alpha != 1.f) {
        const __m512 al = _mm512_set1_ps(alpha);
        for (int64_t k = 0; k < D; k += 16) {
          _mm512_store_ps(o + r * D + k, _mm512_mul_ps(al, _mm512_load_ps(o + r * D + k)));
        }
      }
    }
    _tile_loadd(3, p[0], 128);
    if (second) _tile_loadd(2, p[0] + 32, 128);
    for (int64_t j = 0; j < slices; ++j) {
      _tile_loadd(7, o + 16 * j, D * 4);
      _tile_loadd(6, st.v + ((kb / 32) * slices + j) * 256, 64);
      _tile_dpbf16ps(7, 3, 6);
      if (second) {
        _tile_loadd(4, st.v + ((kb / 32 + 1) * slices + j) * 256, 64);
        _tile_dpbf16ps(7, 2, 4);
      }
      _tile_stored(7, o + 16 * j, D * 4);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t k = 0; k < D; k += 16) {
      _mm512_storeu_ps(out + (i0 + r) * o_s0 + k, _mm512_mul_ps(inv, _mm512_load_ps(o + r * D + k)));
    }
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
         const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
         int64_t first_seq, int64_t num_seqs, float scale) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  const int64_t block_size = kv_cache.size(2), group = H / Hkv;
  const int64_t tok_stride = Hkv * D, blk_stride = block_size * tok_stride;
  const T* kp = kv_cache.data_ptr<T>();
  const T* vp = kp + kv_cache.size(1) * blk_stride;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t tstride = block_tables.stride(0);
  // Staging buffers: one region per (sequence, KV head), staged in runs of kStageKeys keys.
  struct StageItem { int64_t s, g, k0, k1, kt_off, v_off; };
  std::vector<StageItem> stages;
  std::vector<int64_t> kt_off, v_off;  // per (sequence, KV head) unit
  int64_t kt_total = 0, v_total = 0;
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t padded = (lens[s] + 31) / 32 * 32;
    for (int64_t g = 0; g < Hkv; ++g) {
      kt_off.push_back(kt_total);
      v_off.push_back(v_total);
      for (int64_t k0 = 0; k0 < padded; k0 += kStageKeys) {
        stages.push_back({s, g, k0, std::min(padded, k0 + kStageKeys), kt_total, v_total});
      }
      kt_total += padded / 16 * (D / 32) * 256;
      v_total += padded / 32 * (D / 16) * 256;
    }
  }
  std::vector<uint32_t> kt(kt_total + 16), v(v_total + 16);
  uint32_t* ktp = amx::align64(kt.data());
  uint32_t* vpp = amx::align64(v.data());
  parallel_dynamic(static_cast<int64_t>(stages.size()), [&](int64_t i) {
    const StageItem& it = stages[i];
    stage<T>(kp, vp, tables + it.s * tstride, block_size, tok_stride, blk_stride, it.g * D,
             lens[it.s], D, it.k0, it.k1, ktp + it.kt_off, vpp + it.v_off);
  });
  struct Item { int64_t s, h, unit, i0, i1, cost; };
  std::vector<Item> items;
  for (int64_t s = first_seq, unit = 0; s < num_seqs; ++s, unit += Hkv) {
    const int64_t n = qsl[s + 1] - qsl[s], p0 = lens[s] - n;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        items.push_back({s, h, unit + h / group, i0, std::min(n, i0 + 16), p0 + i0 + 16});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), o_s0 = out.stride(0);
  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
    amx::load_full_config();
    const Item& it = items[i];
    const int64_t n = qsl[it.s + 1] - qsl[it.s];
    const Staged st{ktp + kt_off[it.unit], vpp + v_off[it.unit]};
    compute(qp + qsl[it.s] * q_s0 + it.h * q.stride(1), q_s0,
            op + qsl[it.s] * o_s0 + it.h * out.stride(1), o_s0, st, D, lens[it.s],
            lens[it.s] - n, it.i0, it.i1, scale);
    _tile_release();
  });
}

}  // namespace
#endif

template <typename T>
bool prefill_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                 int64_t first_seq, int64_t num_seqs, float scale) {
#ifdef TS_AMX
  const int64_t D = q.size(2);
  if (D % 32 != 0 || D > 256 || !isa::amx_status().permitted || !isa::amx_status().bf16) {
    return false;
  }
  run<T>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs, scale);
  return true;
#else
  (void)out, (void)q, (void)kv_cache, (void)block_tables, (void)lens, (void)qsl, (void)first_seq,
      (void)num_seqs, (void)scale;
  return false;
#endif
}

template bool prefill_amx<float>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const int64_t*, const int64_t*, int64_t,
                                 int64_t, float);
template bool prefill_amx<c10::BFloat16>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const int64_t*, const int64_t*,
                                         int64_t, int64_t, float);
template bool prefill_amx<c10::Half>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const int64_t*, const int64_t*, int64_t,
                                     int64_t, float);

}  // namespace tailserve_cpu
