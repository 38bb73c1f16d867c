// Unit tests of tools/lib/input_file.h: what it reads from a regular file, and every file it refuses
// with its message: the kinds that are not regular files (a FIFO, also behind a symlink, without
// blocking), a file over a size limit, a line over a length limit, a read past the end.
#include "tools/lib/input_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "tests/scratch_dir.h"

namespace tpsim::tools {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

using testing::ScratchDir;

InputFile openInput(const std::string& path) {
  return InputFile(path, "test '" + path + "'", "a test file",
                   [&](int error) { return "cannot open '" + path + "': " + std::strerror(error); });
}

// The message of the InvalidArgument `fn` throws; fails the test if it throws nothing.
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

// The error of opening `fifo` (or a link to it at `path`), failing instead of hanging when the open
// has not returned after 10 s: it waits for a writer then, so the FIFO's write end is opened to
// release it.
std::string errorOfOpeningFifo(const std::string& path, const std::string& fifo) {
  std::future<std::string> error = std::async(std::launch::async, [&] { return errorOf([&] { openInput(path); }); });
  if (error.wait_for(10s) == std::future_status::timeout) {
    ADD_FAILURE() << "opening " << path << " blocked for 10 s";
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    std::string message = error.get();
    ::close(writer);
    return message;
  }
  return error.get();
}

TEST(InputFileTest, ReadsARegularFile) {
  ScratchDir dir;
  const std::string path = dir.write("a.bin", "0123456789");
  InputFile file = openInput(path);
  EXPECT_EQ(file.size(), 10u);
  char bytes[4] = {};
  file.read(bytes, 3, "the start");
  EXPECT_EQ(std::string(bytes, 3), "012");
  file.read(bytes, 4, "the middle");
  EXPECT_EQ(std::string(bytes, 4), "3456");
  file.readAt(8, bytes, 2, "the end");
  EXPECT_EQ(std::string(bytes, 2), "89");
  const std::vector<char> all = file.readAll(10);
  EXPECT_EQ(std::string(all.begin(), all.end()), "0123456789");
  EXPECT_TRUE(openInput(dir.write("empty.bin", "")).readAll(0).empty());
}

TEST(InputFileTest, FollowsASymlinkToARegularFile) {
  ScratchDir dir;
  fs::create_symlink(dir.write("a.bin", "abc"), dir.file("link.bin"));
  EXPECT_EQ(openInput(dir.file("link.bin")).size(), 3u);
}

// realPath names the file a symlink leads to, and refuses a path that names another file by now.
TEST(InputFileTest, RealPathResolvesSymlinksAndNamesTheOpenFile) {
  ScratchDir dir;
  const std::string target = dir.write("a.bin", "abc");
  fs::create_symlink(target, dir.file("link.bin"));
  EXPECT_EQ(openInput(dir.file("link.bin")).realPath(), fs::canonical(target).string());
  const InputFile opened = openInput(target);
  fs::remove(target);
  dir.write("a.bin", "replaced");
  EXPECT_NE(errorOf([&] { (void)opened.realPath(); }).find("expected the path to name the file opened, got it replaced"),
            std::string::npos);
}

TEST(InputFileTest, PrintableEscapesAndShortens) {
  EXPECT_EQ(printable("a\x1b[31m\"\\\n"), "a\\x1b[31m\\x22\\x5c\\x0a");
  EXPECT_EQ(printable(std::string(300, 'x'), 4), "xxxx...");
}

TEST(InputFileTest, ReadsLines) {
  ScratchDir dir;
  InputFile file = openInput(dir.write("a.txt", "a = 1\n\n  b\r\nlast"));
  std::vector<std::string> lines;
  for (std::string line; file.readLine(line, 8);) lines.push_back(line);
  EXPECT_EQ(lines, (std::vector<std::string>{"a = 1", "", "  b\r", "last"}));
  InputFile ending = openInput(dir.write("b.txt", "x\n"));
  std::string line;
  EXPECT_TRUE(ending.readLine(line, 8));
  EXPECT_EQ(line, "x");
  EXPECT_FALSE(ending.readLine(line, 8));
}

TEST(InputFileTest, RefusesAMissingFileInTheCallersWords) {
  ScratchDir dir;
  const std::string path = dir.file("missing.bin");
  EXPECT_EQ(errorOf([&] { openInput(path); }), "cannot open '" + path + "': No such file or directory");
}

TEST(InputFileTest, RefusesAFifoWithoutBlocking) {
  ScratchDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_EQ(errorOfOpeningFifo(fifo, fifo), "test '" + fifo + "': expected a regular file, got a FIFO");
}

TEST(InputFileTest, RefusesASymlinkToAFifoWithoutBlocking) {
  ScratchDir dir;
  const std::string fifo = dir.file("fifo"), link = dir.file("link");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  fs::create_symlink(fifo, link);
  EXPECT_EQ(errorOfOpeningFifo(link, fifo), "test '" + link + "': expected a regular file, got a FIFO");
}

TEST(InputFileTest, RefusesADirectoryNamingWhatWasExpected) {
  ScratchDir dir;
  const std::string path = dir.file("sub");
  fs::create_directory(path);
  EXPECT_EQ(errorOf([&] { openInput(path); }), "test '" + path + "': expected a test file, got a directory");
}

TEST(InputFileTest, RefusesASocket) {
  ScratchDir dir;
  const std::string path = dir.file("socket");
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof address.sun_path) GTEST_SKIP() << "temporary directory path too long for a socket";
  std::strcpy(address.sun_path, path.c_str());
  const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0) << std::strerror(errno);
  ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0) << std::strerror(errno);
  EXPECT_EQ(errorOf([&] { openInput(path); }), "test '" + path + "': expected a regular file, got a socket");
  ::close(listener);
}

