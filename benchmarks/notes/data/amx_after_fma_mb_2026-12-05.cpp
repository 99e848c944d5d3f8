// benchmarks/notes/cpu_kernels.md, 2026-12-05 12:00 section's frequency check: g++ -O3 -march=native -o lic amx_after_fma_mb_2026-12-05.cpp && ./lic
// Does a burst of 512-bit FMAs slow the tile loop that follows (a frequency license)?
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
using clk = std::chrono::steady_clock;
static double tiles(long n) {
  auto t0 = clk::now();
  for (long i = 0; i < n; ++i) { _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5); }
  alignas(64) float o[256]; _tile_stored(0, o, 64);
  return std::chrono::duration<double>(clk::now() - t0).count() / (4.0 * n) * 1e9 + o[0] * 0;
}
static double fmas(long n, int width) {
  __m512 z[8]; __m256 w[8];
  for (int i = 0; i < 8; ++i) { z[i] = _mm512_set1_ps(1.f + i); w[i] = _mm256_set1_ps(1.f + i); }
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  const __m256 a2 = _mm256_set1_ps(0.999f), b2 = _mm256_set1_ps(0.001f);
  auto t0 = clk::now();
  for (long i = 0; i < n; ++i) {
    if (width == 512) { for (int k = 0; k < 8; ++k) z[k] = _mm512_fmadd_ps(z[k], a, b); }
    else { for (int k = 0; k < 8; ++k) w[k] = _mm256_fmadd_ps(w[k], a2, b2); }
    asm volatile("" : "+v"(z[0]), "+v"(z[1]), "+v"(z[2]), "+v"(z[3]), "+v"(z[4]), "+v"(z[5]), "+v"(z[6]), "+v"(z[7]));
    asm volatile("" : "+v"(w[0]), "+v"(w[1]), "+v"(w[2]), "+v"(w[3]), "+v"(w[4]), "+v"(w[5]), "+v"(w[6]), "+v"(w[7]));
  }
  return std::chrono::duration<double>(clk::now() - t0).count() / (8.0 * n) * 1e9;
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct alignas(64) { uint8_t p, s, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } c{};
  c.p = 1; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  asm volatile("" ::"r"(&c) : "memory"); _tile_loadconfig(&c);
  alignas(64) static uint16_t a[512], b[512];
  for (int i = 0; i < 512; ++i) { a[i] = 0x3f00 + (i * 37 & 0xff); b[i] = 0x3c00 + (i * 91 & 0x1ff); }
  _tile_loadd(4, a, 64); _tile_loadd(5, b, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int r = 0; r < 3; ++r) {
    tiles(200000);  // settle
    usleep(20000);
    printf("after 20 ms idle:       tiles %.2f ns/dp\n", tiles(20000));
    double f512 = fmas(3000000, 512);
    printf("right after 512-bit FMAs (%.3f ns/FMA): tiles %.2f ns/dp\n", f512, tiles(20000));
    double f256 = fmas(3000000, 256);
    printf("right after 256-bit FMAs (%.3f ns/FMA): tiles %.2f ns/dp\n", f256, tiles(20000));
    printf("512-bit FMAs right after tiles: %.3f ns/FMA\n", (tiles(200000), fmas(200000, 512)));
  }
}
