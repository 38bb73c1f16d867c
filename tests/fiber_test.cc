// Fiber: switching, values handed across, and exception state that stays with its fiber even
// when several fibers are suspended inside catch blocks on one thread.
#include "backends/world/fiber.h"

#include <gtest/gtest.h>

#if defined(__SANITIZE_ADDRESS__)
#define TPSIM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TPSIM_TEST_ASAN 1
#endif
#endif
#if defined(TPSIM_TEST_ASAN)
#include <sanitizer/asan_interface.h>
#endif

#include <stdexcept>
#include <string>
#include <vector>

namespace tpsim::world {
namespace {

TEST(Fiber, RunsUntilSuspendAndHandsTheRequestOver) {
  std::vector<int> log;
  int token = 7;
  Fiber f(Fiber::defaultStackBytes(), [&] {
    log.push_back(1);
    f.suspend(&token);
    log.push_back(3);
  });
  EXPECT_EQ(f.resume(), &token);
  log.push_back(2);
  EXPECT_EQ(f.resume(), nullptr);
  EXPECT_TRUE(f.finished());
  EXPECT_EQ(log, (std::vector<int>{1, 2, 3}));
}

TEST(Fiber, EscapedExceptionIsKept) {
  Fiber f(Fiber::defaultStackBytes(), [] { throw std::runtime_error("escaped"); });
  f.resume();
  ASSERT_TRUE(f.finished());
  ASSERT_TRUE(f.error());
  EXPECT_THROW(std::rethrow_exception(f.error()), std::runtime_error);
}

TEST(Fiber, ExceptionStateTravelsWithItsFiber) {
  // Two fibers each suspend inside a catch block and while unwinding; interleaving them on one
  // thread must not mix up std::uncaught_exceptions() or which exception a rethrow sees.
  std::vector<std::string> rethrown(2);
  std::vector<int> uncaughtInDtor(2, -1);
  struct SuspendsInDestructor {
    Fiber*& self;
    int& uncaught;
    ~SuspendsInDestructor() {
      uncaught = std::uncaught_exceptions();
      self->suspend(nullptr);
    }
  };
  std::vector<Fiber*> selves(2);
  std::vector<std::unique_ptr<Fiber>> fibers;
  for (int i = 0; i < 2; ++i) {
    fibers.push_back(std::make_unique<Fiber>(Fiber::defaultStackBytes(), [&, i] {
      try {
        throw std::runtime_error("fiber " + std::to_string(i));
      } catch (const std::exception&) {
        selves[i]->suspend(nullptr);  // suspended inside the handler
        try {
          throw;  // must rethrow this fiber's exception, not the other's
        } catch (const std::exception& e) {
          rethrown[i] = e.what();
        }
      }
      try {
        SuspendsInDestructor guard{selves[i], uncaughtInDtor[i]};
        throw std::logic_error("unwinding");
      } catch (const std::logic_error&) {
      }
    }));
    selves[i] = fibers.back().get();
  }
  for (int round = 0; round < 3; ++round)
    for (auto& f : fibers)
      if (!f->finished()) f->resume();
  EXPECT_EQ(std::uncaught_exceptions(), 0);
  EXPECT_EQ(rethrown, (std::vector<std::string>{"fiber 0", "fiber 1"}));
  EXPECT_EQ(uncaughtInDtor, (std::vector<int>{1, 1}));
  for (auto& f : fibers) EXPECT_TRUE(f->finished());
}

// A fiber destroyed while suspended never returns from its frames: their redzones must not stay
// poisoned in ASan's shadow once its stack is unmapped, or the next mapping there (the next world's
// fiber stack) reports overflows that are not there.
TEST(Fiber, ADestroyedFiberLeavesNoPoisonBehind) {
#if defined(TPSIM_TEST_ASAN)
  const char* local = nullptr;
  {
    Fiber f(Fiber::defaultStackBytes(), [&] {
      volatile char buffer[64];  // redzones on both sides while this frame lives
      buffer[0] = 1;
      local = const_cast<const char*>(buffer);
      f.suspend(nullptr);
    });
    f.resume();
    ASSERT_NE(__asan_region_is_poisoned(const_cast<char*>(local) - 64, 256), nullptr) << "no redzone to look for";
  }
  // Only the shadow is read: the stack itself is unmapped.
  EXPECT_EQ(__asan_region_is_poisoned(const_cast<char*>(local) - 64, 256), nullptr);
#else
  GTEST_SKIP() << "reads AddressSanitizer's shadow memory: an ASan build checks it";
#endif
}

TEST(Fiber, DeepRecursionFitsTheDefaultStack) {
  std::function<int(int)> depth = [&](int n) {
    volatile char pad[512];
    pad[0] = char(n);
    return n == 0 ? pad[0] : depth(n - 1) + 1;
  };
  int result = -1;
  Fiber f(Fiber::defaultStackBytes(), [&] { result = depth(1000); });
  f.resume();
  EXPECT_EQ(result, 1000);
}

}  // namespace
}  // namespace tpsim::world
