// tpsim layout: every tensor of a layer (the MLP block's fc1 and fc2 included) drawn as its global
// tensor cut into the blocks each rank (t, g) holds: pad rows, replicated copies and partial sums
// marked, each rank's gtp_local_pad_zero_count and the duplicate filters' choice listed. Text on
// stdout (ANSI colour on a terminal unless NO_COLOR is set), and with --svg one standalone SVG page.
//
// It draws core/placement.h's description of layers built on the simulator; it runs no forward or
// backward and reads no tensor values.
#pragma once

#include <string>
#include <vector>

#include "core/placement.h"
#include "tools/lib/run_config.h"

namespace tpsim::tools {

// placementsOf(config) (tools/lib/runner.h), after checking config and its sizes (checkSizes), with
// messages naming the flags.
std::vector<TensorPlacement> layoutPlacements(const RunConfig& config);

// The text drawing of every tensor; `colour` adds ANSI escapes.
std::string layoutText(const RunConfig& config, const std::vector<TensorPlacement>& placements, bool colour);

// One standalone SVG page: a panel per tensor, a colour per rank, padding hatched, a legend. Each
// block is a <rect class="block"> with data-rank, data-t, data-g, data-pad and its layout ranges
// data-rows="begin end" and data-cols="begin end" (columns: dims after the first, flattened); each
// panel a <g class="panel"> with data-tensor, data-rows, data-cols (its layout extents) and
// data-copies (how many ranks hold each element).
std::string layoutSvg(const RunConfig& config, const std::vector<TensorPlacement>& placements);

}  // namespace tpsim::tools
