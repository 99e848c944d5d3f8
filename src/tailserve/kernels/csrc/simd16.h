// 16-bit storage (bfloat16, float16) read into float32 registers, and float32 stored back.
//
// Weights and the KV cache may be kept in 16 bits to halve the bytes a decode step reads; the
// kernels still compute in float32. bfloat16 is the top half of a float32, so widening is a
// 16-bit shift (or a mask, for the odd element of a packed pair); float16 needs F16C's
// vcvtph2ps, which every AVX2 CPU has. Stores round to nearest even, as torch's .to() does,
// so the C++ and the torch paths write the same bits.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace tailserve_cpu {

#ifdef TS_AVX2
// Eight consecutive elements as float32.
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#ifdef __F16C__
inline __m256 load8_f32(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#endif

// Does the AVX2 fast path of a kernel have a widening load for T? (float16 needs F16C.)
template <typename T>
constexpr bool has_load8() {
#if defined(TS_AVX2) && defined(__F16C__)
  return true;
#elif defined(TS_AVX2)
  return !std::is_same_v<T, c10::Half>;
#else
  return false;
#endif
}

// dst[0..n) = src[0..n) in T (round to nearest even for the 16-bit types).
template <typename T>
inline void store_from_f32(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

}  // namespace tailserve_cpu
