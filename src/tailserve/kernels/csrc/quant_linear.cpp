// torch.ops.tailserve.quant_linear, quant_embedding, quant_dequantize, set_quant_isa: products
// and lookups on GGUF weights kept as their stored blocks (model/quant/formats.py).
//
// A packed weight is a uint8 tensor [N, K / block, type_size]: each output row is a run of
// whole ggml blocks, as in the file. type_size alone names the format (Q4_0 18, Q4_1 20,
// Q5_0 22, Q5_1 24, Q8_0 34, Q4_K 144, Q5_K 176, Q6_K 210 bytes), so no format argument
// travels beside the tensor and decode_layers can tell a packed weight from a float panel.
// The 32-value formats are served tiled, [N / 16, K / 32, 16, type_size] (the same bytes in
// the order of the integer dot products, built once at load): those go to quant_tiled.cpp
// for every row count after x is quantized here; what follows reads the stored form.
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
// The instruction set is chosen at run time (set_quant_isa; -1 = best this CPU has), so tests
// run the AVX2 path on an AVX512 machine too. All paths compute the same integer sums; they
// differ only in the order float partial sums are added (~1e-6 relative).

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "quant_tiled.h"
#include "simd.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace {

enum class Fmt { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

struct FmtInfo {
  Fmt fmt;
  int64_t block;  // values per block
};

bool fmt_of(int64_t type_size, FmtInfo* out) {
  switch (type_size) {
    case 18: *out = {Fmt::Q4_0, 32}; return true;
    case 20: *out = {Fmt::Q4_1, 32}; return true;
    case 22: *out = {Fmt::Q5_0, 32}; return true;
    case 24: *out = {Fmt::Q5_1, 32}; return true;
    case 34: *out = {Fmt::Q8_0, 32}; return true;
    case 144: *out = {Fmt::Q4_K, 256}; return true;
    case 176: *out = {Fmt::Q5_K, 256}; return true;
    case 210: *out = {Fmt::Q6_K, 256}; return true;
    default: return false;
  }
}

inline float h2f(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ggml's 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block -> q[block] (bytes), a4[block / 4] (the scale of each run of 4 values: the lanes
// of the integer dot), b16[block / 16] (the offset of each group of 16).
inline void set_group(float* a4, float* b16, int64_t g, float a, float b) {
  for (int i = 0; i < 4; ++i) a4[4 * g + i] = a;
  b16[g] = b;
}

void unpack_block(Fmt fmt, const uint8_t* blk, uint8_t* q, float* a4, float* b16) {
  switch (fmt) {
    case Fmt::Q4_0:
    case Fmt::Q4_1: {
      const float d = h2f(blk);
      const float b = fmt == Fmt::Q4_0 ? -8.f * d : h2f(blk + 2);
      const uint8_t* qs = blk + (fmt == Fmt::Q4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = qs[j] & 0xF;
        q[j + 16] = qs[j] >> 4;
      }
      set_group(a4, b16, 0, d, b);
      set_group(a4, b16, 1, d, b);
      return;
    }
    case Fmt::Q5_0:
    case Fmt::Q5_1: {
      const float d = h2f(blk);
      const float b = fmt == Fmt::Q5_0 ? -16.f * d : h2f(blk + 2);
      const uint8_t* hp = blk + (fmt == Fmt::Q5_0 ? 2 : 4);
      uint32_t qh;
      std::memcpy(&qh, hp, 4);
      const uint8_t* qs = hp + 4;
      for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      set_group(a4, b16, 0, d, b);
      set_group(a4, b16, 1, d, b);
      return;
    }
    case Fmt::Q8_0: {
      const float d = h2f(blk);
      std::memcpy(q, blk + 2, 32);  // int8, read signed by the dot
      set_group(a4, b16, 0, d, 0.f);
      set_group(a4, b16, 1, d, 0.f);
      return;
    }
    case Fmt::Q4_K:
    case Fmt::Q5_K: {
      const float d = h2f(blk), dmin = h2f(blk + 2);
      const uint8_t* scales = blk + 4;
      const bool five = fmt == Fmt::Q5_K;
      const uint8_t* qh = blk + 16;
      const uint8_t* ql = blk + (five ? 48 : 16);
      for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles then high nibbles of 32 bytes
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * j, scales, &sc1, &m1);
        scale_min_k4(2 * j + 1, scales, &sc2, &m2);
        const uint8_t u1 = static_cast<uint8_t>(1 << (2 * j)), u2 = static_cast<uint8_t>(2 << (2 * j));
        uint8_t* qo = q + 64 * j;
        for (int l = 0; l < 32; ++l) {
          qo[l] = (ql[l] & 0xF) | (five && (qh[l] & u1) ? 16 : 0);
          qo[l + 32] = (ql[l] >> 4) | (five && (qh[l] & u2) ? 16 : 0);
        }
        ql += 32;
        for (int g = 0; g < 2; ++g) {
          set_group(a4, b16, 4 * j + g, d * sc1, -dmin * m1);
          set_group(a4, b16, 4 * j + 2 + g, d * sc2, -dmin * m2);
        }
      }
      return;
    }
    case Fmt::Q6_K: {
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = h2f(blk + 208);
      for (int n = 0; n < 2; ++n) {  // 128 values each
        uint8_t* qo = q + 128 * n;
        for (int l = 0; l < 32; ++l) {
          qo[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
          qo[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
          qo[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          qo[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
        for (int g = 0; g < 8; ++g) {
          const float a = d * sc[8 * n + g];
          set_group(a4, b16, 8 * n + g, a, -32.f * a);
        }
        ql += 64;
        qh += 32;
      }
      return;
    }
  }
}

// A row of K values, unpacked: K bytes, K / 4 lane scales, K / 16 group offsets.
void unpack_row(const FmtInfo& f, const uint8_t* row, int64_t K, int64_t type_size, uint8_t* q,
                float* a4, float* b16) {
  for (int64_t k = 0; k < K; k += f.block, row += type_size) {
    unpack_block(f.fmt, row, q + k, a4 + k / 4, b16 + k / 16);
  }
}

// ----------------------------------------------------------------- activations to int8

#ifdef TS_AVX2
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// x [M, K] -> xq [M, K] int8, dx [M, K / 32], xs [M, K / 16] = dx * (sum of xq over 16),
// xs32 [M, K / 32] the same over 32. Every path (and the torch reference) rounds the same
// float32 products x * (1 / d) to nearest even, so they agree on every integer.
inline void quantize_block(const float* v, int8_t* o, float* d_out, float* s16, float* s32,
                           int32_t* i32) {
#ifdef TS_AVX2
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256 r[4];
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_round_ps(_mm256_mul_ps(x[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(r[i]);
  }
  const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), b);
  const float lo = hsum256(_mm256_add_ps(r[0], r[1])), hi = hsum256(_mm256_add_ps(r[2], r[3]));
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int lo_i = 0, hi_i = 0;
  for (int i = 0; i < 32; ++i) {
    const int qv = static_cast<int>(std::nearbyint(v[i] * id));
    o[i] = static_cast<int8_t>(qv);
    (i < 16 ? lo_i : hi_i) += qv;
  }
  const float lo = static_cast<float>(lo_i), hi = static_cast<float>(hi_i);
#endif
  *d_out = d;
  s16[0] = d * lo;
  s16[1] = d * hi;
  *s32 = d * (lo + hi);
  *i32 = static_cast<int32_t>(lo + hi);  // sums of at most 32 x 127: exact in float
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs,
                   float* xs32, int32_t* xi32) {
  const int64_t nb = K / 32;
  parallel_dynamic((M + 7) / 8, [&](int64_t item) {
    const int64_t m1 = std::min(M, item * 8 + 8);
    for (int64_t m = item * 8; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        quantize_block(x + m * K + b * 32, xq + m * K + b * 32, dx + m * nb + b,
                       xs + m * (K / 16) + 2 * b, xs32 + m * nb + b, xi32 + m * nb + b);
      }
    }
  });
}

// ----------------------------------------------------------------- integer dot products

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

int best_isa() {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return kAvx512Vnni;
#endif
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (__builtin_cpu_supports("avx512bw")) return kAvx512;
#endif
#ifdef TS_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_isa{-1};  // -1: not chosen yet

int current_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = best_isa();
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return isa;
}

// Rows of one x row (xq, dx) against R unpacked weight rows: out[r] = the a-part of the dot.
template <int R, bool Signed>
void dot_rows_scalar(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                     const float* const* a4, float* out) {
  for (int r = 0; r < R; ++r) {
    double acc = 0.0;
    for (int64_t b = 0; b < K / 32; ++b) {
      float blk = 0.f;
      for (int l = 0; l < 8; ++l) {  // lanes of 4, as the SIMD paths group them
        int32_t s = 0;
        for (int i = 0; i < 4; ++i) {
          const int64_t k = b * 32 + l * 4 + i;
          const int w = Signed ? static_cast<int8_t>(q[r][k]) : q[r][k];
          s += w * xq[k];
        }
        blk += static_cast<float>(s) * a4[r][b * 8 + l];
      }
      acc += static_cast<double>(blk * dx[b]);
    }
    out[r] = static_cast<float>(acc);
  }
}

#ifdef TS_AVX2
inline __m256i dot32_avx2(__m256i w, __m256i x, bool is_signed) {
  const __m256i p = is_signed
                        ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                        : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}


template <int R, bool Signed>
void dot_rows_avx2(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                   const float* const* a4, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256 d = _mm256_broadcast_ss(dx + k / 32);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + k));
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv, Signed)),
                                     _mm256_loadu_ps(a4[r] + k / 4));
      acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
