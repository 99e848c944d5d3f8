// paged_prefill_attention on AMX bf16 tiles: the amx level (split operands, near float32) and
// the opt-in amx-bf16 level (one bf16 rounding each) of isa.h.
//
// Two phases per call. Staging: each (sequence, KV head)'s context is read once from the paged
// pool and written as bf16 A tiles — K as [16 keys][32 dims] (the pool's order), V transposed
// as [16 dims][32 keys] — shared by every query head of the GQA group and every query block.
// Compute: an item is 16 query tokens of one head, transposed so the softmax runs down
// columns: per 64 keys, S^T = K Q^T (one key per row, the queries across the lanes), the
// online softmax in float32 on AVX512 with each query's max and sum as vertical operations,
// the probabilities of two keys interleaved into a row of P^T, and O^T += V^T P^T. Rounding q
// (scaled), K, p and V to bf16, and exp's degree-4 polynomial, are the only differences from
// the float32 path (tests/test_prefill_attention.py states the tolerance), which is why the
// level is opt-in.
//
// Split (the default amx level, kSplit): each operand x is carried as hi + lo, hi = x rounded
// to bf16 and lo = the rest rounded to bf16 (16 significant bits), and each product as
// hi*hi + hi*lo + lo*hi, three tile products summed in float32; the dropped lo*lo is under
// 2^-16 of |x*y|, and exp is a degree-6 polynomial (relative error ~1e-7). The error against
// float64: at most 7e-5 on the tests' cases (float32's kernel: 1e-5; one rounding: 4e-2); the
// tile work three times the bf16 level's, the time twice, still half float32 FMAs' at long
// chunks (notes: attention.md).
//
// Why not the float32 kernel's vdpbf16ps route on this level: on the Intel core measured here
// vdpbf16ps issues at half the rate of the FMAs it replaces, and the avx512bf16 level's
// attention ran at 0.65x the float32 one (benchmarks/notes/cpu_kernels.md).

#include "prefill_amx.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "isa.h"
#include "prefill_amx_tiles.h"
#include "prefill_vec.h"
#include "scratch.h"
#include "work_pool.h"

