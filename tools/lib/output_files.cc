#include "tools/lib/output_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "backends/errors.h"
#include "tools/lib/input_file.h"

namespace fs = std::filesystem;

namespace tpsim::tools {
namespace {

// ---- Temporary names: ".tpsim-PID-SERIAL.partial", at most 57 bytes whatever the target's name.

constexpr char kTemporaryPrefix[] = ".tpsim-";
constexpr char kTemporarySuffix[] = ".partial";
constexpr std::size_t kTemporaryNameSize = 64;


// The decimal digits of v at out; returns their end. Async-signal-safe, as is temporaryName.
char* appendDecimal(char* out, std::uint64_t v) {
  char digits[20];
  int n = 0;
  do {
    digits[n++] = char('0' + v % 10);
    v /= 10;
  } while (v != 0);
  while (n > 0) *out++ = digits[--n];
  return out;
}

// The temporary numbered `serial`, NUL-terminated, into out[kTemporaryNameSize].
void temporaryName(char* out, std::uint64_t serial) {
  for (const char* s = kTemporaryPrefix; *s; ++s) *out++ = *s;
  out = appendDecimal(out, std::uint64_t(::getpid()));
  *out++ = '-';
  out = appendDecimal(out, serial);
  for (const char* s = kTemporarySuffix; *s; ++s) *out++ = *s;
  *out = '\0';
}

std::string temporaryName(std::uint64_t serial) {
  char name[kTemporaryNameSize];
  temporaryName(name, serial);
  return name;
}

// ---- The temporaries alive in this process, for the signal handler: preallocated, so that it
// reads them without allocating or locking. A slot holds its directory's descriptor plus one (0:
// free), stored after the serial. Whatever slot a handler reads, it unlinks only names this process
// made, which no other file can have, so a slot reused under it does no harm.

constexpr std::size_t kMaxTemporaries = std::size_t(1) << 16;
struct LiveTemporary {
  std::atomic<int> dirPlusOne;
  std::atomic<std::uint64_t> serial;
};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free,
              "the signal handler reads the slots: they must not take locks");
LiveTemporary gLive[kMaxTemporaries];  // zero: every slot free

std::mutex gMutex;  // allocating slots, and the lock table below
std::size_t gSlotHint = 0;
std::uint64_t gNextSerial = 0;  // of the next temporary

// Signals that end a process by default and that a user, a terminal, a pipe or a file-size limit
// sends while a command writes.
constexpr int kEndingSignals[] = {SIGHUP, SIGINT, SIGPIPE, SIGTERM, SIGXFSZ};

void removeTemporariesAndEnd(int signal) {
  for (LiveTemporary& t : gLive) {
    const int dirPlusOne = t.dirPlusOne.load();
    if (dirPlusOne == 0) continue;
    char name[kTemporaryNameSize];
    temporaryName(name, t.serial.load());
    ::unlinkat(dirPlusOne - 1, name, 0);
  }
  // Blocked while the handler runs: delivered with its default action as soon as it returns.
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

void installSignalHandlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_handler = removeTemporariesAndEnd;
    sigemptyset(&action.sa_mask);
    for (int s : kEndingSignals) sigaddset(&action.sa_mask, s);
    for (int s : kEndingSignals) {
      struct sigaction old {};
      // An ignored signal (nohup, a shell's background job) stays ignored.
      if (::sigaction(s, nullptr, &old) == 0 && old.sa_handler != SIG_IGN) ::sigaction(s, &action, nullptr);
    }
  });
}

// A new temporary's serial in the directory `dir`, and the slot that holds it.
struct Tracked {
  std::uint64_t serial;
  std::size_t slot;
};
Tracked track(int dir, const std::string& flag) {
  installSignalHandlers();
  std::lock_guard<std::mutex> lock(gMutex);
  for (std::size_t i = 0; i < kMaxTemporaries; ++i) {
    const std::size_t slot = (gSlotHint + i) % kMaxTemporaries;
    if (gLive[slot].dirPlusOne.load() != 0) continue;
    const std::uint64_t serial = gNextSerial++;
    gLive[slot].serial.store(serial);
    gLive[slot].dirPlusOne.store(dir + 1);
    gSlotHint = slot + 1;
    return {serial, slot};
  }
  throw InvalidArgument(detail::concat(flag, ": expected at most ", kMaxTemporaries, " files written at once, got more"));
}