template <bool Vnni, bool Signed>
inline __m512i dot64_avx512(__m512i w, __m512i x) {
  if constexpr (Signed) {  // |w| x (x with w's sign): u8 x s8 as the instructions want
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    w = _mm512_abs_epi8(w);
  }
#ifdef __AVX512VNNI__
  if constexpr (Vnni) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#endif
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
}

template <int R, bool Signed, bool Vnni>
void dot_rows_avx512(const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
                     const float* const* a4, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i xv = _mm512_loadu_si512(xq + k);
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(dx[k / 32]),
                                        _mm256_set1_ps(dx[k / 32 + 1]), 1);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(q[r] + k);
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot64_avx512<Vnni, Signed>(wv, xv)),
                                     _mm512_loadu_ps(a4[r] + k / 4));
      acc[r] = _mm512_fmadd_ps(s, d, acc[r]);
    }
  }
  float tail[R] = {};
  if (k < K) {  // one block of 32 left (K is a multiple of 32)
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256 d = _mm256_broadcast_ss(dx + k / 32);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + k));
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32_avx2(wv, xv, Signed)),
                                     _mm256_loadu_ps(a4[r] + k / 4));
      tail[r] = hsum256(_mm256_mul_ps(s, d));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}
#endif

template <int R, bool Signed>
void dot_rows(int isa, const int8_t* xq, const float* dx, int64_t K, const uint8_t* const* q,
              const float* const* a4, float* out) {
  switch (isa) {
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#ifdef __AVX512VNNI__
    case kAvx512Vnni: return dot_rows_avx512<R, Signed, true>(xq, dx, K, q, a4, out);
#endif
    case kAvx512: return dot_rows_avx512<R, Signed, false>(xq, dx, K, q, a4, out);
#endif
#ifdef TS_AVX2
    case kAvx2: return dot_rows_avx2<R, Signed>(xq, dx, K, q, a4, out);
#endif
    default: return dot_rows_scalar<R, Signed>(xq, dx, K, q, a4, out);
  }
}


