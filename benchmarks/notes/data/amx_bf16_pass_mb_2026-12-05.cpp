// The standalone microbenchmark of benchmarks/notes/cpu_kernels.md's section of 2026-12-05 12:58
// (amx-bf16's 2 x 2 tile pass alone). g++ -O3 -march=native -o bf amx_bf16_pass_mb_2026-12-05.cpp;
// ./bf MODE ROWS [rand [wide]]: mode 0 x streamed as the kernel packs it, 4 one A and one B
// place (L1), 2/3 next block's x prefetched to L1/L2; without rand the arrays are never written.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
static void cfg_full() {
  struct alignas(64) { uint8_t p, s, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } c{};
  c.p = 1; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  asm volatile("" ::"r"(&c) : "memory"); _tile_loadconfig(&c);
}
constexpr int NB = 18;
static int ROWS = 512;  // rows of x (groups*16)
alignas(64) static uint16_t xb[NB * 2048 * 32];
alignas(64) static uint16_t bb[2 * NB * 512];
alignas(64) static float y[2048 * 64];
int main(int argc, char** argv) {
  int mode = atoi(argv[1]);
  ROWS = argc > 2 ? atoi(argv[2]) : 512;
  syscall(SYS_arch_prctl, 0x1023, 18);
  if (argc > 4) { unsigned s = 7; for (auto& v : xb) { s = s * 1103515245 + 12345; v = ((s >> 16) & 0x807f) | (((s >> 24) % 8 + 120) << 7); } for (auto& v : bb) { s = s * 1103515245 + 12345; v = ((s >> 16) & 0x807f) | (((s >> 24) % 8 + 118) << 7); } } else if (argc > 3) { unsigned s = 1; for (auto& v : xb) { s = s * 1103515245 + 12345; v = 0x3f00 + ((s >> 16) & 0xff); } for (auto& v : bb) { s = s * 1103515245 + 12345; v = 0x3c00 + ((s >> 16) & 0x1ff) + ((s >> 8 & 1) << 15); } }
  cfg_full();
  const int groups = ROWS / 16;
  const int reps = 2000 * 512 / ROWS;
  auto t0 = std::chrono::steady_clock::now();
  long dps = 0;
  for (int it = 0; it < reps; ++it) {
    for (int m = 0; m < groups; m += 2) {
      const uint16_t* xt = (mode == 1) ? xb : xb + 16 * m * 32;  // mode 1: A from one hot place
      const long rs = (mode == 1) ? 64 : ROWS;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int g = 0; g < NB; ++g) {
        const uint16_t* a = mode == 4 ? xb + 4096 : xt + g * rs * 32;
        const int gb = mode == 4 ? 0 : g;
        if (mode >= 2 && g + 1 < NB) {
          const char* n = (const char*)(a + rs * 32);
          if (mode == 3) { for (int l = 0; l < 32; ++l) _mm_prefetch(n + 64 * l, _MM_HINT_T1); } else { for (int l = 0; l < 32; ++l) _mm_prefetch(n + 64 * l, _MM_HINT_T0); }
        }
        _tile_loadd(4, a, 64);
        _tile_loadd(6, bb + gb * 512, 64);
        _tile_loadd(5, a + 16 * 32, 64);
        _tile_loadd(7, bb + NB * 512 + gb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, y, 256); _tile_stored(1, y + 16, 256); _tile_stored(2, y + 1024, 256); _tile_stored(3, y + 1040, 256);
      dps += 4 * NB;
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("mode %d rows %d: %.2f ns/dp, %.2f TFLOP/s one thread\n", mode, ROWS, s / dps * 1e9, dps * 16384.0 / s / 1e12);
}
