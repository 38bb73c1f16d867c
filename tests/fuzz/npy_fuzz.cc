// libFuzzer target: tools/lib/npy.cc on arbitrary file contents. Each input must read as an array
// whose data matches its shape, or fail with InvalidArgument; NpyReader, reading it in parts, must
// read the same; an array read back after writeNpy must be the same array. Anything else (a crash,
// a sanitizer report, another exception) is a bug.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "backends/errors.h"
#include "tools/lib/npy.h"

namespace {

// An in-memory file that readNpy opens by path, as it would a file on disk.
struct MemoryFile {
  int fd = memfd_create("tpsim_fuzz_npy", 0);
  std::string path = "/proc/self/fd/" + std::to_string(fd);
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tpsim::tools;
  static const MemoryFile in, out;
  if (in.fd < 0 || out.fd < 0 || ftruncate(in.fd, 0) != 0 || pwrite(in.fd, data, size, 0) != ssize_t(size)) std::abort();
  NpyArray a;
  try {
    a = readNpy(in.path);
  } catch (const tpsim::InvalidArgument&) {
    return 0;
  }
  std::size_t bytes = tpsim::dtypeSize(a.dtype);
  for (std::int64_t d : a.shape) bytes *= std::size_t(d);
  const NpyArray header = readNpyHeader(in.path);
  if (bytes != a.data.size() || header.shape != a.shape || header.dtype != a.dtype) std::abort();
  NpyReader reader(in.path);
  std::string parts(a.data.size(), '\0');
  const std::size_t itemSize = tpsim::dtypeSize(a.dtype);
  for (std::int64_t first = 0, count = 1; first < reader.numel(); count = count * 2 + 1) {
    const std::int64_t n = std::min(count, reader.numel() - first);
    reader.read(n, parts.data() + std::size_t(first) * itemSize);
    first += n;
  }
  if (reader.numel() * std::int64_t(itemSize) != std::int64_t(a.data.size()) ||
      parts.compare(0, std::string::npos, a.data.data(), a.data.size()) != 0)
    std::abort();
  writeNpy(out.path, a.dtype, a.shape, a.data.data());
  const NpyArray back = readNpy(out.path);
  if (back.dtype != a.dtype || back.shape != a.shape || back.data != a.data) std::abort();
  return 0;
}