struct Packed {
  FmtInfo f;
  int64_t N, K, type_size;
  const uint8_t* data;
  bool tiled;  // [N / 16, K / 32, 16, type_size] (quant_tiled.h), else [N, blocks, type_size]
};

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


// ----------------------------------------------------------------- decode rows, in registers

// Up to kFusedMaxRows rows of x, the 32-value formats are read block by block straight into
// vector registers (no buffer), kFusedRows x rows per pass over W: a decode step reads each
// weight byte once or twice. Above it unpacking a tile once for every row of x is cheaper
// (measured on Zen 5, 3072 x 576 Q4_1: 8 rows 0.27 ms fused vs 0.39 ms in panels; 64 rows
// 0.72 ms in panels). The K-quants likewise (fused_kquant_rows).
constexpr int64_t kFusedRows = 4;
constexpr int64_t kFusedMaxRows = 8;
constexpr int64_t kPanelMinRows = 9;

// Decode rows stream W from DRAM (a 135M model's 97 MB do not fit in L3), and one core's
// hardware prefetchers alone kept too few lines in flight: the LM head (Q8_0, 30 MB) ran at
// 6-8 GB/s per thread against 33 GB/s for the same kernel on a matrix held in L3. The fused
// loops prefetch the bytes this far ahead of the block they read (one thread, LM head:
// 1 KB 14, 4 KB 14-17, 8 KB 17 GB/s; the down projection 6 -> 10-12 GB/s at 2-4 KB; 2
// threads, LM head 3-4 -> 14-17 GB/s; shared machine, benchmarks/RESULTS.md).
constexpr int64_t kPrefetchBytes = 4096;
inline int64_t prefetch_bytes() { return kPrefetchBytes; }

bool is_block32(Fmt f) {
  return f == Fmt::Q4_0 || f == Fmt::Q4_1 || f == Fmt::Q5_0 || f == Fmt::Q5_1 || f == Fmt::Q8_0;
}

