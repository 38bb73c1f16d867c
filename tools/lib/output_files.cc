#include "tools/lib/output_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "backends/errors.h"

namespace fs = std::filesystem;

namespace tpsim::tools {
namespace {

// The temporary sits beside the target so that rename() is atomic.
std::string temporaryOf(const std::string& target) {
  const fs::path path(target);
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  return (dir / ("." + path.filename().string() + ".partial")).string();
}

}  // namespace

OutputFiles::OutputFiles(std::string flag) : flag_(std::move(flag)) {}

OutputFiles::~OutputFiles() {
  for (const Pending& p : pending_) ::unlink(p.temporary.c_str());
}

void OutputFiles::checkTarget(const std::string& path) const {
  TPSIM_CHECK(!path.empty(), flag_, ": expected a file name, got an empty path");
  const fs::file_type type = fs::symlink_status(path).type();
  TPSIM_CHECK(type == fs::file_type::not_found || type == fs::file_type::regular || type == fs::file_type::symlink,
              flag_, ": expected ", path, " to be absent or a regular file, got another kind of file");
}

void OutputFiles::write(const std::string& path, const std::string& bytes) {
  write(path, [&](std::FILE* file) {
    if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size())
      TPSIM_CHECK(false, flag_, ": cannot write ", path, " (", std::strerror(errno), ")");
  });
}

void OutputFiles::write(const std::string& path, const std::function<void(std::FILE*)>& produce) {
  checkTarget(path);
  const std::string temporary = temporaryOf(path);
  // A file or symlink left at the temporary name by an earlier run is removed, never written through.
  ::unlink(temporary.c_str());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  TPSIM_CHECK(fd >= 0, flag_, ": cannot write ", path, " (cannot create ", temporary, ": ", std::strerror(errno), ")");
  std::FILE* file = ::fdopen(fd, "wb");
  if (!file) {
    const int error = errno;
    ::close(fd);
    ::unlink(temporary.c_str());
    TPSIM_CHECK(false, flag_, ": cannot write ", path, " (", std::strerror(error), ")");
  }
  pending_.push_back({path, temporary});  // removed by the destructor unless committed
  try {
    produce(file);
  } catch (...) {
    std::fclose(file);
    throw;
  }
  // A full disk often shows only when the buffer is flushed.
  const bool flushed = std::fflush(file) == 0;
  const int error = errno;
  const bool closed = std::fclose(file) == 0;
  TPSIM_CHECK(flushed && closed, flag_, ": cannot write ", path, " (", std::strerror(flushed ? errno : error), ")");
}

void OutputFiles::commit() {
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    if (::rename(pending_[i].temporary.c_str(), pending_[i].target.c_str()) != 0) {
      const int error = errno;
      const std::string target = pending_[i].target;
      pending_.erase(pending_.begin(), pending_.begin() + std::ptrdiff_t(i));  // the rest are removed
      TPSIM_CHECK(false, flag_, ": cannot write ", target, " (", std::strerror(error), ")");
    }
  }
  pending_.clear();
}

}  // namespace tpsim::tools
