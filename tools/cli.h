// Shared pieces of the tpsim command line: the usage-error type and the subcommand entry points.
//
// Each subcommand parses its own options (Boost.Program_options) into a plain config struct
// before doing any work, prints its effective configuration first, and returns the process exit
// code (kExitCodes).
#pragma once

#include <boost/program_options/options_description.hpp>
#include <boost/program_options/variables_map.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace tpsim::tools {

// A bad command line: main prints one line plus "Try 'tpsim --help'" and exits 2.
struct UsageError {
  std::string message;
};

// The exit codes of every command, for the --help texts: a contract for outside harnesses.
extern const char kExitCodes[];

int demoMain(const std::vector<std::string>& args);
int benchMain(const std::vector<std::string>& args);
int runMain(const std::vector<std::string>& args);
int checkpointMain(const std::vector<std::string>& args);

// Parses `args` against `options` into a notified variables_map. Throws UsageError for a stray
// word: Boost would drop it silently, so `--bias false` would run with the bias on.
boost::program_options::variables_map parseOptions(const std::vector<std::string>& args,
                                                   const boost::program_options::options_description& options);
// "1234" -> 1234 for --seed: digits only, so "-1" is refused instead of wrapping to 2^64 - 1.
std::uint64_t parseSeed(const std::string& text);

// "1,2,4" -> {1, 2, 4}; "2..64" -> powers of two from 2 to 64. Throws UsageError naming `option`.
std::vector<int> parseIntList(const std::string& option, const std::string& text);
// "128", "64K", "16M", "1G" -> bytes. Throws UsageError naming `option`.
long long parseSize(const std::string& option, const std::string& text);
// parseSize's inverse: 268435456 -> "256M", 1536 -> "1536".
std::string sizeText(long long bytes);

}  // namespace tpsim::tools