namespace tailserve_cpu {

#ifdef TS_AMX
namespace {

using prefill_vec::load16_f32;
using prefill_vec::transpose16_store;
using namespace prefill_tiles;  // NOLINT: the tile passes of this file, split out for size

constexpr int64_t kStageKeys = 256;  // keys per staging item
constexpr int64_t kSplitMinWork = 16 * 2048;  // query x key pairs a split call needs

// Both staged operands are A tiles (16 rows of 32 bf16): K as [ceil(ctx / 16)][D / 32][16
// keys][32 dims] (the pool's row order, no transpose), V transposed as [ceil(ctx / 32)][D / 16]
// [16 dims][32 keys]; split, each such tile is followed by its lo (kLo further).
struct Staged {
  const uint16_t* k;
  const uint32_t* vt;
};

// 32-bit words of one staged tile: hi, and lo after it where split.
template <bool kSplit>
constexpr int64_t kTileWords = kSplit ? 512 : 256;

// Keys [k0, k1) of one (sequence, KV head) into the staged layouts (k1 - k0 a multiple of 32
// except at the end of the context; keys past ctx are written as zeros up to the next 32).
template <typename T, bool kSplit>
void stage(const T* kp, const T* vp, const int64_t* table, int64_t block_size, int64_t tok_stride,
           int64_t blk_stride, int64_t head_off, int64_t ctx, int64_t D, int64_t k0, int64_t k1,
           uint16_t* k, uint32_t* vt) {
  auto key_row = [&](const T* base, int64_t t) -> const T* {
    return base + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
  };
  const int64_t halves = D / 32, slices = D / 16;
  constexpr int64_t kt = 2 * kTileWords<kSplit>, vtile = kTileWords<kSplit>;  // bf16, words
  for (int64_t b = k0; b < k1; b += 16) {  // K: each key's 32 dims of a half, as bf16
    for (int64_t h = 0; h < halves; ++h) {
      uint16_t* out = k + ((b / 16) * halves + h) * kt;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t t = b + c;
        __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
        if (t < ctx) {
          const T* kr = key_row(kp, t) + 32 * h;
          x0 = load16_f32(kr);
          x1 = load16_f32(kr + 16);
        }
        if constexpr (kSplit) {
          const __m512 h0 = bf16_hi(x0), h1 = bf16_hi(x1);
          _mm512_store_si512(out + kLo + 32 * c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
              _mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0))));
          x0 = h0, x1 = h1;
        }
        _mm512_store_si512(out + 32 * c,
                           reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)));
      }
    }
  }
  alignas(64) uint32_t pairs[2][16][16];  // [hi, lo][key pair][dim]
  const float* rows[2][16];
  for (int i = 0; i < 16; ++i) {
    rows[0][i] = reinterpret_cast<const float*>(pairs[0][i]);
    rows[1][i] = reinterpret_cast<const float*>(pairs[1][i]);
  }
  for (int64_t b = k0; b < k1; b += 32) {  // V: pairs of keys per 32-bit lane, transposed
    for (int64_t j = 0; j < slices; ++j) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t t = b + 2 * r;
        __m512 lo = t < ctx ? load16_f32(key_row(vp, t) + 16 * j) : _mm512_setzero_ps();
        __m512 hi = t + 1 < ctx ? load16_f32(key_row(vp, t + 1) + 16 * j)
                                : _mm512_setzero_ps();
        if constexpr (kSplit) {
          const __m512 hl = bf16_hi(lo), hh = bf16_hi(hi);
          _mm512_store_si512(pairs[1][r], prefill_vec::pair_bf16(_mm512_sub_ps(lo, hl),
                                                                 _mm512_sub_ps(hi, hh)));
          lo = hl, hi = hh;
        }
        _mm512_store_si512(pairs[0][r], prefill_vec::pair_bf16(lo, hi));
      }
      uint32_t* dst = vt + ((b / 32) * slices + j) * vtile;
      transpose16_store(rows[0], reinterpret_cast<float*>(dst), 16);
      if constexpr (kSplit) transpose16_store(rows[1], reinterpret_cast<float*>(dst + 256), 16);
    }
  }
}

// A query's reference for its probabilities moves only when a score passes it by more than
// 2^8: p <= 256 stays exact enough in bf16 and float32 sums, and the output's rescale (a
// pass over O^T in memory) is skipped for almost every step after the first.
constexpr float kLazyMax = 8.f;

