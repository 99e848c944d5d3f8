// isa.h: the level in use and the AMX probe.

#include "isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tailserve_cpu {
namespace isa {
namespace {

std::atomic<int> g_level{-1};  // -1: not chosen yet

#if defined(__x86_64__) && defined(__GNUC__)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

AmxStatus probe_amx() {
  AmxStatus s{false, false, false, false, ""};
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    s.reason = "CPUID leaf 7 is not available";
    return s;
  }
  const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
  s.bf16 = (d >> 22) & 1;
  s.cpu = tile && int8;
  if (!s.cpu) {
    s.reason = "the CPU has no AMX (CPUID.(7,0):EDX AMX-TILE bit 24 = " + std::to_string(tile) +
               ", AMX-INT8 bit 25 = " + std::to_string(int8) + ")";
    return s;
  }
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid(1, &a1, &b1, &c1, &d1);
  const bool osxsave = (c1 >> 27) & 1;
  // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves tile state on a context switch.
  s.os = osxsave && ((xgetbv0() >> 17) & 3) == 3;
  if (!s.os) {
    s.reason = "the OS does not enable AMX tile state (XCR0 bits 17-18 clear)";
    return s;
  }
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl ARCH_REQ_XCOMP_PERM
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    s.reason = "Linux refused AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM, "
               "XFEATURE_XTILEDATA): a kernel before 5.16 or a sandbox that forbids it";
    return s;
  }
  s.permitted = true;
  s.reason = "";
#else
  s.reason = "AMX tile permission is only requested on Linux";
#endif
#else
  s.reason = "not an x86-64 build";
#endif
  return s;
}

}  // namespace

// The highest vector level this CPU and build run, the opt-in bf16 one included.
int vector_supported() {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16")) {
    return kAvx512Bf16;
  }
#endif
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return kAvx512Vnni;
#endif
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (__builtin_cpu_supports("avx512bw")) return kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

// AMX: the tile products of quant_amx.cpp, where this build has them and Linux granted the tile
// state. Above the bf16 level in number only: it adds the tile products to VNNI's and a near
// float32 prefill attention on split bf16 tiles (kAvx512Bf16's bf16 attention stays that
// level's alone).
bool amx_usable() { return amx_kernels_built() && amx_status().permitted; }

int supported() {
  const int top = vector_supported();
  return top >= kAvx512Vnni && amx_usable() ? kAmx : top;
}

// The best level bit-identical to VNNI's answers: AMX's integer sums are VNNI's exactly.
int best() {
  const int top = supported();
  return top == kAmx ? kAmx : std::min<int>(top, kAvx512Vnni);
}

int current() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = best();
    g_level.store(level, std::memory_order_relaxed);
  }
  return level;
}

int set(int level) {
  const int top = supported();
  TORCH_CHECK(level >= -1 && level <= kAmxBf16, "set_quant_isa: ", level,
              " is not -1 (best), 0 (scalar), 1 (AVX2), 2 (AVX512), 3 (AVX512-VNNI), "
              "4 (AVX512-BF16), 5 (AMX) or 6 (AMX-BF16)");
  if (level == kAmxBf16) {
    const AmxStatus& amx = amx_status();
    TORCH_CHECK(top == kAmx && amx.bf16 && vector_supported() >= kAvx512Bf16,
                "set_quant_isa: AMX-BF16 asked, not available: ",
                top != kAmx ? (amx.permitted ? std::string("this build has no AMX tile kernels")
                                             : amx.reason)
                            : std::string("the CPU has no AMX-BF16 or no AVX512-BF16"));
    g_level.store(kAmxBf16, std::memory_order_relaxed);
    return kAmxBf16;
  }
  if (level == kAmx) {
    const AmxStatus& amx = amx_status();
    TORCH_CHECK(top == kAmx, "set_quant_isa: AMX asked, not available: ",
                !amx.permitted ? amx.reason
                : !amx_kernels_built()
                    ? std::string("this build has no AMX tile kernels (the compiler did not "
                                  "target AMX-TILE, AMX-INT8 and AMX-BF16)")
                    : std::string("AMX needs AVX512-VNNI for its other kernels"));
    g_level.store(kAmx, std::memory_order_relaxed);
    return kAmx;
  }
  TORCH_CHECK(level <= vector_supported(), "set_quant_isa: level ", level,
              " asked, this CPU/build has ", vector_supported());
  const int chosen = level < 0 ? best() : level;
  g_level.store(chosen, std::memory_order_relaxed);
  return chosen;
}

bool has_avx512bf16() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has && current() >= kAvx512;
#else
  return false;
#endif
}

WeightPrefetch default_weight_prefetch() {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  // "GenuineIntel" is EBX, EDX, ECX of leaf 0: "Genu", "ineI", "ntel".
  if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e) {
    return {8192, true};
  }
#endif
  return {4096, false};
}

WeightPrefetch g_weight_prefetch = default_weight_prefetch();

WeightPrefetch set_weight_prefetch(int64_t bytes, bool l2) {
  TORCH_CHECK(bytes <= (1 << 20), "set_weight_prefetch: ", bytes,
              " bytes ahead is beyond any cache's reach (at most 1 MiB)");
  g_weight_prefetch = bytes < 0 ? default_weight_prefetch() : WeightPrefetch{bytes, l2};
  return g_weight_prefetch;
}

const AmxStatus& amx_status() {
  static std::once_flag once;
  static AmxStatus status;
  std::call_once(once, [] { status = probe_amx(); });
  return status;
}

}  // namespace isa
}  // namespace tailserve_cpu
