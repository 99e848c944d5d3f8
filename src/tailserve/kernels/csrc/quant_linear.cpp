// torch.ops.tailserve.quant_linear, quant_embedding, quant_dequantize, set_quant_isa: products
// and lookups on GGUF weights kept as their stored blocks (model/quant/formats.py). This file
// checks the inputs, chooses the instruction set and sends each product to its path:
//
//   quant_blocks.h         the block formats, a block unpacked, what the files below share
//   quant_activations.cpp  x to int8 in blocks of 32
//   quant_decode_rows.cpp  1-8 rows of x: blocks unpacked in registers, read once per step
//   quant_panels.cpp       9 rows and more: unpacked, interleaved weight tiles (VNNI, AVX2)
//   quant_unpacked.cpp     the rest (the scalar level): rows unpacked into a buffer
//   quant_tiled.cpp        tiled 32-value formats, every row count
//   quant_amx*.cpp         AMX tiles: int8 (tiled, VNNI's bits; quant_amx_kquant.cpp the
//                          K-quants as stored, the panels' bits) and the opt-in bf16 (any)
//
// A packed weight is a uint8 tensor [N, K / block, type_size]: each output row is a run of
// whole ggml blocks, as in the file. type_size alone names the format (Q4_0 18, Q4_1 20,
// Q5_0 22, Q5_1 24, Q8_0 34, Q4_K 144, Q5_K 176, Q6_K 210 bytes), so no format argument
// travels beside the tensor and decode_layers can tell a packed weight from a float panel.
// The 32-value formats are served tiled, [N / 16, K / 32, 16, type_size] (the same bytes in
// the order of the integer dot products, built once at load): those go to quant_tiled.cpp
// for every row count after x is quantized; the other paths read the stored form.
//
// y = x W^T works the way llama.cpp gets its speed: each row of x is quantized to int8 in
// blocks of 32 (scale dx = max|x| / 127, round to nearest), and every format is read as
//   w_i = a_g * q_i + b_g   (q_i an unsigned integer < 64, or int8 for Q8_0; g a group of 16)
// so a row's dot product is  sum_blocks dx * sum_g a_g * (integer dot of q and xq over g)
//                           + sum_g b_g * dx * (sum of xq over g).
// The integer dots run 32 (AVX2 maddubs) or 64 (AVX512 VNNI dpbusd) values per instruction.
// Blocks are unpacked (nibbles and high bits merged into bytes, scales expanded) a few rows at
// a time into a per-thread buffer that stays in L1/L2, and reused for every row of x: the
// weights are read from memory once per call, in their stored size.
//
// The instruction set is chosen at run time (isa.h: set_quant_isa; -1 = best this CPU has), so
// tests run the AVX2 path on an AVX512 machine too. All paths compute the same integer sums; they
// differ only in the order float partial sums are added (~1e-6 relative).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "scratch.h"
#include "cpu_ops.h"
#include "isa.h"
#include "quant_blocks.h"
#include "quant_tiled.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {

using namespace quant;

namespace {

Packed check_packed(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte &&
                  (w.dim() == 3 || w.dim() == 4) && w.is_contiguous(),
              op, ": packed weight must be a contiguous uint8 CPU tensor [N, blocks, type_size] "
              "(as stored) or [N / 16, K / 32, 16, type_size] (tiled), got ", w.scalar_type(),
              " ", w.sizes());
  Packed p;
  const int64_t ts = w.size(w.dim() - 1);
  TORCH_CHECK(fmt_of(ts, &p.f), op, ": no ggml format has ", ts,
              "-byte blocks (Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, Q8_0 34, Q4_K 144, Q5_K 176, "
              "Q6_K 210)");
  p.tiled = w.dim() == 4;
  p.type_size = ts;
  p.data = w.data_ptr<uint8_t>();
  if (p.tiled) {
    TORCH_CHECK(p.f.block == 32 && w.size(2) == 16, op, ": a tiled weight is [N / 16, K / 32, "
                "16, type_size] of a 32-value format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), got ",
                w.sizes());
    p.N = w.size(0) * 16;
    p.K = w.size(1) * 32;
  } else {
    p.N = w.size(0);
    p.K = w.size(1) * p.f.block;
  }
  return p;
}