#ifdef TS_AVX2
inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// One block of a 32-value format: its 32 integers (u8, or s8 for Q8_0), scale and offset.
template <Fmt F>
inline __m256i load_block32(const uint8_t* blk, float* d, float* off) {
  *d = f16_at(blk);
  if constexpr (F == Fmt::Q8_0) {
    *off = 0.f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    constexpr int kQs = F == Fmt::Q4_0 ? 2 : F == Fmt::Q4_1 ? 4 : F == Fmt::Q5_0 ? 6 : 8;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQs));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                                 _mm256_set1_epi8(0x0F));
    if constexpr (F == Fmt::Q5_0 || F == Fmt::Q5_1) {
      uint32_t qh;
      std::memcpy(&qh, blk + (F == Fmt::Q5_0 ? 2 : 4), 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    }
    if constexpr (F == Fmt::Q4_0) *off = -8.f * *d;
    else if constexpr (F == Fmt::Q5_0) *off = -16.f * *d;
    else *off = f16_at(blk + 2);
    return q;
  }
}

template <bool Vnni>
inline __m256i idot32(__m256i w, __m256i x, bool is_signed) {
  if (is_signed) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (Vnni) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// Rows [n0, n1) of W against MR rows of x; two weight rows at a time for two FMA chains.
template <Fmt F, bool Vnni, int MR>
void fused_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
                const float* dx, const float* xs32, float* y, int64_t N, const float* bias) {
  constexpr int64_t kTs = F == Fmt::Q4_0 ? 18 : F == Fmt::Q4_1 ? 20 : F == Fmt::Q5_0 ? 22
                          : F == Fmt::Q5_1 ? 24 : 34;
  constexpr bool kSigned = F == Fmt::Q8_0;
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;
    const uint8_t* r0 = w + n * nb * kTs;
    const uint8_t* r1 = two ? r0 + nb * kTs : r0;
    __m256 acc0[MR], acc1[MR];
    float off0[MR], off1[MR];
    for (int m = 0; m < MR; ++m) {
      acc0[m] = acc1[m] = _mm256_setzero_ps();
      off0[m] = off1[m] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      // Both rows' bytes kPrefetchBytes ahead (the rows after them).
      _mm_prefetch(reinterpret_cast<const char*>(r0 + b * kTs + prefetch_bytes()), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r1 + b * kTs + prefetch_bytes()), _MM_HINT_T0);
      float d0, o0, d1, o1;
      const __m256i w0 = load_block32<F>(r0 + b * kTs, &d0, &o0);
      const __m256i w1 = load_block32<F>(r1 + b * kTs, &d1, &o1);
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
        const float dm = dx[m * nb + b];
        acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(w0, xv, kSigned)),
                                  _mm256_set1_ps(d0 * dm), acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(w1, xv, kSigned)),
                                  _mm256_set1_ps(d1 * dm), acc1[m]);
        if constexpr (!kSigned) {
          off0[m] += o0 * xs32[m * nb + b];
          off1[m] += o1 * xs32[m * nb + b];
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[m * N + n] = hsum256(acc0[m]) + off0[m] + (bias ? bias[n] : 0.f);
      if (two) y[m * N + n + 1] = hsum256(acc1[m]) + off1[m] + (bias ? bias[n + 1] : 0.f);
    }
  }
}

template <Fmt F, bool Vnni>
void fused_dispatch(int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                    const int8_t* xq, const float* dx, const float* xs32, float* y, int64_t N,
                    const float* bias) {
  switch (M) {
    case 1: return fused_rows<F, Vnni, 1>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case 2: return fused_rows<F, Vnni, 2>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case 3: return fused_rows<F, Vnni, 3>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
    default: return fused_rows<F, Vnni, 4>(w, n0, n1, K, xq, dx, xs32, y, N, bias);
  }
}

template <bool Vnni>
void fused_linear(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* dx, const float* xs32, float* y, int64_t N,
                  const float* bias) {
  switch (f) {
    case Fmt::Q4_0: return fused_dispatch<Fmt::Q4_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q4_1: return fused_dispatch<Fmt::Q4_1, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q5_0: return fused_dispatch<Fmt::Q5_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    case Fmt::Q5_1: return fused_dispatch<Fmt::Q5_1, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
    default: return fused_dispatch<Fmt::Q8_0, Vnni>(M, w, n0, n1, K, xq, dx, xs32, y, N, bias);
  }
}

