// torch.ops.tailserve.paged_decode_attention: one query token per sequence against its K/V
// blocks, read in place from the paged pool (no gather into a workspace), the query heads of a
// GQA group sharing every K/V row they read; one pass with an online softmax.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "decode_heads.h"
#include "decode_split.h"
#include "paged_rows.h"
#include "simd.h"
#include "simd16.h"
#include "work_pool.h"

namespace tailserve_cpu {

// q (already float) against a K row of any storage type.
template <typename T>
inline float dot_q(const float* q, const T* k, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += q[i] * to_f(k[i]);
  return r;
}
template <>
inline float dot_q<float>(const float* q, const float* k, int64_t n) {
  return dot_f32(q, k, n);
}

// acc[0..n) += w * v[0..n)
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * to_f(v[i]);
}
template <>
inline void axpy<float>(float* acc, float w, const float* v, int64_t n) {
#ifdef TS_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < n; ++i) acc[i] += w * v[i];
#else
  for (int64_t i = 0; i < n; ++i) acc[i] += w * v[i];
#endif
}

// ------------------------------------------------------------------ paged decode attention

// Generic path (any dtype, any head_dim): scores, softmax, weighted sum of V over tokens
// [t_begin, t_end). TQ: q and out; TKV: the pool (a 16-bit pool is widened as it is read).
// partial: write the unnormalized sums, max and sum there instead of out (decode_split.h).
template <typename TQ, typename T>
void decode_one_generic(const TQ* qp, int64_t q_s1, TQ* op, int64_t o_s1, const T* kp,
                        const T* vp, const PagedRows& rows, int64_t t_begin, int64_t t_end,
                        int64_t group, int64_t head_dim, float scale,
                        const DecodePartial* partial) {
  const int64_t len = t_end - t_begin;
  std::vector<float> buf(group * (len + 2 * head_dim));
  float* scores = buf.data();
  float* qf = scores + group * len;
  float* acc = qf + group * head_dim;
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_f(qp[h * q_s1 + d]) * scale;
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* krow = rows.row(kp, t_begin + t);
    for (int64_t h = 0; h < group; ++h) scores[h * len + t] = dot_q<T>(qf + h * head_dim, krow, head_dim);
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * len;
    const float mx = *std::max_element(row, row + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - mx);
      sum += row[t];
    }
    float* a = acc + h * head_dim;
    if (partial != nullptr) {
      for (int64_t t = 0; t < len; ++t) axpy<T>(a, row[t], rows.row(vp, t_begin + t), head_dim);
      std::copy(a, a + head_dim, partial->acc + h * head_dim);
      partial->m[h] = mx;
      partial->l[h] = sum;
      continue;
    }
    for (int64_t t = 0; t < len; ++t) axpy<T>(a, row[t] / sum, rows.row(vp, t_begin + t), head_dim);
    for (int64_t d = 0; d < head_dim; ++d) op[h * o_s1 + d] = static_cast<TQ>(a[d]);
  }
}

// plan_decode_split's shortest part: kMinPartTokens, or what a test set.
static std::atomic<int64_t> g_split_tokens{kMinPartTokens};

int64_t set_decode_split_tokens(int64_t tokens) {
  TORCH_CHECK(tokens >= 0, "set_decode_split_tokens: tokens must be >= 0 (0: the default), got ",
              tokens);
  return g_split_tokens.exchange(tokens > 0 ? tokens : kMinPartTokens);
}

