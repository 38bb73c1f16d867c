// tpsim demo: collectives on a simulated TP x GTP_remat x DP grid, checked against closed forms.
//
// Builds Megatron's rank grid (SPEC 1.4.2), splits the world into its process groups on every
// simulated rank, runs one collective on each of five groups with data built from the global
// rank (x_r[i] = 100·r + i), prints what every rank issued, and verifies every rank's result.
// Exit 0 only if all agree.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <numeric>

#include "core/process_groups.h"
#include "core/rank_grid.h"
#include "sim/world.h"
#include "tools/cli.h"

namespace po = boost::program_options;

namespace tpsim::tools {
namespace {

struct DemoConfig {
  int tp = 2, gtpRemat = 2, dp = 2;
  int count = 4;  // elements per rank
  int threads = 0;
};

double value(int globalRank, std::int64_t i) { return 100.0 * globalRank + double(i); }

struct Check {
  std::string collective, group;
  long wrong = 0;
  long checked = 0;
};

std::vector<float> download(Compute& compute, ConstView v) {
  std::vector<float> host(static_cast<std::size_t>(v.numel()));
  compute.download(v, host.data());
  return host;
}

Tensor rankTensor(Compute& compute, int globalRank, std::int64_t count, std::int64_t offset = 0) {
  std::vector<float> host(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) host[std::size_t(i)] = float(value(globalRank, offset + i));
  Tensor t = compute.empty({count}, DType::kFloat32);
  compute.upload(host.data(), t);
  return t;
}

}  // namespace

int demoMain(const std::vector<std::string>& args) {
  DemoConfig c;
  po::options_description par("Parallelism");
  par.add_options()
      ("help,h", "show this help")
      ("tp,p", po::value(&c.tp)->default_value(c.tp), "tensor-parallel size T")
      ("gtp-remat,G", po::value(&c.gtpRemat)->default_value(c.gtpRemat), "GTP_remat size G")
      ("dp,d", po::value(&c.dp)->default_value(c.dp), "data-parallel size D");
  po::options_description run("Run");
  run.add_options()
      ("count,c", po::value(&c.count)->default_value(c.count), "fp32 elements per rank and collective")
      ("threads,t", po::value(&c.threads)->default_value(c.threads), "sim worker threads (0 = min(cores, ranks))");
  po::options_description all("tpsim demo [options]");
  all.add(par).add(run);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << all << "\n";
    return 0;
  }
  for (auto [flag, v] : {std::pair{"tp", c.tp}, {"gtp-remat", c.gtpRemat}, {"dp", c.dp}, {"count", c.count}})
    if (v < 1) throw UsageError{std::string("--") + flag + ": expected >= 1, got " + std::to_string(v)};
  if (c.tp * c.gtpRemat * c.dp > 64)
    throw UsageError{"--tp x --gtp-remat x --dp: expected at most 64 ranks, got " +
                     std::to_string(c.tp * c.gtpRemat * c.dp)};

  ParallelSizes sizes;
  sizes.world = c.tp * c.gtpRemat * c.dp;
  sizes.tp = c.tp;
  sizes.gtpRemat = c.gtpRemat;
  const ParallelLayout layout(sizes);
  const int world = sizes.world;
  std::printf("# tpsim demo: world %d = TP %d x GTP_remat %d x DP %d on the simulator, %d fp32 per rank\n", world,
              c.tp, c.gtpRemat, c.dp, c.count);
  std::printf("# dense grid %s\n\n", layout.dense().str().c_str());
  std::printf("%6s %4s %4s %4s   %-12s %-12s %-12s %-14s\n", "rank", "t", "g", "d", "tp group", "gtp group",
              "dp group", "dp+gtp group");
  auto members = [](const std::vector<int>& g) {
    std::string s = "[";
    for (std::size_t i = 0; i < g.size(); ++i) s += (i ? "," : "") + std::to_string(g[i]);
    return s + "]";
  };
  const int tAxis = 0, gAxis = 1, dAxis = 4;  // positions in tp-gtp_remat-cp-ep-dp-pp
  for (int r = 0; r < world; ++r) {
    auto coord = layout.dense().coordinates(r);
    std::printf("%6d %4d %4d %4d   %-12s %-12s %-12s %-14s\n", r, coord[tAxis], coord[gAxis], coord[dAxis],
                members(layout.groupOf(GroupId::kTp, r)).c_str(), members(layout.groupOf(GroupId::kGtpRemat, r)).c_str(),
                members(layout.groupOf(GroupId::kDp, r)).c_str(), members(layout.groupOf(GroupId::kDpGtp, r)).c_str());
  }

