// tpsim layout: the command line of tools/lib/layout.h's drawing.
#include <boost/program_options.hpp>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <unistd.h>

#include "tools/cli/cli.h"
#include "tools/lib/input_file.h"
#include "tools/lib/layout.h"
#include "tools/lib/output_files.h"

namespace po = boost::program_options;

namespace tpsim::tools {

LayoutArgs parseLayoutArgs(const std::vector<std::string>& args) {
  LayoutArgs out;
  RunConfig& c = out.config;
  std::string layer;
  po::options_description par("Parallelism");
  addParallelismOptions(par, c, layer);
  po::options_description lay("Layer options (Megatron's constructor arguments)");
  addLayerOptions(lay, c);
  po::options_description size("Problem size");
  addSizeOptions(size, c);
  po::options_description output("Output");
  output.add_options()("svg", po::value(&out.svg), "also write the drawing as one standalone SVG page to FILE");
  po::options_description all("tpsim layout --layer KIND [options]");
  all.add(par).add(lay).add(size).add(output);
  const po::variables_map vm = parseOptions(args, all);
  if (vm.count("help")) {
    std::ostringstream help;
    help << all << "\nText on stdout, coloured on a terminal unless NO_COLOR is set.\n"
         << "exit codes: 0 drawn, 2 bad flags or sizes, or an --svg path that cannot be written\n";
    out.help = help.str();
    return out;
  }
  if (layer.empty()) throw UsageError{"--layer is required: " + layerKindNames()};
  if (vm.count("svg") && out.svg.empty()) throw UsageError{"--svg: expected a file name, got an empty path"};
  c.layer = parseLayer(layer);
  givenSizeFlags(size, vm, c);
  applyLayerConventions(c);
  return out;
}

int layoutMain(const std::vector<std::string>& args) {
  const LayoutArgs parsed = parseLayoutArgs(args);
  if (!parsed.help.empty()) {
    std::fputs(parsed.help.c_str(), stdout);
    return 0;
  }
  const RunConfig& c = parsed.config;
  const std::string& svg = parsed.svg;
  const std::vector<TensorPlacement> placements = layoutPlacements(c);
  const char* noColour = std::getenv("NO_COLOR");
  const bool colour = isatty(fileno(stdout)) && (noColour == nullptr || *noColour == '\0');
  if (!svg.empty()) {  // a bad path fails before any output
    FileUses uses;
    uses.write({"--svg"}, svg);
    OutputFiles output("--svg");
    output.write(svg, layoutSvg(c, placements));
    output.commit();
  }
  std::fputs(layoutText(c, placements, colour).c_str(), stdout);
  if (!svg.empty()) std::printf("\nwrote %s\n", terminalText(svg).c_str());
  return 0;
}

}  // namespace tpsim::tools
