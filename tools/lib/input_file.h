// InputFile: every file a tpsim command reads goes through it (--load's .npy files, a checkpoint's
// index and safetensors files, --device-model), so that all of them follow one set of rules; it is
// the counterpart of OutputFiles.
//
// - Regular files only: the path is opened without blocking (opening a FIFO would wait for a
//   writer, possibly forever) and what was opened is checked before a byte is read; a directory,
//   FIFO, socket or device is refused, naming the file and what it is. A symlink is followed: the
//   check is on its target.
// - Bounded: the size is fstat's, taken at open. Whole-file reads and lines have limits checked
//   before reading, and neither reads past that size, so no input grows memory without bound.
// Not a parser: each format checks what it reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace tpsim::tools {

// Untrusted bytes as a message may quote them: printable ASCII as is, every other byte, '\\' and
// '"' as \xNN (Python's repr), at most `maxChars` of them and "..." after, so that no input sends
// control bytes to a terminal or makes a message as long as itself.
std::string printable(std::string_view bytes, std::size_t maxChars = 200);

// A path or name as a command's output shows it: control bytes (below 0x20, and 0x7f) as \xNN,
// every other byte as is (UTF-8 names stay readable), so that no path drives the terminal.
std::string terminalText(std::string_view text);

class InputFile {
 public:
  // Opens `path`. Throws InvalidArgument with cannotOpen(errno) when it cannot be opened (each
  // format keeps its own words for that), "<where>: expected <kind>, got a directory" for a
  // directory, and "<where>: expected a regular file, got a FIFO" (a socket, a device or other
  // special file) for the other kinds. `kind` is what the path should name: "a .npy file".
  InputFile(const std::string& path, std::string where, const std::string& kind,
            const std::function<std::string(int error)>& cannotOpen);
  ~InputFile();
  InputFile(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  InputFile& operator=(InputFile&&) = delete;

  // Bytes in the file when it was opened.
  std::uint64_t size() const { return size_; }

  // The canonical path of the opened file (every symlink resolved), checked to name the file that
  // is open: what a reader that confines its inputs to a directory compares. Throws
  // "<where>: expected ..., got it replaced" when the path now names another file.
  std::string realPath() const;

  // Exactly `n` bytes at `offset`, or at the current position (which moves past them). `what` names
  // them when the file ends first: "<where>: expected to read 8 bytes of header length, got 3 (the
  // file shrank while being read)".
  void readAt(std::uint64_t offset, void* dst, std::size_t n, const std::string& what) const;
  void read(void* dst, std::size_t n, const std::string& what);
  // Moves the current position past `n` bytes without reading them.
  void skip(std::uint64_t n) { position_ += n; }

  // Throws "<where>: expected a file of at most `limit` bytes, got S" when size() is larger.
  void checkSize(std::uint64_t limit) const;
  // The whole file, after checkSize(limit): nothing is read from a file that is too large.
  std::vector<char> readAll(std::uint64_t limit);

  // The next line, without its '\n' (the last one may lack it) into `line`; false at the end.
  // Throws "<where>:N: expected lines of at most `maxBytes` bytes, got a longer one" before holding
  // more than that. Reads ahead from the current position: do not mix with read().
  bool readLine(std::string& line, std::size_t maxBytes);

 private:
  std::string path_, where_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::uint64_t position_ = 0;
  std::string buffered_;         // read ahead by readLine, from bufferedBegin_ on
  std::size_t bufferedBegin_ = 0;
  int lines_ = 0;                // lines readLine has returned or is reading
};

}  // namespace tpsim::tools
