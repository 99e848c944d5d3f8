// Per-thread scratch buffers of the kernels, kept between calls.
//
// A kernel's staging buffer as a fresh std::vector costs, every call, a value-initialising
// memset on the calling thread (and, past malloc's mmap threshold, page faults) before the
// work pool starts: serial time in front of every parallel region (a 512-row product's int8
// activations, ~1 MB; split attention's staged K/V, 3.3 MB at 2,000 keys). A Scratch, declared
// thread_local where it is used, grows to the largest size asked of it and never clears: its
// users write every element they read.

#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tailserve_cpu {

template <typename T>
class Scratch {
 public:
  // At least n elements (contents: whatever the last call left), 64-byte aligned.
  T* get(int64_t n) {
    const size_t want = static_cast<size_t>(n) + 64 / sizeof(T) + 1;
    if (buf_.size() < want) buf_.resize(want);
    const auto addr = reinterpret_cast<uintptr_t>(buf_.data());
    return reinterpret_cast<T*>((addr + 63) & ~static_cast<uintptr_t>(63));
  }

 private:
  std::vector<T> buf_;
};

}  // namespace tailserve_cpu
