// Every torch.ops.tailserve schema and its CPU implementation, in one place; the kernels are
// declared in cpu_ops.h and defined by concern in the other files of this folder.

#include <torch/library.h>

#include "cpu_ops.h"
#include "work_pool.h"

TORCH_LIBRARY(tailserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
  m.def("write_kv_cache(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int first_seq, float scale) -> ()");
  m.def("set_kernel_spin_us(int us) -> ()");
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
  m.def("panel16_linear(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
  m.def("set_bf16_dot(bool enabled) -> bool");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("decode_layers(Tensor(a!) embeds, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int num_decodes, Tensor final_norm, int num_heads, float eps, "
        "float scale) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("quant_embedding(Tensor ids, Tensor w) -> Tensor");
  m.def("quant_dequantize(Tensor w) -> Tensor");
  m.def("set_quant_isa(int isa) -> int");
  m.def("set_weight_prefetch(int bytes, bool l2) -> (int, bool)");
  m.def("weight_prefetch() -> (int, bool)");
  m.def("isa_info() -> (int, int, int, bool, bool, bool, bool, bool, str)");
  m.def("set_decode_split_tokens(int tokens) -> int");
  m.def("amx_peak(bool bf16, int iterations) -> float");
}

// No tensor arguments: registered for every backend.
TORCH_LIBRARY_IMPL(tailserve, CompositeExplicitAutograd, m) {
  m.impl("set_kernel_spin_us", &tailserve_cpu::set_kernel_spin_us);
  m.impl("set_bf16_dot", &tailserve_cpu::set_bf16_dot);
  m.impl("set_quant_isa", &tailserve_cpu::set_quant_isa);
  m.impl("set_weight_prefetch", &tailserve_cpu::set_weight_prefetch);
  m.impl("weight_prefetch", &tailserve_cpu::weight_prefetch);
  m.impl("isa_info", &tailserve_cpu::isa_info);
  m.impl("set_decode_split_tokens", &tailserve_cpu::set_decode_split_tokens);
  m.impl("amx_peak", &tailserve_cpu::amx_peak);
}

TORCH_LIBRARY_IMPL(tailserve, CPU, m) {
  m.impl("paged_decode_attention", &tailserve_cpu::paged_decode_attention);
  m.impl("write_kv_cache", &tailserve_cpu::write_kv_cache);
  m.impl("paged_prefill_attention", &tailserve_cpu::paged_prefill_attention);
  m.impl("skinny_linear", &tailserve_cpu::skinny_linear);
  m.impl("panel_linear", &tailserve_cpu::panel_linear);
  m.impl("panel16_linear", &tailserve_cpu::panel16_linear);
  m.impl("rms_norm", &tailserve_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &tailserve_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &tailserve_cpu::silu_and_mul);
  m.impl("rope_", &tailserve_cpu::rope_);
  m.impl("decode_layers", &tailserve_cpu::decode_layers);
  m.impl("quant_linear", &tailserve_cpu::quant_linear);
  m.impl("quant_embedding", &tailserve_cpu::quant_embedding);
  m.impl("quant_dequantize", &tailserve_cpu::quant_dequantize);
}
