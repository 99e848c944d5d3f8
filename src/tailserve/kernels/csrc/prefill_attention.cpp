// torch.ops.tailserve.write_kv_cache and paged_prefill_attention: a step's K/V into their
// slots, and causal attention of prefill chunks over their sequences' cached K/V, read in
// place from the paged pool.
//
// Why not SDPA: it runs on OpenMP's threads while every product of the step runs on the
// kernels' work pool (work_pool.h). On a 2-core host the two pools spin against each other
// after each call (OpenMP spins by default) and the prefill lost a third of its speed
// (benchmarks/notes/, "Prefill on one pool"). A chunk with earlier context also needed a
// gather of its K/V into a workspace, a mask tensor, and a copy of the output.
//
// Work split: an item is (sequence, KV head, 32 query tokens); the query heads of the GQA
// group share every K/V chunk the item stages. A step with few items (a short chunk after a
// long prompt start: 3 items for SmolLM2's 3 KV heads, on 2 threads) cuts each item's key
// range into parts of >= 128 keys, about 24 pieces in all, so both threads stay busy. Each
// part keeps its rows' unnormalized output, max and sum; the thread that finishes an item's
// last part rescales the parts to their common max and merges them (log-sum-exp). The split
// depends on the shapes only, never on which thread ran what, so results are the same run to
// run and thread count to thread count. Pieces run costliest first, handed out dynamically.
//
// Inner loops: a chunk of 64 keys is staged as float32 (K transposed to [D][64], by 16 x 16
// in-register transposes on AVX512; V as [64][D]; a 16-bit pool is widened here). Scores are
// a register tile of 6 query rows x 64 keys (AVX512: 24 accumulators; per d, 4 K loads and 6
// broadcasts feed 24 independent FMAs, enough to keep both FMA pipes busy); the online
// softmax (max, exp, rescale) runs once per 64 keys per row; the output is a tile of 6 rows x
// 64 dims over the chunk's keys, loaded and stored once per chunk. AVX2 and scalar take 16
// keys / 16 dims per tile (AVX2: 12 ymm accumulators of its 16 registers).
//
// At the avx512bf16 level (isa.h; opt-in) the two products run on vdpbf16ps, two multiply-adds
// per float32 lane where an FMA does one: q (scaled) and the staged K become bf16 pairs (K's
// two dims of a key in one lane), and after the float32 softmax of a tile its probabilities
// and the chunk's V (two keys of a dim in one lane); the max, the exp, the sums, the rescaling
// and the output accumulators stay float32. Rounding to bf16 (nearest even) is the only
// difference from the float32 path (test_prefill_attention states the tolerance): 1.2-1.3x
// the float32 path on Zen 4 (benchmarks/prefill_attention_op.py), not the instruction's 2x,
// as the softmax and the staging do not shrink.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "isa.h"
#include "prefill_amx.h"
#include "simd.h"
#include "simd16.h"
#include "prefill_vec.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace {

constexpr int64_t kQueryBlock = 32;  // query tokens per item
constexpr int64_t kChunk = 64;       // keys per staged chunk and per softmax update
constexpr int64_t kChunkVecs = kChunk / 16;
constexpr int64_t kRows = 6;         // query rows (token x head) computed together
// Fewer items than this: split their key ranges (parts of >= kMinPartKeys, kChunk-aligned)
// towards kTargetPieces pieces.
constexpr int64_t kMinItems = 16;
constexpr int64_t kTargetPieces = 24;
constexpr int64_t kMinPartKeys = 128;

using prefill_vec::VecScalar;
#ifdef TS_AVX2
using prefill_vec::VecAvx2;
#endif
#if defined(__AVX512F__)
using prefill_vec::Vec512;
using prefill_vec::load16_f32;
using prefill_vec::transpose16_store;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TS_PREFILL_BF16 1
using prefill_vec::bcast_pair;
using prefill_vec::pair_bf16;
using prefill_vec::store32_bf16;
#endif

// One piece's buffers, per thread, grown to the largest piece seen.
struct PieceBuffers {
  std::vector<float> q, acc, m, l, kt, vf;
  // The bf16 level: q [rows][D] and K pairs [D / 2][kChunk] (dims 2d, 2d + 1 of a key in one
  // 32-bit lane), V pairs [kChunk / 2][D] (keys 2j, 2j + 1 of a dim in one lane).
  std::vector<uint16_t> qh;
  std::vector<int32_t> kp2, vp2;
};

