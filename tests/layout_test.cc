// tpsim layout's description against where `tpsim run` puts the data: for every weight of a layer,
// each rank's TP rows or columns and its GTP_remat rows (pad rows included) as runSharded reports
// them in its shard lines equal the blocks of the layers' placement. And the drawings hold a panel
// per tensor.
#include "tools/layout.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>

namespace tpsim::tools {
namespace {

// What a rank holds of a weight along its dim 0 and its TP dim, in local order, with its pad rows.
struct Held {
  std::vector<std::int64_t> rows;  // global dim-0 index of each local row; -1 for a pad row
  std::vector<std::int64_t> cols;  // global dim-1 index of each local column
  bool operator==(const Held& o) const { return rows == o.rows && cols == o.cols; }
};

// Parses "w (8, 16) = rows [0, 4)+[8, 12) of (16, 16); GTP_remat rank 1 of 2 keeps rows [16, 32) of
// it padded by 24 to 32: (16, 16)", the runner's shard line.
Held fromShardLine(const std::string& line) {
  static const std::regex head(R"(^\S+ \((\d+), (\d+)\) = (rows|columns) (.*) of \((\d+), (\d+)\)(.*)$)");
  static const std::regex range(R"(\[(\d+), (\d+)\))");
  static const std::regex gtp(R"(keeps rows \[(\d+), (\d+)\) of it padded by (\d+))");
  std::smatch m;
  EXPECT_TRUE(std::regex_match(line, m, head)) << line;
  const bool byRows = m[3] == "rows";
  const std::int64_t fullRows = std::stoll(m[5]), fullCols = std::stoll(m[6]);
  std::vector<std::int64_t> tpIndex;  // TP-local index -> global index along the TP dim
  const std::string ranges = m[4], rest = m[7];
  for (auto it = std::sregex_iterator(ranges.begin(), ranges.end(), range); it != std::sregex_iterator(); ++it)
    for (std::int64_t i = std::stoll((*it)[1]); i < std::stoll((*it)[2]); ++i) tpIndex.push_back(i);
  Held h;
  std::vector<std::int64_t> tpLocalRows;
  if (byRows) {
    tpLocalRows = tpIndex;
    for (std::int64_t c = 0; c < fullCols; ++c) h.cols.push_back(c);
  } else {
    for (std::int64_t r = 0; r < fullRows; ++r) tpLocalRows.push_back(r);
    h.cols = tpIndex;
  }
  std::smatch g;
  if (std::regex_search(rest, g, gtp)) {
    const std::int64_t b = std::stoll(g[1]), e = std::stoll(g[2]), dLog = std::int64_t(tpLocalRows.size());
    for (std::int64_t i = b; i < e; ++i) h.rows.push_back(i < dLog ? tpLocalRows[std::size_t(i)] : -1);
  } else {
    h.rows = tpLocalRows;
  }
  return h;
}

Held fromPlacement(const TensorPlacement& p, int t, int g) {
  const auto shape = localShape(p, t, g);
  Held h;
  h.rows.assign(std::size_t(shape[0]), -2);
  h.cols.assign(std::size_t(shape[1]), -2);
  for (const Block& b : blocksOf(p, t, g)) {
    for (std::int64_t i = 0; i < b.layout[0].size(); ++i)
      h.rows[std::size_t(b.local[0] + i)] = b.pad ? -1 : b.global[0].begin + i;
    for (std::int64_t j = 0; j < b.layout[1].size(); ++j) h.cols[std::size_t(b.local[1] + j)] = b.global[1].begin + j;
  }
  return h;
}

void expectRunnerAgrees(const RunConfig& c) {
  const RunResult run = runSharded(c, generateInputs(c));
  std::map<std::string, TensorPlacement> byName;
  for (const TensorPlacement& p : layoutPlacements(c)) byName[p.name] = p;
  int compared = 0;
  for (int t = 0; t < c.tp; ++t)
    for (int g = 0; g < c.gtpRemat; ++g)
      for (const std::string& line : run.shards[std::size_t(t + c.tp * g)]) {
        const std::string name = line.substr(0, line.find(' '));
        if (name.size() < 6 || name.compare(name.size() - 6, 6, "weight") != 0) continue;
        ASSERT_TRUE(byName.count(name)) << name;
        EXPECT_EQ(fromShardLine(line), fromPlacement(byName[name], t, g))
            << c.str() << " rank (" << t << ", " << g << "): " << line;
        ++compared;
      }
  EXPECT_EQ(compared, c.tp * c.gtpRemat * (c.layer == LayerKind::kMlp ? 2 : 1)) << c.str();
}

TEST(Layout, PlacementsAgreeWithWhereTheRunnerPutsTheWeights) {
  for (LayerKind kind : {LayerKind::kColumn, LayerKind::kRow, LayerKind::kEmbedding, LayerKind::kMlp})
    for (int tp : {1, 2, 4})
      for (int gtp : {1, 2})
        for (int stride : {1, 2})
          for (int pad : {0, 16}) {
            if (stride > 1 && (kind == LayerKind::kEmbedding || kind == LayerKind::kMlp)) continue;
            RunConfig c;
            c.layer = kind;
            c.tp = tp;
            c.gtpRemat = gtp;
            c.stride = stride;
            c.padForAlignment = pad;
            c.inputIsParallel = kind == LayerKind::kRow && stride > 1;
            c.batch = 2 * gtp;
            c.seq = 4;
            c.inFeatures = 8 * tp * stride;
            c.outFeatures = 4 * tp * stride;
            c.ffnHidden = 8 * tp;
            c.vocab = 8 * tp;
            expectRunnerAgrees(c);
          }
}

TEST(Layout, DrawsEveryTensorOfTheMlpBlock) {
  RunConfig c;
  c.layer = LayerKind::kMlp;
  c.tp = 2;
  c.gtpRemat = 2;
  c.sequenceParallel = true;
  const auto ps = layoutPlacements(c);
  const std::string text = layoutText(c, ps, false), svg = layoutSvg(c, ps);
  for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.output.partial", "fc1.input.grad"}) {
    EXPECT_NE(text.find(std::string("\n") + name + " ("), std::string::npos) << name;
    EXPECT_NE(svg.find(std::string("data-tensor=\"") + name + "\""), std::string::npos) << name;
  }
  EXPECT_EQ(text.find("\033["), std::string::npos);
  EXPECT_NE(layoutText(c, ps, true).find("\033[30;48;5;"), std::string::npos);
}

}  // namespace
}  // namespace tpsim::tools
