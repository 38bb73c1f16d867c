#include "tools/cli/cli.h"

#include <boost/program_options.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <limits>
#include <new>

#include "backends/errors.h"
#include "backends/world.h"
#include "tools/lib/job.h"

namespace po = boost::program_options;

namespace tpsim::tools {

const char kExitCodes[] =
    "exit codes:\n"
    "  0  the sharded results agree with the unsharded computation\n"
    "  1  a result is outside its bound (or not finite)\n"
    "  2  bad input: flags, files, sizes, out of memory, or a path that cannot be read or written\n"
    "  3  the simulated world failed (a rank or a collective), or tpsim's own error\n";

namespace {

// Control bytes (a file's header, a path) shown as \xNN: an error message must not drive the terminal.
std::string printableLines(const std::string& text) {
  std::string out;
  for (unsigned char ch : text) {
    if (ch >= 0x20 && ch != 0x7f) {
      out += char(ch);
    } else if (ch == '\n') {
      out += "\n";  // multi-line messages (a world failure's ranks) stay readable
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", ch);
      out += hex;
    }
  }
  return out;
}

// What needed more memory than the machine has, and where the command's sizes come from.
std::string sizeSources(const std::string& command) {
  const std::string shapes =
      "--seq, --batch, --in-features, --out-features, --ffn-hidden, --vocab, --tokens, --experts";
  if (command == "bench")
    return "the benchmark needs more than this machine has; its sizes come from --ranks, --bw-ranks, --max-bytes, "
           "--tokens, --hidden, --ffn and --mlp-tp";
  if (command == "layout")
    return "the layout's layers need more than this machine has; their sizes come from " + shapes +
           ", --tp, --gtp-remat and --pad-for-alignment";
  if (command == "checkpoint") return "the checkpoint's tensors need more than this machine has";
  return "the run needs more than this machine has; its size comes from " + shapes +
         ", --tp, --gtp-remat and --pad-for-alignment, or from the --load files";
}

// One line, "tpsim <command>: <message>", and the exit code. The tools' own messages already start
// with "tpsim run: " where they reach library callers too; that is not repeated.
CommandFailure failed(const std::string& command, const std::string& kind, std::string message, int code) {
  const std::string prefix = "tpsim " + command + ": ";
  if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  return {code, prefix + kind + printableLines(message) + "\n"};
}

}  // namespace

bool isCommand(const std::string& command) {
  return command == "demo" || command == "bench" || command == "run" || command == "layout" ||
         command == "checkpoint" || command == "devices";
}

CommandFailure failureOf(const std::string& command, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    const bool known = isCommand(command);
    const std::string name = known ? "tpsim " + command : "tpsim";
    return {2, name + ": " + printableLines(e.message) + "\nTry '" + name + " --help'\n"};
  } catch (const po::error& e) {
    return {2, "tpsim " + command + ": " + printableLines(e.what()) + "\nTry 'tpsim " + command + " --help'\n"};
  } catch (const JobRefusal& e) {
    return failed(command, "", e.what(), e.code);
  } catch (const WorldError& e) {
    return failed(command, "the simulated world failed: ", e.what(), 3);
  } catch (const InvalidArgument& e) {
    return failed(command, "", e.what(), 2);
  } catch (const std::filesystem::filesystem_error& e) {
    return failed(command, "", "'" + e.path1().string() + "': expected a usable path, got '" + e.code().message() + "'",
                  2);
  } catch (const std::bad_alloc&) {
    return failed(command, "", "out of memory: " + sizeSources(command), 2);
  } catch (const std::exception& e) {
    return failed(command, "", e.what(), 3);
  }
}

boost::program_options::variables_map parseOptions(const std::vector<std::string>& args,
                                                   const boost::program_options::options_description& options) {
  namespace po = boost::program_options;
  const po::parsed_options parsed = po::command_line_parser(args).options(options).run();
  for (const std::string& word : po::collect_unrecognized(parsed.options, po::include_positional))
    throw UsageError{"expected only options (a switch such as --bias takes no value: give it for on, leave it "
                     "out for off), got the stray argument '" + word + "'"};
  po::variables_map vm;
  po::store(parsed, vm);
  po::notify(vm);
  return vm;
}