// The K-quants at decode rows, unpacked in registers the same way: a Q4_K / Q5_K super-block
// is 8 groups of 32 with 6-bit scales and mins, a Q6_K one 16 groups of 16 with int8 scales.
template <Fmt F, bool Vnni, int MR>
void fused_kquant_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
                       const float* dx, const float* xs16, const float* xs32, float* y,
                       int64_t N, const float* bias) {
  constexpr int64_t kTs = F == Fmt::Q4_K ? 144 : F == Fmt::Q5_K ? 176 : 210;
  const int64_t nsb = K / 256, nb = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nsb * kTs;
    __m256 acc0[MR], acc1[MR];
    float off[MR];
    for (int m = 0; m < MR; ++m) {
      acc0[m] = acc1[m] = _mm256_setzero_ps();
      off[m] = 0.f;
    }
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = row + sb * kTs;
      for (int64_t c = 0; c < kTs; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + c + prefetch_bytes()), _MM_HINT_T0);
      }
      if constexpr (F == Fmt::Q4_K || F == Fmt::Q5_K) {
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        int sc[8], mn[8];
        for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
        const uint8_t* ql = blk + (F == Fmt::Q5_K ? 48 : 16);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (F == Fmt::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * j));
          __m256i lo = _mm256_and_si256(v, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (F == Fmt::Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
            qh = _mm256_srli_epi16(qh, 2);
          }
          const int64_t g0 = sb * 8 + 2 * j, g1 = g0 + 1;
          const float a0 = d * static_cast<float>(sc[2 * j]), a1 = d * static_cast<float>(sc[2 * j + 1]);
          const float m0 = dmin * static_cast<float>(mn[2 * j]), m1 = dmin * static_cast<float>(mn[2 * j + 1]);
          for (int m = 0; m < MR; ++m) {
            const int8_t* xr = xq + m * K;
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g0 * 32));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g1 * 32));
            acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(lo, x0, false)),
                                      _mm256_set1_ps(a0 * dx[m * nb + g0]), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(hi, x1, false)),
                                      _mm256_set1_ps(a1 * dx[m * nb + g1]), acc1[m]);
            off[m] -= m0 * xs32[m * nb + g0] + m1 * xs32[m * nb + g1];
          }
        }
      } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d; q - 32 per group of 16
        const uint8_t* ql = blk;
        const uint8_t* qhp = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = f16_at(blk + 208);
        const __m256i three = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; ++h) {
          const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
          const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qhp + 32 * h));
          __m256i q[4];
          q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                 _mm256_slli_epi16(_mm256_and_si256(hv, three), 4));
          q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srli_epi16(hv, 2), three), 4));
          q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                 _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 4), three), 4));
          q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                 _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 6), three), 4));
          for (int c = 0; c < 4; ++c) {
            const int64_t b = sb * 8 + h * 4 + c;  // the 32-block of x
            const float sa = d * static_cast<float>(sc[h * 8 + 2 * c]);
            const float sb2 = d * static_cast<float>(sc[h * 8 + 2 * c + 1]);
            for (int m = 0; m < MR; ++m) {
              const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
              const float dm = dx[m * nb + b];
              const __m256 s = _mm256_set_m128(_mm_set1_ps(sb2 * dm), _mm_set1_ps(sa * dm));
              __m256& acc = (c & 1) ? acc1[m] : acc0[m];
              acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot32<Vnni>(q[c], xv, false)), s, acc);
              off[m] -= 32.f * (sa * xs16[m * 2 * nb + 2 * b] + sb2 * xs16[m * 2 * nb + 2 * b + 1]);
            }
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      y[m * N + n] = hsum256(_mm256_add_ps(acc0[m], acc1[m])) + off[m] + (bias ? bias[n] : 0.f);
    }
  }
}

template <bool Vnni>
void fused_kquant(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* dx, const float* xs16, const float* xs32,
                  float* y, int64_t N, const float* bias) {
#define TS_KQ(F)                                                                            \
  switch (M) {                                                                              \
    case 1: return fused_kquant_rows<F, Vnni, 1>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    case 2: return fused_kquant_rows<F, Vnni, 2>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    case 3: return fused_kquant_rows<F, Vnni, 3>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
    default: return fused_kquant_rows<F, Vnni, 4>(w, n0, n1, K, xq, dx, xs16, xs32, y, N, bias); \
  }
  if (f == Fmt::Q4_K) { TS_KQ(Fmt::Q4_K) }
  if (f == Fmt::Q5_K) { TS_KQ(Fmt::Q5_K) }
  TS_KQ(Fmt::Q6_K)
#undef TS_KQ
}
#endif

// ----------------------------------------------------------------- many rows: VNNI panels

#ifdef TS_AVX2
// 16 unpacked weight rows interleaved for dpbusd: for each 4 values k..k+3, the 16 rows'
// bytes side by side (64 bytes, one zmm); per group of G values (32, or 16 for Q6_K) the 16
// rows' scales a and offsets b. One dpbusd against x's 4 bytes broadcast is then 64 products
// into 16 outputs, and the unpacked tile is reused by every row of x.
struct PanelTile {
  std::vector<uint8_t> q;  // [K / 4][16][4]
  std::vector<float> a, b;  // [K / G][16]
};

