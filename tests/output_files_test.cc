// Unit tests of tools/lib/output_files.h: a set lands whole or not at all, its temporaries are
// short and unique and go away on failure, on a signal and (left by a killed process) under the
// next lock; a second writer of a directory waits for the first; and FileUses finds one file under
// two spellings (./, .., a symlinked directory) while a symlink or hard link at an output is another.
#include "tools/lib/output_files.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/errors.h"
#include "tests/scratch_dir.h"

namespace tpsim::tools {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::ScratchDir;

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Every name in `dir`, sorted.
std::vector<std::string> names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgument";
  return "";
}

// Removes the step hook however a test ends.
struct StepHook {
  explicit StepHook(std::function<void(OutputFiles::Step, const std::string&)> hook) {
    OutputFiles::setStepHook(std::move(hook));
  }
  ~StepHook() { OutputFiles::setStepHook({}); }
};

TEST(OutputFiles, ASetLandsWholeInTheOrderWritten) {
  ScratchDir dir;
  std::vector<std::string> renamed;
  StepHook hook([&](OutputFiles::Step step, const std::string& path) {
    if (step == OutputFiles::Step::kRenamed) renamed.push_back(fs::path(path).filename().string());
  });
  OutputFiles output("--test");
  output.write(dir.file("b"), "second");
  output.write(dir.file("a"), "first");
  EXPECT_FALSE(fs::exists(dir.file("a")));  // nothing in place before commit()
  output.commit();
  EXPECT_EQ(contents(dir.file("a")), "first");
  EXPECT_EQ(contents(dir.file("b")), "second");
  EXPECT_EQ(renamed, (std::vector<std::string>{"b", "a"}));
}

TEST(OutputFiles, TemporariesAreShortUniqueAndHidden) {
  ScratchDir dir;
  const std::string longest(255, 'n');  // NAME_MAX: ".NAME.partial" would not fit
  std::vector<std::string> seen;
  StepHook hook([&](OutputFiles::Step step, const std::string&) {
    if (step == OutputFiles::Step::kWritten) seen = names(dir.file(""));
  });
  OutputFiles output("--test");
  output.write(dir.file(longest), "x");
  ASSERT_EQ(seen.size(), 1u);
  const std::string temporary = seen[0];
  EXPECT_THAT(temporary, ::testing::StartsWith(".tpsim-" + std::to_string(getpid()) + "-"));
  EXPECT_THAT(temporary, ::testing::EndsWith(".partial"));
  EXPECT_LE(temporary.size(), 64u);
  output.write(dir.file("other"), "y");
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_NE(seen[0], seen[1]);
  output.commit();
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{longest, "other"}));
}

TEST(OutputFiles, AFailedOrDroppedSetLeavesNothing) {
  ScratchDir dir;
  dir.write("a", "old");
  {
    OutputFiles output("--test");
    output.write(dir.file("a"), "new");
    output.write(dir.file("b"), "new");
  }  // dropped before commit()
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"a"}));
  EXPECT_EQ(contents(dir.file("a")), "old");
  {
    OutputFiles failing("--test");
    failing.write(dir.file("b"), "new");
    EXPECT_THAT(errorOf([&] {
                  failing.write(dir.file("c"), [](std::FILE*) { throw InvalidArgument("full disk"); });
                }),
                HasSubstr("full disk"));
  }
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"a"}));
}

TEST(OutputFiles, AFailureAtAnyStepLeavesNoTemporary) {
  ScratchDir dir;
  for (int failAt = 0; failAt < 4; ++failAt) {  // two written, two renamed
    int step = 0;
    StepHook hook([&](OutputFiles::Step, const std::string&) {
      if (step++ == failAt) throw InvalidArgument("step " + std::to_string(failAt));
    });
    {
      OutputFiles output("--test");
      EXPECT_THAT(errorOf([&] {
                    output.write(dir.file("a"), "a");
                    output.write(dir.file("b"), "b");
                    output.commit();
                  }),
                  HasSubstr("step " + std::to_string(failAt)));
    }
    for (const std::string& name : names(dir.file(""))) EXPECT_THAT(name, ::testing::Not(HasSubstr(".partial")));
    fs::remove(dir.file("a"));
    fs::remove(dir.file("b"));
  }
}

