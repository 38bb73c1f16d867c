#include "backends/world/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/detail/fcontext.hpp>
#include <cerrno>
#include <cstring>
#include <cxxabi.h>  // abi::__cxa_get_globals, as the C++ runtime declares it (gcc and clang agree)
#include <utility>

#include "backends/errors.h"

#if defined(__SANITIZE_ADDRESS__)
#define TPSIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TPSIM_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define TPSIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TPSIM_TSAN 1
#endif
#endif

#if defined(TPSIM_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(TPSIM_TSAN)
#include <sanitizer/tsan_interface.h>
#endif


namespace tpsim::world {
namespace ctx = boost::context::detail;

namespace {

void asanStartSwitch([[maybe_unused]] void** fakeStackSave, [[maybe_unused]] const void* bottom,
                     [[maybe_unused]] std::size_t size) {
#if defined(TPSIM_ASAN)
  __sanitizer_start_switch_fiber(fakeStackSave, bottom, size);
#endif
}

void asanFinishSwitch([[maybe_unused]] void* fakeStack, [[maybe_unused]] const void** oldBottom,
                      [[maybe_unused]] std::size_t* oldSize) {
#if defined(TPSIM_ASAN)
  __sanitizer_finish_switch_fiber(fakeStack, oldBottom, oldSize);
#endif
}

// ASan keeps a stack's redzones in its shadow memory after munmap: frames a fiber never returned
// from (entry's own, every frame of a fiber destroyed while suspended) would stay poisoned, and a
// later mmap that reuses the range (the next fiber's stack, any buffer) would report overflows
// that are not there. A stack's range is cleared when it is mapped and before it is unmapped.
void asanUnpoison([[maybe_unused]] void* begin, [[maybe_unused]] std::size_t bytes) {
#if defined(TPSIM_ASAN)
  __asan_unpoison_memory_region(begin, bytes);
#endif
}

void tsanSwitchTo([[maybe_unused]] void* fiber) {
#if defined(TPSIM_TSAN)
  __tsan_switch_to_fiber(fiber, 0);
#endif
}

std::size_t pageSize() { return std::size_t(sysconf(_SC_PAGESIZE)); }

}  // namespace

std::size_t Fiber::defaultStackBytes() {
#if defined(TPSIM_ASAN) || defined(TPSIM_TSAN)
  return std::size_t(8) << 20;
#else
  return std::size_t(1) << 20;
#endif
}

Fiber::Fiber(std::size_t stackBytes, std::function<void()> body) : body_(std::move(body)) {
  const std::size_t page = pageSize();
  const std::size_t usable = (std::max(stackBytes, std::size_t(64) << 10) + page - 1) / page * page;
  mappedBytes_ = usable + page;
  // MAP_NORESERVE: pages are committed on first touch, so 64 idle ranks cost little memory.
  stack_ = mmap(nullptr, mappedBytes_, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (stack_ == MAP_FAILED) {
    stack_ = nullptr;
    // The machine cannot hold the ranks asked for: bad input (exit 2 in the CLI), like too large a size.
    throw InvalidArgument(detail::concat("sim: cannot map a fiber stack of ", mappedBytes_, " bytes: ",
                                         std::strerror(errno), "; ask for fewer ranks"));
  }
  asanUnpoison(stack_, mappedBytes_);
  // Guard page: a stack overflow faults instead of silently corrupting the neighbour's memory.
  mprotect(stack_, page, PROT_NONE);
  char* top = static_cast<char*>(stack_) + mappedBytes_;
  context_ = ctx::make_fcontext(top, usable, [](ctx::transfer_t t) { entry(&t); });
#if defined(TPSIM_TSAN)
  tsanFiber_ = __tsan_create_fiber(0);
#endif
}

Fiber::~Fiber() {
#if defined(TPSIM_TSAN)
  if (tsanFiber_) __tsan_destroy_fiber(tsanFiber_);
#endif
  if (stack_) {
    asanUnpoison(stack_, mappedBytes_);
    munmap(stack_, mappedBytes_);
  }
}

void Fiber::swapExceptionState() {
  auto* globals = reinterpret_cast<EhState*>(abi::__cxa_get_globals());
  std::swap(*globals, eh_);
}

void* Fiber::resume() {
  TPSIM_INTERNAL_ASSERT(!finished_, "resume() of a finished fiber");
  void* fakeStack = nullptr;
  const std::size_t page = pageSize();
  asanStartSwitch(&fakeStack, static_cast<char*>(stack_) + page, mappedBytes_ - page);
#if defined(TPSIM_TSAN)
  tsanCaller_ = __tsan_get_current_fiber();
#endif
  tsanSwitchTo(tsanFiber_);
  swapExceptionState();
  ctx::transfer_t t = ctx::jump_fcontext(context_, this);
  swapExceptionState();
  asanFinishSwitch(fakeStack, nullptr, nullptr);
  context_ = t.fctx;
  return t.data;
}

void Fiber::suspend(void* request) {
  asanStartSwitch(&asanFakeStack_, callerStackBottom_, callerStackSize_);
  tsanSwitchTo(tsanCaller_);
  ctx::transfer_t t = ctx::jump_fcontext(caller_, request);
  caller_ = t.fctx;
  asanFinishSwitch(asanFakeStack_, &callerStackBottom_, &callerStackSize_);
}

void Fiber::entry(void* transfer) {
  auto* t = static_cast<ctx::transfer_t*>(transfer);
  auto* self = static_cast<Fiber*>(t->data);
  self->caller_ = t->fctx;
  asanFinishSwitch(nullptr, &self->callerStackBottom_, &self->callerStackSize_);
  try {
    self->body_();
  } catch (...) {
    self->error_ = std::current_exception();
  }
  self->finished_ = true;
  // Last switch: nothing of this stack survives, so ASan gets no fake stack to save.
  asanStartSwitch(nullptr, self->callerStackBottom_, self->callerStackSize_);
  tsanSwitchTo(self->tsanCaller_);
  ctx::jump_fcontext(self->caller_, nullptr);
  TPSIM_INTERNAL_ASSERT(false, "a finished fiber was resumed");
}

}  // namespace tpsim::world