void addParallelismOptions(po::options_description& par, RunConfig& c, std::string& layer) {
  par.add_options()
      ("help,h", "show this help")
      ("layer,l", po::value(&layer), layerHelp())
      ("tp,p", po::value(&c.tp)->default_value(c.tp), "tensor-parallel size T (ranks)")
      ("sequence-parallel,S", po::bool_switch(&c.sequenceParallel), "shard activations along the sequence")
      ("gtp-remat,G", po::value(&c.gtpRemat)->default_value(c.gtpRemat),
       "GTP_remat size G: weights sharded again over G peers that split the batch (world T x G)")
      ("pad-for-alignment", po::value(&c.padForAlignment)->default_value(c.padForAlignment),
       "GTP_remat: pad dim 0 to a multiple of A x G (0 = no padding; dim 0 must divide by G)");
}

void addLayerOptions(po::options_description& lay, RunConfig& c) {
  lay.add_options()
      ("bias", po::bool_switch(&c.bias), "column/row: with a bias")
      ("gather-output", po::bool_switch(&c.gatherOutput), "column: all-gather the output")
      ("input-is-parallel", po::bool_switch(&c.inputIsParallel), "row: the input is already split along K")
      ("reduce-scatter-embeddings", po::bool_switch(&c.reduceScatterEmbeddings),
       "embedding: reduce-scatter the output along the sequence")
      ("skip-bias-add", po::bool_switch(&c.skipBiasAdd), "column/row: return the bias instead of adding it")
      ("disable-grad-reduce", po::bool_switch(&c.disableGradReduce),
       "column: no TP reduction of the input gradient; input.grad is each rank's partial, (T, s, b, K)")
      ("stride", po::value(&c.stride)->default_value(c.stride), "column/row: interleaved partition stride");
}

void addSizeOptions(po::options_description& size, RunConfig& c) {
  size.add_options()
      ("seq,s", po::value(&c.seq)->default_value(c.seq), "sequence length s")
      ("batch,b", po::value(&c.batch)->default_value(c.batch), "micro-batch b")
      ("in-features,k", po::value(&c.inFeatures)->default_value(c.inFeatures), "K (the MLP's hidden size h)")
      ("out-features,n", po::value(&c.outFeatures)->default_value(c.outFeatures), "N (the embedding's h)")
      ("ffn-hidden,f", po::value(&c.ffnHidden)->default_value(c.ffnHidden), "mlp: ffn hidden size F")
      ("vocab,V", po::value(&c.vocab)->default_value(c.vocab), "embedding: vocabulary size V")
      ("tokens", po::value(&c.tokens)->default_value(c.tokens), "grouped: routed tokens M, each to one expert")
      ("experts", po::value(&c.experts)->default_value(c.experts),
       "grouped: local experts E (also with --load: the weight<i>.npy files it reads)");
}

std::set<std::string> givenSizeFlags(const po::options_description& size, const po::variables_map& vm,
                                     const RunConfig& c) {
  std::set<std::string> given;
  for (const auto& option : size.options()) {
    const std::string& flag = option->long_name();
    if (vm[flag].defaulted()) continue;
    const std::vector<SizeSpec>& sizes = c.layer->sizes();
    if (std::none_of(sizes.begin(), sizes.end(), [&](const SizeSpec& s) { return s.flag == flag; }))
      throw UsageError{"--" + flag + ": applies to --layer " + layerKindsSizedBy(flag) + ", got --layer " +
                       c.layer->name()};
    given.insert(flag);
  }
  return given;
}

const LayerKind* parseLayer(const std::string& s) {
  if (const LayerKind* k = findLayerKind(s)) return k;
  throw UsageError{"--layer: expected " + layerKindNames() + ", got '" + s + "'"};
}

const char* layerHelp() {
  static const std::string help = [] {
    std::string s;
    for (const LayerKind* k : layerKinds()) s += (s.empty() ? "" : " | ") + std::string(k->name());
    return s + " (required)";
  }();
  return help.c_str();
}

std::uint64_t parseSeed(const std::string& text) {
  bool ok = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  std::uint64_t v = 0;
  try {
    if (ok) v = std::stoull(text);
  } catch (const std::out_of_range&) {
    ok = false;
  }
  if (!ok) throw UsageError{"--seed: expected an integer in 0..2^64-1, got '" + text + "'"};
  return v;
}

