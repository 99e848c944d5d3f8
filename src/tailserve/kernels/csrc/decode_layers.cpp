// torch.ops.tailserve.decode_layers: every decoder layer of one step (its decode rows and its
// prefill chunks), then the final norm, in one call. "decode" as in "decoder layers": the op
// began with decode-only steps and keeps its name.
//
// A step runs ~10 small ops per layer. Called from Python, each costs a module call, argument
// parsing and a dispatch; over 30 layers that is several milliseconds per step, a tenth of a
// single-stream token on a 2-core CPU, and under mixed traffic most steps carry a prefill
// chunk. This runs the same kernels in the same order as LlamaForCausalLM.forward after
// apply_cpu_kernels (model/transforms/), with attention split as CpuKernelAttentionBackend
// splits it (decode rows, then prefill chunks), so its hidden states are bit-identical to the
// module forward's: the CPU counterpart of replaying a captured CUDA graph. Registered in
// bindings.cpp.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_ops.h"
#include "simd16.h"

namespace tailserve_cpu {
namespace {

// Per layer, in this order: input norm weight, qkv panels, qkv bias (empty when the model has
// none), o panels, post-attention norm weight, gate_up panels, down panels
// (DecodeLayerWeights.op_args in model/cpu_decode.py).
// Projections are float32 or 16-bit panels, or GGUF blocks (project picks the kernel).
constexpr int64_t kWeightsPerLayer = 7;

// K and V of this step's tokens into their slots: qkv rows are [q | k | v]. A 16-bit pool
// (T) gets them rounded to nearest even, the bits the module forward's .to() writes.
template <typename T>
void write_kv_as(const at::Tensor& kv_cache, const at::Tensor& qkv, int64_t q_size,
                 int64_t kv_size, const int64_t* slots) {
  T* k_pool = kv_cache.data_ptr<T>();
  T* v_pool = k_pool + kv_cache.size(1) * kv_cache.size(2) * kv_size;
  const float* src = qkv.data_ptr<float>();
  const int64_t row = qkv.size(1);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    store_from_f32(k_pool + slots[t] * kv_size, src + t * row + q_size, kv_size);
    store_from_f32(v_pool + slots[t] * kv_size, src + t * row + q_size + kv_size, kv_size);
  }
}

void write_kv(const at::Tensor& kv_cache, const at::Tensor& qkv, int64_t q_size, int64_t kv_size,
              const int64_t* slots) {
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: return write_kv_as<c10::BFloat16>(kv_cache, qkv, q_size, kv_size, slots);
    case at::kHalf: return write_kv_as<c10::Half>(kv_cache, qkv, q_size, kv_size, slots);
    default: return write_kv_as<float>(kv_cache, qkv, q_size, kv_size, slots);
  }
}

// A layer's projection: panels [N/16, K, 16] in float32 or 16 bits (decode_linear,
// linear16.cpp) or GGUF blocks (uint8, quant_linear.cpp): as stored [N, blocks, type_size] or
// in tiles of 16 rows [N / 16, K / 32, 16, type_size] (quant_tiled.h).
int64_t outputs_of(const at::Tensor& w) {
  if (w.scalar_type() == at::kByte) return w.dim() == 4 ? w.size(0) * 16 : w.size(0);
  return w.size(0) * 16;
}

// GGUF blocks write into out, one of the step's buffers, allocated at the step's first GGUF
// product of its shape (at::empty costs ~0.75 us, and a one-sequence step makes 120
// products; Zen 4); panels return a tensor of their own, and a step of panels allocates none.
at::Tensor project_into(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& b, at::Tensor& out) {
  if (w.scalar_type() != at::kByte) return decode_linear(x, w, b);
  if (!out.defined()) out = at::empty({x.size(0), outputs_of(w)}, x.options());
  quant_linear_out(x, w, b, out);
  return out;
}