template <typename TQ, typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_tables.stride(0);
  // K/V rows of one token for one KV head are head_dim apart inside a token's slot.
  const int64_t tok_stride = num_kv_heads * head_dim;
  const int64_t blk_stride = block_size * tok_stride;
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const TQ* qp = q.data_ptr<TQ>();
  TQ* op = out.data_ptr<TQ>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // The vector path, chosen at run time (quant_isa(): 0 scalar, 1 AVX2, 2+ AVX512); the
  // AVX512 and AVX2 ones give the same bits, the generic one the same within rounding.
  const int isa = quant_isa();
  (void)isa;
  // Checked here: an exception must not leave a parallel region.
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && (lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "paged_decode_attention: sequence ", s, " has context ", lens[s],
                " for a block table of ", block_tables.size(1), " blocks");
  }

  // Work items: whole sequences when there are enough of them for every thread (reads of a
  // block are then sequential), else (sequence, KV head) pairs so one long sequence still
  // spreads over the threads; too few of those, and their contexts are split (decode_split.h).
  const int64_t threads = at::get_num_threads();
  const bool whole = num_seqs >= 2 * threads && num_heads <= kMaxItemHeads;
  const int64_t per_item = whole ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / per_item;
  // Tokens [t0, t1) of an item, normalized into out, or kept in *partial.
  const auto run = [&](int64_t item, int64_t t0, int64_t t1, const DecodePartial* partial) {
    const int64_t s = item / items_per_seq;
    const int64_t g = (item % items_per_seq) * per_item;
    const PagedRows rows{bt + s * bt_s0, block_size, blk_stride, tok_stride, g * head_dim};
    const TQ* qs = qp + s * q_s0 + g * group * q_s1;
    TQ* os = op + s * o_s0 + g * group * o_s1;
#ifdef TS_AVX2
    if constexpr (std::is_same_v<TQ, float> && has_load8<T>()) {
      if (isa >= 1 && per_item * group <= kMaxItemHeads && (head_dim == 64 || head_dim == 128)) {
        const auto heads = [&](auto kernel) {
          kernel(qs, q_s1, os, o_s1, kp, vp, rows, t0, t1, per_item, group, fscale, partial);
        };
#ifdef __AVX512F__
        if (isa >= 2) {
          return head_dim == 64 ? heads(decode_heads<prefill_vec::Vec512, 8, T>)
                                : heads(decode_heads<prefill_vec::Vec512, 16, T>);
        }
#endif
        return head_dim == 64 ? heads(decode_heads<prefill_vec::VecAvx2, 8, T>)
                              : heads(decode_heads<prefill_vec::VecAvx2, 16, T>);
      }
    }
#endif
    for (int64_t gi = 0; gi < per_item; ++gi) {
      const PagedRows rg{rows.table, block_size, blk_stride, tok_stride, (g + gi) * head_dim};
      DecodePartial pg{};
      if (partial != nullptr) {
        pg = {partial->acc + gi * group * head_dim, partial->m + gi * group, partial->l + gi * group};
      }
      decode_one_generic<TQ, T>(qs + gi * group * q_s1, q_s1, os + gi * group * o_s1, o_s1, kp, vp,
                                rg, t0, t1, group, head_dim, fscale,
                                partial != nullptr ? &pg : nullptr);
    }
  };
  const DecodePlan plan =
      whole ? DecodePlan{} : plan_decode_split(lens, num_seqs, items_per_seq, threads, g_split_tokens.load());
  if (plan.pieces.empty()) {
    parallel_dynamic(num_seqs * items_per_seq,
                     [&](int64_t item) { run(item, 0, lens[item / items_per_seq], nullptr); });
    return;
  }
  // Partial slots: acc [heads, D], m [heads], l [heads] per part (heads: one KV head's group).
  const int64_t heads = per_item * group, part_floats = heads * (head_dim + 2);
  thread_local std::vector<float> partials;
  partials.resize(plan.num_parts * part_floats);
  // A worker naming `partials` would get its own thread_local: pass the caller's by pointer.
  float* const part_base = partials.data();
  const auto slot = [&](int64_t part) {
    float* base = part_base + part * part_floats;
    return DecodePartial{base, base + heads * head_dim, base + heads * (head_dim + 1)};
  };
  // Parts done per split item: whichever thread finishes the last one merges them; acq_rel so
  // it sees every other part's partial.
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[plan.splits.size()]);
  for (size_t i = 0; i < plan.splits.size(); ++i) done[i].store(0, std::memory_order_relaxed);
  parallel_dynamic(static_cast<int64_t>(plan.pieces.size()), [&](int64_t i) {
    const DecodePiece& pc = plan.pieces[i];
    if (pc.split < 0) {
      run(pc.item, pc.t0, pc.t1, nullptr);
      return;
    }
    const DecodePartial mine = slot(pc.part);
    run(pc.item, pc.t0, pc.t1, &mine);
    const DecodeSplitItem& sp = plan.splits[pc.split];
    if (done[pc.split].fetch_add(1, std::memory_order_acq_rel) + 1 < sp.parts) return;
    DecodePartial parts[kMaxParts];
    for (int64_t p = 0; p < sp.parts; ++p) parts[p] = slot(plan.pieces[sp.piece0 + p].part);
    const int64_t s = sp.item / items_per_seq, g = (sp.item % items_per_seq) * per_item;
    merge_parts<TQ>(parts, sp.parts, heads, head_dim, op + s * o_s0 + g * group * o_s1, o_s1);
  });
}

// out [n, H, D] (last dim contiguous) = attention of q [n, H, D] over each sequence's first
// seq_lens[i] cached tokens. kv_cache: [2, num_blocks, block_size, H_kv, D], contiguous.
// dtypes: q, out and kv_cache alike, or q and out float32 over a bfloat16 / float16 pool
// (widened as it is read: half the bytes of a float32 pool).
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [n, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || q.scalar_type() == at::kFloat,
              "paged_decode_attention: q is ", q.scalar_type(), " over a ",
              kv_cache.scalar_type(), " kv_cache (want the same dtype, or float32 q)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.size(0) >= q.size(0), "seq_lens too short");
  TORCH_CHECK(block_tables.size(0) >= q.size(0), "block_tables has too few rows");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  const bool fq = q.scalar_type() == at::kFloat;
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      decode_attention_impl<float, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    case at::kBFloat16:
      if (fq) {
        decode_attention_impl<float, c10::BFloat16>(out, q, k_cache, v_cache, block_tables,
                                                    seq_lens, scale);
      } else {
        decode_attention_impl<c10::BFloat16, c10::BFloat16>(out, q, k_cache, v_cache,
                                                            block_tables, seq_lens, scale);
      }
      break;
    case at::kHalf:
      if (fq) {
        decode_attention_impl<float, c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                scale);
      } else {
        decode_attention_impl<c10::Half, c10::Half>(out, q, k_cache, v_cache, block_tables,
                                                    seq_lens, scale);
      }
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", kv_cache.scalar_type());
  }
}

}  // namespace tailserve_cpu