// 16 query tokens [i0, i1) of the chunk (positions p0 + i), one head: out rows.
//
// Transposed, so the softmax runs down columns: S^T = K Q^T puts one key per row of the score
// tiles and the 16 queries across their lanes, so each query's max and sum are vertical
// vector operations (no horizontal reduction per row and step), and the probabilities of two
// keys interleave into one row of P^T, which is the B tile of O^T = V^T P^T as it stands.
template <bool kSplit>
void compute(const float* q, int64_t q_s0, float* out, int64_t o_s0, const Staged& st, int64_t D,
             int64_t ctx, int64_t p0, int64_t i0, int64_t i1, float scale) {
  const int64_t rows = i1 - i0, halves = D / 32, slices = D / 16;
  alignas(64) uint32_t qt[8][16][16];  // Q^T per 32 dims: [dim pair][query], bf16 pairs
  alignas(64) uint32_t qtl[kSplit ? 8 : 1][16][16];  // the split's lo of Q^T
  alignas(64) uint32_t pt[2][16][16];  // P^T per 32 keys: [key pair][query], bf16 pairs
  alignas(64) uint32_t ptl[2][16][16];  // the split's lo of P^T
  alignas(64) float ot[256][16];       // O^T: [dim][query]
  alignas(64) int32_t pos_a[16];
  const float sl2 = scale * 1.44269504f;  // scores in log2 units: exp2 of them is exp
  {
    alignas(64) uint32_t qp[2][16][16];  // [hi, lo][query][dim pair]
    const float* qrows[2][16];
    for (int i = 0; i < 16; ++i) {
      qrows[0][i] = reinterpret_cast<const float*>(qp[0][i]);
      qrows[1][i] = reinterpret_cast<const float*>(qp[1][i]);
    }
    const __m512 sc = _mm512_set1_ps(sl2);
    for (int64_t h = 0; h < halves; ++h) {
      for (int64_t n = 0; n < 16; ++n) {
        const float* qr = q + (i0 + std::min(n, rows - 1)) * q_s0 + 32 * h;  // padding repeats
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(qr), sc);
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(qr + 16), sc);
        if constexpr (kSplit) {
          const __m512 h0 = bf16_hi(x0), h1 = bf16_hi(x1);
          _mm512_store_si512(qp[1][n], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
              _mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0))));
          x0 = h0, x1 = h1;
        }
        _mm512_store_si512(qp[0][n], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)));
      }
      transpose16_store(qrows[0], reinterpret_cast<float*>(qt[h][0]), 16);
      if constexpr (kSplit) transpose16_store(qrows[1], reinterpret_cast<float*>(qtl[h][0]), 16);
    }
  }
  for (int64_t n = 0; n < 16; ++n) pos_a[n] = static_cast<int32_t>(p0 + i0 + std::min(n, rows - 1));
  const __m512i pos = _mm512_load_si512(pos_a);
  const int64_t first = p0 + i0, last = p0 + i1 - 1;  // keys <= first are read by every row
  const int64_t kend = std::min(ctx, last + 1);
  std::memset(ot, 0, sizeof(float) * 16 * D);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Word i of cvtne2ps_pbh(b, a) is a[i] and word 16 + i is b[i]: interleaved, lane n holds
  // (a[n], b[n]), the pair of two keys one lane of P^T multiplies.
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  __m512 m = ninf, l = _mm512_setzero_ps();
  alignas(64) float s[64][16];  // S^T of a step: [key][query]
  for (int64_t kb = 0; kb < kend; kb += 64) {
    const int64_t nk = std::min<int64_t>(64, kend - kb), nk32 = (nk + 31) / 32 * 32;
    if constexpr (kSplit) {
      switch ((nk + 15) / 16) {
        case 1: split_scores<1>(qt, qtl, st.k, kb / 16, halves, s); break;
        case 2: split_scores<2>(qt, qtl, st.k, kb / 16, halves, s); break;
        case 3: split_scores<3>(qt, qtl, st.k, kb / 16, halves, s); break;
        default: split_scores<4>(qt, qtl, st.k, kb / 16, halves, s); break;
      }
    } else {
      switch ((nk + 15) / 16) {
        case 1: scores<1>(qt, st.k, kb / 16, halves, s); break;
        case 2: scores<2>(qt, st.k, kb / 16, halves, s); break;
        case 3: scores<3>(qt, st.k, kb / 16, halves, s); break;
        default: scores<4>(qt, st.k, kb / 16, halves, s); break;
      }
    }
    // A key past a query's position, or in the step's last 32-key run beyond nk, scores -inf
    // (kend is the last row's position + 1, so a short step is always masked).
    const bool masked = kb + nk32 - 1 > first;
    __m512 mx4[4] = {ninf, ninf, ninf, ninf};  // four chains: a max waits 4 cycles for the last
    for (int64_t i = 0; i < nk32; ++i) {
      __m512 v = _mm512_load_ps(s[i]);
      if (masked) {
        const __mmask16 keep = i < nk ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(
                                            static_cast<int32_t>(kb + i)))
                                      : static_cast<__mmask16>(0);
        v = _mm512_mask_mov_ps(ninf, keep, v);
        _mm512_store_ps(s[i], v);
      }
      mx4[i & 3] = _mm512_max_ps(mx4[i & 3], v);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
    // mx is finite: key 0 is read by every row in the first step.
    const __mmask16 grow = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m, _mm512_set1_ps(kLazyMax)),
                                              _CMP_GT_OQ);
    if (grow != 0) {
      const __m512 mnew = _mm512_mask_mov_ps(m, grow, mx);
      const __m512 alpha = exp2_of<kSplit>(_mm512_sub_ps(m, mnew));  // 1 where it did not move
      l = _mm512_mul_ps(l, alpha);
      if (kb > 0) {
        for (int64_t d = 0; d < D; ++d) {
          _mm512_store_ps(ot[d], _mm512_mul_ps(alpha, _mm512_load_ps(ot[d])));
        }
      }
      m = mnew;
    }
    __m512 sum2[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t r = 0; r < nk32 / 2; ++r) {
      const __m512 sa = _mm512_load_ps(s[2 * r]), sb = _mm512_load_ps(s[2 * r + 1]);
      __m512 a = exp2_of<kSplit>(_mm512_sub_ps(sa, m)), b = exp2_of<kSplit>(_mm512_sub_ps(sb, m));
      if (masked) {  // a masked key's probability is 0, not exp2's floor
        a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sa, ninf, _CMP_NEQ_OQ), a);
        b = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sb, ninf, _CMP_NEQ_OQ), b);
      }
      sum2[r & 1] = _mm512_add_ps(sum2[r & 1], _mm512_add_ps(a, b));
      if constexpr (kSplit) {
        const __m512 ha = bf16_hi(a), hb = bf16_hi(b);
        _mm512_store_si512(ptl[r / 16][r % 16], _mm512_permutexvar_epi16(
            inter, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb),
                                                                  _mm512_sub_ps(a, ha)))));
        a = ha, b = hb;
      }
      _mm512_store_si512(pt[r / 16][r % 16], _mm512_permutexvar_epi16(
          inter, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a))));
    }
    l = _mm512_add_ps(l, _mm512_add_ps(sum2[0], sum2[1]));
    _tile_loadd(5, pt[0][0], 64);
    const bool second = nk32 > 32;
    if (second) _tile_loadd(7, pt[1][0], 64);
    constexpr int64_t vtile = kTileWords<kSplit>;  // one slice's V^T (hi, then lo: split)
    const uint32_t* v0 = st.vt + (kb / 32) * slices * vtile;
    const uint32_t* v1 = second ? v0 + slices * vtile : nullptr;
    if constexpr (kSplit) {
      _tile_loadd(2, ptl[0][0], 64);
      if (second) _tile_loadd(3, ptl[1][0], 64);
      for (int64_t j = 0; j < slices; j += 2) {  // 2 slices of 16 dims per pass
        const uint32_t* w1 = v1 != nullptr ? v1 + j * vtile : nullptr;
        if (slices - j == 1) {
          split_values<1>(ot + 16 * j, v0 + j * vtile, w1);
        } else {
          split_values<2>(ot + 16 * j, v0 + j * vtile, w1);
        }
      }
    } else {
      for (int64_t j = 0; j < slices; j += 4) {  // 4 slices of 16 dims per pass
        const uint32_t* w1 = v1 != nullptr ? v1 + j * vtile : nullptr;
        switch (std::min<int64_t>(4, slices - j)) {
          case 1: values<1>(ot + 16 * j, v0 + j * vtile, w1); break;
          case 2: values<2>(ot + 16 * j, v0 + j * vtile, w1); break;
          case 3: values<3>(ot + 16 * j, v0 + j * vtile, w1); break;
          default: values<4>(ot + 16 * j, v0 + j * vtile, w1); break;
        }
      }
    }
  }
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  alignas(64) float o[16][16];
  const float* orows[16];
  for (int64_t j = 0; j < slices; ++j) {
    for (int64_t i = 0; i < 16; ++i) {
      _mm512_store_ps(ot[16 * j + i], _mm512_mul_ps(inv, _mm512_load_ps(ot[16 * j + i])));
      orows[i] = ot[16 * j + i];
    }
    transpose16_store(orows, o[0], 16);  // o[query][dim]
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_storeu_ps(out + (i0 + r) * o_s0 + 16 * j, _mm512_load_ps(o[r]));
    }
  }
}