// Steps of many rows (a long prompt's whole-budget chunk) run the gate/up product and SiLU
// kMlpRowBlock rows at a time: [rows, 2 x intermediate] floats then stay in L2 for SiLU to
// read, where a 2,000-row step wrote and re-read 25 MB a layer. Every row's numbers are the
// same: each row is quantized and multiplied alone, and blocks a multiple of 16 rows (the
// last one longer) leave the same last T mod 16 rows to the same vector passes as one call.
// The bundled model on the Xeon with AMX (benchmarks/notes/cpu_kernels.md): a step of 960 to
// 1,016 / 1,500 / 2,000 rows 3-7% / 11-14% / 9-12% sooner; at 384-768 rows the blocks cost
// up to 8% (the weights streamed once a block), so fewer rows keep one call.
constexpr int64_t kMlpRowBlock = 128;
constexpr int64_t kMlpBlockedFrom = 960;

void gate_up_silu(const at::Tensor& h, const at::Tensor& w, at::Tensor& gate_up_buf,
                  at::Tensor& act_buf) {
  const int64_t T = h.size(0);
  if (T < kMlpBlockedFrom || w.scalar_type() != at::kByte) {
    silu_and_mul_out(project_into(h, w, std::nullopt, gate_up_buf), act_buf);
    return;
  }
  if (!gate_up_buf.defined()) {
    gate_up_buf = at::empty({2 * kMlpRowBlock, outputs_of(w)}, h.options());
  }
  for (int64_t r0 = 0; r0 < T;) {
    // The last block takes the rest too (kMlpRowBlock to 2 x kMlpRowBlock - 1 rows), so no
    // call has few rows: the K-quants' 1-8 row kernels do not give the many-row kernels' bits.
    const int64_t n = T - r0 < 2 * kMlpRowBlock ? T - r0 : kMlpRowBlock;
    at::Tensor gate_up = gate_up_buf.narrow(0, 0, n);
    quant_linear_out(h.narrow(0, r0, n), w, std::nullopt, gate_up);
    at::Tensor act = act_buf.narrow(0, r0, n);
    silu_and_mul_out(gate_up, act);
    r0 += n;
  }
}

}  // namespace

