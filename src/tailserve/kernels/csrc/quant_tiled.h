// GGUF blocks of the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in row tiles: the
// layout quant_linear reads for every row count (quant_tiled.cpp; the layout is defined and
// built at load by model/quant/formats.py, tile_blocks).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace tailserve_cpu {

// One tile block's byte layout per format (type_size TS): scales at 0, offsets m at 32 (Q4_1,
// Q5_1), fifth-bit masks at kH (Q5_0, Q5_1), the values' chunks at kQs; kZero is the value
// subtracted from the stored integer (Q8_0: signed, none).
template <int TS>
struct TiledLayout {
  static constexpr bool kMin = TS == 20 || TS == 24;   // Q4_1, Q5_1: fp16 offsets m
  static constexpr bool kHigh = TS == 22 || TS == 24;  // Q5_0, Q5_1: fifth bits
  static constexpr bool kQ8 = TS == 34;
  static constexpr int kH = kMin ? 64 : 32;
  static constexpr int kQs = 32 + (kMin ? 32 : 0) + (kHigh ? 64 : 0);
  static constexpr int kBytes = 16 * TS;
  static constexpr int kZero = TS == 18 ? 8 : TS == 22 ? 16 : 0;  // q - zero (Q8_0: signed)
};

#if defined(__AVX512BW__)
// Chunk j (0..3) of a Q4 / Q5 tile block as unsigned values, fifth bits included: lo holds
// values 4j..4j+3 of each of the 16 rows (byte 4r + i), hi values 16+4j..16+4j+3. What VNNI's
// dpbusd and AMX's int8 / bf16 tiles all read (quant_tiled.cpp, quant_amx*.cpp).
template <int TS>
inline void split_chunk512(const uint8_t* blk, int j, __m512i& lo, __m512i& hi) {
  using L = TiledLayout<TS>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(blk + L::kQs + 64 * j);
  lo = _mm512_and_si512(v, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (L::kHigh) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    uint64_t m0, m1;
    std::memcpy(&m0, blk + L::kH + 8 * j, 8);
    std::memcpy(&m1, blk + L::kH + 8 * (j + 4), 8);
    lo = _mm512_mask_add_epi8(lo, m0, lo, bit4);  // lo < 16: + 16 sets bit 4
    hi = _mm512_mask_add_epi8(hi, m1, hi, bit4);
  }
}
#endif

// y [M, N] (rows N apart) = x W^T (+ bias) on tiled blocks w [N / 16, K / 32, 16, type_size].
// x arrives quantized as quant_linear quantizes it: xq [M, K] int8, dx [M, K / 32] the block
// scales, xs32 [M, K / 32] = dx * (sum of xq over the block), xi32 the same sums as integers.
// isa: set_quant_isa's numbering (0 scalar, 1 AVX2, 2 AVX512 -> the AVX2 path, 3 VNNI).
void tiled_linear(int isa, int64_t type_size, const uint8_t* w, int64_t N, int64_t K, int64_t M,
                  const int8_t* xq, const float* dx, const float* xs32, const int32_t* xi32,
                  float* y, const float* bias);

// The same product on AMX int8 tiles (quant_amx.cpp) for the first 16 * (M / 16) rows of x,
// bit for bit tiled_linear's; returns how many rows it computed (0 where AMX is not built or
// not permitted: the caller runs tiled_linear on the rest).
int64_t tiled_linear_amx(int64_t type_size, const uint8_t* w, int64_t N, int64_t K, int64_t M,
                         const int8_t* xq, const float* dx, const float* xs32,
                         const int32_t* xi32, float* y, const float* bias);

// The same product on AMX bf16 tiles (quant_amx_bf16.cpp; the opt-in amx-bf16 level): each
// 16-row tile dequantized to bf16 once per call, x rounded to bf16, float32 sums over all of K
// (no per-block epilogue). Not VNNI's answers: bf16 rounds weights and x. Rows as
// tiled_linear_amx (the first 16 * (M / 16)); x float32 [M, K].
int64_t tiled_linear_amx_bf16(int64_t type_size, const uint8_t* w, int64_t N, int64_t K,
                              int64_t M, const float* x, float* y, const float* bias);

// The same bf16 tiles on a weight as stored ([N, K / block, type_size], any format: the
// K-quants, which are never tiled), 16 rows of it dequantized per tile from the panels'
// unpacking (quant_blocks.h). Rows as tiled_linear_amx_bf16; 0 also where N is not a
// multiple of 16 (the caller's other paths take the product).
int64_t stored_linear_amx_bf16(int64_t type_size, const uint8_t* w, int64_t N, int64_t K,
                               int64_t M, const float* x, float* y, const float* bias);

// Row n of a tiled table, dequantized into out [K] (the values gguf's dequantizer gives).
void tiled_row(int64_t type_size, const uint8_t* w, int64_t K, int64_t n, float* out);

}  // namespace tailserve_cpu