// Up to kFusedMaxRows rows of x the blocks are read straight into vector registers
// (quant_decode_rows.cpp): a decode step reads each weight byte once or twice. Above it
// unpacking a tile once for every row of x is cheaper (quant_panels.cpp; measured on Zen 5,
// 3072 x 576 Q4_1: 8 rows 0.27 ms fused vs 0.39 ms in panels; 64 rows 0.72 ms in panels).
// The K-quants likewise.
constexpr int64_t kFusedMaxRows = 8;
constexpr int64_t kPanelMinRows = 9;

}  // namespace

static_assert(kAvx512Vnni == isa::kAvx512Vnni && kAvx2 == isa::kAvx2, "isa.h numbers the levels");

int64_t set_quant_isa(int64_t level) { return isa::set(static_cast<int>(level)); }

int quant_isa() { return isa::current(); }

std::tuple<int64_t, bool> set_weight_prefetch(int64_t bytes, bool l2) {
  const isa::WeightPrefetch p = isa::set_weight_prefetch(bytes, l2);
  return {p.bytes, p.l2};
}

std::tuple<int64_t, bool> weight_prefetch() {
  return {isa::g_weight_prefetch.bytes, isa::g_weight_prefetch.l2};
}

// (level, best, supported, avx512bf16, amx cpu, amx bf16, amx os, amx permitted, why AMX is
// not usable)
std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, bool, bool, std::string> isa_info() {
  const isa::AmxStatus& amx = isa::amx_status();
  return {isa::current(), isa::best(), isa::supported(), isa::has_avx512bf16(), amx.cpu,
          amx.bf16, amx.os, amx.permitted, amx.reason};
}

namespace {

void check_x(const Packed& p, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quant_linear: x must be float32 CPU [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == p.K, "quant_linear: x has ", x.size(1), " features, the weight ", p.K);
}

// y = x W^T on int8 activations: the tiles (VNNI, AMX int8), or the stored-block paths.
void int8_rows(const Packed& p, const at::Tensor& xc, const float* bp, float* yp) {
  const int64_t M = xc.size(0), K = p.K, N = p.N;
  // x in int8: xq [M, K], dx [M, K/32], xs [M, K/16] (and per 32: xs32). The calling
  // thread's buffers, kept between calls, grown and never cleared (quantize_rows writes every
  // element the products read; scratch.h): a zeroed allocation a call, ~1 MB at 512 rows,
  // cost the int8 tile products 2-9% (576 x 576 x 512 rows: 0.43 -> 0.39 ms).
  thread_local Scratch<int8_t> xq_buf;
  thread_local Scratch<float> dx_buf, xs_buf, xs32_buf;
  thread_local Scratch<int32_t> xi32_buf;
  int8_t* xq = xq_buf.get(M * K);
  float* dx = dx_buf.get(M * (K / 32));
  float* xs = xs_buf.get(M * (K / 16));
  float* xs32 = xs32_buf.get(M * (K / 32));
  int32_t* xi32 = xi32_buf.get(M * (K / 32));
  quantize_rows(xc.data_ptr<float>(), M, K, xq, dx, xs, xs32, xi32);
  const QuantizedRows xr{M, xq, dx, xs, xs32};
  // The vector products stop at VNNI (the bf16 level adds nothing to them); the AMX level
  // adds its tiles for whole groups of 16 rows.
  const int level = tailserve_cpu::isa::current();
  const int isa = std::min<int>(level, kAvx512Vnni);
  if (p.tiled) {  // every row count on the tiles (quant_tiled.cpp; AMX: quant_amx.cpp)
    const int64_t done =
        level == tailserve_cpu::isa::kAmx
            ? tiled_linear_amx(p.type_size, p.data, N, K, M, xq, dx, xs32, xi32, yp, bp)
            : 0;
    const int64_t nb = K / 32;
    if (done < M) {
      tiled_linear(isa, p.type_size, p.data, N, K, M - done, xq + done * K, dx + done * nb,
                   xs32 + done * nb, xi32 + done * nb, yp + done * N, bp);
    }
    return;
  }
#ifdef TS_AVX2
  if (isa >= kAvx2 && M <= kFusedMaxRows) {
    decode_rows_linear(isa, p, xr, yp, bp);
    return;
  }
#endif
  // The K-quants' panels on int8 tiles (quant_amx_kquant.cpp); at amx-bf16, the rows its
  // bf16 tiles left (a last partial group; N not a multiple of 16).
  if (level >= tailserve_cpu::isa::kAmx && M >= kPanelMinRows && kquant_linear_amx(p, xr, yp, bp)) {
    return;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (isa >= kAvx512Vnni && M >= kPanelMinRows) {
    panel_linear_vnni(p, xr, yp, bp);
    return;
  }
#endif
#ifdef TS_AVX2
  if (isa >= kAvx2 && M >= kPanelMinRows) {
    panel_linear_avx2(p, xr, yp, bp);
    return;
  }
#endif
  // Everything else: the scalar level (every AVX2 level takes one of the paths above at any
  // row count), or a build without AVX2.
  unpacked_linear(isa, p, xr, yp, bp);
}

// y = x W^T (+ bias) into y [M, N]; x and y checked by the callers.
void linear_into(const Packed& p, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                 at::Tensor& y) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = p.K, N = p.N;
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "quant_linear: bias must be float32 [", N, "]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  float* yp = y.data_ptr<float>();
  if (tailserve_cpu::isa::current() == tailserve_cpu::isa::kAmxBf16) {
    // The opt-in bf16 tiles take whole groups of 16 rows, tiled or as stored (the K-quants);
    // the rest below, as at VNNI.
    const float* xp = xc.data_ptr<float>();
    const int64_t done = p.tiled ? tiled_linear_amx_bf16(p.type_size, p.data, N, K, M, xp, yp, bp)
                                 : stored_linear_amx_bf16(p.type_size, p.data, N, K, M, xp, yp, bp);
    if (done == M) return;
    // Rows of a contiguous x are contiguous: the remaining ones start at row `done`.
    if (done > 0) return int8_rows(p, xc.narrow(0, done, M - done), bp, yp + done * N);
  }
  int8_rows(p, xc, bp, yp);
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
  const Packed p = check_packed(w, "quant_linear");
  check_x(p, x);
  at::Tensor y = at::empty({x.size(0), p.N}, x.options());
  linear_into(p, x, bias, y);
  return y;
}

void quant_linear_out(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const Packed p = check_packed(w, "quant_linear");
  check_x(p, x);
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.is_contiguous() &&
                  y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == p.N,
              "quant_linear: out must be a contiguous float32 CPU [", x.size(0), ", ", p.N,
              "], got ", y.scalar_type(), " ", y.sizes());
  linear_into(p, x, bias, y);
}

