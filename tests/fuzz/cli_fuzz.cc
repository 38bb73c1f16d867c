// libFuzzer target: `tpsim run`, `tpsim demo` and `tpsim bench` argument handling, parsing and
// validation up to the run, with argv built from the input (the first byte picks the command, '\0'
// separates the words). A usage error or InvalidArgument is the expected answer to a bad command line; for a
// good one, the memory estimate and the printed configuration must not fail either.
#include <boost/program_options/errors.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tools/cli/cli.h"
#include "tools/lib/memory.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tpsim::tools;
  if (size == 0) return 0;
  std::vector<std::string> args(1);
  for (std::size_t i = 1; i < size; ++i) {
    if (data[i] == '\0') args.emplace_back();
    else args.back() += char(data[i]);
  }
  try {
    if (data[0] % 3 == 0) {
      const RunArgs a = parseRunArgs(args);
      if (a.help.empty() && a.loadDir.empty()) {
        (void)bytesText(estimateRunBytes(a.config, tensorShapes(a.config), a.verify));
        (void)a.config.str();
        (void)commandLine(a.config);
      }
    } else if (data[0] % 3 == 1) {
      const DemoArgs a = parseDemoArgs(args);
      if (a.help.empty()) (void)tensorShapes(a.config);
    } else {
      (void)parseBenchArgs(args);
    }
  } catch (const UsageError&) {
  } catch (const tpsim::InvalidArgument&) {
  } catch (const boost::program_options::error&) {
  }
  return 0;
}
