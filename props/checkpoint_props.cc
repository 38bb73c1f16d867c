// Checkpoint laws (tools/lib/checkpoint_files.h), for random layers (column, row, embedding, the MLP block)
// and two random topologies (T, GTP_remat, pad_for_alignment, dtype):
//   - a save at the first and a load at the second gives bitwise the same global tensors: the
//     consolidated checkpoint is the saved parameters, every rank of the second world holds exactly
//     its rows of them (converted once to its dtype) and zeros in its own pad rows, and every chunk
//     is written exactly once;
//   - a step (forward and backward) at the second topology from the checkpoint agrees with the dense
//     step within its bound, as the step at the first does;
//   - corrupting any byte of a file's header or data, truncating or dropping a file gives an
//     InvalidArgument, never numbers or a crash; a corrupt index byte gives an error or, where the
//     byte does not matter (whitespace, a writer's rank), exactly the saved tensors.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <set>

#include "tools/lib/checkpoint_files.h"
#include "core/embedding.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "props/generators.h"
#include "props/harness.h"
#include "props/rank_checks.h"
#include "tests/sim_test_util.h"
#include "tools/lib/host_tensor.h"
#include "tools/lib/runner.h"

namespace tpsim::props {
namespace {

namespace fs = std::filesystem;
using testing::valuesOf;
using tools::HostTensor;

constexpr int kReshardCases = 150;
constexpr int kCorruptionCases = 250;

struct Side {
  int tp = 1, gtp = 1, pad = 0;
  DType dtype = DType::kFloat32;
};

// Sizes that every T in {1, 2, 4} and G in {1, 2} divide where they must: column and embedding rows
// and row columns by T, TP-local rows by G (pad_for_alignment 0), the batch by G.
rc::Gen<Side> genSide() {
  return rc::gen::apply(
      [](int tp, int gtp, int pad, DType dtype) { return Side{tp, gtp, gtp == 1 ? 0 : pad, dtype}; },
      pick<int>({1, 2, 4}), pick<int>({1, 2}), pick<int>({0, 1, 4, 16}), genFloatDtype());
}

RunConfig configFor(const LayerKind* kind, const Side& s, bool bias, std::int64_t q, std::int64_t other, std::uint64_t seed) {
  RunConfig c;
  c.layer = kind;
  c.tp = s.tp;
  c.gtpRemat = s.gtp;
  c.padForAlignment = s.pad;
  c.dtype = s.dtype;
  c.bias = bias && (kind == layerKind("column") || kind == layerKind("row"));
  c.seq = 2;
  c.batch = 2;
  c.seed = seed;
  c.outFeatures = kind == layerKind("row") ? 2 * q : 8 * q;
  c.inFeatures = kind == layerKind("row") ? 4 * other : kind == layerKind("mlp") ? 2 * other : other;
  c.ffnHidden = 8 * q;
  c.vocab = 8 * q;
  return c;
}

std::vector<std::string> paramKeys(const RunConfig& c) {
  if (c.layer == layerKind("mlp")) return {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  if (c.bias) return {"weight", "bias"};
  return {"weight"};
}

// `inputs` with every floating tensor rounded to `dtype`, as a run at that dtype receives them.
TensorMap roundedTo(const TensorMap& inputs, DType dtype) {
  TensorMap out;
  for (const auto& [name, t] : inputs) out[name] = t.dtype == DType::kInt64 ? t : tools::makeHost(t.shape, dtype, t.values);
  return out;
}

std::string freshDir() {
  const fs::path p = fs::temp_directory_path() / "tpsim-props" / (currentTestName() + ".ckpt");
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string save(const RunConfig& c, const TensorMap& inputs) {
  CheckpointWriter writer;
  tools::runSharded(c, tools::storedOf(inputs), {nullptr, &writer});
  const std::string dir = freshDir();
  writer.commit(dir);
  return dir;
}

Values consolidatedValues(const CheckpointReader& reader, const std::string& key) {
  const CheckpointKey& k = reader.key(key);
  const std::vector<char> bytes = reader.consolidated(key);
  Values v(bytes.size() / dtypeSize(k.dtype));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = loadAsDouble(k.dtype, bytes.data() + i * dtypeSize(k.dtype));
  return v;
}

// Every rank of a world at `s` loads the layer's parameters and compares them with `full` (the
// unsharded tensors in s.dtype), placed as Megatron shards them: column-like weights (column,
// embedding, fc1) by TP-local rows, row-like ones (row, fc2) by TP-local columns, each TP-local
// weight's rows padded and split over the GTP_remat peers; pad rows must be zero.
void checkRankShards(const RunConfig& c, const Side& s, const CheckpointReader& reader, const TensorMap& full,
                     Problems& problems) {
  ParallelSizes sizes;
  sizes.world = s.tp * s.gtp;
  sizes.tp = s.tp;
  sizes.gtpRemat = s.gtp;
  const ParallelLayout layout(sizes);
  ModelParallelConfig mp;
  mp.tensorModelParallelSize = s.tp;
  mp.performInitialization = false;
  mp.paramsDtype = s.dtype;
  mp.gtpRematSize = s.gtp;
  mp.gtpPadForAlignment = s.pad;
  const InitMethod unused = initMethodNormal(0.02);
  testing::runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    const LayerContext lc{ctx.compute, pg.tp(), nullptr, nullptr, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    const int T = s.tp, t = pg.tp().rank(), g = pg.gtpRemat().rank();
    const std::string at = "rank " + std::to_string(ctx.comm.rank()) + " (t " + std::to_string(t) + ", g " +
                           std::to_string(g) + "): ";
    ShardedStateDict sd;
    std::map<std::string, std::pair<Parameter*, bool>> params;  // key -> (param, row-like)
    std::unique_ptr<ColumnParallelLinear> col;
    std::unique_ptr<RowParallelLinear> row;
    std::unique_ptr<VocabParallelEmbedding> emb;
    auto add = [&](ShardedStateDict more) { sd.insert(sd.end(), more.begin(), more.end()); };
    ColumnParallelOptions co;
    co.bias = c.bias || c.layer == layerKind("mlp");
    RowParallelOptions ro;
    ro.bias = co.bias;
    ro.inputIsParallel = c.layer == layerKind("mlp");
    const std::string p = c.layer == layerKind("mlp") ? "fc1." : "";
    const std::string p2 = c.layer == layerKind("mlp") ? "fc2." : "";
    if (c.layer == layerKind("column") || c.layer == layerKind("mlp")) {
      const HostTensor& w = full.at(p + "weight");
      col = std::make_unique<ColumnParallelLinear>(lc, mp, w.shape[1], w.shape[0], unused, co);
      add(shardedStateDict(*col, p, {}, pg.tp(), &pg.dpCpGtp()));
      params[p + "weight"] = {col->weight(), false};
      if (col->bias()) params[p + "bias"] = {col->bias(), false};
    }
    if (c.layer == layerKind("row") || c.layer == layerKind("mlp")) {
      const HostTensor& w = full.at(p2 + "weight");
      row = std::make_unique<RowParallelLinear>(lc, mp, w.shape[1], w.shape[0], unused, ro);
      add(shardedStateDict(*row, p2, {}, pg.tp(), &pg.dpCpGtp()));
      params[p2 + "weight"] = {&row->weight(), true};
      if (row->bias()) params[p2 + "bias"] = {row->bias(), true};
    }
    if (c.layer == layerKind("embedding")) {
      const HostTensor& w = full.at("weight");
      emb = std::make_unique<VocabParallelEmbedding>(lc, mp, w.shape[0], w.shape[1], unused);
      add(shardedStateDict(*emb, "", {}, pg.tp(), &pg.dpCpGtp()));
      params["weight"] = {&emb->weight(), false};
    }
    for (const ShardedEntry& e : sd)
      if (const auto* st = std::get_if<ShardedTensor>(&e)) reader.load(*st, params.at(st->key).first->data, ctx.compute);
    for (const auto& [key, pr] : params) {
      const auto [param, rowLike] = pr;
      const HostTensor& f = full.at(key);
      const Values got = valuesOf(ctx.compute, param->data);
      const Shape shape = param->data.shape();
      const std::int64_t rows = shape[0], cols = shape.rank() > 1 ? shape[1] : 1;
      const bool bias = f.shape.size() == 1;
      const std::int64_t n = f.shape[0], k = bias ? 1 : f.shape[1];
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) {
          double want = 0;
          const std::int64_t r = bias ? i : g * rows + i;  // row within the TP-local weight
          if (bias) want = rowLike ? f.values[std::size_t(i)] : f.values[std::size_t(t * n / T + i)];
          else if (!rowLike && r < n / T) want = f.values[std::size_t((t * n / T + r) * k + j)];
          else if (rowLike && r < n) want = f.values[std::size_t(r * k + t * k / T + j)];
          const double v = got[std::size_t(i * cols + j)];
          if (!(v == want)) {
            problems.add(detail::concat(at, key, " local (", i, ", ", j, ") is ", v, ", expected ", want,
                                        want == 0 && !bias ? " (a pad row)" : ""));
            return;
          }
        }
    }
  });
}

TPSIM_PROP(CheckpointFileLaws, SaveAtOneTopologyLoadAtAnotherIsBitwiseWithZeroPadRows, kReshardCases) {
  const LayerKind* kind = *pick<const LayerKind*>({layerKind("column"), layerKind("row"), layerKind("embedding"), layerKind("mlp")});
  const Side from = *genSide(), to = *genSide();
  const bool bias = *flag();
  const std::int64_t q = *pick<std::int64_t>({1, 2, 3}), other = *pick<std::int64_t>({1, 2, 3});
  const std::uint64_t seed = *genSeed();
  const RunConfig c1 = configFor(kind, from, bias, q, other, seed);
  RunConfig c2 = configFor(kind, to, bias, q, other, seed);
  RC_LOG() << "save: " << tools::commandLine(c1) << "\nload: " << tools::commandLine(c2) << "\n";
  const TensorMap inputs = tools::hostOf(tools::generateInputs(c1));
  const std::string dir = save(c1, inputs);
  const CheckpointReader reader(dir);
  for (const std::string& key : paramKeys(c1)) {
    // The consolidated checkpoint is the saved tensor, bit for bit.
    RC_ASSERT(sameBits(consolidatedValues(reader, key), inputs.at(key).values));
    // Each chunk written once: distinct offsets, the stored elements adding up to the tensor.
    const CheckpointKey& k = reader.key(key);
    std::set<std::vector<std::int64_t>> offsets;
    std::int64_t stored = 0;
    for (const CheckpointChunk& ch : k.chunks) {
      RC_ASSERT(offsets.insert(ch.globalOffset).second);
      stored += std::accumulate(ch.storedShape.begin(), ch.storedShape.end(), std::int64_t(1), std::multiplies<>());
    }
    RC_ASSERT(stored == inputs.at(key).numel());
  }
  // Every rank at the second topology: its rows, converted once, and zero pad rows.
  const TensorMap converted = roundedTo(inputs, to.dtype);
  Problems problems;
  checkRankShards(c2, to, reader, converted, problems);
  problems.assertNone();
  // The step at either topology agrees with the dense step on the same parameters.
  for (const tools::Verdict& v :
       tools::verify(c1, tools::storedOf(inputs), tools::runSharded(c1, tools::storedOf(inputs)).results))
    RC_ASSERT(v.outside == 0);
  const tools::RunResult second = tools::runSharded(c2, tools::storedOf(converted), {&reader, nullptr});
  for (const tools::Verdict& v : tools::verify(c2, tools::storedOf(converted), second.results)) {
    RC_LOG() << v.name << " max|err| " << v.maxError << " bound " << v.maxBound << "\n";
    RC_ASSERT(v.outside == 0);
  }
}

std::vector<char> readAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TPSIM_PROP(CheckpointFileLaws, CorruptByteOrMissingFileIsAnErrorNeverWrongNumbers, kCorruptionCases) {
  const LayerKind* kind = *pick<const LayerKind*>({layerKind("column"), layerKind("row"), layerKind("embedding"), layerKind("mlp")});
  const Side side = *genSide();
  const RunConfig c = configFor(kind, side, *flag(), *pick<std::int64_t>({1, 2}), *pick<std::int64_t>({1, 2}), *genSeed());
  const TensorMap inputs = tools::hostOf(tools::generateInputs(c));
  const std::string dir = save(c, inputs);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  const fs::path file = files[std::size_t(*pickIndex(int(files.size())))];
  const bool index = file.filename() == "index.json";
  std::vector<char> bytes = readAll(file);
  std::uint64_t headerEnd = 0;
  if (!index)
    for (int i = 0; i < 8; ++i) headerEnd |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  headerEnd += 8;
  const int action = *pickIndex(4);  // 0 header byte, 1 data byte, 2 truncate, 3 drop the file
  const char* names[] = {"header byte", "data byte", "truncate", "drop"};
  RC_TAG(index ? "index.json" : "safetensors", index && action <= 1 ? "byte" : names[action]);
  RC_LOG() << tools::commandLine(c) << "\n" << names[action] << " of " << file.filename().string() << "\n";
  if (action <= 1) {
    // A safetensors file's header is its length and JSON; the index is all header.
    const std::size_t end = index ? bytes.size() : std::min<std::size_t>(bytes.size(), headerEnd);
    const bool data = action == 1 && !index && end < bytes.size();
    const std::size_t at = data ? *uniform<std::size_t>(end, bytes.size() - 1) : *uniform<std::size_t>(0, end - 1);
    bytes[at] = char(bytes[at] ^ *uniform<int>(1, 255));
    RC_LOG() << "byte " << at << " of " << bytes.size() << "\n";
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
  } else if (action == 2) {
    fs::resize_file(file, *uniform<std::size_t>(0, bytes.size() - 1));
  } else {
    fs::remove(file);
  }
  try {
    const CheckpointReader reader(dir);
    for (const std::string& key : paramKeys(c)) RC_ASSERT(sameBits(consolidatedValues(reader, key), inputs.at(key).values));
  } catch (const InvalidArgument& e) {
    RC_LOG() << "refused: " << e.what() << "\n";
    return;
  }
  // Only an index byte that carries nothing (whitespace, a writer's rank, a replica id) may load.
  RC_ASSERT(index && action <= 1);
}

}  // namespace
}  // namespace tpsim::props
