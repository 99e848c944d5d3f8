// The prefill attention on AMX bf16 tiles (prefill_amx.cpp): split operands (near float32) for
// the amx level, one bf16 rounding each for the opt-in amx-bf16 level.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tailserve_cpu {

// paged_prefill_attention's work (its arguments, checked by it) on AMX bf16 tiles; false where
// this build, CPU or head size cannot (head_dim a multiple of 32, at most 256): the caller runs
// its float32 path. split: each operand as bf16 hi + lo, three tile products a product.
template <typename T>
bool prefill_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                 int64_t first_seq, int64_t num_seqs, float scale, bool split);

}  // namespace tailserve_cpu
