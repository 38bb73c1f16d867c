// HostPool: threads that help one call finish its independent tasks sooner (a large GEMM's tiles).
//
// The caller works on its own tasks too, and how a call is split into tasks never depends on the
// pool, so results are the same with any number of helpers, or none. Several callers (the worker
// threads of a world) may run at once; helpers take tasks from any of them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tpsim::sim {

class HostPool {
 public:
  explicit HostPool(int helpers);  // helper threads, >= 0
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  int helpers() const { return int(threads_.size()); }

  // Runs task(i) once for every i in [0, count) and returns when all have finished. Every task
  // runs even when one throws; the first exception is rethrown here. Once the caller's stop flag
  // (backends/stop.h) is set, the tasks not yet begun throw Stopped instead.
  void run(std::int64_t count, const std::function<void(std::int64_t)>& task);

 private:
  struct Job;
  void helperLoop();
  static std::int64_t work(Job& job);  // claims and runs tasks until none is left; returns how many

  std::mutex mu_;
  std::condition_variable wake_;  // helpers: a job arrived, or stop
  std::condition_variable done_;  // callers: a helper finished its part of a job
  std::vector<Job*> jobs_;        // jobs with tasks left to claim
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Runs task(i) for i in [0, count) on `pool`, or in order on the calling thread when it is null;
// a stop as HostPool::run.
void runTasks(HostPool* pool, std::int64_t count, const std::function<void(std::int64_t)>& task);

}  // namespace tpsim::sim
