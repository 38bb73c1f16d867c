// What a long command is doing, for a person at a terminal: one stderr line with the phase, its
// count (ranks past it) and the time so far, redrawn four times a second once the command has run
// for a while (TPSIM_PROGRESS_AFTER_MS, default 2000); when it ends, the time each phase took.
// Silent when stderr is not a terminal or the command was asked to be quiet, so logs, pipes and
// harnesses see nothing of it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tpsim::tools {

struct PhaseTime {
  std::string name;
  std::int64_t total = 0, done = 0;  // counted phases: how many must pass it, how many have
  std::chrono::steady_clock::time_point start, end;
  bool ended = false;
};

// "tpsim run: backward 3/8 ranks, 12.4 s": the first phase not ended, with the time since `begin`.
std::string progressLine(const std::string& command, const std::vector<PhaseTime>& phases,
                         std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point now);
// "tpsim run: 14.2 s: generate 0.8 s, forward 6.1 s, ...": every phase's time, in order.
std::string progressSummary(const std::string& command, const std::vector<PhaseTime>& phases,
                            std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end);

// TPSIM_PROGRESS_AFTER_MS: how long a command runs before its progress shows (default 2000; 0
// shows it at once). Throws UsageError naming the variable for anything but whole milliseconds.
std::chrono::milliseconds progressDelay();

// True when `quiet` is off and stderr is a terminal.
bool progressWanted(bool quiet);

class Progress {
 public:
  // Shows nothing unless `enabled`; then the line appears once `after` has passed.
  Progress(std::string command, bool enabled, std::chrono::milliseconds after, std::FILE* out = stderr);
  ~Progress();  // as finish(), without the summary when the command failed (it unwinds)
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Ends the phases still open and starts `name`.
  void phase(const std::string& name);
  // Ends the phases still open and starts `names` at once, each counting to `total`: a phase ends
  // when passed() has named it `total` times (ranks reach the next phase at their own pace).
  void counted(const std::vector<std::string>& names, std::int64_t total);
  // One more has passed the counted phase `name`. Thread safe.
  void passed(const std::string& name);
  // Runs `print`, which writes lines to stdout, with the progress line taken off the terminal
  // meanwhile (stdout and stderr usually share it), then draws the line again below them.
  void above(const std::function<void()>& print);
  // Ends the last phase; if the line was shown, replaces it with the summary.
  void finish();

 private:
  void endOpenPhases(std::chrono::steady_clock::time_point now);
  void tick();
  void draw();  // with drawMu_ held

  const std::string command_;
  const bool enabled_;
  const std::chrono::milliseconds after_;
  std::FILE* const out_;
  const std::chrono::steady_clock::time_point begin_;
  std::mutex mu_;  // phases_ and the flags below
  std::condition_variable wake_;
  std::vector<PhaseTime> phases_;
  bool stopping_ = false, finished_ = false;
  std::mutex drawMu_;    // the terminal line; taken before mu_ where both are
  bool onScreen_ = false;  // the line is drawn now (with drawMu_)
  bool shown_ = false;     // it has been drawn at least once (with drawMu_)
  std::thread ticker_;
};

}  // namespace tpsim::tools