// Query tokens [j0, j1) of a sequence's chunk, keys [t0, t1) of its context. part >= 0: one
// of several parts of the item's keys (the item's split: split), its results kept for the
// merge at partial offset part.
struct Piece {
  int64_t seq, kv_head, j0, j1, t0, t1, part, split;
};

// Where a piece writes: the output rows (part < 0), or a partial [rows, D] + max + sum.
struct PartialSlot {
  float* acc;
  float* m;
  float* l;
};

// Scores of rows qr[0..kRows) against the staged chunk kt [D][kChunk], into s [kRows][kChunk],
// for the first `needed` vectors of 16 keys (rounded up to the tile; the rest are masked).
template <typename V>
inline void tile_scores(const float* const* qr, const float* kt, int64_t D, int64_t needed,
                        float (*s)[kChunk]) {
  constexpr int64_t G = V::kKeyGroup;
  for (int64_t k0 = 0; k0 < needed; k0 += G) {
    V acc[kRows][G];
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t g = 0; g < G; ++g) acc[i][g] = V::set1(0.f);
    }
    for (int64_t d = 0; d < D; ++d) {
      V k[G];
      for (int64_t g = 0; g < G; ++g) {
        k[g] = V::pinned(V::load(kt + d * kChunk + 16 * (k0 + g)));
      }
      for (int64_t i = 0; i < kRows; ++i) {
        const V qb = V::set1(qr[i][d]);
        for (int64_t g = 0; g < G; ++g) acc[i][g] = V::fma(qb, k[g], acc[i][g]);
      }
    }
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t g = 0; g < G; ++g) acc[i][g].store(s[i] + 16 * (k0 + g));
    }
  }
}

// ar[i][dv0 * 16 ..] = alpha[i] * ar[i] + sum_j p[i][j] * V[j], G vectors of 16 dims per row.
template <typename V, int64_t G>
inline void tile_pv(float* const* ar, const float* alpha, const float (*p)[kChunk],
                    const float* const* vrows, int64_t most, int64_t dv0, int64_t live) {
  V a[kRows][G];
  for (int64_t i = 0; i < kRows; ++i) {
    const V al = V::set1(alpha[i]);
    for (int64_t g = 0; g < G; ++g) a[i][g] = V::mul(al, V::load(ar[i] + 16 * (dv0 + g)));
  }
  for (int64_t j = 0; j < most; ++j) {
    V vv[G];
    for (int64_t g = 0; g < G; ++g) {
      vv[g] = V::pinned(V::load(vrows[j] + 16 * (dv0 + g)));
    }
    for (int64_t i = 0; i < kRows; ++i) {
      const V pb = V::set1(p[i][j]);
      for (int64_t g = 0; g < G; ++g) a[i][g] = V::fma(pb, vv[g], a[i][g]);
    }
  }
  // Rows past the end (repeats of the last one) are dropped; the last live one is stored last.
  for (int64_t i = kRows - 1; i >= 0; --i) {
    if (i < live) {
      for (int64_t g = 0; g < G; ++g) a[i][g].store(ar[i] + 16 * (dv0 + g));
    }
  }
}

#ifdef TS_PREFILL_BF16
// tile_scores on vdpbf16ps: q and K rounded to bf16, two dims per multiply-add, sums in float32.
inline void tile_scores_bf16(const uint16_t* const* qh, const int32_t* kp2, int64_t D,
                             float (*s)[kChunk]) {
  __m512 acc[kRows][kChunkVecs];
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t g = 0; g < kChunkVecs; ++g) acc[i][g] = _mm512_setzero_ps();
  }
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m512i k[kChunkVecs];
    for (int64_t g = 0; g < kChunkVecs; ++g) {
      k[g] = _mm512_loadu_si512(kp2 + dp * kChunk + 16 * g);
      asm("" : "+v"(k[g]));  // one load per vector, not one folded into each of six dots
    }
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh qb = bcast_pair(qh[i] + 2 * dp);
      for (int64_t g = 0; g < kChunkVecs; ++g) {
        acc[i][g] = _mm512_dpbf16_ps(acc[i][g], qb, reinterpret_cast<__m512bh>(k[g]));
      }
    }
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t g = 0; g < kChunkVecs; ++g) _mm512_storeu_ps(s[i] + 16 * g, acc[i][g]);
  }
}