void untrack(std::size_t slot) { gLive[slot].dirPlusOne.store(0); }

// ---- Directory locks, shared by the sets of this process (flock on two descriptors of one
// directory would make a process wait for itself).

using LockKey = std::pair<dev_t, ino_t>;
struct DirectoryLock {
  int fd = -1;
  int sets = 0;
};
std::map<LockKey, DirectoryLock> gLocks;

// Under a fresh lock no set of this process writes there, and every other writer holds the lock
// while its temporaries exist: a temporary found there was left by a process that was killed.
void removeLeftTemporaries(int dir) {
  const int fd = ::openat(dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* listing = fd >= 0 ? ::fdopendir(fd) : nullptr;
  if (!listing) {
    if (fd >= 0) ::close(fd);
    return;  // nothing is lost: a leftover stays, as it would have
  }
  while (const dirent* e = ::readdir(listing))
    if (isTemporaryName(e->d_name)) ::unlinkat(dir, e->d_name, 0);
  ::closedir(listing);
}

std::function<void(OutputFiles::Step, const std::string&)>& stepHook() {
  static std::function<void(OutputFiles::Step, const std::string&)> hook;
  return hook;
}

void stepDone(OutputFiles::Step step, const std::string& path) {
  if (stepHook()) stepHook()(step, path);
}

// ---- Targets

std::string directoryOf(const fs::path& path) { return path.has_parent_path() ? path.parent_path().string() : "."; }

// The target's name in its directory, refusing what cannot be one.
std::string targetName(const std::string& flag, const std::string& path) {
  TPSIM_CHECK(!path.empty(), flag, ": expected a file name, got an empty path");
  const std::string name = fs::path(path).filename().string();
  TPSIM_CHECK(!name.empty() && name != "." && name != "..", flag, ": expected a file name, got the directory path '",
              path, "'");
  TPSIM_CHECK(!isTemporaryName(name), flag, ": expected a name other than a tpsim temporary's (.tpsim-*.partial), got '",
              path, "'");
  return name;
}

void checkKind(const std::string& flag, const std::string& path, bool writable) {
  TPSIM_CHECK(writable, flag, ": expected ", path, " to be absent or a regular file, got another kind of file");
}

const char* kindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "another kind of file";
}

// A symlink at a target is replaced, unless it leads to a file other than a regular one: one to
// /proc/self/fd/1 or a device stands for something the user still needs. A dangling one goes.
void checkSymlinkTarget(const std::string& flag, const std::string& path, int followed, const struct stat& target) {
  TPSIM_CHECK(followed != 0 || S_ISREG(target.st_mode), flag, ": expected ", path,
              " to be absent, a regular file or a symlink to one, got a symlink to ", kindOf(target.st_mode));
}

void checkWritable(const std::string& flag, const std::string& path) {
  const fs::file_type type = fs::symlink_status(path).type();
  checkKind(flag, path, type == fs::file_type::not_found || type == fs::file_type::regular || type == fs::file_type::symlink);
  if (type == fs::file_type::symlink) {
    struct stat target {};
    checkSymlinkTarget(flag, path, ::stat(path.c_str(), &target), target);
  }
  targetName(flag, path);
}

}  // namespace

bool isTemporaryName(const std::string& name) {
  const std::size_t prefix = sizeof kTemporaryPrefix - 1, suffix = sizeof kTemporarySuffix - 1;
  return name.size() > prefix + suffix && name.compare(0, prefix, kTemporaryPrefix) == 0 &&
         name.compare(name.size() - suffix, suffix, kTemporarySuffix) == 0;
}

// ---- FileUses

std::string FileUse::text() const { return file.empty() ? flag : flag + "'s " + file; }

bool FileUses::Entry::operator==(const Entry& other) const {
  return exists == other.exists && name == other.name &&
         (exists ? dev == other.dev && ino == other.ino : dir == other.dir);
}

