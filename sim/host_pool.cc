#include "sim/host_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>

#include "backends/errors.h"
#include "backends/stop.h"
#include "backends/threads.h"

namespace tpsim::sim {

struct HostPool::Job {
  std::int64_t count = 0;
  const std::function<void(std::int64_t)>* task = nullptr;
  const StopFlag* stop = nullptr;  // the caller's: helpers run its tasks without it
  std::atomic<std::int64_t> next{0};
  std::int64_t finished = 0;  // tasks run to the end, under mu_
  int helpersInside = 0;      // helpers between claiming and reporting, under mu_
  std::mutex errorMu;
  std::exception_ptr error;
};

HostPool::HostPool(int helpers) {
  TPSIM_CHECK(helpers >= 0, "HostPool: helpers must be >= 0, got ", helpers);
  threads_ = startThreads(helpers, [this](int) { helperLoop(); }, "helper threads for large GEMMs (--threads)");
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

std::int64_t HostPool::work(Job& job) {
  std::int64_t ran = 0;
  for (std::int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.count; ++ran) {
    try {
      throwIfStopped(job.stop, "sim");  // a progress point: each task is a block of c at most
      (*job.task)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.errorMu);
      if (!job.error) job.error = std::current_exception();
    }
  }
  return ran;
}

void HostPool::helperLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job* job = jobs_.front();
    ++job->helpersInside;
    lock.unlock();
    const std::int64_t ran = work(*job);
    lock.lock();
    // Nothing is left to claim: no other helper needs to look at this job.
    if (auto it = std::find(jobs_.begin(), jobs_.end(), job); it != jobs_.end()) jobs_.erase(it);
    job->finished += ran;
    --job->helpersInside;
    done_.notify_all();
  }
}

void HostPool::run(std::int64_t count, const std::function<void(std::int64_t)>& task) {
  if (count <= 0) return;
  if (threads_.empty() || count == 1) {
    runTasks(nullptr, count, task);
    return;
  }
  Job job;
  job.count = count;
  job.task = &task;
  job.stop = currentStopFlag();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(&job);
  }
  wake_.notify_all();
  const std::int64_t ran = work(job);
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (auto it = std::find(jobs_.begin(), jobs_.end(), &job); it != jobs_.end()) jobs_.erase(it);
    job.finished += ran;
    // job lives on this stack: no helper may still hold it when run returns.
    done_.wait(lock, [&] { return job.finished == count && job.helpersInside == 0; });
  }
  if (job.error) std::rethrow_exception(job.error);
}

void runTasks(HostPool* pool, std::int64_t count, const std::function<void(std::int64_t)>& task) {
  if (pool) return pool->run(count, task);
  std::exception_ptr error;
  const StopFlag* stop = currentStopFlag();
  for (std::int64_t i = 0; i < count; ++i) {
    try {
      throwIfStopped(stop, "sim");
      task(i);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace tpsim::sim
