// The byte form in which the processes of one world exchange data (backends/mpi/): values in this
// machine's byte order, as the processes of one job share it, strings and blobs after their size.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "backends/errors.h"

namespace tpsim::wire {

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
inline void putString(std::string& out, const std::string& s) {
  put(out, std::uint64_t(s.size()));
  out += s;
}

// Tensor data in a part starts at a multiple of kDataAlign bytes from the part's start, which the
// allocator aligns at least as much, so that a view of it reads every dtype aligned.
inline constexpr std::size_t kDataAlign = 16;
inline std::size_t alignedOffset(std::size_t at) { return (at + kDataAlign - 1) / kDataAlign * kDataAlign; }
inline void padToData(std::string& out) { out.resize(alignedOffset(out.size()), '\0'); }

// Reads what put and putString wrote; a read past the end is an internal error naming `what`.
class Reader {
 public:
  Reader(const std::string& bytes, const char* what) : bytes_(bytes), what_(what) {}

  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  std::string getString() {
    const auto size = get<std::uint64_t>();
    return std::string(take(size), size);
  }
  std::size_t at() const { return at_; }  // where the next read starts
  const char* take(std::size_t n) {
    TPSIM_INTERNAL_ASSERT(n <= bytes_.size() - at_, what_, " is truncated");
    at_ += n;
    return bytes_.data() + at_ - n;
  }

 private:
  const std::string& bytes_;
  const char* what_;
  std::size_t at_ = 0;
};

}  // namespace tpsim::wire