FileUses::Entry FileUses::entryIn(const std::string& dir, std::string name) {
  Entry e;
  e.name = std::move(name);
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    e.exists = true, e.dev = st.st_dev, e.ino = st.st_ino;
  } else {
    std::error_code ec;
    fs::path normal = fs::weakly_canonical(fs::absolute(dir), ec);
    if (ec) normal = fs::absolute(dir).lexically_normal();
    if (normal.has_relative_path() && normal.filename().empty()) normal = normal.parent_path();  // "a/b/.." is "a/"
    e.dir = normal.string();
  }
  return e;
}

void FileUses::read(const FileUse& use, const std::string& path) {
  // Resolved as reading resolves it. A path that cannot be is left to its reader to name.
  std::error_code ec;
  fs::path real = fs::canonical(path, ec);
  if (ec) real = fs::absolute(path).lexically_normal();
  add(use, path, entryIn(directoryOf(real), real.filename().string()), false);
}

void FileUses::write(const FileUse& use, const std::string& path) {
  checkWritable(use.flag, path);
  const fs::path p(path);
  add(use, path, entryIn(directoryOf(p), p.filename().string()), true);
}

void FileUses::outputDirectory(const FileUse& use, const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "out/" names out
  add(use, dir, entryIn(directoryOf(p), p.filename().string()), false);
}

void FileUses::add(const FileUse& use, const std::string& path, Entry entry, bool output) {
  for (const Registered& r : files_) {
    if (!(output || r.output) || !(r.entry == entry)) continue;
    // Named by the output (the later one when both are): its flag is the one to change.
    const FileUse& written = output ? use : r.use;
    const FileUse& other = output ? r.use : use;
    throw InvalidArgument(detail::concat(written.flag, ": expected a file other than ", other.text(),
                                         ", got the same file ", output ? path : r.path));
  }
  files_.push_back({use, path, std::move(entry), output});
}

// ---- OutputFiles

OutputFiles::OutputFiles(std::string flag) : flag_(std::move(flag)) {}

OutputFiles::~OutputFiles() {
  for (const Pending& p : pending_) {
    ::unlinkat(p.dir, temporaryName(p.serial).c_str(), 0);
    untrack(p.slot);
  }
  release();
}

void OutputFiles::setStepHook(std::function<void(Step, const std::string& path)> hook) { stepHook() = std::move(hook); }

int OutputFiles::lockDirectoryOf(const std::string& path) {
  const std::string dir = directoryOf(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TPSIM_CHECK(fd >= 0, flag_, ": cannot write ", path, " (cannot open its directory: ", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    TPSIM_CHECK(false, flag_, ": cannot write ", path, " (", std::strerror(error), ")");
  }
  const LockKey key{st.st_dev, st.st_ino};
  std::lock_guard<std::mutex> lock(gMutex);
  if (const auto held = gLocks.find(key); held != gLocks.end()) {
    ::close(fd);
    if (std::find(locked_.begin(), locked_.end(), key) == locked_.end()) {
      ++held->second.sets;
      locked_.push_back(key);
    }
    return held->second.fd;
  }
  int locked = ::flock(fd, LOCK_EX | LOCK_NB);
  if (locked != 0 && errno == EWOULDBLOCK) {
    std::fprintf(stderr, "tpsim: %s: waiting for another process reading or writing the same directory\n",
                 flag_.rfind("--", 0) == 0 ? flag_.c_str() : "output");
    do {
      locked = ::flock(fd, LOCK_EX);
    } while (locked != 0 && errno == EINTR);
  }
  if (locked != 0) {
    const int error = errno;
    ::close(fd);
    TPSIM_CHECK(false, flag_, ": cannot write ", path, " (cannot lock its directory against other writers: ",
                std::strerror(error), ")");
  }
  removeLeftTemporaries(fd);
  gLocks[key] = {fd, 1};
  locked_.push_back(key);
  return fd;
}

DirectoryReadLock::DirectoryReadLock(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    if (fd >= 0) ::close(fd);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(gMutex);
    if (gLocks.count({st.st_dev, st.st_ino})) {
      ::close(fd);
      return;
    }
  }
  int locked = ::flock(fd, LOCK_SH | LOCK_NB);
  if (locked != 0 && errno == EWOULDBLOCK) {
    std::fprintf(stderr, "tpsim: checkpoint %s: waiting for another process writing into it\n",
                 printable(dir).c_str());
    do {
      locked = ::flock(fd, LOCK_SH);
    } while (locked != 0 && errno == EINTR);
  }
  if (locked != 0) {
    ::close(fd);
    return;
  }
  fd_ = fd;
}