TEST(InputFileTest, RefusesADevice) {
  for (const std::string path : {"/dev/null", "/dev/zero"})
    EXPECT_EQ(errorOf([&] { openInput(path); }),
              "test '" + path + "': expected a regular file, got a device or other special file");
}

TEST(InputFileTest, RefusesAFileOverTheSizeLimitBeforeReading) {
  ScratchDir dir;
  // Sparse: 1 GiB that would take a while to read, and memory to hold.
  const std::string path = dir.file("big.bin");
  std::ofstream(path, std::ios::binary).close();
  fs::resize_file(path, std::uintmax_t(1) << 30);
  InputFile file = openInput(path);
  EXPECT_EQ(errorOf([&] { file.readAll(1 << 20); }),
            "test '" + path + "': expected a file of at most 1048576 bytes, got 1073741824");
  EXPECT_EQ(errorOf([&] { file.checkSize(1 << 20); }),
            "test '" + path + "': expected a file of at most 1048576 bytes, got 1073741824");
  EXPECT_EQ(openInput(dir.write("limit.bin", "1234")).readAll(4).size(), 4u);
}

TEST(InputFileTest, RefusesALineOverTheLengthLimit) {
  ScratchDir dir;
  const std::string path = dir.write("a.txt", "12345678\n123456789\n");
  InputFile file = openInput(path);
  std::string line;
  EXPECT_TRUE(file.readLine(line, 8));
  EXPECT_EQ(line, "12345678");
  EXPECT_EQ(errorOf([&] { file.readLine(line, 8); }),
            "test '" + path + "':2: expected lines of at most 8 bytes, got a longer one");
  // A file without a newline is one line: refused, not read whole.
  const std::string unbroken = dir.write("b.txt", std::string(1 << 20, 'x'));
  InputFile noNewline = openInput(unbroken);
  EXPECT_EQ(errorOf([&] { noNewline.readLine(line, 4096); }),
            "test '" + unbroken + "':1: expected lines of at most 4096 bytes, got a longer one");
}

TEST(InputFileTest, RefusesAReadPastTheEnd) {
  ScratchDir dir;
  const std::string path = dir.write("a.bin", "0123");
  InputFile file = openInput(path);
  char bytes[8];
  EXPECT_EQ(errorOf([&] { file.read(bytes, 8, "data"); }),
            "test '" + path + "': expected to read 8 bytes of data, got 4 (the file shrank while being read)");
  EXPECT_EQ(errorOf([&] { file.readAt(2, bytes, 4, "the tail"); }),
            "test '" + path + "': expected to read 4 bytes of the tail, got 2 (the file shrank while being read)");
}

}  // namespace
}  // namespace tpsim::tools