// width: rows per tile (16 for AVX512 VNNI, 8 for AVX2); q8_unsigned: Q8_0 stored + 128.
void build_panel(const Packed& p, int64_t n0, int64_t rows, int64_t G, int64_t width,
                 bool q8_unsigned, PanelTile* t, std::vector<uint8_t>& qrow,
                 std::vector<float>& a4, std::vector<float>& b16) {
  const int64_t K = p.K, groups = K / G;
  t->q.assign(K * width, 0);
  t->a.assign(groups * width, 0.f);
  t->b.assign(groups * width, 0.f);
  qrow.resize(K);
  a4.resize(K / 4);
  b16.resize(K / 16);
  const int64_t row_bytes = (K / p.f.block) * p.type_size;
  const bool q8 = p.f.fmt == Fmt::Q8_0 && q8_unsigned;
  for (int64_t r = 0; r < rows; ++r) {
    unpack_row(p.f, p.data + (n0 + r) * row_bytes, K, p.type_size, qrow.data(), a4.data(),
               b16.data());
    uint32_t* dst = reinterpret_cast<uint32_t*>(t->q.data());
    for (int64_t k4 = 0; k4 < K / 4; ++k4) {
      uint32_t v;
      std::memcpy(&v, qrow.data() + 4 * k4, 4);
      if (q8) v ^= 0x80808080u;  // int8 -> uint8 + 128, the 128 moved into the offset
      dst[k4 * width + r] = v;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float a = a4[g * G / 4];
      t->a[g * width + r] = a;
      t->b[g * width + r] = q8 ? -128.f * a : b16[g * G / 16];
    }
  }
}

// AVX2: 8 rows per tile; maddubs + madd in place of dpbusd. Q8_0 stays signed: its products
// are |w| x (x with w's sign), as u8 + 128 would overflow maddubs' 16-bit pair sums.
template <int MR, int G, bool Signed>
void panel_rows_avx2(const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                     const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  __m256 accf[MR];
  alignas(32) float bias8[8] = {};
  for (int64_t c = 0; c < cols && bias; ++c) bias8[c] = bias[c];
  for (int m = 0; m < MR; ++m) accf[m] = _mm256_load_ps(bias8);
  const int64_t groups = K / G;
  const uint8_t* wq = t.q.data();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm256_setzero_si256();
    for (int k4 = 0; k4 < G / 4; ++k4, wq += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i wa = Signed ? _mm256_sign_epi8(wv, wv) : wv;
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * G + 4 * k4, 4);
        __m256i xb = _mm256_set1_epi32(xv);
        if constexpr (Signed) xb = _mm256_sign_epi8(xb, wv);
        acci[m] = _mm256_add_epi32(acci[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xb), ones));
      }
    }
    const __m256 av = _mm256_loadu_ps(t.a.data() + g * 8);
    const __m256 bv = _mm256_loadu_ps(t.b.data() + g * 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_mul_ps(av, _mm256_set1_ps(dx[m * (K / 32) + g * G / 32]));
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[m]), s, accf[m]);
      if constexpr (!Signed) {
        accf[m] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xsg[m * groups + g]), accf[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (cols == 8) {
      _mm256_storeu_ps(y + m * N, accf[m]);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, accf[m]);
      for (int64_t c = 0; c < cols; ++c) y[m * N + c] = out[c];
    }
  }
}

template <int G, bool Signed>
void panel_chunk_avx2(int64_t rows, const PanelTile& t, int64_t K, const int8_t* xq,
                      const float* dx, const float* xsg, float* y, int64_t N, int64_t cols,
                      const float* bias) {
  switch (rows) {  // 4 rows: 8 accumulators + weights within the 16 AVX2 registers
    case 1: return panel_rows_avx2<1, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    case 2: return panel_rows_avx2<2, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    case 3: return panel_rows_avx2<3, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
    default: return panel_rows_avx2<4, G, Signed>(t, K, xq, dx, xsg, y, N, cols, bias);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// MR rows of x against one tile; y rows are N apart, `cols` (<= 16) outputs stored.
template <int MR, int G>
void panel_rows_vnni(const PanelTile& t, int64_t K, const int8_t* xq, const float* dx,
                     const float* xsg, float* y, int64_t N, int64_t cols, const float* bias) {
  __m512 accf[MR];
  const __m512 bv0 = bias ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), bias)
                          : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) accf[m] = bv0;
  const int64_t groups = K / G;
  const uint8_t* wq = t.q.data();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acci[MR];
    for (int m = 0; m < MR; ++m) acci[m] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < G / 4; ++k4, wq += 64) {
      const __m512i wv = _mm512_loadu_si512(wq);
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * G + 4 * k4, 4);
        acci[m] = _mm512_dpbusd_epi32(acci[m], wv, _mm512_set1_epi32(xv));
      }
    }
    const __m512 av = _mm512_loadu_ps(t.a.data() + g * 16);
    const __m512 bv = _mm512_loadu_ps(t.b.data() + g * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_mul_ps(av, _mm512_set1_ps(dx[m * (K / 32) + g * G / 32]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[m]), s, accf[m]);
      accf[m] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xsg[m * groups + g]), accf[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * N, mask, accf[m]);
}

