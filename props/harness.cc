#include "props/harness.h"

#include <rapidcheck/detail/Configuration.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>

#include "tools/lib/npy.h"

namespace tpsim::props {
namespace {

// Cases per second of every property that ran in this process, printed once at the end.
struct Rate {
  int cases;
  double seconds;
};
std::map<std::string, Rate>& rates() {
  static std::map<std::string, Rate> r;
  return r;
}

class RateSummary : public ::testing::Environment {
 public:
  void TearDown() override {
    if (rates().size() < 2) return;  // one property per process (ctest): its own line says it all
    std::printf("[  props   ] %-80s %7s %9s %10s\n", "property", "cases", "seconds", "cases/s");
    int cases = 0;
    double seconds = 0;
    for (const auto& [name, r] : rates()) {
      std::printf("[  props   ] %-80s %7d %9.3f %10.1f\n", name.c_str(), r.cases, r.seconds, r.cases / r.seconds);
      cases += r.cases;
      seconds += r.seconds;
    }
    std::printf("[  props   ] %-80s %7d %9.3f %10.1f\n", "all", cases, seconds, cases / seconds);
  }
};
const ::testing::Environment* const kRateSummary = ::testing::AddGlobalTestEnvironment(new RateSummary);

// True when RC_PARAMS sets max_success itself.
bool rcParamsSetMaxSuccess() {
  const char* p = std::getenv("RC_PARAMS");
  return p != nullptr && std::string(p).find("max_success") != std::string::npos;
}

}  // namespace

int soakFactor() {
  const char* s = std::getenv("TPSIM_PROPS_SOAK");
  if (s == nullptr || *s == '\0') return 1;
  char* end = nullptr;
  const long n = std::strtol(s, &end, 10);
  if (*end != '\0' || n < 1 || n > 1000000) {
    std::fprintf(stderr, "TPSIM_PROPS_SOAK must be a positive integer, got '%s'; using 1\n", s);
    return 1;
  }
  return int(n);
}

int caseBudget(int cases) {
  if (rcParamsSetMaxSuccess()) return rc::detail::configuration().testParams.maxSuccess;
  return cases * soakFactor();
}

std::string currentTestName() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info ? std::string(info->test_suite_name()) + "." + info->name() : std::string("unknown");
}

void checkProperty(int cases, const std::function<void()>& property) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata metadata;
  metadata.id = std::string(info->test_suite_name()) + "/" + info->name();  // RC_GTEST_PROP's id
  metadata.description = info->name();
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  params.maxSuccess = caseBudget(cases);

  const auto start = std::chrono::steady_clock::now();
  const rc::detail::TestResult result = rc::detail::checkTestable(property, metadata, params);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  rc::detail::SuccessResult success;
  if (!result.match(success)) {
    std::ostringstream os;
    rc::detail::printResultMessage(result, os);
    FAIL() << os.str() << "\n";
  }
  if (!success.distribution.empty()) {
    rc::detail::printResultMessage(result, std::cout);
    std::cout << std::endl;
  }
  const std::string name = currentTestName();
  rates()[name] = {success.numSuccess, seconds};
  std::printf("[  props   ] %s: %d cases in %.3f s (%.1f cases/s)\n", name.c_str(), success.numSuccess, seconds,
              success.numSuccess / seconds);
  ::testing::Test::RecordProperty("cases", success.numSuccess);
  ::testing::Test::RecordProperty("cases_per_second", std::to_string(success.numSuccess / seconds));
}

std::string writeFailingInputs(const TensorMap& inputs) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "tpsim-props" / currentTestName();
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  fs::create_directories(dir);
  for (const auto& [name, t] : inputs) {
    const std::string file = (dir / (name + ".npy")).string();
    if (t.dtype == DType::kInt64) {
      const std::vector<std::int64_t> v(t.values.begin(), t.values.end());
      tools::writeNpy(file, DType::kInt64, t.shape, v.data());
    } else {
      const std::vector<float> v(t.values.begin(), t.values.end());
      tools::writeNpy(file, DType::kFloat32, t.shape, v.data());
    }
  }
  return dir.string();
}

void failLayerCase(const RunConfig& config, Numerics numerics, const std::string& backend, const TensorMap& inputs,
                   const std::string& what) {
  const std::string dir = writeFailingInputs(inputs);
  std::ostringstream os;
  os << "\n  case:    " << config.str() << " " << shapesOf(config) << " (" << numericsName(numerics)
     << " mode) on backend " << backend;
  const std::string gtp = gtpSummary(config);
  if (!gtp.empty()) os << "\n  gtp:     " << gtp;
  os << "\n  failure: " << what << "\n  inputs:  " << dir << "/*.npy (" << inputs.size()
     << " files)\n  replay:  " << tools::commandLine(config, dir) << "\n";
  RC_FAIL(os.str());
}

}  // namespace tpsim::props
