// libFuzzer target: CheckpointReader (tools/lib/checkpoint_files.h) on an arbitrary index.json beside
// the valid files of `tpsim run --layer mlp --tp 2 --gtp-remat 2 --save-checkpoint DIR`, which it
// writes once at start through the same code (its index is the seed in corpus/checkpoint/). An
// input that parses as a JSON object is sealed first (sealCheckpointIndex), so that mutations reach
// past the index's checksum to every check behind it. Each input must load, and then consolidate
// every key, or fail with InvalidArgument; anything else (a crash, a sanitizer report, another
// exception) is a bug.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

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
      (void)reader.consolidated(key);
    }
  } catch (const tpsim::InvalidArgument&) {
  }
  return 0;
}