// tile_pv on vdpbf16ps: p (after its float32 sum) and V rounded to bf16, two keys per
// multiply-add, the output accumulated in float32.
template <int64_t G>
inline void tile_pv_bf16(float* const* ar, const float* alpha, const uint16_t (*ph)[kChunk],
                         const int32_t* vp2, int64_t D, int64_t most, int64_t dv0, int64_t live) {
  __m512 a[kRows][G];
  for (int64_t i = 0; i < kRows; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int64_t g = 0; g < G; ++g) a[i][g] = _mm512_mul_ps(al, _mm512_loadu_ps(ar[i] + 16 * (dv0 + g)));
  }
  for (int64_t jp = 0; jp < (most + 1) / 2; ++jp) {
    __m512i vv[G];
    for (int64_t g = 0; g < G; ++g) {
      vv[g] = _mm512_loadu_si512(vp2 + jp * D + 16 * (dv0 + g));
      asm("" : "+v"(vv[g]));
    }
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh pb = bcast_pair(ph[i] + 2 * jp);
      for (int64_t g = 0; g < G; ++g) {
        a[i][g] = _mm512_dpbf16_ps(a[i][g], pb, reinterpret_cast<__m512bh>(vv[g]));
      }
    }
  }
  for (int64_t i = kRows - 1; i >= 0; --i) {
    if (i < live) {
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(ar[i] + 16 * (dv0 + g), a[i][g]);
    }
  }
}
#endif