template <int G>
void panel_chunk_vnni(int64_t rows, const PanelTile& t, int64_t K, const int8_t* xq,
                      const float* dx, const float* xsg, float* y, int64_t N, int64_t cols,
                      const float* bias) {
  switch (rows) {
#define TS_CASE(r) \
    case r: return panel_rows_vnni<r, G>(t, K, xq, dx, xsg, y, N, cols, bias);
    TS_CASE(1) TS_CASE(2) TS_CASE(3) TS_CASE(4) TS_CASE(5) TS_CASE(6) TS_CASE(7)
#undef TS_CASE
    default: return panel_rows_vnni<8, G>(t, K, xq, dx, xsg, y, N, cols, bias);
  }
}
#endif

// Weight rows unpacked per hand-out: their buffers (~2.3 bytes a value) stay in L2.
constexpr int64_t kTileRows = 16;
constexpr int kDotRows = 4;  // weight rows per x-row pass: each x load feeds four dots

}  // namespace

int64_t set_quant_isa(int64_t isa) {
  const int best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= kAvx512Vnni, "set_quant_isa: ", isa,
              " is not -1 (best), 0 (scalar), 1 (AVX2), 2 (AVX512) or 3 (AVX512-VNNI)");
  TORCH_CHECK(isa <= best, "set_quant_isa: level ", isa, " asked, this CPU/build has ", best);
  const int chosen = isa < 0 ? best : static_cast<int>(isa);
  g_isa.store(chosen, std::memory_order_relaxed);
  return chosen;
}

int quant_isa() { return current_isa(); }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
  const Packed p = check_packed(w, "quant_linear");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quant_linear: x must be float32 CPU [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == p.K, "quant_linear: x has ", x.size(1), " features, the weight ", p.K);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = p.K, N = p.N;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "quant_linear: bias must be float32 [", N, "]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0 || N == 0) return y;
  // x in int8: xq [M, K], dx [M, K/32], xs [M, K/16] (and per 32: xs32)
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / 32)), xs(M * (K / 16)), xs32(M * (K / 32));
  std::vector<int32_t> xi32(M * (K / 32));
  quantize_rows(xc.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data(), xs32.data(),
                xi32.data());
  const int isa = current_isa();
  const bool is_signed = p.f.fmt == Fmt::Q8_0;
  float* yp = y.data_ptr<float>();
  if (p.tiled) {  // every row count on the tiles (quant_tiled.cpp)
    tiled_linear(isa, p.type_size, p.data, N, K, M, xq.data(), dx.data(), xs32.data(),
                 xi32.data(), yp, bp);
    return y;
  }
#ifdef TS_AVX2
  if (isa >= kAvx2 && M <= kFusedMaxRows) {
    // Runs of rows per hand-out: each thread's reads stay sequential.
    const int64_t per_item = std::max<int64_t>(
        16, (N / (8 * at::get_num_threads()) + 15) / 16 * 16);
    parallel_dynamic((N + per_item - 1) / per_item, [&](int64_t item) {
      const int64_t n0 = item * per_item, n1 = std::min(N, n0 + per_item);
      for (int64_t m = 0; m < M; m += kFusedRows) {
        const int64_t mr = std::min(kFusedRows, M - m);
        const int8_t* xr = xq.data() + m * K;
        const float* dr = dx.data() + m * (K / 32);
        const float* s16 = xs.data() + m * (K / 16);
        const float* s32 = xs32.data() + m * (K / 32);
        float* yr = yp + m * N;
        const bool vnni = isa >= kAvx512Vnni;
        if (is_block32(p.f.fmt)) {
          if (vnni) fused_linear<true>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s32, yr, N, bp);
          else fused_linear<false>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s32, yr, N, bp);
        } else {
          if (vnni) fused_kquant<true>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s16, s32, yr, N, bp);
          else fused_kquant<false>(p.f.fmt, mr, p.data, n0, n1, K, xr, dr, s16, s32, yr, N, bp);
        }
      }
    });
    return y;
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (isa >= kAvx512Vnni && M >= kPanelMinRows) {
    const int64_t G = p.f.fmt == Fmt::Q6_K ? 16 : 32;
    const float* xsg = G == 16 ? xs.data() : xs32.data();
    parallel_dynamic((N + 15) / 16, [&](int64_t tile) {
      thread_local PanelTile t;
      thread_local std::vector<uint8_t> qrow;
      thread_local std::vector<float> a4, b16;
      const int64_t n0 = tile * 16, cols = std::min<int64_t>(16, N - n0);
      build_panel(p, n0, cols, G, 16, true, &t, qrow, a4, b16);
      const float* b = bp ? bp + n0 : nullptr;
      for (int64_t m = 0; m < M; m += 8) {
        const int64_t rows = std::min<int64_t>(8, M - m);
        const int8_t* xr = xq.data() + m * K;
        const float* dr = dx.data() + m * (K / 32);
        if (G == 16) {
          panel_chunk_vnni<16>(rows, t, K, xr, dr, xsg + m * (K / 16), yp + m * N + n0, N,
                               cols, b);
        } else {
          panel_chunk_vnni<32>(rows, t, K, xr, dr, xsg + m * (K / 32), yp + m * N + n0, N,
                               cols, b);
        }
      }
    });
    return y;
  }
