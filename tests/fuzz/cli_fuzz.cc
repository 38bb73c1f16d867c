// libFuzzer target: the argument handling of `tpsim run`, `demo`, `bench`, `layout` and `checkpoint`,
// parsing and validation up to the work, with argv built from the input (the first byte picks the
// command, '\0' separates the words). A usage error or InvalidArgument is the expected answer to a
// bad command line; for a good one, the memory estimate and the printed configuration must not fail
// either, and a layout small enough for the fuzzer's memory is drawn, as text and as SVG.
#include <boost/program_options/errors.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tools/cli/cli.h"
#include "tools/lib/layout.h"
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
    switch (data[0] % 5) {
      case 0: {
        const RunArgs a = parseRunArgs(args);
        if (a.help.empty() && a.loadDir.empty()) {
          const ShapeMap shapes = tensorShapes(a.config);
          (void)bytesText(estimateRunBytes(a.config, shapes, a.verify));
          // And a process's share of the world spread over an MPI job, holding the inputs whole or not.
          const int ranks = a.config.tp * a.config.gtpRemat;
          for (int p = 2; p <= 4; ++p)
            if (ranks % p == 0) (void)bytesText(estimateRunBytes(a.config, shapes, a.verify, {p != 3, p, p == 2}));
          (void)a.config.str();
          (void)commandLine(a.config);
        }
        break;
      }
      case 1: {
        const DemoArgs a = parseDemoArgs(args);
        if (a.help.empty()) (void)tensorShapes(a.config);
        break;
      }
      case 2: (void)parseBenchArgs(args); break;
      case 3: {
        const LayoutArgs a = parseLayoutArgs(args);
        if (!a.help.empty()) break;
        // tpsim layout builds the layers (tools/lib/layout.h), pad rows included: drawn when a run of
        // them is estimated to fit well within the fuzzer's memory. The estimate takes checked
        // sizes, as tpsim run's and layout's own checks leave them.
        a.config.validate();
        checkSizes(a.config, {SizeSources::Inputs::kFlags, ""});
        const double bytes = estimateRunBytes(a.config, tensorShapes(a.config), VerifyMode::kNone);
        if (bytes > double(64 << 20) || a.config.tp * a.config.gtpRemat > 64) break;
        const std::vector<tpsim::TensorPlacement> placements = layoutPlacements(a.config);
        (void)layoutText(a.config, placements, data[0] % 2 == 0);
        (void)layoutSvg(a.config, placements);
        break;
      }
      default: (void)parseCheckpointArgs(args); break;
    }
  } catch (const UsageError&) {
  } catch (const tpsim::InvalidArgument&) {
  } catch (const boost::program_options::error&) {
  }
  return 0;
}
