// Unit tests of tools/lib/progress.h: the line names the first phase not ended with its rank
// count, the summary charges counted phases from the end of the one before, nothing is written
// before the delay or when disabled, a command that unwinds leaves a clean line and no summary, and
// stdout text goes above the line.
#include "tools/lib/progress.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "tools/lib/usage_error.h"

namespace tpsim::tools {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What a Progress writes, read back from a temporary file.
class Captured {
 public:
  Captured() : file_(std::tmpfile()) {}
  ~Captured() { std::fclose(file_); }
  std::FILE* file() { return file_; }
  std::string text() {
    std::fflush(file_);
    std::string out;
    std::rewind(file_);
    for (int c; (c = std::fgetc(file_)) != EOF;) out += char(c);
    return out;
  }

 private:
  std::FILE* file_;
};

PhaseTime phaseAt(const std::string& name, Clock::time_point begin, int startMs, int endMs, std::int64_t total = 0,
                  bool ended = true) {
  return PhaseTime{name, total, 0, begin + milliseconds(startMs), begin + milliseconds(endMs), ended};
}

TEST(ProgressLine, NamesTheFirstOpenPhaseWithItsRankCount) {
  const Clock::time_point t0 = Clock::now();
  std::vector<PhaseTime> phases = {phaseAt("generate", t0, 0, 800), phaseAt("forward", t0, 800, 2000, 8),
                                   phaseAt("backward", t0, 800, 0, 8, false)};
  phases[2].done = 3;
  EXPECT_EQ(progressLine("tpsim run", phases, t0, t0 + milliseconds(12400)), "tpsim run: backward 3/8 ranks, 12.4 s");
  phases[1].ended = false;
  phases[1].done = 5;
  EXPECT_EQ(progressLine("tpsim run", phases, t0, t0 + milliseconds(1000)), "tpsim run: forward 5/8 ranks, 1.0 s");
  EXPECT_EQ(progressLine("tpsim run", {phaseAt("verify", t0, 0, 0, 0, false)}, t0, t0 + milliseconds(50)),
            "tpsim run: verify, 0.1 s");
  EXPECT_EQ(progressLine("tpsim run", {}, t0, t0), "tpsim run: 0.0 s");
}

// Forward and backward start together (ranks move at their own pace); backward is charged from the
// moment the last rank passed forward.
TEST(ProgressSummary, ChargesEachPhaseFromTheEndOfTheOneBefore) {
  const Clock::time_point t0 = Clock::now();
  const std::vector<PhaseTime> phases = {phaseAt("generate", t0, 0, 1000), phaseAt("forward", t0, 1000, 2500, 4),
                                         phaseAt("backward", t0, 1000, 3000, 4), phaseAt("verify", t0, 3000, 4200)};
  EXPECT_EQ(progressSummary("tpsim run", phases, t0, t0 + milliseconds(4300)),
            "tpsim run: 4.3 s: generate 1.0 s, forward 1.5 s, backward 0.5 s, verify 1.2 s");
  EXPECT_EQ(progressSummary("tpsim run", {}, t0, t0 + milliseconds(100)), "tpsim run: 0.1 s");
}

TEST(Progress, CountedPhasesEndWhenEveryRankPassedThem) {
  Captured out;
  Progress p("tpsim run", true, milliseconds(0), out.file());
  p.phase("generate");
  p.counted({"forward", "backward"}, 4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&p] {
      p.passed("forward");
      p.passed("backward");
    });
  for (std::thread& t : ranks) t.join();
  p.phase("verify");
  p.finish();
  const std::string text = out.text();
  // Drawn at once (delay 0), then replaced by the summary on a line of its own.
  EXPECT_THAT(text, HasSubstr("\r\033[Ktpsim run: "));
  EXPECT_THAT(text, MatchesRegex(".*tpsim run: [0-9.]+ s: generate [0-9.]+ s, forward [0-9.]+ s, backward [0-9.]+ s, "
                                 "verify [0-9.]+ s\n"));
}

TEST(Progress, NothingBeforeTheDelayOrWhenDisabled) {
  for (const bool enabled : {false, true}) {
    Captured out;
    {
      Progress p("tpsim run", enabled, enabled ? milliseconds(3'600'000) : milliseconds(0), out.file());
      p.phase("generate");
      std::this_thread::sleep_for(milliseconds(300));  // past a redraw
      p.above([] {});
      p.finish();
    }
    EXPECT_EQ(out.text(), "") << (enabled ? "an hour's delay" : "disabled");
  }
}

// An exception unwinding through the command clears the line for its message and prints no
// summary: the phases' times of a failed run would mislead.
TEST(Progress, AFailedCommandLeavesACleanLineAndNoSummary) {
  Captured out;
  {
    Progress p("tpsim run", true, milliseconds(0), out.file());
    p.phase("forward");
    std::this_thread::sleep_for(milliseconds(300));  // past the redraw after the first
  }
  const std::string text = out.text();
  EXPECT_THAT(text, HasSubstr("tpsim run: forward, "));
  EXPECT_THAT(text, EndsWith("\r\033[K"));
  EXPECT_THAT(text, Not(HasSubstr("\n")));
}

TEST(Progress, StdoutTextGoesAboveTheLine) {
  Captured out;
  Progress p("tpsim run", true, milliseconds(0), out.file());
  p.phase("verify");
  std::this_thread::sleep_for(milliseconds(50));
  std::string order;
  p.above([&] { order = out.text(); });
  // While `print` runs the line is off the terminal: the last bytes written cleared it.
  EXPECT_THAT(order, EndsWith("\r\033[K"));
  // Then it is drawn again below.
  EXPECT_THAT(out.text(), MatchesRegex(".*\r\033\\[Ktpsim run: verify, [0-9.]+ s"));
  p.finish();
}

TEST(ProgressDelay, ReadsWholeMillisecondsAndRefusesTheRest) {
  const char* saved = std::getenv("TPSIM_PROGRESS_AFTER_MS");
  const std::string restore = saved ? saved : "";
  unsetenv("TPSIM_PROGRESS_AFTER_MS");
  EXPECT_EQ(progressDelay(), milliseconds(2000));
  setenv("TPSIM_PROGRESS_AFTER_MS", "0", 1);
  EXPECT_EQ(progressDelay(), milliseconds(0));
  setenv("TPSIM_PROGRESS_AFTER_MS", "150", 1);
  EXPECT_EQ(progressDelay(), milliseconds(150));
  for (const char* bad : {"-1", "1.5", "2s", "1000000000", " 5"}) {
    setenv("TPSIM_PROGRESS_AFTER_MS", bad, 1);
    try {
      progressDelay();
      ADD_FAILURE() << bad << " accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(e.message, std::string("TPSIM_PROGRESS_AFTER_MS: expected whole milliseconds from 0 to 999999999, got '") +
                               bad + "'");
    }
  }
  if (saved) setenv("TPSIM_PROGRESS_AFTER_MS", restore.c_str(), 1);
  else unsetenv("TPSIM_PROGRESS_AFTER_MS");
}

}  // namespace
}  // namespace tpsim::tools
