// Error types and checking macros shared by every tpsim target.
//
// TPSIM_CHECK is for the caller's mistake (bad shape, bad option) and throws InvalidArgument;
// TPSIM_INTERNAL_ASSERT is for our own bug and throws InternalError with file:line. Messages
// follow "<Where>: <what was expected>, got <what>[; <how to fix>]". Nothing here calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tpsim {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed something invalid: a shape, a size, an option, a file.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// tpsim itself is wrong; the message carries file:line.
class InternalError : public Error {
 public:
  using Error::Error;
};

// A backend library call failed (CUDA, cuBLAS, NCCL).
class BackendError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tpsim

#define TPSIM_CHECK(cond, ...)                                               \
  do {                                                                       \
    if (!(cond)) throw ::tpsim::InvalidArgument(::tpsim::detail::concat(__VA_ARGS__)); \
  } while (0)

#define TPSIM_INTERNAL_ASSERT(cond, ...)                                              \
  do {                                                                                \
    if (!(cond))                                                                      \
      throw ::tpsim::InternalError(::tpsim::detail::concat(                           \
          __FILE__, ":", __LINE__, ": internal error: ", #cond, " failed. ", ##__VA_ARGS__)); \
  } while (0)
