// The host side of a GPU world of one rank per MPI process: which device a process takes, which
// worlds a job refuses, and what each member passes ncclCommSplit. Runs without a GPU.
#include <gtest/gtest.h>

#include "backends/errors.h"
#include "gpu/nccl_transport.h"
#include "gpu/world.h"

namespace tpsim::gpu {
namespace {

TEST(GpuJob, LocalProcessTakesItsDevice) {
  EXPECT_EQ(deviceForLocalProcess(0, 1), 0);
  EXPECT_EQ(deviceForLocalProcess(3, 8), 3);
  EXPECT_EQ(deviceForLocalProcess(7, 8), 7);
}

TEST(GpuJob, TooFewDevicesNamesBothNumbers) {
  try {
    deviceForLocalProcess(2, 2);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "gpu::World: the job's process 2 on this machine (counted from 0) takes CUDA device 2, "
                           "but the machine has 2 device(s); run at most 2 process(es) per machine");
  }
  EXPECT_THROW(deviceForLocalProcess(0, 0), InvalidArgument);
}

TEST(GpuJob, OneRankPerProcess) {
  EXPECT_EQ(processPlacementError(1, 1), "");
  EXPECT_EQ(processPlacementError(4, 4), "");
  EXPECT_EQ(processPlacementError(4, 2),
            "a GPU world in an MPI job runs one rank per process: expected a world of 2 rank(s), one for each of "
            "the 2 processes, got 4");
  EXPECT_NE(processPlacementError(1, 2), "");
}

TEST(GpuJob, SplitArgsKeepColorAndKey) {
  // NCCL orders a color's members by (key, parent rank), as the rendezvous does.
  const NcclSplitArgs a = ncclSplitArgs(world::SplitPlace{3, -5, "w.0.3", 1, 2});
  EXPECT_EQ(a.color, 3);
  EXPECT_EQ(a.key, -5);
  const NcclSplitArgs none = ncclSplitArgs(world::SplitPlace{-1, 7, "", -1, 0});
  EXPECT_EQ(none.color, NCCL_SPLIT_NOCOLOR);
  EXPECT_EQ(ncclSplitArgs(world::SplitPlace{-9, 0, "", -1, 0}).color, NCCL_SPLIT_NOCOLOR);
}

TEST(GpuJob, ProcessZerosIdReachesEveryProcess) {
  // Process 1 of a job: its own id is never made; it gets what process 0 broadcast.
  std::string sent;
  auto broadcast = [&](const std::string& bytes) {
    sent = bytes;
    std::string fromZero(sizeof(ncclUniqueId::internal), '\0');
    for (std::size_t i = 0; i < fromZero.size(); ++i) fromZero[i] = char(i + 1);
    return fromZero;
  };
  bool made = false;
  const ncclUniqueId id = shareUniqueId(1, broadcast, [&] {
    made = true;
    return ncclUniqueId{};
  });
  EXPECT_FALSE(made);
  for (std::size_t i = 0; i < sizeof id.internal; ++i) ASSERT_EQ(id.internal[i], char(i + 1)) << "byte " << i;
  // Process 0 sends the id it made.
  ncclUniqueId mine{};
  mine.internal[5] = 42;
  const ncclUniqueId got = shareUniqueId(0, [](const std::string& b) { return b; }, [&] { return mine; });
  EXPECT_EQ(got.internal[5], 42);
  EXPECT_EQ(sent.size(), 0u);  // the first call's process 1 sent nothing of its own
  EXPECT_THROW(shareUniqueId(1, [](const std::string&) { return std::string("short"); }, [] { return ncclUniqueId{}; }),
               InternalError);
}

}  // namespace
}  // namespace tpsim::gpu
