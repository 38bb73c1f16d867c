// How a property runs: TPSIM_PROP (a gtest test that checks one rapidcheck property with its own
// case budget, scaled by the soak factor, and reports cases per second), and what a layer-case
// failure prints: the whole case, the inputs written as .npy files and the `tpsim run --load`
// command line that replays them. Not a generator library (generators.h) and not a backend list
// (backends.h).
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <functional>
#include <string>

#include "props/generators.h"

namespace tpsim::props {

// The soak factor: TPSIM_PROPS_SOAK=N in the environment multiplies every property's case budget
// by N (default 1). RC_PARAMS="max_success=M" instead sets every budget to M.
int soakFactor();
// The successful cases a property with default budget `cases` runs now.
int caseBudget(int cases);

// Checks `property` as a rapidcheck property of the running gtest test (its id is
// "Suite/Name", as RC_GTEST_PROP's, so RC_PARAMS="reproduce=..." replays it) with caseBudget(cases)
// successful cases. Prints "[  props   ] Suite.Name: 200 cases in 1.234 s (162.1 cases/s)" and
// records cases and cases_per_second as gtest properties; fails the test with rapidcheck's
// report (the shrunk counterexample and the reproduce string) when the property fails.
void checkProperty(int cases, const std::function<void()>& property);

// "Suite.Name" of the running gtest test.
std::string currentTestName();

// Writes `inputs` to <temp>/tpsim-props/<Suite.Name>/<name>.npy (float32 values, which hold every
// fp32/bf16/fp16 value exactly, or int64 ids), replacing whatever an earlier failure of the same
// property left there, and returns the folder. During shrinking the last write is the final,
// smallest counterexample.
std::string writeFailingInputs(const TensorMap& inputs);

// RC_FAILs with everything needed to act on a failed layer case: the configuration and shapes,
// the numeric mode, the backend, the GTP_remat geometry when G > 1 (gtpSummary), `what` went
// wrong, the folder of its inputs and the `tpsim run ... --load <folder>` command line that replays
// it (with --gtp-remat, --pad-for-alignment, --gtp-reduce and --fp32-accum-reduce-scatter).
[[noreturn]] void failLayerCase(const RunConfig& config, Numerics numerics, const std::string& backend,
                                const TensorMap& inputs, const std::string& what);

}  // namespace tpsim::props

// A property as a gtest test with its own default case budget (RC_GTEST_PROP runs every property
// with the one global max_success; the suite needs cheap laws to run many cases and whole-layer
// laws fewer, so that the default run fits its time budget). The body uses RC_ASSERT, RC_PRE and
// RC_FAIL, and `*gen` to draw values, exactly like an RC_GTEST_PROP body.
#define TPSIM_PROP(Suite, Name, cases)                                                      \
  void tpsimProp_##Suite##_##Name();                                                         \
  TEST(Suite, Name) { ::tpsim::props::checkProperty((cases), &tpsimProp_##Suite##_##Name); } \
  void tpsimProp_##Suite##_##Name()