DirectoryReadLock::~DirectoryReadLock() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFiles::release() {
  std::lock_guard<std::mutex> lock(gMutex);
  for (const LockKey& key : locked_) {
    const auto held = gLocks.find(key);
    if (--held->second.sets > 0) continue;
    ::close(held->second.fd);  // lets go of the flock
    gLocks.erase(held);
  }
  locked_.clear();
}

void OutputFiles::write(const std::string& path, const std::string& bytes) {
  write(path, [&](std::FILE* file) {
    if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size())
      TPSIM_CHECK(false, flag_, ": cannot write ", path, " (", std::strerror(errno), ")");
  });
}

void OutputFiles::write(const std::string& path, const std::function<void(std::FILE*)>& produce) {
  checkWritable(flag_, path);
  const std::string name = targetName(flag_, path);
  const int dir = lockDirectoryOf(path);
  // Again under the lock, on the directory the temporary goes to.
  struct stat st {};
  if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    checkKind(flag_, path, S_ISREG(st.st_mode) || S_ISLNK(st.st_mode));
    if (S_ISLNK(st.st_mode)) {
      struct stat target {};
      checkSymlinkTarget(flag_, path, ::fstatat(dir, name.c_str(), &target, 0), target);
    }
  } else {
    TPSIM_CHECK(errno == ENOENT, flag_, ": cannot write ", path, " (", std::strerror(errno), ")");
  }
  const auto [serial, slot] = track(dir, flag_);  // before it exists: a signal finds it from the start
  const std::string temporary = temporaryName(serial);
  const int fd = ::openat(dir, temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0) {
    const int error = errno;
    untrack(slot);
    TPSIM_CHECK(false, flag_, ": cannot write ", path, " (cannot create a temporary beside it: ", std::strerror(error),
                ")");
  }
  std::FILE* file = ::fdopen(fd, "wb");
  if (!file) {
    const int error = errno;
    ::close(fd);
    ::unlinkat(dir, temporary.c_str(), 0);
    untrack(slot);
    TPSIM_CHECK(false, flag_, ": cannot write ", path, " (", std::strerror(error), ")");
  }
  pending_.push_back({path, name, dir, serial, slot});  // removed by the destructor unless committed
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
  stepDone(Step::kWritten, path);
}

void OutputFiles::removeBeforeRenames(const std::string& path) {
  removeFirst_.push_back({path, targetName(flag_, path), lockDirectoryOf(path)});
}

void OutputFiles::removeAfterRenames(const std::string& path) {
  removeLast_.push_back({path, targetName(flag_, path), lockDirectoryOf(path)});
}

void OutputFiles::removeAll(const std::vector<Removal>& removals) {
  for (const Removal& r : removals) {
    TPSIM_CHECK(::unlinkat(r.dir, r.name.c_str(), 0) == 0 || errno == ENOENT, flag_, ": cannot remove ", r.target,
                " (", std::strerror(errno), ")");
    stepDone(Step::kRemoved, r.target);
  }
}

void OutputFiles::commit() {
  removeAll(removeFirst_);
  removeFirst_.clear();
  std::size_t renamed = 0;
  try {
    while (renamed < pending_.size()) {
      const Pending& p = pending_[renamed];
      TPSIM_CHECK(::renameat(p.dir, temporaryName(p.serial).c_str(), p.dir, p.name.c_str()) == 0, flag_,
                  ": cannot write ", p.target, " (", std::strerror(errno), ")");
      untrack(p.slot);
      ++renamed;
      stepDone(Step::kRenamed, p.target);
    }
  } catch (...) {
    pending_.erase(pending_.begin(), pending_.begin() + std::ptrdiff_t(renamed));  // the rest are removed
    throw;
  }
  pending_.clear();
  removeAll(removeLast_);
  removeLast_.clear();
  release();
}

}  // namespace tpsim::tools
