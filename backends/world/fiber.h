// Fiber: a stackful coroutine on its own guarded stack, for running one rank of a world.
//
// A worker thread resume()s a fiber; the fiber runs until it calls suspend() or its body returns.
// Fibers never migrate: the world pins each one to a single worker thread, so thread-local state
// (errno, the C++ runtime's exception bookkeeping) stays coherent; the exception state that
// libstdc++ keeps per thread is swapped in and out with the fiber, so several fibers may be
// suspended inside catch blocks on one thread. Stack switches are announced to AddressSanitizer
// and ThreadSanitizer. This is not a scheduler (rendezvous.cc is).
#pragma once

#include <cstddef>
#include <exception>
#include <functional>

namespace tpsim::world {

class Fiber {
 public:
  Fiber(std::size_t stackBytes, std::function<void()> body);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Worker side: runs the fiber until it suspends or finishes; returns the pointer it passed to
  // suspend(), or nullptr once finished.
  void* resume();
  // Fiber side: hands `request` to the resumer and returns when the fiber is resumed again.
  void suspend(void* request);

  bool finished() const { return finished_; }
  // An exception that escaped the body (the world's bodies catch everything; this is a backstop).
  std::exception_ptr error() const { return error_; }

  // Default stack: 1 MiB, or 8 MiB when built with a sanitizer (instrumented frames are larger).
  static std::size_t defaultStackBytes();

 private:
  struct EhState {  // mirrors __cxa_eh_globals of libstdc++ and libc++abi
    void* caughtExceptions = nullptr;
    unsigned int uncaughtExceptions = 0;
  };
  static void entry(void* transfer);  // receives boost::context::detail::transfer_t by pointer
  void swapExceptionState();

  std::function<void()> body_;
  void* stack_ = nullptr;        // mmap'd region, guard page at the low end
  std::size_t mappedBytes_ = 0;
  void* context_ = nullptr;      // the fiber's suspended context (fcontext_t)
  void* caller_ = nullptr;       // the resumer's context while the fiber runs
  bool finished_ = false;
  std::exception_ptr error_;
  EhState eh_;
  // Sanitizer bookkeeping (unused in plain builds).
  void* asanFakeStack_ = nullptr;
  const void* callerStackBottom_ = nullptr;
  std::size_t callerStackSize_ = 0;
  void* tsanFiber_ = nullptr;
  void* tsanCaller_ = nullptr;
};

}  // namespace tpsim::world