// Bf16: QK^T and PV on vdpbf16ps (the bf16 level; V is Vec512 then), the softmax in float32.
template <typename V, typename T, bool Bf16 = false>
void prefill_piece(const Piece& pc, const float* qp, int64_t q_s0, int64_t q_s1, float* op,
                   int64_t o_s0, int64_t o_s1, const T* kp, const T* vp, const int64_t* table,
                   int64_t block_size, int64_t tok_stride, int64_t blk_stride, int64_t q_begin,
                   int64_t ctx, int64_t chunk_len, int64_t group, int64_t D, float scale,
                   const PartialSlot* slot, PieceBuffers& b) {
  const int64_t n = pc.j1 - pc.j0, rows = n * group, nv = D / 16;
  const int64_t pos0 = ctx - chunk_len + pc.j0;  // position of the piece's first query
  b.q.resize(rows * D);
  b.acc.assign(rows * D, 0.f);
  b.m.assign(rows, -std::numeric_limits<float>::infinity());
  b.l.assign(rows, 0.f);
  b.kt.resize(D * kChunk);
  b.vf.resize(kChunk * D);
  // Row r = token jq * group + hg: query head kv_head * group + hg of token j0 + jq.
  for (int64_t jq = 0; jq < n; ++jq) {
    for (int64_t hg = 0; hg < group; ++hg) {
      const float* src = qp + (q_begin + pc.j0 + jq) * q_s0 + (pc.kv_head * group + hg) * q_s1;
      float* dst = b.q.data() + (jq * group + hg) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
  if constexpr (Bf16) {
    b.qh.resize(rows * D);
    for (int64_t i = 0; i < rows * D; ++i) b.qh[i] = c10::BFloat16(b.q[i]).x;  // nearest even
    b.kp2.resize(D / 2 * kChunk);
    b.vp2.resize(kChunk / 2 * D);
  }
  const int64_t head_off = pc.kv_head * D;
  alignas(64) float p[kRows][kChunk];
  alignas(64) uint16_t ph[kRows][kChunk];
  for (int64_t t0 = pc.t0; t0 < pc.t1; t0 += kChunk) {
    const int64_t c = std::min(kChunk, pc.t1 - t0);
    // Stage the chunk; K lanes past its end are zero. A float32 pool's V rows are read where
    // they are (only K needs its transpose).
    const float* vrows[kChunk];
    const T* krows[kChunk];
    for (int64_t j = 0; j < kChunk; ++j) {
      vrows[j] = b.vf.data() + j * D;
      krows[j] = nullptr;
      if (j < c) {
        const int64_t t = t0 + j;
        const int64_t off = table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
        krows[j] = kp + off;
        if constexpr (std::is_same_v<T, float>) vrows[j] = vp + off;
      }
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<V, Vec512>) {
      for (int64_t db = 0; db < nv; ++db) {
        for (int64_t kg = 0; kg < kChunkVecs; ++kg) {
          const T* rows16[16];
          for (int64_t i = 0; i < 16; ++i) {
            rows16[i] = krows[16 * kg + i] != nullptr ? krows[16 * kg + i] + 16 * db : nullptr;
          }
          transpose16_store(rows16, b.kt.data() + 16 * db * kChunk + 16 * kg, kChunk);
        }
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < c; ++j) {
          const T* vr = vp + (krows[j] - kp);
          for (int64_t db = 0; db < nv; ++db) _mm512_storeu_ps(b.vf.data() + j * D + 16 * db, load16_f32(vr + 16 * db));
        }
      }
    } else
#endif
    {
      for (int64_t j = 0; j < kChunk; ++j) {
        if (j < c) {
          const T* kr = krows[j];
          for (int64_t d = 0; d < D; ++d) b.kt[d * kChunk + j] = to_f(kr[d]);
          if constexpr (!std::is_same_v<T, float>) {
            const T* vr = vp + (kr - kp);
            for (int64_t d = 0; d < D; ++d) b.vf[j * D + d] = to_f(vr[d]);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) b.kt[d * kChunk + j] = 0.f;
        }
      }
    }
#ifdef TS_PREFILL_BF16
    if constexpr (Bf16) {  // K pairs from the transposed chunk; V pairs, zero past its end
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        for (int64_t kg = 0; kg < kChunkVecs; ++kg) {
          const float* k0 = b.kt.data() + 2 * dp * kChunk + 16 * kg;
          _mm512_storeu_si512(b.kp2.data() + dp * kChunk + 16 * kg,
                              pair_bf16(_mm512_loadu_ps(k0), _mm512_loadu_ps(k0 + kChunk)));
        }
      }
      for (int64_t jp = 0; jp < (c + 1) / 2; ++jp) {
        const bool odd_live = 2 * jp + 1 < c;
        for (int64_t db = 0; db < nv; ++db) {
          const __m512 lo = _mm512_loadu_ps(vrows[2 * jp] + 16 * db);
          const __m512 hi = odd_live ? _mm512_loadu_ps(vrows[2 * jp + 1] + 16 * db) : _mm512_setzero_ps();
          _mm512_storeu_si512(b.vp2.data() + jp * D + 16 * db, pair_bf16(lo, hi));
        }
      }
    }
#endif
    // Query token jq sees keys 0 .. pos0 + jq: none of this chunk before jq = t0 - pos0.
    for (int64_t r0 = std::max<int64_t>(0, t0 - pos0) * group; r0 < rows; r0 += kRows) {
      const int64_t live = std::min(kRows, rows - r0);
      int64_t valid[kRows];
      int64_t most = 0;
      const float* qr[kRows];
      const uint16_t* qhr[kRows];
      float* ar[kRows];
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = r0 + std::min(i, live - 1);  // past the end: repeat, then dropped
        valid[i] = i < live ? std::max<int64_t>(0, std::min(c, pos0 + r / group - t0 + 1)) : 0;
        most = std::max(most, valid[i]);
        qr[i] = b.q.data() + r * D;
        qhr[i] = Bf16 ? b.qh.data() + r * D : nullptr;
        ar[i] = b.acc.data() + r * D;
      }
#ifdef TS_PREFILL_BF16
      if constexpr (Bf16) {
        tile_scores_bf16(qhr, b.kp2.data(), D, p);
      } else
#endif
      {
        tile_scores<V>(qr, b.kt.data(), D, (most + 15) / 16, p);
      }
      float alpha[kRows];
      for (int64_t i = 0; i < kRows; ++i) {
        alpha[i] = 1.f;
        const int64_t vi = valid[i];
        if (vi == 0) {  // nothing of this chunk is visible to the row (or no row)
          std::fill(p[i], p[i] + kChunk, 0.f);
          continue;
        }
        const int64_t r = r0 + i;
        V x[kChunkVecs];
        V mx = V::set1(-std::numeric_limits<float>::infinity());
        for (int64_t k = 0; k < kChunkVecs; ++k) {
          x[k] = V::load(p[i] + 16 * k);
          if (16 * k + 16 > vi) x[k] = x[k].neg_inf_past(vi - 16 * k);
          mx = V::max(mx, x[k]);
        }
        const float m_old = b.m[r];
        const float m_new = std::max(m_old, mx.hmax());
        V sum = V::set1(0.f);
        for (int64_t k = 0; k < kChunkVecs; ++k) {
          V e = x[k].exp_sub(m_new);
          if (16 * k + 16 > vi) e = e.zero_past(vi - 16 * k);
          e.store(p[i] + 16 * k);
          sum = V::add(sum, e);
        }
        if (m_new > m_old) {  // rescale what was summed against the old max (exp(-inf) = 0)
          alpha[i] = std::exp(m_old - m_new);
          b.l[r] *= alpha[i];
          b.m[r] = m_new;
        }
        b.l[r] += sum.hsum();
      }
      constexpr int64_t G = V::kDimGroup;
      int64_t dv0 = 0;
#ifdef TS_PREFILL_BF16
      if constexpr (Bf16) {
        for (int64_t i = 0; i < kRows; ++i) {
          store32_bf16(p[i], ph[i]);
          store32_bf16(p[i] + 32, ph[i] + 32);
        }
        for (; dv0 + G <= nv; dv0 += G) tile_pv_bf16<G>(ar, alpha, ph, b.vp2.data(), D, most, dv0, live);
        for (; dv0 < nv; ++dv0) tile_pv_bf16<1>(ar, alpha, ph, b.vp2.data(), D, most, dv0, live);
        continue;
      }
#endif
      for (; dv0 + G <= nv; dv0 += G) tile_pv<V, G>(ar, alpha, p, vrows, most, dv0, live);
      for (; dv0 < nv; ++dv0) tile_pv<V, 1>(ar, alpha, p, vrows, most, dv0, live);
    }
  }
  if (slot != nullptr) {  // one part of the item's keys: kept for the merge
    std::copy(b.acc.begin(), b.acc.end(), slot->acc);
    std::copy(b.m.begin(), b.m.end(), slot->m);
    std::copy(b.l.begin(), b.l.end(), slot->l);
    return;
  }
  for (int64_t jq = 0; jq < n; ++jq) {
    for (int64_t hg = 0; hg < group; ++hg) {
      const int64_t r = jq * group + hg;
      const float inv = 1.f / b.l[r];
      float* dst = op + (q_begin + pc.j0 + jq) * o_s0 + (pc.kv_head * group + hg) * o_s1;
      const float* ar = b.acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
    }
  }
}

