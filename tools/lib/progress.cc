#include "tools/lib/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <system_error>

#include "tools/lib/usage_error.h"

namespace tpsim::tools {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kRedraw{250};
constexpr const char* kClearLine = "\r\033[K";

std::string secondsText(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

}  // namespace

std::string progressLine(const std::string& command, const std::vector<PhaseTime>& phases, Clock::time_point begin,
                         Clock::time_point now) {
  std::string line = command + ":";
  const auto open = std::find_if(phases.begin(), phases.end(), [](const PhaseTime& p) { return !p.ended; });
  if (open != phases.end()) {
    line += " " + open->name;
    if (open->total > 0) line += " " + std::to_string(open->done) + "/" + std::to_string(open->total) + " ranks";
    line += ",";
  }
  return line + " " + secondsText(now - begin);
}

std::string progressSummary(const std::string& command, const std::vector<PhaseTime>& phases, Clock::time_point begin,
                            Clock::time_point end) {
  std::string line = command + ": " + secondsText(end - begin);
  // Counted phases start together; each is charged only from the end of the one before it.
  Clock::time_point previousEnd = begin;
  for (std::size_t i = 0; i < phases.size(); ++i) {
    const PhaseTime& p = phases[i];
    const Clock::time_point from = std::max(p.start, previousEnd), to = std::max(p.end, from);
    line += (i == 0 ? ": " : ", ") + p.name + " " + secondsText(to - from);
    previousEnd = to;
  }
  return line;
}

std::chrono::milliseconds progressDelay() {
  const char* v = std::getenv("TPSIM_PROGRESS_AFTER_MS");
  if (v == nullptr || *v == '\0') return std::chrono::milliseconds(2000);
  const std::string text = v;
  if (text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
    throw UsageError{"TPSIM_PROGRESS_AFTER_MS: expected whole milliseconds from 0 to 999999999, got '" + text + "'"};
  return std::chrono::milliseconds(std::stoll(text));
}

bool progressWanted(bool quiet) { return !quiet && isatty(STDERR_FILENO) == 1; }

Progress::Progress(std::string command, bool enabled, std::chrono::milliseconds after, std::FILE* out)
    : command_(std::move(command)), enabled_(enabled), after_(after), out_(out), begin_(Clock::now()) {
  if (!enabled_) return;
  if (after_.count() <= 0) {  // shown from the start, not from the ticker's first turn
    std::lock_guard<std::mutex> draw(drawMu_);
    this->draw();
  }
  try {
    ticker_ = std::thread([this] { tick(); });
  } catch (const std::system_error&) {
    // A display only: a command that cannot start its thread runs without it.
  }
}

Progress::~Progress() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = stopping_ = true;
  }
  wake_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  // The command is unwinding: its error goes on a clean line, with no summary above it.
  std::lock_guard<std::mutex> draw(drawMu_);
  if (onScreen_) std::fputs(kClearLine, out_);
  std::fflush(out_);
}

void Progress::endOpenPhases(Clock::time_point now) {
  for (PhaseTime& p : phases_)
    if (!p.ended) {
      p.end = now;
      p.ended = true;
    }
}

void Progress::phase(const std::string& name) { counted({name}, 0); }

void Progress::counted(const std::vector<std::string>& names, std::int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  endOpenPhases(now);
  for (const std::string& name : names) phases_.push_back(PhaseTime{name, total, 0, now, now, false});
}

void Progress::passed(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  for (PhaseTime& p : phases_)
    if (!p.ended && p.name == name && p.total > 0 && ++p.done == p.total) {
      p.end = Clock::now();
      p.ended = true;
    }
}

void Progress::above(const std::function<void()>& print) {
  std::lock_guard<std::mutex> draw(drawMu_);
  if (onScreen_) {
    std::fputs(kClearLine, out_);
    std::fflush(out_);
    onScreen_ = false;
  }
  print();
  std::fflush(stdout);
  if (shown_) this->draw();
}

void Progress::draw() {
  std::string line;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    line = progressLine(command_, phases_, begin_, Clock::now());
  }
  std::fprintf(out_, "%s%s", kClearLine, line.c_str());
  std::fflush(out_);
  onScreen_ = shown_ = true;
}

void Progress::tick() {
  for (;;) {
    if (Clock::now() - begin_ >= after_) {
      std::lock_guard<std::mutex> draw(drawMu_);
      this->draw();
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (wake_.wait_for(lock, kRedraw, [this] { return stopping_; })) return;
  }
}

void Progress::finish() {
  std::string summary;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = stopping_ = true;
    const Clock::time_point end = Clock::now();
    endOpenPhases(end);
    summary = progressSummary(command_, phases_, begin_, end);
  }
  wake_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  std::lock_guard<std::mutex> draw(drawMu_);
  if (!shown_) return;  // ended before the delay
  std::fprintf(out_, "%s%s\n", onScreen_ ? kClearLine : "", summary.c_str());
  std::fflush(out_);
  onScreen_ = false;
}

}  // namespace tpsim::tools