const char kInjectHelp[] =
    "RANK:K:FAULT, repeatable: rank RANK, at its K-th collective (counted from 1 over all its groups, "
    "group splits not counted: the order `tpsim demo` lists), does FAULT: skip (does not issue it), op, count, "
    "dtype or group (issues another one), throw (the rank throws), stall (blocks until --timeout): the run "
    "ends with every rank's diagnostic and exit 3; corrupt[:ELEMENT:BIT] (flips BIT, default the top exponent "
    "bit, of ELEMENT, default 0, of the rank's result of that collective): the run completes and the "
    "verification must catch it (exit 1)";
const char kTimeoutHelp[] =
    "seconds a collective may wait for its members before the world fails (exit 3); a positive number";

const char kTraceHelp[] =
    "write a Chrome Trace Event file (Perfetto, chrome://tracing): a process per rank, compute and "
    "communication tracks, a span per op and collective, arrows between a collective's members";
const char kClockHelp[] = "measured (this run's wall time per rank) | model (--device-model's roofline and links)";
const char kDeviceModelHelp[] =
    "--clock model: h100-nvlink | h200-nvlink | a100-nvlink | pcie | FILE of key = value lines (tflops.fp32, "
    "tflops.bf16, tflops.fp16, tflops.fp64, memory_gbps, link_latency_us, link_gbps)";

std::vector<Fault> parseInjections(const std::vector<std::string>& specs) {
  std::vector<Fault> faults;
  for (const std::string& spec : specs) {
    try {
      faults.push_back(parseFault(spec));
    } catch (const InvalidArgument& e) {
      throw UsageError{std::string("--inject: ") + e.what()};
    }
  }
  return faults;
}

std::chrono::milliseconds parseTimeout(const std::string& text) {
  std::size_t used = 0;
  double seconds = 0;
  try {
    seconds = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  // Whole milliseconds, at most about 11 days: the watchdog's clock arithmetic stays far from overflow.
  if (used == 0 || used != text.size() || !(seconds >= 0.001 && seconds <= 1e6))
    throw UsageError{"--timeout: expected a positive number of seconds from 0.001 to 1000000 (like 1 or 0.5), got '" +
                     text + "'"};
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

std::vector<int> parseIntList(const std::string& option, const std::string& text) {
  auto fail = [&](const std::string& why) {
    return UsageError{"--" + option + ": expected positive integers like 1,2,4 or 2..64" + why + ", got '" + text + "'"};
  };
  auto toInt = [&](const std::string& s) {
    int v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 1) throw fail("");
    return v;
  };
  std::vector<int> out;
  if (auto dots = text.find(".."); dots != std::string::npos) {
    const int lo = toInt(text.substr(0, dots)), hi = toInt(text.substr(dots + 2));
    if (lo > hi) throw fail(" (a range from low to high)");
    for (long long v = lo; v <= hi; v *= 2) out.push_back(int(v));
    return out;
  }
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(toInt(text.substr(start, comma - start)));
    start = comma + 1;
  }
  return out;
}

long long parseSize(const std::string& option, const std::string& text) {
  long long v = -1;
  const char* const end = text.data() + text.size();
  // from_chars takes no '+', space or base prefix; a '-' is refused below.
  const auto [used, ec] = std::from_chars(text.data(), end, v);
  const std::string suffix(used, end);
  int shift = -1;
  if (suffix.empty()) shift = 0;
  else if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  if (ec != std::errc() || v < 0 || shift < 0 || v > (std::numeric_limits<long long>::max() >> shift))
    throw UsageError{"--" + option + ": expected a size like 128, 64K, 16M or 1G (at most 2^63 - 1 bytes), got '" +
                     text + "'"};
  return v << shift;
}

std::string sizeText(long long bytes) {
  for (auto [scale, suffix] : {std::pair{1LL << 30, "G"}, {1LL << 20, "M"}, {1LL << 10, "K"}})
    if (bytes != 0 && bytes % scale == 0) return std::to_string(bytes / scale) + suffix;
  return std::to_string(bytes);
}

}  // namespace tpsim::tools
