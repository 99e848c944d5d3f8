// The GGUF block formats as stored, and what the files of quant_linear share (quant_linear.cpp
// has the overview): which format a block size names, a block unpacked into bytes and scales,
// a checked packed weight, the instruction-set levels, x quantized to int8, and each path's
// entry (decode rows in registers, panels, unpacked rows).
//
// The helpers are defined here, inline, so every file that reads blocks compiles the same code
// it did when all of this was one file; each path's loops stay in their own file, called once
// per product.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace tailserve_cpu {
namespace quant {

enum class Fmt { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

struct FmtInfo {
  Fmt fmt;
  int64_t block;  // values per block
};

inline bool fmt_of(int64_t type_size, FmtInfo* out) {
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

// Bytes of one K-quant super-block of 256 values (fmt_of's sizes).
constexpr int64_t kquant_bytes(Fmt f) { return f == Fmt::Q4_K ? 144 : f == Fmt::Q5_K ? 176 : 210; }

// Q6_K's four runs of 32 values in one half super-block as 6-bit integers (0..63): the
// nibbles of ql's two 32-byte rows l0, l1 with the 2-bit fields of qh's 32 bytes hv on top.
// V is __m256i (one weight row) or __m512i (two rows side by side, quant_kquant_pairs.cpp):
// the masks keep every byte to its own bits, so shifting whole 64-bit lanes gives the bytes a
// 16-bit shift would, at either width.
template <class V>
inline void q6k_values(V l0, V l1, V hv, V q[4]) {
  typedef unsigned long long U __attribute__((vector_size(sizeof(V))));
  constexpr unsigned long long kLow4 = 0x0F0F0F0F0F0F0F0Full, kLow2 = 0x0303030303030303ull;
  const U a = reinterpret_cast<U>(l0), b = reinterpret_cast<U>(l1), h = reinterpret_cast<U>(hv);
  q[0] = reinterpret_cast<V>((a & kLow4) | ((h & kLow2) << 4));
  q[1] = reinterpret_cast<V>((b & kLow4) | (((h >> 2) & kLow2) << 4));
  q[2] = reinterpret_cast<V>(((a >> 4) & kLow4) | (((h >> 4) & kLow2) << 4));
  q[3] = reinterpret_cast<V>(((b >> 4) & kLow4) | (((h >> 6) & kLow2) << 4));
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

// scale_min_k4 for all 8 sub-blocks at once, four at a time in 32-bit words: byte j of *sc and
// *mn is sub-block j's scale and min.
inline void scales_mins_k4(const uint8_t* q, uint64_t* sc, uint64_t* mn) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  *sc = (u[0] & 0x3f3f3f3fu) |
        static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  *mn = (u[1] & 0x3f3f3f3fu) |
        static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4))
            << 32;
}

// One block -> q[block] (bytes), a4[block / 4] (the scale of each run of 4 values: the lanes
// of the integer dot), b16[block / 16] (the offset of each group of 16).
inline void set_group(float* a4, float* b16, int64_t g, float a, float b) {
  for (int i = 0; i < 4; ++i) a4[4 * g + i] = a;
  b16[g] = b;
}

inline void unpack_block(Fmt fmt, const uint8_t* blk, uint8_t* q, float* a4, float* b16) {
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
inline void unpack_row(const FmtInfo& f, const uint8_t* row, int64_t K, int64_t type_size,
                       uint8_t* q, float* a4, float* b16) {
  for (int64_t k = 0; k < K; k += f.block, row += type_size) {
    unpack_block(f.fmt, row, q + k, a4 + k / 4, b16 + k / 16);
  }
}

// A packed weight, checked (check_packed in quant_linear.cpp).
struct Packed {
  FmtInfo f;
  int64_t N, K, type_size;
  const uint8_t* data;
  bool tiled;  // [N / 16, K / 32, 16, type_size] (quant_tiled.h), else [N, blocks, type_size]
};

// set_quant_isa's levels (quant_linear.cpp chooses one per process).
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

#ifdef TS_AVX2
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// x [M, K] -> xq [M, K] int8, dx [M, K / 32], xs [M, K / 16] = dx * (sum of xq over 16),
// xs32 [M, K / 32] the same over 32, xi32 [M, K / 32] those sums as integers
// (quant_activations.cpp).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs,
                   float* xs32, int32_t* xi32);

// x as quantize_rows leaves it, rows K values (xq), K / 32 (dx, xs32) and K / 16 (xs) apart.
struct QuantizedRows {
  int64_t M;
  const int8_t* xq;
  const float* dx;
  const float* xs;
  const float* xs32;
};

// Each path computes y [M, N] = x W^T (+ bias, nullable) on a stored (untiled) weight.
#ifdef TS_AVX2
// 1 .. kFusedMaxRows rows of x, every format, blocks unpacked in registers; isa >= kAvx2
// (quant_decode_rows.cpp).
void decode_rows_linear(int isa, const Packed& p, const QuantizedRows& x, float* y,
                        const float* bias);

// Many rows: 8-row tiles of unpacked weights, maddubs (quant_panels.cpp).
void panel_linear_avx2(const Packed& p, const QuantizedRows& x, float* y, const float* bias);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// Many rows: 16-row tiles of unpacked weights, dpbusd (quant_panels.cpp).
void panel_linear_vnni(const Packed& p, const QuantizedRows& x, float* y, const float* bias);

// Decode rows of a K-quant (Q4_K, Q5_K, Q6_K) weight as stored, two weight rows a zmm, bit for
// bit decode_rows_linear's (quant_kquant_pairs.cpp): rows [n0, end) of W against 1-4 rows of
// x (M), where end = n0 + an even count <= n1 - n0; returns end (the caller takes the odd row).
int64_t kquant_pairs_vnni(Fmt f, int64_t M, const uint8_t* w, int64_t n0, int64_t n1,
                          int64_t K, const int8_t* xq, const float* dx, const float* xs16,
                          const float* xs32, float* y, int64_t N, const float* bias);
#endif

// Many rows of x on a K-quant (Q4_K, Q5_K, Q6_K) weight as stored, on AMX int8 tiles: the
// VNNI panels' outputs bit for bit (quant_amx_kquant.cpp). False (nothing written) where
// the build or the CPU has no AMX, or the weight is another format.
bool kquant_linear_amx(const Packed& p, const QuantizedRows& x, float* y, const float* bias);

// Any rows at any level: weight rows unpacked into a buffer, one dot product per (x row,
// weight row) (quant_unpacked.cpp).
void unpacked_linear(int isa, const Packed& p, const QuantizedRows& x, float* y,
                     const float* bias);

}  // namespace quant
}  // namespace tailserve_cpu
