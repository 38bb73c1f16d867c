// OutputFiles: every file a tpsim command writes goes through it, so that all of them follow one
// set of rules.
//
// - Whole or not at all: each file is written to a temporary beside its target, ".NAME.partial",
//   and only when every file of the set is complete are they renamed into place, in the order they
//   were written (an index written last lands last). A set dropped before commit(), or one whose
//   write fails, removes its temporaries.
// - Never through a symlink: rename() replaces a symlink at a target instead of following it, so
//   nothing outside the target's directory is written; a temporary is created exclusively.
// - Only over a regular file: any other kind of file at a target (a directory, a FIFO, a device)
//   is refused before a byte is written.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace tpsim::tools {

class OutputFiles {
 public:
  // `flag` names where the paths come from in every message: "--save", "--svg".
  explicit OutputFiles(std::string flag);
  ~OutputFiles();
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;

  // Throws InvalidArgument naming the flag unless `path` may be written: absent, a regular file,
  // or a symlink (which is replaced).
  void checkTarget(const std::string& path) const;
  // Writes the temporary of `path`: `bytes`, or what `produce` writes to the open file (it throws
  // on its own errors; a failed flush or close is reported here, naming `path`).
  void write(const std::string& path, const std::string& bytes);
  void write(const std::string& path, const std::function<void(std::FILE*)>& produce);
  // Renames every temporary into place, in the order written.
  void commit();

 private:
  struct Pending {
    std::string target, temporary;
  };
  std::string flag_;
  std::vector<Pending> pending_;
};

}  // namespace tpsim::tools
