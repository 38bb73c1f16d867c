#include "backends/threads.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <system_error>

#include "backends/errors.h"

namespace tpsim {
namespace {

struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, cancelled = false;
};

}  // namespace

std::vector<std::thread> startThreads(int count, std::function<void(int)> body, const std::string& what) {
  auto gate = std::make_shared<Gate>();
  auto run = std::make_shared<std::function<void(int)>>(std::move(body));
  std::vector<std::thread> threads;
  try {
    threads.reserve(std::size_t(count));
    for (int i = 0; i < count; ++i)
      threads.emplace_back([gate, run, i] {
        {
          std::unique_lock<std::mutex> lock(gate->mu);
          gate->cv.wait(lock, [&] { return gate->open || gate->cancelled; });
          if (gate->cancelled) return;
        }
        (*run)(i);
      });
  } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc for the vector
    {
      std::lock_guard<std::mutex> lock(gate->mu);
      gate->cancelled = true;
    }
    gate->cv.notify_all();
    const std::size_t started = threads.size();
    for (std::thread& t : threads) t.join();
    throw InvalidArgument(detail::concat("cannot start ", count, " ", what, ": the system refused thread ",
                                         started + 1, " (", e.what(), "); ask for fewer"));
  }
  {
    std::lock_guard<std::mutex> lock(gate->mu);
    gate->open = true;
  }
  gate->cv.notify_all();
  return threads;
}

}  // namespace tpsim
