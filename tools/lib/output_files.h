// OutputFiles: every file a tpsim command writes goes through it, so that all of them follow one
// set of rules; FileUses: every file one command reads or writes, checked before it writes any.
//
// - Whole or not at all: each file of a set is written to a temporary beside its target,
//   ".tpsim-PID-N.partial" (unique in the process, short whatever the target's name), and only
//   when every file of the set is complete are they renamed into place, in the order they were
//   written (an index written last lands last). A set dropped before commit(), or one whose write
//   fails, removes its temporaries; so does SIGHUP, SIGINT, SIGPIPE, SIGTERM or SIGXFSZ, which
//   then ends the process as it would have (a signal the process ignores stays ignored).
// - One writer per directory: a set holds an exclusive lock (flock) on each directory it writes
//   into from its first write there to the end of commit(); another process's set waits for it,
//   with a note on stderr. Under a fresh lock, temporaries left there by a killed process are removed.
// - Never through a symlink: rename() replaces a symlink at a target instead of following it, so
//   nothing outside the target's directory is written; a temporary is created exclusively.
// - Only over a regular file: any other kind of file at a target (a directory, a FIFO, a device),
//   or a symlink to one (a terminal's /dev/stdout, say, which replacing would take away), is
//   refused before a byte is written.
// - No output over another use's file: FileUses refuses, before anything is written, a command
//   whose output is one of its inputs or another of its outputs.
// Sets are made and used on one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace tpsim::tools {

// One use of a file by a command: a flag naming a file ("--trace") or a file in a flag's directory
// ("--save", "output.npy").
struct FileUse {
  FileUse(std::string flag, std::string file = "") : flag(std::move(flag)), file(std::move(file)) {}
  std::string flag;  // "--save", "--device-model", "consolidate: FILE"
  std::string file;  // the file's name in the flag's directory; empty when the flag names the file
  std::string text() const;  // "--save's output.npy", "--trace"
};

// The files one command reads and writes. A command registers all of them before it writes any
// output; the first output that is the same file as an input or as another output is refused.
//
// Two paths are the same file when they are the same directory entry: the same name in the same
// directory, directories compared by device and inode where they exist and by their normalised
// absolute path where they do not yet. An input's path is resolved through its symlinks, as
// reading it does; an output's last component is not, as the rename replaces a symlink there. A
// hard link to an input is another entry: replacing it leaves the input as it was.
// True for the names OutputFiles gives its temporaries (".tpsim-PID-N.partial"): a set removes
// those it finds in a directory it locks, so nothing else may be named so.
bool isTemporaryName(const std::string& name);

class FileUses {
 public:
  // Throws InvalidArgument "<output flag>: expected a file other than <other use>, got the same
  // file <output path>" when the path is the same file as an output registered before (or, for an
  // output, as any file registered before).
  void read(const FileUse& use, const std::string& path);
  // Also throws, naming the flag, unless `path` may be written (OutputFiles::write's rules).
  void write(const FileUse& use, const std::string& path);
  // A directory the command writes its outputs into: no output may be that directory itself
  // (registered as a use, not an output, as two sets may share a directory).
  void outputDirectory(const FileUse& use, const std::string& dir);

 private:
  struct Entry {
    bool exists = false;   // the directory exists: compared by dev and ino, else by dir
    dev_t dev = 0;
    ino_t ino = 0;
    std::string dir, name;
    bool operator==(const Entry& other) const;
  };
  struct Registered {
    FileUse use;
    std::string path;
    Entry entry;
    bool output = false;
  };
  static Entry entryIn(const std::string& dir, std::string name);
  void add(const FileUse& use, const std::string& path, Entry entry, bool output);
  std::vector<Registered> files_;
};

class OutputFiles {
 public:
  // `flag` names where the paths come from in every message: "--save", "--svg".
  explicit OutputFiles(std::string flag);
  ~OutputFiles();
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;

  // Writes the temporary of `path`: `bytes`, or what `produce` writes to the open file (it throws
  // on its own errors; a failed flush or close is reported here, naming `path`). Throws
  // InvalidArgument naming the flag unless `path` may be written: a file name (not a directory's
  // path, not a tpsim temporary's name) that is absent, a regular file, or a symlink (replaced).
  void write(const std::string& path, const std::string& bytes);
  void write(const std::string& path, const std::function<void(std::FILE*)>& produce);
  // At commit(), `path` is removed (if there) before the first rename: a file that would vouch
  // for the files being replaced (a checkpoint's old index).
  void removeBeforeRenames(const std::string& path);
  // At commit(), `path` is removed (if there) after the last rename: a file of an earlier, larger
  // set. Its directory is locked from now on, so a listing made afterwards sees no other writer's.
  void removeAfterRenames(const std::string& path);
  // Renames every temporary into place, in the order written, between the removals; then lets go
  // of the directories' locks.
  void commit();

  // Tests only: `hook` is called after each step of every set (a temporary complete, a file
  // removed, a temporary renamed into place) with the target's path; a hook that throws fails the
  // set at that step, as a full disk or a crash would. An empty function removes it.
  enum class Step { kWritten, kRemoved, kRenamed };
  static void setStepHook(std::function<void(Step, const std::string& path)> hook);

 private:
  struct Pending {
    std::string target, name;  // name: the target's in its directory
    int dir = -1;              // the locked directory's descriptor
    std::uint64_t serial = 0;  // the temporary is temporaryName(serial)
    std::size_t slot = 0;      // where the signal handler finds it
  };
  struct Removal {
    std::string target, name;
    int dir = -1;
  };
  int lockDirectoryOf(const std::string& path);
  void removeAll(const std::vector<Removal>& removals);
  void release();
  std::string flag_;
  std::vector<Pending> pending_;
  std::vector<Removal> removeFirst_, removeLast_;
  std::vector<std::pair<dev_t, ino_t>> locked_;  // the directories this set has locked
};

// A shared lock (flock) on a directory whose files are read as one (a checkpoint's), held while it
// lives: a writer of another process finishes before the reading starts, and none starts until it
// ends; waiting for one, it says so on stderr. It takes none on a directory this process writes
// into (a lock there would wait for itself; FileUses refuses reading one's own outputs), nor where
// the directory cannot be opened or locked (the reader then names what is wrong, and a write under
// it shows as a size or checksum that disagrees with the index).
class DirectoryReadLock {
 public:
  explicit DirectoryReadLock(const std::string& dir);
  ~DirectoryReadLock();
  DirectoryReadLock(const DirectoryReadLock&) = delete;
  DirectoryReadLock& operator=(const DirectoryReadLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace tpsim::tools