template <typename T, bool kSplit>
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
      kt_total += padded / 16 * (D / 32) * kTileWords<kSplit>;
      v_total += padded / 32 * (D / 16) * kTileWords<kSplit>;
    }
  }
  // Kept between calls (scratch.h; stage writes every word compute reads): a zeroed allocation
  // a call (3.3 MB split at 2,000 keys and 3 KV heads) cost 2,000 + 128 tokens 2.7 -> 1.5 ms.
  thread_local Scratch<uint32_t> kt, v;
  uint32_t* ktp = kt.get(kt_total);
  uint32_t* vpp = v.get(v_total);
  parallel_dynamic(static_cast<int64_t>(stages.size()), [&](int64_t i) {
    const StageItem& it = stages[i];
    stage<T, kSplit>(kp, vp, tables + it.s * tstride, block_size, tok_stride, blk_stride,
                     it.g * D, lens[it.s], D, it.k0, it.k1,
                     reinterpret_cast<uint16_t*>(ktp + it.kt_off), vpp + it.v_off);
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
  // One (sequence, KV head) unit after another, longest first within it (the balance at the
  // end): a unit's staged K and V stay in L2 while both threads pass over them, where the
  // units interleaved spilled past L2 at long contexts (split, 2,000 + 128 tokens, 3 KV
  // heads: 3.2 ms a call against 2.7 by unit; amx-bf16 0.87 -> 0.82).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.unit != b.unit) return a.unit < b.unit;
    return a.cost > b.cost;
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), o_s0 = out.stride(0);
  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
    amx::load_full_config();
    const Item& it = items[i];
    const int64_t n = qsl[it.s + 1] - qsl[it.s];
    const Staged st{reinterpret_cast<const uint16_t*>(ktp + kt_off[it.unit]), vpp + v_off[it.unit]};
    compute<kSplit>(qp + qsl[it.s] * q_s0 + it.h * q.stride(1), q_s0,
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
                 int64_t first_seq, int64_t num_seqs, float scale, bool split) {
#ifdef TS_AMX
  const int64_t D = q.size(2);
  if (D % 32 != 0 || D > 256 || !isa::amx_status().permitted || !isa::amx_status().bf16) {
    return false;
  }
  if (split) {
    // A small call (a 64-token chunk from the start: 0.055 ms a call split, 0.047 on float32
    // FMAs) stays on the caller's float32 path: staging hi and lo costs more than the tiles
    // save. Work in query x key pairs; one item of 16 queries over 2,048 keys is the bar.
    int64_t work = 0;
    for (int64_t s = first_seq; s < num_seqs; ++s) work += (qsl[s + 1] - qsl[s]) * lens[s];
    if (work < kSplitMinWork) return false;
    run<T, true>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs, scale);
  } else {
    run<T, false>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs, scale);
  }
  return true;
#else
  (void)out, (void)q, (void)kv_cache, (void)block_tables, (void)lens, (void)qsl, (void)first_seq,
      (void)num_seqs, (void)scale, (void)split;
  return false;
#endif
}

template bool prefill_amx<float>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const int64_t*, const int64_t*, int64_t,
                                 int64_t, float, bool);
template bool prefill_amx<c10::BFloat16>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const int64_t*, const int64_t*,
                                         int64_t, int64_t, float, bool);
template bool prefill_amx<c10::Half>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const int64_t*, const int64_t*, int64_t,
                                     int64_t, float, bool);

}  // namespace tailserve_cpu