template <typename V, typename T, bool Bf16 = false>
void prefill_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                  int64_t first_seq, int64_t num_seqs, float scale) {
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tok_stride = num_kv_heads * D, blk_stride = block_size * tok_stride;
  const T* kp = kv_cache.data_ptr<T>();
  const T* vp = kp + kv_cache.size(1) * blk_stride;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t bt_s0 = block_tables.stride(0);
  // An item's keys: [0, position of its last query + 1).
  const auto keys_of = [&](int64_t s, int64_t j1) { return lens[s] - (qsl[s + 1] - qsl[s]) + j1; };
  int64_t num_items = 0;
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    num_items += (qsl[s + 1] - qsl[s] + kQueryBlock - 1) / kQueryBlock * num_kv_heads;
  }
  const int64_t want_parts = num_items < kMinItems ? (kTargetPieces + num_items - 1) / std::max<int64_t>(num_items, 1) : 1;
  std::vector<Piece> pieces;
  struct Split {
    int64_t piece0, parts;  // the item's pieces [piece0, piece0 + parts)
  };
  std::vector<Split> splits;
  int64_t num_parts = 0;
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t len = qsl[s + 1] - qsl[s];
    for (int64_t j0 = 0; j0 < len; j0 += kQueryBlock) {
      const int64_t j1 = std::min(len, j0 + kQueryBlock), keys = keys_of(s, j1);
      const int64_t parts = std::max<int64_t>(1, std::min(want_parts, keys / kMinPartKeys));
      const int64_t per = (keys + parts - 1) / parts;
      const int64_t step = (per + kChunk - 1) / kChunk * kChunk;
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        if (parts == 1) {
          pieces.push_back({s, g, j0, j1, 0, keys, -1, -1});
          continue;
        }
        const int64_t first = static_cast<int64_t>(pieces.size());
        const int64_t split = static_cast<int64_t>(splits.size());
        for (int64_t t = 0; t < keys; t += step) {
          pieces.push_back({s, g, j0, j1, t, std::min(keys, t + step), num_parts++, split});
        }
        splits.push_back({first, static_cast<int64_t>(pieces.size()) - first});
      }
    }
  }
  // Partials: acc [rows, D], max [rows], sum [rows] per part (rows = query tokens x group).
  const int64_t part_rows = kQueryBlock * group, part_floats = part_rows * (D + 2);
  thread_local std::vector<float> partials;
  partials.resize(num_parts * part_floats);
  std::vector<int64_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const Piece& x = pieces[a];
    const Piece& y = pieces[b];
    return (x.j1 - x.j0) * (x.t1 - x.t0) > (y.j1 - y.j0) * (y.t1 - y.t0);
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* part_base = partials.data();
  const auto slot_of = [&](int64_t part) {
    float* base = part_base + part * part_floats;
    return PartialSlot{base, base + part_rows * D, base + part_rows * (D + 1)};
  };
  // Merges a split item's parts, in part order: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
  const auto merge = [&](const Split& sp) {
    const Piece& first = pieces[sp.piece0];
    const int64_t n = first.j1 - first.j0;
    const int64_t q_begin = qsl[first.seq];
    for (int64_t r = 0; r < n * group; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < sp.parts; ++p) mx = std::max(mx, slot_of(pieces[sp.piece0 + p].part).m[r]);
      float l = 0.f;
      float w[kTargetPieces];
      for (int64_t p = 0; p < sp.parts; ++p) {
        const PartialSlot s = slot_of(pieces[sp.piece0 + p].part);
        w[p] = s.m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s.m[r] - mx);
        l += w[p] * s.l[r];
      }
      const float inv = 1.f / l;
      const int64_t jq = r / group, hg = r % group;
      float* dst = op + (q_begin + first.j0 + jq) * out.stride(0) + (first.kv_head * group + hg) * out.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        float a = 0.f;
        for (int64_t p = 0; p < sp.parts; ++p) a += w[p] * slot_of(pieces[sp.piece0 + p].part).acc[r * D + d];
        dst[d] = a * inv;
      }
    }
  };
  // Parts done per split item: whichever thread finishes an item's last part merges it, in the
  // same pass (a second parallel region per call cost a wake-up of the pool per layer).
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[splits.size()]);
  for (size_t i = 0; i < splits.size(); ++i) done[i].store(0, std::memory_order_relaxed);
  parallel_dynamic(static_cast<int64_t>(order.size()), [&](int64_t i) {
    thread_local PieceBuffers buffers;
    const Piece& pc = pieces[order[i]];
    PartialSlot slot{};
    if (pc.part >= 0) slot = slot_of(pc.part);
    prefill_piece<V, T, Bf16>(pc, qp, q.stride(0), q.stride(1), op, out.stride(0), out.stride(1), kp,
                        vp, bt + pc.seq * bt_s0, block_size, tok_stride, blk_stride,
                        qsl[pc.seq], lens[pc.seq], qsl[pc.seq + 1] - qsl[pc.seq], group, D,
                        scale, pc.part >= 0 ? &slot : nullptr, buffers);
    // acq_rel: the last part's thread sees every other part's partial.
    if (pc.split >= 0 && done[pc.split].fetch_add(1, std::memory_order_acq_rel) + 1 == splits[pc.split].parts) {
      merge(splits[pc.split]);
    }
  });
}

