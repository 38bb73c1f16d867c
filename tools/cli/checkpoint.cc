// tpsim checkpoint: look into a sharded checkpoint (`inspect`) or write its tensors unsharded into
// one safetensors file (`consolidate`). Both read and check the whole checkpoint first
// (tools/lib/checkpoint_files.h), so a corrupt one is refused with the file and the mismatch named;
// the names they print come from its files, escaped (printable) so that none reaches the terminal raw.
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <set>

#include "backends/errors.h"
#include "backends/world/rendezvous.h"
#include "tools/lib/checkpoint_files.h"
#include "tools/cli/cli.h"
#include "tools/lib/input_file.h"
#include "tools/lib/output_files.h"
#include "tools/lib/npy.h"

namespace po = boost::program_options;

namespace tpsim::tools {
namespace {

const char* kCheckpointUsage =
    "usage: tpsim checkpoint inspect DIR\n"
    "       tpsim checkpoint consolidate DIR FILE.safetensors [--dtype saved|fp32|bf16|fp16]\n"
    "\n"
    "  inspect      the keys, their global shapes, dtypes, chunks and writing ranks, and the files\n"
    "  consolidate  every tensor unsharded (pad rows dropped) in one safetensors file\n";

const char* kCheckpointExitCodes =
    "exit codes:\n"
    "  0  done\n"
    "  2  bad input: arguments, a checkpoint that is missing, truncated, corrupt or incomplete, or a FILE\n"
    "     that cannot be written; the message names the file, the key and the expected and actual value\n";

// printf into a string.
template <class... Args>
void appendf(std::string& out, const char* format, const Args&... args) {
  const int n = std::snprintf(nullptr, 0, format, args...);
  const std::size_t at = out.size();
  out.resize(at + std::size_t(n) + 1);
  std::snprintf(&out[at], std::size_t(n) + 1, format, args...);
  out.pop_back();
}

}  // namespace

std::string checkpointPaddingText(const CheckpointKey& k) {
  const CheckpointChunk& c = k.chunks.front();
  if (!c.gtpPadding) return "-";
  if (c.gtpPadding->padLength == 0) return "GTP_remat, none";
  return detail::concat(c.gtpPadding->padLength, " rows per ",
                        c.gtpPadding->tpAxis == 0 && c.gtpPadding->tpSize > 1
                            ? detail::concat("TP slice (T=", c.gtpPadding->tpSize, ")")
                            : std::string("tensor"));
}

std::string inspectText(const std::string& dir, const CheckpointReader& reader) {
  std::string out;
  std::map<std::string, std::pair<int, std::int64_t>> files;  // file -> (writer, chunks)
  for (const auto& [key, k] : reader.keys())
    for (const auto& c : k.chunks) {
      files[c.file].first = c.writer;
      ++files[c.file].second;
    }
  appendf(out, "# checkpoint %s: %zu tensors, %zu objects, %zu files (checksums verified)\n\n", terminalText(dir).c_str(),
              reader.keys().size(), reader.objects().size(), files.size());
  appendf(out, "%-22s %-5s %-14s %-14s %6s  %-10s %s\n", "key", "dtype", "global shape", "saved shape", "chunks",
              "writers", "GTP_remat padding (not stored)");
  for (const auto& [key, k] : reader.keys()) {
    std::set<int> writers;
    for (const auto& c : k.chunks) writers.insert(c.writer);
    appendf(out, "%-22s %-5s %-14s %-14s %6zu  %-10s %s\n", printable(key).c_str(), safetensorsDtype(k.dtype),
                shapeText(k.globalShape).c_str(), shapeText(k.savedGlobalShape).c_str(), k.chunks.size(),
                world::rankList({writers.begin(), writers.end()}).c_str(), checkpointPaddingText(k).c_str());
  }
  for (const auto& [key, o] : reader.objects()) {
    const std::set<int> writers(o.writers.begin(), o.writers.end());
    appendf(out, "%-22s %-5s %-14s %-14s %6zu  %-10s %s\n", printable(key).c_str(), "-",
                shapeText(o.globalShape).c_str(), "-", o.writers.size(),
                world::rankList({writers.begin(), writers.end()}).c_str(), "(value None)");
  }
  bool placed = false;
  for (const auto& [key, k] : reader.keys())
    if (!k.placement.empty()) {
      if (!placed) out += "\n# placements when saved\n";
      placed = true;
      appendf(out, "%-22s %s\n", printable(key).c_str(), printable(k.placement).c_str());
    }
  appendf(out, "\n%-24s %6s %8s %12s\n", "file", "writer", "chunks", "bytes");
  for (const auto& [file, info] : files)
    appendf(out, "%-24s %6d %8lld %12lld\n", printable(file).c_str(), info.first, (long long)info.second,
            (long long)std::filesystem::file_size(std::filesystem::path(dir) / file));
  return out;
}

std::string consolidateCheckpoint(const std::string& dir, const std::string& file, std::optional<DType> to) {
  namespace fs = std::filesystem;
  const fs::path out(file);
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  TPSIM_CHECK(fs::is_directory(parent), "consolidate: FILE: expected a file in an existing directory, got '", file,
              "' (no directory ", parent.string(), ")");
  FileUses uses;
  uses.write({"consolidate: FILE"}, file);
  CheckpointIndex index(dir);
  index.checkFitsInMemory("consolidate");
  const CheckpointReader reader(std::move(index));
  for (const std::string& path : reader.paths()) uses.read({"DIR", fs::path(path).filename().string()}, path);
  std::vector<SafetensorsEntry> tensors;
  for (const auto& [key, k] : reader.keys()) {
    SafetensorsEntry e{key, k.dtype, k.globalShape, reader.consolidated(key)};
    if (to && *to != k.dtype) {
      TPSIM_CHECK(isFloating(k.dtype), "consolidate: --dtype ", dtypeName(*to), ": key '", key, "' is ", dtypeName(k.dtype),
                  ", not a floating type");
      std::vector<char> converted(e.bytes.size() / dtypeSize(k.dtype) * dtypeSize(*to));
      for (std::size_t i = 0; i < converted.size() / dtypeSize(*to); ++i)
        storeFromDouble(*to, loadAsDouble(k.dtype, e.bytes.data() + i * dtypeSize(k.dtype)),
                        converted.data() + i * dtypeSize(*to));
      e.dtype = *to;
      e.bytes = std::move(converted);
    }
    tensors.push_back(std::move(e));
  }
  OutputFiles output("consolidate: FILE");
  output.write(file, safetensorsBytes(tensors, {{"source", "tpsim checkpoint consolidate"}}));
  output.commit();
  std::string report;
  appendf(report, "# consolidated %s: %zu tensors, pad rows dropped, into %s\n", terminalText(dir).c_str(),
          tensors.size(), terminalText(file).c_str());
  for (const auto& t : tensors)
    appendf(report, "%-22s %-5s %s\n", printable(t.name).c_str(), safetensorsDtype(t.dtype), shapeText(t.shape).c_str());
  return report;
}

CheckpointArgs parseCheckpointArgs(const std::vector<std::string>& args) {
  CheckpointArgs out;
  std::string dtype = "saved";
  std::vector<std::string> words;
  po::options_description opts("Options");
  opts.add_options()("help,h", "show this help")(
      "dtype,d", po::value(&dtype)->default_value(dtype),
      "consolidate: saved | fp32 | bf16 | fp16 (numpy reads no bf16: fp32 for numpy)");
  po::options_description hidden;
  hidden.add_options()("args", po::value(&words)->composing(), "the action and its paths");
  po::options_description all;
  all.add(opts).add(hidden);
  po::positional_options_description positional;
  positional.add("args", -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(positional).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::ostringstream help;
    help << kCheckpointUsage << "\n" << opts << "\n" << kCheckpointExitCodes;
    out.help = help.str();
    return out;
  }
  if (words.empty()) throw UsageError{"expected an action, inspect or consolidate, got none"};
  out.action = words[0];
  for (std::size_t i = 1; i < words.size(); ++i)
    if (words[i].empty()) throw UsageError{out.action + ": expected paths, got an empty argument"};
  if (out.action == "inspect") {
    if (words.size() != 2) throw UsageError{"inspect: expected one argument DIR, got " + std::to_string(words.size() - 1)};
    if (dtype != "saved" || !vm["dtype"].defaulted())
      throw UsageError{"--dtype: applies to consolidate, got it with inspect"};
    out.dir = words[1];
    return out;
  }
  if (out.action == "consolidate") {
    if (words.size() != 3)
      throw UsageError{"consolidate: expected two arguments DIR FILE.safetensors, got " +
                       std::to_string(words.size() - 1)};
    if (dtype != "saved") {
      if (dtype != "fp32" && dtype != "bf16" && dtype != "fp16")
        throw UsageError{"--dtype: expected saved, fp32, bf16 or fp16, got '" + dtype + "'"};
      out.to = parseDType(dtype);
    }
    out.dir = words[1];
    out.file = words[2];
    TPSIM_CHECK(std::filesystem::path(out.file).extension() == ".safetensors",
                "consolidate: FILE: expected a name ending in .safetensors, got '", out.file, "'");
    return out;
  }
  throw UsageError{"expected an action, inspect or consolidate, got '" + out.action + "'"};
}

int checkpointMain(const std::vector<std::string>& args) {
  const CheckpointArgs parsed = parseCheckpointArgs(args);
  if (!parsed.help.empty()) {
    std::fputs(parsed.help.c_str(), stdout);
    return 0;
  }
  const std::string report = parsed.action == "inspect" ? inspectText(parsed.dir, CheckpointReader(parsed.dir))
                                                        : consolidateCheckpoint(parsed.dir, parsed.file, parsed.to);
  std::fputs(report.c_str(), stdout);
  return 0;
}

}  // namespace tpsim::tools
