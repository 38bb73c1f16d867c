// Shared pieces of the tpsim command line: the usage-error type and the subcommand entry points.
//
// Each subcommand parses its own options (Boost.Program_options) into a plain config struct
// before doing any work, prints its effective configuration first, and returns the process exit
// code (kExitCodes).
#pragma once

#include <boost/program_options/options_description.hpp>
#include <boost/program_options/variables_map.hpp>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backends/fault.h"
#include "tools/cli/bench_gpu.h"
#include "tools/lib/layer_kind.h"
#include "tools/lib/runner.h"
#include "tools/lib/trace.h"
#include "tools/lib/usage_error.h"

namespace tpsim::tools {

// The exit codes of every command, for the --help texts: a contract for outside harnesses.
extern const char kExitCodes[];

// Whether `command` is one of tpsim's commands (run, demo, ...).
bool isCommand(const std::string& command);
// What a command that threw `error` prints on stderr (its lines: "tpsim <command>: <message>", the
// message's control bytes shown as \xNN) and its exit code (kExitCodes): bad input 2, a failed world
// or tpsim's own error 3.
struct CommandFailure {
  int code = 0;
  std::string text;
};
CommandFailure failureOf(const std::string& command, std::exception_ptr error);

int demoMain(const std::vector<std::string>& args);
int benchMain(const std::vector<std::string>& args);
int runMain(const std::vector<std::string>& args);
int checkpointMain(const std::vector<std::string>& args);
int layoutMain(const std::vector<std::string>& args);

// A `tpsim run` command line, parsed and checked: all runMain decides before it touches a file or
// allocates a tensor. parseRunArgs throws UsageError or InvalidArgument naming the flag.
struct RunArgs {
  RunConfig config;
  VerifyMode verify = VerifyMode::kBound;
  std::string loadDir, saveDir;            // "" when not given
  std::string loadCheckpoint, saveCheckpoint;  // "" when not given
  std::set<std::string> sizeFlags;         // the size flags given (without dashes): the files must agree
  std::optional<std::int64_t> maxMemory;   // --max-memory, bytes
  TraceOptions trace;                      // --trace, --clock, --device-model
  bool quiet = false;                      // --quiet: no progress line on stderr
  std::chrono::milliseconds progressAfter{0};  // TPSIM_PROGRESS_AFTER_MS
  std::string help;                        // --help: the text to print (and nothing to run)
};
RunArgs parseRunArgs(const std::vector<std::string>& args);
// `tpsim demo`'s command line: its MLP configuration, or the --help text.
struct DemoArgs {
  RunConfig config;
  TraceOptions trace;  // --trace, --clock, --device-model
  std::string help;
};
DemoArgs parseDemoArgs(const std::vector<std::string>& args);

// `tpsim bench`'s simulator sections (tools/cli/bench.cc).
struct BenchConfig {
  std::string what = "all";
  std::vector<int> ranks;
  std::string ranksText;  // --ranks as given, for the header
  int threads = 0;
  int iters = 5000;
  int bwRanks = 8;
  long long minBytes = 0, maxBytes = 0;
  int bwIters = 5;
  int gemmReps = 3;
  std::int64_t tokens = 2048, hidden = 1024, ffn = 4096;
  std::vector<int> mlpTp;
  int mlpReps = 2;
};
// `tpsim bench`'s command line: the simulator's configuration, or with --backend gpu the GPU's.
struct BenchArgs {
  bool gpuBackend = false;
  BenchConfig sim;
  GpuBenchConfig gpu;
  std::string help;
};
BenchArgs parseBenchArgs(const std::vector<std::string>& args);

// `tpsim layout`'s command line: the layer to draw, or the --help text.
struct LayoutArgs {
  RunConfig config;
  std::string svg;  // --svg FILE; "" when not given
  std::string help;
};
LayoutArgs parseLayoutArgs(const std::vector<std::string>& args);

// `tpsim checkpoint`'s command line: the action and its paths, or the --help text.
struct CheckpointArgs {
  std::string action;         // "inspect" or "consolidate"
  std::string dir, file;      // file: consolidate's FILE.safetensors
  std::optional<DType> to;    // consolidate --dtype; nullopt: the saved dtypes
  std::string help;
};
CheckpointArgs parseCheckpointArgs(const std::vector<std::string>& args);
// What `tpsim checkpoint inspect DIR` prints of `reader`, DIR's checkpoint read and checked whole.
std::string inspectText(const std::string& dir, const CheckpointReader& reader);
// The inspect table's GTP_remat padding column of a key: "-", "GTP_remat, none", "24 rows per TP slice (T=2)".
std::string checkpointPaddingText(const CheckpointKey& key);
// `tpsim checkpoint consolidate DIR FILE`: writes FILE (all or nothing), returns what it prints.
std::string consolidateCheckpoint(const std::string& dir, const std::string& file, std::optional<DType> to);

// Parses `args` against `options` into a notified variables_map. Throws UsageError for a stray
// word: Boost would drop it silently, so `--bias false` would run with the bias on.
boost::program_options::variables_map parseOptions(const std::vector<std::string>& args,
                                                   const boost::program_options::options_description& options);
// The flags `tpsim run` and `tpsim layout` share, bound to `c` (--layer to `layer`, for
// parseLayer): help, layer, TP, sequence parallelism and GTP_remat into `parallelism`; Megatron's
// constructor arguments into `layer`; the shape flags into `size`.
void addParallelismOptions(boost::program_options::options_description& parallelism, RunConfig& c, std::string& layer);
void addLayerOptions(boost::program_options::options_description& layerOptions, RunConfig& c);
void addSizeOptions(boost::program_options::options_description& size, RunConfig& c);
// The size flags of `size` given in `vm`. Throws UsageError for one that c's layer kind has no size
// for (--vocab with --layer column): it would be ignored unsaid.
std::set<std::string> givenSizeFlags(const boost::program_options::options_description& size,
                                     const boost::program_options::variables_map& vm, const RunConfig& c);
// --layer's value. Throws UsageError.
const LayerKind* parseLayer(const std::string& text);
// --layer's help: the kinds of the table.
const char* layerHelp();

// "1234" -> 1234 for --seed: digits only, so "-1" is refused instead of wrapping to 2^64 - 1.
std::uint64_t parseSeed(const std::string& text);

// The help of --inject and --timeout, which run and demo share.
extern const char kInjectHelp[];
extern const char kTimeoutHelp[];
// The help of --trace, --clock and --device-model, which run and demo share.
extern const char kTraceHelp[];
extern const char kClockHelp[];
extern const char kDeviceModelHelp[];
// --inject RANK:K:FAULT, each one (backends/fault.h). Throws UsageError naming --inject.
std::vector<Fault> parseInjections(const std::vector<std::string>& specs);
// --timeout SECONDS: a positive number ("1", "0.5"), in milliseconds. Throws UsageError.
std::chrono::milliseconds parseTimeout(const std::string& text);

// "1,2,4" -> {1, 2, 4}; "2..64" -> powers of two from 2 to 64 (never empty). Throws UsageError
// naming `option`.
std::vector<int> parseIntList(const std::string& option, const std::string& text);
// "128", "64K", "16M", "1G" (or k, m, g) -> bytes, at most 2^63 - 1. Throws UsageError naming
// `option`.
long long parseSize(const std::string& option, const std::string& text);
// parseSize's inverse: 268435456 -> "256M", 1536 -> "1536".
std::string sizeText(long long bytes);

}  // namespace tpsim::tools
