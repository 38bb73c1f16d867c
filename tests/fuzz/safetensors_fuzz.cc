// libFuzzer target: readSafetensorsHeader (tools/lib/checkpoint_files.h) on arbitrary file contents.
// Each input must read as tensors that index every data byte once, in order, each holding its
// shape's bytes, or fail with InvalidArgument; the tensors written again by safetensorsBytes must
// read back the same. Anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tools/lib/checkpoint_files.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<char> bytes(data, data + size);
  std::vector<tpsim::SafetensorsTensor> tensors;
  try {
    tensors = tpsim::readSafetensorsHeader(bytes, "fuzz");
  } catch (const tpsim::InvalidArgument&) {
    return 0;
  }
  const std::uint64_t dataStart = 8 + tpsim::safetensorsHeaderLength(bytes, "fuzz");
  std::vector<tpsim::SafetensorsEntry> entries;
  std::uint64_t at = 0;
  for (const tpsim::SafetensorsTensor& t : tensors) {
    std::uint64_t want = tpsim::dtypeSize(t.dtype);
    for (std::int64_t d : t.shape) want *= std::uint64_t(d);
    if (t.begin != at || t.end - t.begin != want) std::abort();
    at = t.end;
    entries.push_back({t.name, t.dtype, t.shape, {bytes.begin() + std::ptrdiff_t(dataStart + t.begin),
                                                  bytes.begin() + std::ptrdiff_t(dataStart + t.end)}});
  }
  if (dataStart + at != size) std::abort();
  const std::string again = tpsim::safetensorsBytes(entries);
  const std::vector<tpsim::SafetensorsTensor> back = tpsim::readSafetensorsHeader({again.begin(), again.end()}, "again");
  if (back.size() != tensors.size()) std::abort();
  for (std::size_t i = 0; i < back.size(); ++i)
    if (back[i].name != tensors[i].name || back[i].dtype != tensors[i].dtype || back[i].shape != tensors[i].shape ||
        back[i].begin != tensors[i].begin || back[i].end != tensors[i].end)
      std::abort();
  return 0;
}
