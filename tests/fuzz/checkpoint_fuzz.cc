// libFuzzer target: CheckpointReader (tools/lib/checkpoint_files.h) on an arbitrary index.json beside
// the valid files of `tpsim run --layer mlp --tp 2 --gtp-remat 2 --save-checkpoint DIR`, which it
// writes once at start through the same code (its index is the seed in corpus/checkpoint/). An
// input that parses as a JSON object is sealed first (sealCheckpointIndex), so that mutations reach
// past the index's checksum to every check behind it. Each input must load, and then consolidate
// every key (and read it again a box of rows at a time, to the same bytes), or fail with
// InvalidArgument; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tools/cli/cli.h"
#include "tools/lib/checkpoint_files.h"
#include "tools/lib/runner.h"

namespace {

// The checkpoint directory, its files written, its index replaced by each input.
struct Checkpoint {
  std::string dir;
  Checkpoint() {
    char name[] = "/tmp/tpsim_fuzz_checkpoint_XXXXXX";
    if (!mkdtemp(name)) std::abort();
    dir = name;
    const tpsim::tools::RunArgs run = tpsim::tools::parseRunArgs({"--layer", "mlp", "--tp", "2", "--gtp-remat", "2"});
    tpsim::CheckpointWriter writer(run.config.layer->name());
    tpsim::tools::runSharded(run.config, tpsim::tools::generateInputs(run.config), {nullptr, &writer});
    writer.commit(dir);
  }
  ~Checkpoint() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Checkpoint checkpoint;
  std::string index(reinterpret_cast<const char*>(data), size);
  try {
    index = tpsim::sealCheckpointIndex(index);
  } catch (const tpsim::InvalidArgument&) {
  }
  std::ofstream(checkpoint.dir + "/index.json", std::ios::binary | std::ios::trunc) << index;
  try {
    const tpsim::CheckpointReader reader(checkpoint.dir);
    for (const auto& entry : reader.keys()) {
      const std::string& key = entry.first;
      const std::vector<char> all = reader.consolidated(key);
      // The same bytes a box of rows at a time, as tpsim run reads a parameter.
      const std::vector<std::int64_t>& shape = reader.key(key).globalShape;
      if (shape.empty() || shape[0] == 0) continue;
      const std::size_t rowBytes = all.size() / std::size_t(shape[0]);
      std::vector<std::int64_t> begin(shape.size(), 0), box = shape;
      for (std::int64_t row = 0; row < shape[0]; row += 7) {
        begin[0] = row;
        box[0] = std::min<std::int64_t>(7, shape[0] - row);
        std::vector<char> part(std::size_t(box[0]) * rowBytes);
        reader.readBox(key, begin, box, part.data());
        if (std::memcmp(part.data(), all.data() + std::size_t(row) * rowBytes, part.size()) != 0) __builtin_trap();
      }
    }
  } catch (const tpsim::InvalidArgument&) {
  }
  return 0;
}
