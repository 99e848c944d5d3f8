// The tailserve CPU kernels, registered as torch.ops.tailserve.* by bindings.cpp; decode_layers
// also calls them directly (C++ to C++, without the dispatcher).
//
//   paged_decode_attention  attention.cpp    one query token per sequence against its paged
//                                            K/V blocks, read in place
//   set_decode_split_tokens attention.cpp    its shortest context part (decode_split.h; tests)
//   write_kv_cache, paged_prefill_attention
//                           prefill_attention.cpp  a step's K/V into their slots; causal
//                                            attention of prefill chunks over paged K/V
//   panel_linear            linear.cpp       decode batches (1-128 rows) on a panel copy of W
//   skinny_linear           linear.cpp       a few rows on W as stored (no panel copy)
//   panel16_linear          linear16.cpp     any rows on 16-bit (bf16 / fp16) weight panels
//   rms_norm, fused_add_rms_norm, silu_and_mul, rope_
//                           elementwise.cpp  one pass each instead of several torch ops
//   decode_layers           decode_layers.cpp  every decoder layer of a step (decodes and
//                                            prefill chunks)
//   set_kernel_spin_us      work_pool.cpp    how long idle workers spin before they sleep
//   quant_linear, quant_embedding, quant_dequantize, set_quant_isa
//                           quant_linear.cpp products and lookups on GGUF blocks as stored
//                                            (with quant_blocks.h, quant_activations.cpp,
//                                            quant_decode_rows.cpp, quant_panels.cpp,
//                                            quant_unpacked.cpp), or tiled (quant_tiled.cpp)
//
// Parallel work runs on the kernels' own work pool (work_pool.h), handed out dynamically
// through an atomic counter because decode contexts differ in length by 10x within one step.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace tailserve_cpu {

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale);
// paged_decode_attention's shortest context part when it splits (0: the default); returns the
// previous one. For tests, which make parts of a few tokens.
int64_t set_decode_split_tokens(int64_t tokens);
void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping);
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_seq,
                             double scale);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp,
                        const c10::optional<at::Tensor>& bias);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias);
at::Tensor panel16_linear(const at::Tensor& x, const at::Tensor& wp,
                          const c10::optional<at::Tensor>& bias);
// panel_linear for float32 panels, panel16_linear for 16-bit ones (decode_layers' products).
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& wp,
                         const c10::optional<at::Tensor>& bias);
// Whether bfloat16 panels may use vdpbf16ps; returns whether they now do (the CPU has it).
bool set_bf16_dot(bool enabled);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
// Into a given [rows, n / 2] (decode_layers' step-wide buffers: no allocation per layer).
void silu_and_mul_out(const at::Tensor& x, at::Tensor& out);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor decode_layers(const at::Tensor& embeds, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         int64_t num_decodes, const at::Tensor& final_norm, int64_t num_heads,
                         double eps, double scale);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias);
// Into a given contiguous float32 [M, N] (decode_layers: ~0.75 us of at::empty per product).
void quant_linear_out(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, at::Tensor& y);
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& w);
at::Tensor quant_dequantize(const at::Tensor& w);
int64_t set_quant_isa(int64_t level);  // isa.h
// The decode rows' weight prefetch (isa.h): bytes < 0 restores this CPU's default; returns
// (bytes ahead, into L2) in use.
std::tuple<int64_t, bool> set_weight_prefetch(int64_t bytes, bool l2);
std::tuple<int64_t, bool> weight_prefetch();
// isa.h's state: (level, best, supported, avx512bf16, AMX cpu / bf16 / os / permitted, AMX's
// reason).
std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, bool, bool, std::string> isa_info();
// The instruction set level in use (set_quant_isa's numbering: 0 scalar, 1 AVX2, 2 AVX512,
// 3 AVX512-VNNI; isa.h); the prefill attention follows it too, so TAILSERVE_QUANT_ISA=avx2 tests
// the AVX2 paths on an AVX512 machine.
int quant_isa();
// Ops/s of AMX tile instructions (int8 TDPBSSD or bf16 TDPBF16PS) run back to back on registers
// by every thread torch uses, `iterations` x 4 each: the tile unit's peak (quant_amx.cpp).
double amx_peak(bool bf16, int64_t iterations);

}  // namespace tailserve_cpu
