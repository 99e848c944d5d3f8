// Paged K/V rows as the decode attention kernels walk them (attention.cpp's generic one and
// decode_heads.h): the block table lookup, a chunk's row pointers, the prefetches.

#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace tailserve_cpu {

// Pointer to token t's row for KV head g: blocks are [block_size, H_kv, D].
struct PagedRows {
  const int64_t* table;
  int64_t block_size, blk_stride, tok_stride, head_off;
  template <typename T>
  inline const T* row(const T* base, int64_t t) const {
    return base + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
  }
};

// The most query heads one work item of the decode attention holds (its per-head buffers);
// the item planning in attention.cpp reads it at every level, vector kernels or not.
constexpr int64_t kMaxItemHeads = 32;

#ifdef TS_AVX2
// Why one pass and spread-out prefetches: reading K/V from DRAM, one thread reached only
// ~4 GB/s with a K pass then a V pass, where a plain walk of the same blocks reads ~10 GB/s.
// A DRAM line takes ~100 ns and a core has few misses in flight, so the loads of a chunk
// must already be on their way while the previous chunk computes. Each chunk therefore
// prefetches into L1 the K rows (during its score loop) and V rows (during its V loop) of the
// chunk kPrefetchTokens ahead, a few lines at a time, and into L2 the rows kFarTokens ahead:
// +25-40% GB/s on 32-64 sequences x 300-1000 tokens for the near prefetches (bursts of whole
// chunks gained nothing), +3-14% more for the far ones (96 tokens: no steadier gain).
constexpr int64_t kPrefetchTokens = 16;
constexpr int64_t kFarTokens = 48;

// K and V row pointers of tokens [t, t + count), one table lookup per block they fall in.
template <typename TKV>
inline void chunk_rows(const PagedRows& rows, const TKV* kp, const TKV* vp, int64_t t,
                       int64_t count, const TKV** pk, const TKV** pv) {
  for (int64_t j = 0; j < count;) {
    const int64_t stop = std::min(count, j + rows.block_size - (t + j) % rows.block_size);
    const TKV* kb = rows.row(kp, t + j);
    const TKV* vb = rows.row(vp, t + j);
    for (int64_t i = 0; j < stop; ++j, ++i) {
      pk[j] = kb + i * rows.tok_stride;
      pv[j] = vb + i * rows.tok_stride;
    }
  }
}

// Prefetch `bytes` bytes from p: Hint _MM_HINT_T0 into L1, _MM_HINT_T1 into L2.
template <int Hint>
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(Hint));
}
#endif

}  // namespace tailserve_cpu