  // Per check: rank -> wrong elements. Closed forms use the grid alone, not the fabric.
  std::vector<Check> checks = {{"allReduce(sum)", "tp"},
                               {"allGather", "gtp_remat"},
                               {"reduceScatter(sum)", "dp_gtp"},
                               {"broadcast(root 0)", "dp"},
                               {"allToAll", "world"}};
  std::mutex mu;
  const std::int64_t n = c.count;
  sim::WorldOptions o;
  o.size = world;
  o.threads = c.threads;
  o.trace = true;
  sim::World sim(o);
  sim.run([&](RankContext& ctx) {
    const int r = ctx.comm.rank();
    ProcessGroups pg(ctx.comm, layout);
    Compute& cp = ctx.compute;
    std::vector<long> wrong(checks.size(), 0);

    Tensor x = rankTensor(cp, r, n);
    pg.tp().allReduce(x)->wait();
    auto got = download(cp, x);
    for (std::int64_t i = 0; i < n; ++i) {
      double expect = 0;
      for (int m : layout.groupOf(GroupId::kTp, r)) expect += value(m, i);
      wrong[0] += got[i] != float(expect);
    }

    Collectives& gtp = pg.gtpRemat();
    Tensor shard = rankTensor(cp, r, n);
    Tensor full = cp.empty({gtp.size() * n}, DType::kFloat32);
    gtp.allGather(shard, full)->wait();
    got = download(cp, full);
    auto gtpMembers = layout.groupOf(GroupId::kGtpRemat, r);
    for (std::size_t q = 0; q < gtpMembers.size(); ++q)
      for (std::int64_t i = 0; i < n; ++i) wrong[1] += got[q * n + i] != float(value(gtpMembers[q], i));

    Collectives& dpg = pg.dpGtp();
    Tensor in = rankTensor(cp, r, dpg.size() * n);
    Tensor block = cp.empty({n}, DType::kFloat32);
    dpg.reduceScatter(in, block)->wait();
    got = download(cp, block);
    for (std::int64_t i = 0; i < n; ++i) {
      double expect = 0;
      for (int m : layout.groupOf(GroupId::kDpGtp, r)) expect += value(m, dpg.rank() * n + i);
      wrong[2] += got[i] != float(expect);
    }

    Tensor b = rankTensor(cp, r, n);
    pg.dp().broadcast(b, b)->wait();
    got = download(cp, b);
    for (std::int64_t i = 0; i < n; ++i) wrong[3] += got[i] != float(value(pg.dp().globalRanks()[0], i));

    Tensor send = rankTensor(cp, r, world * n);
    Tensor recv = cp.empty({world * n}, DType::kFloat32);
    ctx.comm.allToAll(send, recv)->wait();
    got = download(cp, recv);
    for (int q = 0; q < world; ++q)
      for (std::int64_t i = 0; i < n; ++i) wrong[4] += got[q * n + i] != float(value(q, r * n + i));

    std::lock_guard<std::mutex> lock(mu);
    for (std::size_t k = 0; k < checks.size(); ++k) {
      checks[k].wrong += wrong[k];
      ++checks[k].checked;
    }
  });

  std::printf("\n# collectives each rank issued (op, group, bytes sent); splits build the groups\n");
  for (int r = 0; r < world; ++r) {
    std::printf("rank %d:", r);
    for (const auto& e : sim.trace()[r])
      if (e.op != "split") std::printf("  %s %s %lldB", e.op.c_str(), e.group.c_str(), (long long)e.bytes);
    std::printf("\n");
  }

  std::printf("\n# verification against closed forms built from the grid\n");
  std::printf("%-20s %-10s %7s %8s  %s\n", "collective", "group", "ranks", "#wrong", "result");
  bool ok = true;
  for (const Check& k : checks) {
    ok = ok && k.wrong == 0 && k.checked == world;
    std::printf("%-20s %-10s %7ld %8ld  %s\n", k.collective.c_str(), k.group.c_str(), k.checked, k.wrong,
                k.wrong == 0 && k.checked == world ? "OK" : "FAIL");
  }
  std::printf("\n%s\n", ok ? "all collectives agree with the closed forms" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace tpsim::tools