template <typename T>
void prefill_dispatch(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                      int64_t first_seq, int64_t num_seqs, float scale) {
  const int isa = quant_isa();
  // amx: split bf16 operands, near float32 (the default where AMX serves); amx-bf16: one
  // rounding each (opt-in).
  if ((isa == isa::kAmx || isa == isa::kAmxBf16) &&
      prefill_amx<T>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs, scale,
                     isa == isa::kAmx)) {
    return;
  }
#ifdef TS_PREFILL_BF16
  if (isa == isa::kAvx512Bf16) {  // opt-in; the AMX levels keep float32 or their tiles
    return prefill_impl<Vec512, T, true>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                         num_seqs, scale);
  }
#endif
#if defined(__AVX512F__)
  if (isa >= 2) {
    return prefill_impl<Vec512, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                   num_seqs, scale);
  }
#endif
#ifdef TS_AVX2
  if (isa >= 1) {
    return prefill_impl<VecAvx2, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                    num_seqs, scale);
  }
#endif
  (void)isa;
  prefill_impl<VecScalar, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs,
                             scale);
}

template <typename T>
void write_kv_as(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                 const int64_t* slots) {
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  T* k_pool = kv_cache.data_ptr<T>();
  T* v_pool = k_pool + kv_cache.size(1) * kv_cache.size(2) * H * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      store_from_f32(k_pool + (slots[t] * H + h) * D, kp + t * k.stride(0) + h * k.stride(1), D);
      store_from_f32(v_pool + (slots[t] * H + h) * D, vp + t * v.stride(0) + h * v.stride(1), D);
    }
  }
}

