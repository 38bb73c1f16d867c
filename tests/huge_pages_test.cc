// backends/huge_pages.h: large host blocks (resizeFresh's vectors, SimCompute's tensors) ask for
// transparent huge pages on the whole 2 MiB pages inside them and on nothing outside, as the
// kernel's own record of the mappings (/proc/self/smaps, VmFlags "hg") shows.
#include "backends/huge_pages.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <vector>

#include "sim/sim_compute.h"

namespace tpsim {
namespace {

constexpr std::uintptr_t kHuge = std::uintptr_t(2) << 20;

// The mapping of /proc/self/smaps that holds `address`.
struct Mapping {
  std::uintptr_t begin = 0, end = 0;
  bool hugeAdvised = false;
};
Mapping mappingOf(const void* address) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  Mapping current;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= at && at < end;
      if (inside) current = {begin, end, false};
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      current.hugeAdvised = (line + " ").find(" hg ") != std::string::npos;
      return current;
    }
  }
  ADD_FAILURE() << "no mapping holds " << address;
  return {};
}

bool transparentHugePagesBuilt() {
  struct stat s;
  return stat("/sys/kernel/mm/transparent_hugepage", &s) == 0;
}

// Every whole 2 MiB page of [data, data + bytes) is advised.
void expectAdvised(const void* data, std::size_t bytes) {
  const auto at = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (at + kHuge - 1) / kHuge * kHuge, last = (at + bytes) / kHuge * kHuge;
  ASSERT_GE(last, first + 2 * kHuge) << "the block holds too few whole huge pages to test";
  for (std::uintptr_t page = first; page < last; page += kHuge)
    EXPECT_TRUE(mappingOf(reinterpret_cast<const void*>(page)).hugeAdvised)
        << "the huge page at " << std::hex << page << " is not advised";
}

TEST(HugePages, AdvisesTheWholePagesInsideTheBlockAndNothingElse) {
  if (!transparentHugePagesBuilt()) GTEST_SKIP() << "this kernel has no transparent huge pages";
  // A mapping of its own, 2 MiB aligned, so that no neighbour's advice merges into it.
  const std::size_t span = 16 * kHuge;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  const std::uintptr_t base = (reinterpret_cast<std::uintptr_t>(mapped) + kHuge - 1) / kHuge * kHuge + 4 * kHuge;
  // From 1 MiB into one huge page to 1 MiB into the fifth after it: the four between are whole.
  adviseHugePages(reinterpret_cast<void*>(base + kHuge / 2), 5 * kHuge);
  const Mapping m = mappingOf(reinterpret_cast<void*>(base + kHuge));
  EXPECT_TRUE(m.hugeAdvised);
  EXPECT_EQ(m.begin, base + kHuge) << "the advice does not start at the first whole huge page";
  EXPECT_EQ(m.end, base + 5 * kHuge) << "the advice does not end after the last whole huge page";
  EXPECT_FALSE(mappingOf(reinterpret_cast<void*>(base + kHuge / 2)).hugeAdvised);
  EXPECT_FALSE(mappingOf(reinterpret_cast<void*>(base + 5 * kHuge)).hugeAdvised);
  // A block without a whole huge page inside asks for nothing.
  adviseHugePages(reinterpret_cast<void*>(base + 6 * kHuge + 4096), kHuge);
  EXPECT_FALSE(mappingOf(reinterpret_cast<void*>(base + 7 * kHuge)).hugeAdvised);
  EXPECT_FALSE(mappingOf(reinterpret_cast<void*>(base + 6 * kHuge + 4096)).hugeAdvised);
  munmap(mapped, span);
}

TEST(HugePages, ResizeFreshAdvisesItsStorageAndKeepsTheValues) {
  if (!transparentHugePagesBuilt()) GTEST_SKIP() << "this kernel has no transparent huge pages";
  std::vector<float> v{1.5f, -2.f};
  resizeFresh(v, std::size_t(3) << 20);  // 12 MiB
  EXPECT_EQ(v[0], 1.5f);
  EXPECT_EQ(v[1], -2.f);
  for (std::size_t i = 2; i < v.size(); i += 4097) ASSERT_EQ(v[i], 0.f) << i;
  EXPECT_EQ(v.back(), 0.f);
  expectAdvised(v.data(), v.size() * sizeof(float));
}

TEST(HugePages, LargeSimTensorsAreAdvised) {
  if (!transparentHugePagesBuilt()) GTEST_SKIP() << "this kernel has no transparent huge pages";
  sim::SimCompute compute;
  const Tensor t = compute.empty(Shape{std::int64_t(4) << 20}, DType::kFloat32);  // 16 MiB
  expectAdvised(t.data(), std::size_t(4) << 22);
}

}  // namespace
}  // namespace tpsim
