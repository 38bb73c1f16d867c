#include "tools/lib/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "backends/errors.h"

namespace tpsim::tools {
namespace {

// readLine reads ahead this much at a time.
constexpr std::size_t kLineChunk = 64 * 1024;

const char* kindOf(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "a device or other special file";
}

}  // namespace

std::string printable(std::string_view bytes, std::size_t maxChars) {
  std::string out;
  for (std::size_t i = 0; i < bytes.size() && i < maxChars; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"') {
      out += char(c);
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (bytes.size() > maxChars) out += "...";
  return out;
}

std::string terminalText(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != 0x7f) {
      out += ch;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

InputFile::InputFile(const std::string& path, std::string where, const std::string& kind,
                     const std::function<std::string(int error)>& cannotOpen)
    : path_(path), where_(std::move(where)) {
  // O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer. O_NOCTTY: a
  // terminal opened here never becomes the process's controlling terminal.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    // A socket cannot be opened at all (ENXIO, as a device without a driver): with no descriptor to
    // ask, the path says what it is, so that it is named like the kinds that can be opened.
    struct stat st {};
    TPSIM_CHECK(!(error == ENXIO && ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)),
                where_, ": expected a regular file, got ", kindOf(st.st_mode));
    throw InvalidArgument(cannotOpen(error));
  }
  struct stat st {};
  const bool statted = ::fstat(fd, &st) == 0;
  const int statError = errno;
  if (!statted || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TPSIM_CHECK(statted, where_, ": expected a regular file, got '", std::strerror(statError), "'");
    TPSIM_CHECK(!S_ISDIR(st.st_mode), where_, ": expected ", kind, ", got a directory");
    throw InvalidArgument(detail::concat(where_, ": expected a regular file, got ", kindOf(st.st_mode)));
  }
  // O_NONBLOCK was for the open: cleared, the descriptor reads as any other.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags == -1 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int error = errno;
    ::close(fd);
    throw InvalidArgument(detail::concat(where_, ": expected a readable file, got '", std::strerror(error), "'"));
  }
  fd_ = fd;
  size_ = std::uint64_t(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)),
      where_(std::move(other.where_)),
      fd_(std::exchange(other.fd_, -1)),
      size_(other.size_),
      position_(other.position_),
      buffered_(std::move(other.buffered_)),
      bufferedBegin_(other.bufferedBegin_),
      lines_(other.lines_) {}

std::string InputFile::realPath() const {
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::canonical(path_, ec);
  struct stat named {}, opened {};
  TPSIM_CHECK(!ec && ::stat(real.c_str(), &named) == 0 && ::fstat(fd_, &opened) == 0 &&
                  named.st_dev == opened.st_dev && named.st_ino == opened.st_ino,
              where_, ": expected the path to name the file opened, got it replaced");
  return real.string();
}

void InputFile::readAt(std::uint64_t offset, void* dst, std::size_t n, const std::string& what) const {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd_, static_cast<char*>(dst) + got, n - got, off_t(offset + got));
    if (r < 0 && errno == EINTR) continue;
    const int error = errno;
    TPSIM_CHECK(r > 0, where_, ": expected to read ", n, " bytes of ", what, ", got ", got, " (",
                r < 0 ? std::strerror(error) : "the file shrank while being read", ")");
    got += std::size_t(r);
  }
}

void InputFile::read(void* dst, std::size_t n, const std::string& what) {
  readAt(position_, dst, n, what);
  position_ += n;
}

void InputFile::checkSize(std::uint64_t limit) const {
  TPSIM_CHECK(size_ <= limit, where_, ": expected a file of at most ", limit, " bytes, got ", size_);
}

std::vector<char> InputFile::readAll(std::uint64_t limit) {
  checkSize(limit);
  std::vector<char> bytes(static_cast<std::size_t>(size_));
  readAt(0, bytes.data(), bytes.size(), "the file");
  return bytes;
}

bool InputFile::readLine(std::string& line, std::size_t maxBytes) {
  line.clear();
  ++lines_;
  for (;;) {
    const std::size_t newline = buffered_.find('\n', bufferedBegin_);
    const std::size_t end = newline == std::string::npos ? buffered_.size() : newline;
    TPSIM_CHECK(line.size() + (end - bufferedBegin_) <= maxBytes, where_, ":", lines_, ": expected lines of at most ",
                maxBytes, " bytes, got a longer one");
    line.append(buffered_, bufferedBegin_, end - bufferedBegin_);
    if (newline != std::string::npos) {
      bufferedBegin_ = newline + 1;
      return true;
    }
    bufferedBegin_ = 0;
    buffered_.resize(std::size_t(std::min<std::uint64_t>(kLineChunk, size_ - std::min(position_, size_))));
    if (buffered_.empty()) return !line.empty();
    read(buffered_.data(), buffered_.size(), "text");
  }
}

}  // namespace tpsim::tools