void check_pool(const at::Tensor& kv_cache, const char* op) {
  const auto dt = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous() &&
                  (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              op, ": kv_cache must be a contiguous float32 / bfloat16 / float16 CPU tensor "
              "[2, num_blocks, block_size, H_kv, D], got ", dt, " ", kv_cache.sizes());
}

}  // namespace

// kv_cache[:, slot_mapping[t]] = k[t], v[t] (rounded to nearest even for a 16-bit pool, the
// bits torch's .to() writes). k, v: float32 [T, H_kv, D], head_dim contiguous.
void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping) {
  check_pool(kv_cache, "write_kv_cache");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->stride(2) == 1 && t->size(1) == kv_cache.size(3) &&
                    t->size(2) == kv_cache.size(4) && t->size(0) == k.size(0),
                "write_kv_cache: k and v must be float32 [T, ", kv_cache.size(3), ", ",
                kv_cache.size(4), "] with contiguous head_dim, got ", t->scalar_type(), " ",
                t->sizes());
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "write_kv_cache: slot_mapping must be int64 [", k.size(0), "]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot ", slots[t],
                " outside the pool's ", num_slots);
  }
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: return write_kv_as<c10::BFloat16>(kv_cache, k, v, slots);
    case at::kHalf: return write_kv_as<c10::Half>(kv_cache, k, v, slots);
    default: return write_kv_as<float>(kv_cache, k, v, slots);
  }
}

// out[t] for the tokens of sequences [first_seq, num_seqs): causal attention of each
// sequence's chunk (tokens query_start_loc[i] .. query_start_loc[i + 1]) over its first
// seq_lens[i] cached tokens (this chunk's K/V already written). q, out: float32 [T, H, D],
// head_dim contiguous; kv_cache [2, num_blocks, block_size, H_kv, D] in float32 / bf16 / fp16.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_seq,
                             double scale) {
  check_pool(kv_cache, "paged_prefill_attention");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_prefill_attention: q and out must be float32 [T, H, D] with contiguous "
              "head_dim, got ", q.scalar_type(), " ", q.sizes(), " and ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(2) % 16 == 0 && q.size(1) % kv_cache.size(3) == 0,
              "paged_prefill_attention: ", q.size(1), " heads of ", q.size(2), " over ",
              kv_cache.size(3), " KV heads of ", kv_cache.size(4), " (head_dim a multiple of 16)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && query_start_loc.dim() == 1,
              "paged_prefill_attention: block_tables, seq_lens and query_start_loc must be int64");
  const int64_t num_seqs = query_start_loc.numel() - 1;
  TORCH_CHECK(num_seqs >= 0 && 0 <= first_seq && first_seq <= num_seqs &&
                  seq_lens.numel() >= num_seqs && block_tables.size(0) >= num_seqs,
              "paged_prefill_attention: first_seq ", first_seq, " of ", num_seqs, " sequences (",
              seq_lens.numel(), " lengths, ", block_tables.size(0), " block tables)");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(qsl[num_seqs] <= q.size(0), "paged_prefill_attention: query_start_loc ends at ",
              qsl[num_seqs], ", q has ", q.size(0), " tokens");
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s];
    TORCH_CHECK(n >= 0 && n <= lens[s] && (lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "paged_prefill_attention: sequence ", s, " has ", n, " new tokens, context ",
                lens[s], ", a block table of ", block_tables.size(1), " blocks");
  }
  const float fscale = static_cast<float>(scale);
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16:
      return prefill_dispatch<c10::BFloat16>(out, q, kv_cache, block_tables, lens, qsl,
                                             first_seq, num_seqs, fscale);
    case at::kHalf:
      return prefill_dispatch<c10::Half>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                         num_seqs, fscale);
    default:
      return prefill_dispatch<float>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                     num_seqs, fscale);
  }
}

}  // namespace tailserve_cpu
