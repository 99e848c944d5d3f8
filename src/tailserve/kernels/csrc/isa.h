// The one place the kernels ask which instructions to run: the level of every product, the
// attention kernels and the 16-bit dots (set_quant_isa's numbering, TAILSERVE_QUANT_ISA), and
// whether this CPU and kernel let the process use AMX tiles.
//
// The level is chosen at run time (-1 = the best this CPU and build have) and can be forced
// lower, so the tests run the AVX2 paths on an AVX512 machine. AMX is probed once: CPUID
// (AMX-TILE, AMX-INT8, AMX-BF16), the OS's XCR0 tile state, then Linux's permission request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile
// instruction kills the process). Where any step fails the reason is kept and reported
// (tailserve.kernels.isa_info) and kAmx is refused with it. Where it succeeds and the build has
// the tile kernels (quant_amx.cpp), kAmx is what "auto" chooses: its integer sums are VNNI's,
// so its answers are VNNI's bit for bit.

#pragma once

#include <cstdint>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tailserve_cpu {
namespace isa {

// kAvx512Bf16: VNNI's products, and the prefill attention's QK^T and PV on vdpbf16ps (every CPU
// with AVX512-BF16 has VNNI); below it the attention runs float32 FMAs. Opt-in, never best():
// rounding q, K, p and V to bf16 moves near-tied greedy tokens (the VNNI level's answers are
// the float32 attention's; tests/test_isa.py), for 1.2-1.3x the attention's speed.
// kAmx: VNNI's kernels with the tiled GGUF products of 16+ rows of x, and the K-quants' of 9+
// rows (quant_amx_kquant.cpp), on AMX int8 tiles (VNNI's bits), and the prefill attention of
// long calls on AMX bf16 tiles with split operands (hi + lo, three tile products: at most
// 7e-5 off float64 on the tests' cases where float32 FMAs are 1e-5 off and one bf16 rounding
// 4e-2; prefill_amx.cpp), short calls on float32 FMAs.
// Not an order above kAvx512Bf16: the two are alternatives, numbered apart.
// kAmxBf16: opt-in, never best(): the tiled products of 16+ rows on AMX bf16 tiles (weights
// dequantized to bf16 per call, x rounded to bf16, float32 sums over all of K) and the prefill
// attention on AMX bf16 tiles (prefill_amx.cpp): the fastest prompts, not VNNI's answers.
enum Level : int {
  kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4, kAmx = 5, kAmxBf16 = 6
};

// The level "auto" chooses: kAmx where usable, else the best this CPU and build run up to
// kAvx512Vnni (kAvx512Bf16 is opt-in).
int best();
// The highest level set() accepts here (kAmx where usable; else kAvx512Bf16 where the CPU has
// AVX512-BF16).
int supported();
// Whether this build has the AMX tile kernels (quant_amx.cpp: the compiler targeted AMX).
bool amx_kernels_built();
// The level in use (best() until set).
int current();
// Force a level (-1: best()); returns the level chosen. A level above supported() is an error
// that names it, and kAmx's error says why AMX cannot serve here.
int set(int level);

// AVX512-BF16 (vdpbf16ps) on this CPU and build, at the AVX512 levels: the 16-bit panels' dot
// (linear16.cpp) asks this (on by default there, as before this module).
bool has_avx512bf16();

struct AmxStatus {
  bool cpu;        // CPUID has AMX-TILE and AMX-INT8 (and says whether AMX-BF16)
  bool bf16;       // CPUID AMX-BF16
  bool os;         // XCR0 enables the tile config and data state
  bool permitted;  // arch_prctl granted XTILEDATA to this process
  std::string reason;  // why AMX is not usable; empty when it is
};
// Probed once per process (the permission request is made at most once).
const AmxStatus& amx_status();

// Decode rows read each weight byte from DRAM once, and one core's hardware prefetchers keep
// too few lines in flight for that, so the decode-row kernels (quant_tiled.cpp,
// quant_decode_rows.cpp) prefetch the weight `bytes` ahead of the block they read, into L2 or
// L1. Which is this CPU's: the default is chosen once by CPUID's vendor. Zen 3/4 were tuned
// with L1, 4 KiB ahead. On the Xeon with AMX, L1 prefetches held one-row Q4_0 products beyond
// the L3 to 16 GB/s and L2 ones 8 KiB ahead reached 22 (the 8B's decode step 193 -> 160 ms;
// benchmarks/notes/decode.md): an L1 prefetch holds one of the core's few fill buffers until
// its line arrives, an L2 one does not.
struct WeightPrefetch {
  int64_t bytes;  // how far ahead of the block being read
  bool l2;        // _MM_HINT_T1 (L2) rather than _MM_HINT_T0 (L1)
};
WeightPrefetch default_weight_prefetch();
// Read by every prefetch (a plain global: set at load, before any kernel runs, or by a test
// or benchmark between calls).
extern WeightPrefetch g_weight_prefetch;
// bytes < 0: this CPU's default. Returns the one in use.
WeightPrefetch set_weight_prefetch(int64_t bytes, bool l2);

#if defined(__x86_64__)
// One line of weight, g_weight_prefetch.bytes past p.
inline void prefetch_weight(const uint8_t* p) {
  const char* at = reinterpret_cast<const char*>(p + g_weight_prefetch.bytes);
  if (g_weight_prefetch.l2) {
    _mm_prefetch(at, _MM_HINT_T1);
  } else {
    _mm_prefetch(at, _MM_HINT_T0);
  }
}

// prefetch_weight for every line of the `bytes` bytes at p (one block, or one super-block).
inline void prefetch_weights(const uint8_t* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) prefetch_weight(p + c);
}
#endif

}  // namespace isa
}  // namespace tailserve_cpu
