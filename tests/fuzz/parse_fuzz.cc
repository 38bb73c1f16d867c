// libFuzzer target: the CLI's value parsers (tools/cli/cli.h) on arbitrary text. Each must return a
// value in its documented range or throw UsageError; sizeText must round-trip through parseSize.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tools/cli/cli.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tpsim::tools;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const long long bytes = parseSize("min-bytes", text);
    if (bytes < 0 || parseSize("min-bytes", sizeText(bytes)) != bytes) std::abort();
  } catch (const UsageError&) {
  }
  try {
    const std::vector<int> list = parseIntList("ranks", text);
    if (list.empty()) std::abort();
    for (int v : list)
      if (v < 1) std::abort();
  } catch (const UsageError&) {
  }
  try {
    parseSeed(text);
  } catch (const UsageError&) {
  }
  return 0;
}