#endif
#ifdef TS_AVX2
  if (isa >= kAvx2 && M >= kPanelMinRows) {
    const int64_t G = p.f.fmt == Fmt::Q6_K ? 16 : 32;
    const float* xsg = G == 16 ? xs.data() : xs32.data();
    parallel_dynamic((N + 7) / 8, [&](int64_t tile) {
      thread_local PanelTile t;
      thread_local std::vector<uint8_t> qrow;
      thread_local std::vector<float> a4, b16;
      const int64_t n0 = tile * 8, cols = std::min<int64_t>(8, N - n0);
      build_panel(p, n0, cols, G, 8, false, &t, qrow, a4, b16);
      const float* b = bp ? bp + n0 : nullptr;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const int8_t* xr = xq.data() + m * K;
        const float* dr = dx.data() + m * (K / 32);
        float* yr = yp + m * N + n0;
        if (is_signed) {
          panel_chunk_avx2<32, true>(rows, t, K, xr, dr, xsg + m * (K / 32), yr, N, cols, b);
        } else if (G == 16) {
          panel_chunk_avx2<16, false>(rows, t, K, xr, dr, xsg + m * (K / 16), yr, N, cols, b);
        } else {
          panel_chunk_avx2<32, false>(rows, t, K, xr, dr, xsg + m * (K / 32), yr, N, cols, b);
        }
      }
    });
    return y;
  }
#endif
  // Everything else (scalar, AVX2 / AVX512 without VNNI, K-quants at few rows): tiles of
  // unpacked rows, one dot product per (x row, weight row).
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  parallel_dynamic(tiles, [&](int64_t t) {
    thread_local std::vector<uint8_t> qbuf;
    thread_local std::vector<float> abuf, bbuf;
    const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
    qbuf.resize(kTileRows * K);
    abuf.resize(kTileRows * K / 4);
    bbuf.resize(kTileRows * K / 16);
    const int64_t row_bytes = (K / p.f.block) * p.type_size;
    for (int64_t r = 0; r < rows; ++r) {
      unpack_row(p.f, p.data + (n0 + r) * row_bytes, K, p.type_size, qbuf.data() + r * K,
                 abuf.data() + r * K / 4, bbuf.data() + r * K / 16);
    }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq.data() + m * K;
      const float* dr = dx.data() + m * (K / 32);
      const float* sr = xs.data() + m * (K / 16);
      for (int64_t r = 0; r < rows; r += kDotRows) {
        const uint8_t* qs[kDotRows];
        const float* as[kDotRows];
        for (int i = 0; i < kDotRows; ++i) {  // past the tile's end: repeat its last row
          const int64_t rr = std::min(r + i, rows - 1);
          qs[i] = qbuf.data() + rr * K;
          as[i] = abuf.data() + rr * K / 4;
        }
        float out[kDotRows];
        if (is_signed) dot_rows<kDotRows, true>(isa, xr, dr, K, qs, as, out);
        else dot_rows<kDotRows, false>(isa, xr, dr, K, qs, as, out);
        for (int i = 0; i < kDotRows && r + i < rows; ++i) {
          float off = 0.f;
          if (!is_signed) {
            const float* b = bbuf.data() + (r + i) * K / 16;
            for (int64_t g = 0; g < K / 16; ++g) off += b[g] * sr[g];
          }
          yp[m * N + n0 + r + i] = out[i] + off + (bp ? bp[n0 + r + i] : 0.f);
        }
      }
    }
  });
  return y;
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