TEST(OutputFiles, RefusesWhatCannotBeATarget) {
  ScratchDir dir;
  fs::create_directories(dir.file("sub"));
  OutputFiles output("--test");
  EXPECT_EQ(errorOf([&] { output.write(dir.file("sub"), "x"); }),
            "--test: expected " + dir.file("sub") + " to be absent or a regular file, got another kind of file");
  EXPECT_EQ(errorOf([&] { output.write(dir.file("sub") + "/", "x"); }),
            "--test: expected " + dir.file("sub") + "/ to be absent or a regular file, got another kind of file");
  EXPECT_EQ(errorOf([&] { output.write("", "x"); }), "--test: expected a file name, got an empty path");
  EXPECT_EQ(errorOf([&] { output.write(dir.file(".tpsim-1-2.partial"), "x"); }),
            "--test: expected a name other than a tpsim temporary's (.tpsim-*.partial), got '" +
                dir.file(".tpsim-1-2.partial") + "'");
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"sub"}));
}

TEST(OutputFiles, ASymlinkAtATargetIsReplacedNotFollowed) {
  ScratchDir dir;
  dir.write("outside", "keep");
  fs::create_symlink(dir.file("outside"), dir.file("link"));
  OutputFiles output("--test");
  output.write(dir.file("link"), "new");
  output.commit();
  EXPECT_EQ(contents(dir.file("outside")), "keep");
  EXPECT_FALSE(fs::is_symlink(dir.file("link")));
  EXPECT_EQ(contents(dir.file("link")), "new");
}

TEST(OutputFiles, RemovalsComeBeforeAndAfterTheRenames) {
  ScratchDir dir;
  dir.write("index", "old");
  dir.write("stale", "old");
  std::vector<std::string> steps;
  StepHook hook([&](OutputFiles::Step step, const std::string& path) {
    steps.push_back(std::to_string(int(step)) + " " + fs::path(path).filename().string());
  });
  OutputFiles output("--test");
  output.write(dir.file("data"), "new");
  output.write(dir.file("index"), "new");
  output.removeBeforeRenames(dir.file("index"));
  output.removeAfterRenames(dir.file("stale"));
  output.removeAfterRenames(dir.file("absent"));  // nothing there: nothing to do
  output.commit();
  EXPECT_EQ(steps, (std::vector<std::string>{"0 data", "0 index", "1 index", "2 data", "2 index", "1 stale", "1 absent"}));
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"data", "index"}));
  EXPECT_EQ(contents(dir.file("index")), "new");
}

TEST(OutputFiles, TemporariesLeftByAKilledProcessGoUnderTheNextLock) {
  ScratchDir dir;
  dir.write(".tpsim-999999-7.partial", "left by a killed writer");
  dir.write(".notes.partial", "not a tpsim temporary");
  OutputFiles output("--test");
  output.write(dir.file("a"), "a");
  output.commit();
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{".notes.partial", "a"}));
}

TEST(OutputFiles, ASecondWriterOfADirectoryWaitsForTheFirst) {
  ScratchDir dir;
  // Another process's lock: a descriptor of its own on the directory.
  const int other = ::open(dir.file("").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(other, 0);
  ASSERT_EQ(::flock(other, LOCK_EX), 0);
  std::thread writer([&] {
    OutputFiles output("--test");
    output.write(dir.file("a"), "a");
    output.commit();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(names(dir.file("")), std::vector<std::string>{});  // not even a temporary
  ::close(other);  // the other writer is done
  writer.join();
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"a"}));
}

TEST(OutputFiles, TwoSetsOfOneProcessShareADirectory) {
  ScratchDir dir;
  OutputFiles first("--test"), second("--test");
  first.write(dir.file("a"), "a");
  second.write(dir.file("b"), "b");  // would wait forever on a lock of its own
  second.commit();
  first.commit();
  EXPECT_EQ(names(dir.file("")), (std::vector<std::string>{"a", "b"}));
}