// embeds [T, hidden]: this step's token embeddings, laid out as AttentionMetadata says: the
// first num_decodes rows one token per decoding sequence, then each prefilling sequence's chunk
// (query_start_loc [num_seqs + 1], int64). It becomes the residual stream and is modified in
// place. cos, sin [T, 1, head_dim / 2]. kv_caches: one [2, num_blocks, block_size,
// num_kv_heads, head_dim] pool per layer. Returns the final normed hidden states [T, hidden].
at::Tensor decode_layers(const at::Tensor& embeds, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         int64_t num_decodes, const at::Tensor& final_norm, int64_t num_heads,
                         double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers >= 1 && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers,
              "decode_layers: ", weights.size(), " weights for ", num_layers, " layers (want ",
              kWeightsPerLayer, " per layer)");
  TORCH_CHECK(embeds.device().is_cpu() && embeds.scalar_type() == at::kFloat && embeds.dim() == 2 &&
                  embeds.is_contiguous(), "decode_layers: embeds must be float32 CPU [T, hidden]");
  const at::Tensor& pool0 = kv_caches[0];
  TORCH_CHECK(pool0.dim() == 5 && pool0.size(0) == 2, "decode_layers: kv cache must be 5-D");
  for (const at::Tensor& pool : kv_caches) {
    const auto dt = pool.scalar_type();
    TORCH_CHECK(pool.sizes() == pool0.sizes() && pool.is_contiguous() &&
                    dt == pool0.scalar_type() &&
                    (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
                "decode_layers: kv caches must be float32, bfloat16 or float16, of one dtype, "
                "contiguous and of one shape");
  }
  const int64_t T = embeds.size(0);
  const int64_t num_kv_heads = pool0.size(3), head_dim = pool0.size(4);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK((weights[1].dim() == 3 || (weights[1].dim() == 4 && weights[1].scalar_type() == at::kByte)) &&
                  outputs_of(weights[1]) == q_size + 2 * kv_size,
              "decode_layers: qkv weights give ", outputs_of(weights[1]), " outputs for ",
              num_heads, " heads and ", num_kv_heads, " KV heads of ", head_dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T, "decode_layers: slot_mapping must be int64 [T]");
  // The step's layout, checked here once rather than by each layer's attention call (the
  // prefill kernel checks each chunk against its context and block table again).
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(), "decode_layers: seq_lens must be int64 [num_seqs]");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1,
              "decode_layers: query_start_loc must be int64 [", num_seqs + 1, "] for ", num_seqs,
              " sequences");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= num_seqs, "decode_layers: ", num_decodes,
              " decodes of ", num_seqs, " sequences");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) >= num_seqs,
              "decode_layers: block_tables must be int64 [>= ", num_seqs, ", max_blocks]");
  TORCH_CHECK(num_decodes == num_seqs || head_dim % 16 == 0, "decode_layers: prefill chunks ",
              "need a head_dim that is a multiple of 16, not ", head_dim);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t block_size = pool0.size(2);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s];
    TORCH_CHECK(s < num_decodes ? n == 1 : n >= 1, "decode_layers: sequence ", s, " has ", n,
                " tokens (", num_decodes, " decodes of one token, then chunks of at least one)");
    TORCH_CHECK(n <= lens[s] && (lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "decode_layers: sequence ", s, " has ", n, " new tokens, context ", lens[s],
                ", a block table of ", block_tables.size(1), " blocks");
  }
  TORCH_CHECK(num_seqs >= 1 && qsl[0] == 0 && qsl[num_seqs] == T, "decode_layers: ",
              "query_start_loc runs from ", qsl[0], " to ", qsl[num_seqs], " for ", num_seqs,
              " sequences, the step has ", T, " tokens");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = pool0.size(1) * pool0.size(2);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decode_layers: slot ", slots[t],
                " outside the pool's ", num_slots);
  }

  // Every layer's intermediates have the same shapes: allocated once per step, not per layer
  // (the products' outputs by project_into, at their first GGUF product).
  const int64_t intermediate = outputs_of(weights[5]) / 2;
  const at::TensorOptions f32 = embeds.options();
  at::Tensor qkv_buf, o_buf, gate_up_buf, down_buf;
  at::Tensor attn = at::empty({T, num_heads, head_dim}, f32);
  at::Tensor act_buf = at::empty({T, intermediate}, f32);
  at::Tensor x = embeds;
  at::Tensor residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    // The residual add is deferred into the next norm, as in LlamaDecoderLayer.forward.
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, w[0], eps);
    } else {
      fused_add_rms_norm(x, residual, w[0], eps);
      h = x;
    }
    const std::optional<at::Tensor> qkv_bias =
        w[2].numel() ? std::optional<at::Tensor>(w[2]) : std::nullopt;
    at::Tensor qkv = project_into(h, w[1], qkv_bias, qkv_buf);  // [T, q_size + 2 * kv_size]
    rope_(qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, head_dim}), cos,
          sin);
    write_kv(kv_caches[l], qkv, q_size, kv_size, slots);
    // As CpuKernelAttentionBackend.forward: decode rows, then the chunks after them.
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    if (num_decodes > 0) {
      paged_decode_attention(attn.narrow(0, 0, num_decodes), q.narrow(0, 0, num_decodes),
                             kv_caches[l], block_tables, seq_lens, scale);
    }
    if (num_decodes < num_seqs) {
      paged_prefill_attention(attn, q, kv_caches[l], block_tables, seq_lens, query_start_loc,
                              num_decodes, scale);
    }
    h = project_into(attn.view({T, q_size}), w[3], std::nullopt, o_buf);
    fused_add_rms_norm(h, residual, w[4], eps);
    gate_up_silu(h, w[5], gate_up_buf, act_buf);
    // x (down_buf from the layer before) was consumed by this layer's qkv product.
    x = project_into(act_buf, w[6], std::nullopt, down_buf);
  }
  fused_add_rms_norm(x, residual, final_norm, eps);
  return x;
}

}  // namespace tailserve_cpu
