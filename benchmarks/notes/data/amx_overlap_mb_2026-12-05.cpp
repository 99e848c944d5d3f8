// The standalone microbenchmark of benchmarks/notes/cpu_kernels.md's section of 2026-12-05 12:00
// (the int8 tiles' per-block work taken apart). Build and run: g++ -O3 -march=native -o mb
// amx_overlap_mb.cpp && for m in 0 1 2 3 4 5 6 7 8 9 10; do ./mb $m; done (one thread).
// Modes: 0 all; 1 tiles only; 2 epilogue only; 3 no tile store; 4 tile loads + products;
// 5 no products; 6 tile loads + store; 7 no tile loads; 8 tiles + 48 register FMAs a block;
// 9 the FMAs alone; 10 tiles + 96 FMAs a block.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
struct alignas(64) Cfg { uint8_t p, s, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg_load() {
  static Cfg c{}; c.p = 1;
  for (int t : {0, 1, 7}) { c.rows[t] = 16; c.colsb[t] = 64; }
  for (int t : {2, 3, 6}) { c.rows[t] = 16; c.colsb[t] = 32; }
  for (int t : {4, 5}) { c.rows[t] = 8; c.colsb[t] = 64; }
  asm volatile("" ::"r"(&c) : "memory");
  _tile_loadconfig(&c);
}
constexpr int NB = 18, GROUPS = 32, TILES = 96;
alignas(64) static int8_t xg[GROUPS * NB * 512];
alignas(64) static uint8_t bbuf[NB * 512];
alignas(64) static uint16_t dh[NB * 32];
alignas(64) static float dxg[GROUPS * NB * 16], xsg[GROUPS * NB * 16];
alignas(64) static float y[GROUPS * 16 * TILES * 16];
static int MODE;

__attribute__((always_inline)) inline void epi(const int32_t* c, int g, const float* dx, const float* xs, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + g * 32)));
  const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + g * 32 + 16)));
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i a = _mm512_load_si512(c + 16 * r);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(d, _mm512_set1_ps(dx[g * 16 + r])), acc[r]);
    acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[g * 16 + r]), acc[r]);
  }
}

static void group(const int8_t* xq, const float* dx, const float* xs, float* yo) {
  alignas(64) int32_t c[2][2][256];
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const bool alu = MODE == 8 || MODE == 9 || MODE == 10;
  const bool tiles = MODE != 2 && MODE != 9, epis = MODE != 1 && MODE != 4 && MODE != 6 && !alu;
  const bool store = MODE != 3 && MODE != 4, dp = MODE != 5 && MODE != 6, loads = MODE != 7;
  auto products = [&](int g, int set) {
    if (!tiles) return;
    _tile_zero(0);
    if (loads) { _tile_loadd(2, xq + g * 512, 32);
    _tile_loadd(4, bbuf + g * 512, 64); }
    if (dp) _tile_dpbsud(0, 2, 4);
    if (store) _tile_stored(0, c[set][0], 64);
    if (g + 1 < NB) {
      _tile_zero(1);
      if (loads) { _tile_loadd(3, xq + (g + 1) * 512, 32);
      _tile_loadd(5, bbuf + (g + 1) * 512, 64); }
      if (dp) _tile_dpbsud(1, 3, 5);
      if (store) _tile_stored(1, c[set][1], 64);
    }
  };
  products(0, 0);
  __m512 z[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_set1_ps(1.0f + i);
  const __m512 k1 = _mm512_set1_ps(0.999f), k2 = _mm512_set1_ps(0.001f);
  for (int g = 0, set = 0; g < NB; g += 2, set ^= 1) {
    if (g + 2 < NB) products(g + 2, set ^ 1);
    if (alu) {
      for (int rep = 0; rep < (MODE == 10 ? 24 : 12); ++rep) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) z[i] = _mm512_fmadd_ps(z[i], k1, k2);
      }
      asm volatile("" : "+v"(z[0]), "+v"(z[1]), "+v"(z[2]), "+v"(z[3]), "+v"(z[4]), "+v"(z[5]), "+v"(z[6]), "+v"(z[7]));
    }
    if (epis) {
      epi(c[set][0], g, dx, xs, acc);
      if (g + 1 < NB) epi(c[set][1], g + 1, dx, xs, acc);
    }
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(yo + r * TILES * 16, acc[r]);
}

int main(int argc, char** argv) {
  MODE = atoi(argv[1]);
  syscall(SYS_arch_prctl, 0x1023, 18);
  for (size_t i = 0; i < sizeof(xg); ++i) xg[i] = (int8_t)(i * 7);
  for (size_t i = 0; i < sizeof(bbuf); ++i) bbuf[i] = (uint8_t)(i * 3);
  for (int i = 0; i < NB * 32; ++i) dh[i] = 0x3c00;
  for (int i = 0; i < GROUPS * NB * 16; ++i) dxg[i] = xsg[i] = 0.001f;
  cfg_load();
  const int reps = 200;
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < reps; ++it)
    for (int t = 0; t < TILES; ++t)
      for (int m = 0; m < GROUPS; ++m)
        group(xg + m * NB * 512, dxg + m * NB * 16, xsg + m * NB * 16, y + m * 16 * TILES * 16 + t * 16);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double blocks = (double)reps * TILES * GROUPS * NB;
  printf("mode %d: %.1f ns/block = %.0f cycles at 3.1 GHz  (y %f)\n", MODE, s / blocks * 1e9, s / blocks * 3.1e9, y[5]);
}