// The death test's child gets the signal after its second temporary is complete: its handler
// removes both temporaries and the process ends by the signal, as it would have without one.
TEST(OutputFilesDeathTest, ASignalRemovesTheTemporaries) {
  ScratchDir dir;
  for (int signal : {SIGINT, SIGTERM, SIGHUP}) {
    EXPECT_EXIT(
        {
          OutputFiles::setStepHook([&](OutputFiles::Step, const std::string& path) {
            if (fs::path(path).filename() == "b") std::raise(signal);
          });
          OutputFiles output("--test");
          output.write(dir.file("a"), "a");
          output.write(dir.file("b"), "b");
          output.commit();
        },
        ::testing::KilledBySignal(signal), "");
    EXPECT_EQ(names(dir.file("")), std::vector<std::string>{}) << "signal " << signal;
  }
}

TEST(FileUses, OneFileUnderTwoSpellingsIsRefused) {
  ScratchDir dir;
  fs::create_directories(dir.file("out"));
  fs::create_directory_symlink(dir.file("out"), dir.file("link"));
  dir.write("out/input.npy", "input");
  FileUses uses;
  uses.read({"--load", "input.npy"}, dir.file("out/input.npy"));
  uses.write({"--save", "output.npy"}, dir.file("out/output.npy"));
  EXPECT_EQ(errorOf([&] { uses.write({"--trace"}, dir.file("link/../out/./output.npy")); }),
            "--trace: expected a file other than --save's output.npy, got the same file " +
                dir.file("link/../out/./output.npy"));
  EXPECT_EQ(errorOf([&] { uses.write({"--trace"}, dir.file("link/output.npy")); }),
            "--trace: expected a file other than --save's output.npy, got the same file " + dir.file("link/output.npy"));
  EXPECT_EQ(errorOf([&] { uses.write({"--trace"}, dir.file("link/input.npy")); }),
            "--trace: expected a file other than --load's input.npy, got the same file " + dir.file("link/input.npy"));
}

TEST(FileUses, AnInputRegisteredAfterItsOutputIsNamedByTheOutput) {
  ScratchDir dir;
  dir.write("ck/rank-00000.safetensors", "");
  FileUses uses;
  uses.write({"consolidate: FILE"}, dir.file("ck/rank-00000.safetensors"));
  EXPECT_EQ(errorOf([&] { uses.read({"DIR", "rank-00000.safetensors"}, dir.file("ck/rank-00000.safetensors")); }),
            "consolidate: FILE: expected a file other than DIR's rank-00000.safetensors, got the same file " +
                dir.file("ck/rank-00000.safetensors"));
}

TEST(FileUses, OutputsInADirectoryNotYetMadeAreComparedByPath) {
  ScratchDir dir;
  FileUses uses;
  uses.write({"--save", "output.npy"}, dir.file("new/output.npy"));
  uses.write({"--save-checkpoint", "index.json"}, dir.file("new/index.json"));
  EXPECT_THAT(errorOf([&] { uses.write({"--trace"}, dir.file("new/sub/../output.npy")); }),
              HasSubstr("--trace: expected a file other than --save's output.npy"));
}

TEST(FileUses, SymlinksAndHardLinksAtAnOutputAreOtherEntries) {
  ScratchDir dir;
  dir.write("input.npy", "input");
  fs::create_symlink(dir.file("input.npy"), dir.file("symlink.json"));
  fs::create_hard_link(dir.file("input.npy"), dir.file("hardlink.json"));
  FileUses uses;
  uses.read({"--load", "input.npy"}, dir.file("input.npy"));
  uses.read({"--device-model"}, dir.file("input.npy"));  // two reads of one file are fine
  // Each output replaces its own directory entry, leaving the input as it is.
  uses.write({"--trace"}, dir.file("symlink.json"));
  uses.write({"--svg"}, dir.file("hardlink.json"));
  // An input read through a symlink is the file it names.
  FileUses through;
  through.read({"--device-model"}, dir.file("symlink.json"));
  EXPECT_THAT(errorOf([&] { through.write({"--trace"}, dir.file("input.npy")); }),
              HasSubstr("--trace: expected a file other than --device-model, got the same file"));
}

TEST(FileUses, ChecksEachOutputAsAWriteWould) {
  ScratchDir dir;
  fs::create_directories(dir.file("output.npy"));
  FileUses uses;
  EXPECT_EQ(errorOf([&] { uses.write({"--save", "output.npy"}, dir.file("output.npy")); }),
            "--save: expected " + dir.file("output.npy") + " to be absent or a regular file, got another kind of file");
}

}  // namespace
}  // namespace tpsim::tools
