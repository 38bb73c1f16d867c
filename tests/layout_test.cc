// The placements `tpsim layout` draws and `tpsim run` shards by: cutting any tensor by its
// placement and putting it back gives it unchanged, pad rows zero; and the drawings hold a panel
// per tensor.
#include "tools/lib/layout.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>

#include "tools/lib/host_tensor.h"
#include "tools/lib/layer_kind.h"

namespace tpsim::tools {
namespace {

// Values that name their own flat index (+1, so no element is zero), in fp32.
HostTensor indexed(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = double(i + 1);
  return makeHost(shape, DType::kFloat32, std::move(v));
}

// shardOf puts every element where blocksOf says (pad rows zero) and assemble takes each back: the
// two halves of how `tpsim run` shards its inputs and reassembles its results.
void expectShardingRoundTrips(const RunConfig& c) {
  for (TensorPlacement p : layoutPlacements(c)) {
    const HostTensor full = indexed(p.shape);
    std::map<std::pair<int, int>, HostTensor> held;
    for (int g = 0; g < p.gtp.size; ++g)
      for (int t = 0; t < p.tp.size; ++t) {
        const HostTensor mine = shardOf(p, full, t, g);
        ASSERT_EQ(mine.shape, localShape(p, t, g)) << c.str() << " " << p.name;
        std::int64_t zeros = 0;
        for (double v : mine.values) zeros += v == 0;
        EXPECT_EQ(zeros, padZeroCount(p, t, g)) << c.str() << " " << p.name << " (t=" << t << ", g=" << g << ")";
        held[{t, g}] = mine;
      }
    auto local = [&](int t, int g) -> const HostTensor& { return held.at({t, g}); };
    if (p.tp.kind == AxisKind::kPartial || p.gtp.kind == AxisKind::kPartial) {
      // Each copy holds the whole value: their sum is the value times the number of copies.
      const HostTensor sum = assemble(p, local);
      const int copies = (p.tp.kind == AxisKind::kPartial ? p.tp.size : 1) * (p.gtp.kind == AxisKind::kPartial ? p.gtp.size : 1);
      for (std::size_t i = 0; i < sum.values.size(); ++i)
        ASSERT_EQ(sum.values[i], full.values[i] * copies) << c.str() << " " << p.name << " at " << i;
      continue;
    }
    EXPECT_EQ(assemble(p, local).values, full.values) << c.str() << " " << p.name;
  }
}

TEST(Layout, ShardingByThePlacementsRoundTripsEveryTensor) {
  for (const LayerKind* kind : layerKinds())
    for (int tp : {1, 2, 4})
      for (int gtp : {1, 2})
        for (int stride : {1, 2})
          for (int pad : {0, 16}) {
            if (stride > 1 && !kind->takes(LayerOption::kStride)) continue;
            RunConfig c;
            c.layer = kind;
            c.tp = tp;
            c.gtpRemat = gtp;
            c.stride = stride;
            c.padForAlignment = pad;
            c.inputIsParallel = kind->takes(LayerOption::kInputIsParallel) && stride > 1;
            c.sequenceParallel = tp > 1 && kind->takes(LayerOption::kSequenceParallel) &&
                                 (!kind->takes(LayerOption::kInputIsParallel) || c.inputIsParallel);
            c.bias = kind->takes(LayerOption::kBias);
            c.batch = 2 * gtp;
            c.tokens = 6 * gtp;
            c.seq = 4;
            c.inFeatures = 8 * tp * stride;
            c.outFeatures = 4 * tp * stride;
            c.ffnHidden = 8 * tp;
            c.vocab = 8 * tp;
            c.experts = 3;
            expectShardingRoundTrips(c);
          }
}

TEST(Layout, DrawsEveryTensorOfTheMlpBlock) {
  RunConfig c;
  c.layer = layerKind("mlp");
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
