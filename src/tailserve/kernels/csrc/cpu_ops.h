// The torch.ops.tailserve kernels that other translation units call directly (C++ to C++,
// without the dispatcher): see cpu_ops.cpp for what each computes.

#pragma once

#include <ATen/ATen.h>

namespace tailserve_cpu {

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp,
                        const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace tailserve_cpu