// Rows ids of a packed table, dequantized: w = a * q + b, as ggml defines each format.
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& w) {
  const Packed p = check_packed(w, "quant_embedding");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_embedding: ids must be "
              "int64 [T], got ", ids.scalar_type(), " ", ids.sizes());
  const at::Tensor ic = ids.contiguous();
  const int64_t T = ic.size(0), K = p.K;
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < p.N, "quant_embedding: id ", ip[t], " outside [0, ", p.N,
                ")");
  }
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = (K / p.f.block) * p.type_size;
  const bool is_signed = p.f.fmt == Fmt::Q8_0;
  if (p.tiled) {
    parallel_dynamic((T + 15) / 16, [&](int64_t item) {
      const int64_t t1 = std::min(T, item * 16 + 16);
      for (int64_t t = item * 16; t < t1; ++t) tiled_row(p.type_size, p.data, K, ip[t], op + t * K);
    });
    return out;
  }
  parallel_dynamic((T + 15) / 16, [&](int64_t item) {
    std::vector<uint8_t> q(K);
    std::vector<float> a4(K / 4), b16(K / 16);
    const int64_t t1 = std::min(T, item * 16 + 16);
    for (int64_t t = item * 16; t < t1; ++t) {
      unpack_row(p.f, p.data + ip[t] * row_bytes, K, p.type_size, q.data(), a4.data(),
                 b16.data());
      float* o = op + t * K;
      for (int64_t k = 0; k < K; ++k) {
        const float qv = is_signed ? static_cast<float>(static_cast<int8_t>(q[k]))
                                   : static_cast<float>(q[k]);
        o[k] = a4[k / 4] * qv + b16[k / 16];
      }
    }
  });
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& w) {
  const Packed p = check_packed(w, "quant_dequantize");
  return quant_embedding(at::arange(p.N, at::TensorOptions().dtype(at::kLong)), w);
}

}  // namespace tailserve_cpu
