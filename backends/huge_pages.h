// Host memory on transparent huge pages where the kernel gives them on request
// (/sys/kernel/mm/transparent_hugepage/enabled: madvise). The first touch of each 4 KiB page is a
// page fault, and in a virtual machine one costs about 10-20 µs: 3 GiB of fresh tensors took 10 s of
// a 20 s run in faults alone. A 2 MiB page takes one fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <sys/mman.h>

namespace tpsim {

// Asks for huge pages on the whole 2 MiB pages inside [data, data + bytes), before they are first
// touched; the partial pages at either end stay as they are, so nothing outside the block becomes
// resident. A hint: where the kernel refuses, the memory works as before.
inline void adviseHugePages(void* data, std::size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr std::uintptr_t kHuge = std::uintptr_t(2) << 20;
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (at + kHuge - 1) / kHuge * kHuge, end = (at + bytes) / kHuge * kHuge;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

// v resized to n value-initialized (zero) elements, its fresh storage advised first.
template <class T>
void resizeFresh(std::vector<T>& v, std::size_t n) {
  if (n > v.capacity()) {
    std::vector<T> fresh;
    fresh.reserve(n);
    adviseHugePages(fresh.data(), n * sizeof(T));
    fresh.assign(v.begin(), v.end());
    v.swap(fresh);
  }
  v.resize(n);
}

}  // namespace tpsim
