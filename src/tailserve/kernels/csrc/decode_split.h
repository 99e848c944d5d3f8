// paged_decode_attention's context split (attention.cpp): with few (sequence, KV head) work
// items for the threads, e.g. one decoding sequence of SmolLM2's 3 KV heads on 2 threads (one
// thread did 2/3 of every layer's attention while the other waited), each item's context is
// cut into parts that run as items of their own. A part keeps its unnormalized weighted sum of
// V rows, its max score and its sum of exp(score - max); the thread that finishes an item's
// last part merges the parts (log-sum-exp), so a call is still one parallel region.
//
// The split depends only on the shapes (sequences, KV heads, context lengths, threads), so a
// step gives the same bits whoever calls the kernel (decode_layers or the module forward);
// a split item's result differs from the unsplit kernel's only by float32 rounding.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tailserve_cpu {

// Where one part of an item writes: acc [heads, D] (unnormalized), m and l [heads].
struct DecodePartial {
  float* acc;
  float* m;
  float* l;
};

inline void store_partial(const DecodePartial& p, const float* acc, const float* m,
                          const float* l, int64_t heads, int64_t head_dim) {
  std::copy(acc, acc + heads * head_dim, p.acc);
  std::copy(m, m + heads, p.m);
  std::copy(l, l + heads, p.l);
}

// Split only below this many items per thread, into at least 2 and about this many pieces per
// thread, and never into parts under min_part tokens (kMinPartTokens unless tests set it with
// set_decode_split_tokens): on 1 sequence x 128-256 tokens, parts of 64-128 made the call
// slower (each call is ~10 us there: the pieces' set-up and the merge cost more than the
// balance gained; benchmarks/notes/). Parts are kPartAlign-token aligned, so the last one
// may be short.
constexpr int64_t kSplitBelowItemsPerThread = 4;
constexpr int64_t kPiecesPerThread = 2;
constexpr int64_t kMinPartTokens = 256;
constexpr int64_t kPartAlign = 16;
constexpr int64_t kMaxParts = 64;  // merge_parts' weights

// One piece of work: tokens [t0, t1) of item (seq * items_per_seq + kv head group); split >= 0:
// one of split's parts, written to partial slot `part`.
struct DecodePiece {
  int64_t item, t0, t1, part, split;
};
struct DecodeSplitItem {
  int64_t item, piece0, parts;  // its pieces are [piece0, piece0 + parts)
};
struct DecodePlan {
  std::vector<DecodePiece> pieces;  // empty: no split, one piece per item over its whole context
  std::vector<DecodeSplitItem> splits;
  int64_t num_parts = 0;
};

// The pieces of num_seqs x items_per_seq items over `threads` threads.
inline DecodePlan plan_decode_split(const int64_t* lens, int64_t num_seqs, int64_t items_per_seq,
                                    int64_t threads, int64_t min_part) {
  DecodePlan plan;
  const int64_t items = num_seqs * items_per_seq;
  if (threads <= 1 || items >= kSplitBelowItemsPerThread * threads) return plan;
  // Parts per item, rounded up so the pieces divide evenly over the threads where the
  // contexts allow it.
  int64_t want = std::max<int64_t>(2, (kPiecesPerThread * threads + items - 1) / items);
  for (int64_t p = want; p < want + threads; ++p) {
    if ((items * p) % threads == 0) {
      want = p;
      break;
    }
  }
  want = std::min(want, kMaxParts);
  bool any = false;
  for (int64_t s = 0; s < num_seqs && !any; ++s) any = lens[s] / min_part >= 2;
  if (!any) return plan;
  for (int64_t item = 0; item < items; ++item) {
    const int64_t len = lens[item / items_per_seq];
    const int64_t parts = std::min(want, len / min_part);
    if (parts < 2) {
      plan.pieces.push_back({item, 0, len, -1, -1});
      continue;
    }
    const int64_t per = ((len + parts - 1) / parts + kPartAlign - 1) / kPartAlign * kPartAlign;
    const int64_t split = static_cast<int64_t>(plan.splits.size());
    const int64_t first = static_cast<int64_t>(plan.pieces.size());
    for (int64_t t = 0; t < len; t += per) {
      plan.pieces.push_back({item, t, std::min(len, t + per), plan.num_parts++, split});
    }
    plan.splits.push_back({item, first, static_cast<int64_t>(plan.pieces.size()) - first});
  }
  return plan;
}

// out[h] = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M = max_p m_p, parts in order.
template <typename TQ>
void merge_parts(const DecodePartial* parts, int64_t n, int64_t heads, int64_t head_dim, TQ* op,
                 int64_t o_s1) {
  float w[kMaxParts];
  for (int64_t h = 0; h < heads; ++h) {
    float mx = parts[0].m[h];
    for (int64_t p = 1; p < n; ++p) mx = std::max(mx, parts[p].m[h]);
    float l = 0.f;
    for (int64_t p = 0; p < n; ++p) {
      w[p] = std::exp(parts[p].m[h] - mx);
      l += w[p] * parts[p].l[h];
    }
    const float inv = 1.f / l;
    for (int64_t d = 0; d < head_dim; ++d) {
      float a = 0.f;
      for (int64_t p = 0; p < n; ++p) a += w[p] * parts[p].acc[h * head_dim + d];
      op[h * o_s1 + d] = static_cast<TQ>(a * inv);
    }
  }
}

}  // namespace tailserve_cpu
