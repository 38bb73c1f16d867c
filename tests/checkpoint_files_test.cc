// Tests for tools/lib/checkpoint_files.h on the simulator: a column (with bias), a row (with bias) and an
// embedding saved at one (T, GTP_remat, pad_for_alignment, dtype) and loaded at another, checked
// against values filled by an independent formula; the safetensors bytes; the index; and every
// rejected checkpoint (missing key, shape, dtype, truncated or corrupt file, missing file, a chunk
// written twice or missing), with a failed save leaving the previous checkpoint loadable; hostile
// input: an edited index against its checksum, resealed edits against the files, strict numbers,
// duplicate keys and deep nesting, tilings that are no grid, 250,000 chunks, safetensors holes.
#include "tools/lib/checkpoint_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/embedding.h"
#include "core/gtp.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/placement.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"
#include "tools/lib/output_files.h"

namespace tpsim {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::runRanks;
using Ints = std::vector<std::int64_t>;

constexpr std::int64_t kN = 24, kK = 8, kV = 16, kH = 4;

struct Topology {
  int tp = 1, gtp = 1, pad = 0;
  DType dtype = DType::kFloat32;
};

// The logical value of element (i, j) of each global tensor (distinct, not all exact in bf16).
double value(const std::string& key, std::int64_t i, std::int64_t j) {
  const double base = key == "col.weight" ? 1 : key == "col.bias" ? 2 : key == "row.weight" ? 3 : key == "row.bias" ? 4 : 5;
  return base + 0.001 * double(i * 97 + j) + 1.0 / 3.0;
}

// Saved in `saved`, loaded into `loaded`: each conversion rounds once, to nearest even.
double through(DType saved, DType loaded, double v) {
  char a[8], b[8];
  storeFromDouble(saved, v, a);
  storeFromDouble(loaded, loadAsDouble(saved, a), b);
  return loadAsDouble(loaded, b);
}

// One folder per test (ctest runs them in parallel processes).
std::string tempDir(const std::string& name) {
  std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(test.begin(), test.end(), '/', '_');
  const fs::path p = fs::path(::testing::TempDir()) / ("tpsim_ckpt_" + name + "_" + test);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// One rank's layers and their state dict, built at `topo`, parameters filled (fill = true) with
// value() through the layout Megatron gives them: a column's TP-local rows [t·N/T, ...), a row's
// TP-local columns, each TP-local weight's rows padded and split over the GTP_remat peers.
struct Layers {
  std::unique_ptr<ColumnParallelLinear> col;
  std::unique_ptr<RowParallelLinear> row;
  std::unique_ptr<VocabParallelEmbedding> emb;
  ShardedStateDict stateDict;
  std::map<std::string, Parameter*> params;
};

Ints dims(const Shape& s) {
  Ints out;
  for (int i = 0; i < s.rank(); ++i) out.push_back(s[i]);
  return out;
}

// The expected contents of parameter `key` on TP rank t, GTP_remat rank g, for data shape `shape`.
std::vector<double> expected(const std::string& key, const Ints& shape, int T, int t, int g, DType saved, DType loaded) {
  const std::int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
  std::vector<double> out;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t r = g * rows + i;  // the row within the TP-local (padded) tensor
      double v = 0;
      if (key == "col.weight" && r < kN / T) v = value(key, t * kN / T + r, j);
      if (key == "emb.weight" && r < kV / T) v = value(key, t * kV / T + r, j);
      if (key == "row.weight" && r < kN) v = value(key, r, t * kK / T + j);
      if (key == "col.bias") v = value(key, t * kN / T + i, 0);
      if (key == "row.bias") v = value(key, i, 0);
      out.push_back(v == 0 ? 0 : through(saved, loaded, v));
    }
  return out;
}

Layers build(RankContext& ctx, ProcessGroups& pg, LayerContext& lc, const Topology& topo, bool fill) {
  ModelParallelConfig mp;
  mp.tensorModelParallelSize = topo.tp;
  mp.performInitialization = false;
  mp.paramsDtype = topo.dtype;
  mp.gtpRematSize = topo.gtp;
  mp.gtpPadForAlignment = topo.pad;
  Layers l;
  l.col = std::make_unique<ColumnParallelLinear>(lc, mp, kK, kN, initMethodNormal(0.02));
  l.row = std::make_unique<RowParallelLinear>(lc, mp, kK, kN, initMethodNormal(0.02));
  l.emb = std::make_unique<VocabParallelEmbedding>(lc, mp, kV, kH, initMethodNormal(0.02));
  l.params = {{"col.weight", l.col->weight()}, {"col.bias", l.col->bias()}, {"row.weight", &l.row->weight()},
              {"row.bias", l.row->bias()},     {"emb.weight", &l.emb->weight()}};
  for (ShardedStateDict sd : {shardedStateDict(*l.col, "col.", {}, pg.tp(), &pg.dpCpGtp()),
                              shardedStateDict(*l.row, "row.", {}, pg.tp(), &pg.dpCpGtp()),
                              shardedStateDict(*l.emb, "emb.", {}, pg.tp(), &pg.dpCpGtp())})
    for (ShardedEntry& e : sd) l.stateDict.push_back(std::move(e));
  if (fill) {
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    for (auto& [key, p] : l.params) {
      const Shape s = p->data.shape();
      const Ints shape = dims(s);
      ctx.compute.copy(testing::tensorOf(ctx.compute, topo.dtype, expected(key, shape, topo.tp, t, g, topo.dtype, topo.dtype), s),
                       p->data);
    }
  }
  return l;
}

void onWorld(const Topology& topo, const std::function<void(RankContext&, ProcessGroups&, LayerContext&)>& fn) {
  ParallelSizes s;
  s.world = topo.tp * topo.gtp;
  s.tp = topo.tp;
  s.gtpRemat = topo.gtp;
  const ParallelLayout layout(s);
  runRanks(layout.world(), [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    LayerContext lc{ctx.compute, pg.tp(), nullptr, nullptr, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    fn(ctx, pg, lc);
  });
}

void save(const Topology& topo, const std::string& dir) {
  CheckpointWriter writer;
  onWorld(topo, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, topo, true);
    if (ctx.comm.rank() == 0)
      for (const auto& [key, p] : l.params) writer.describe(parameterPlacement(*p, key, topo.tp, topo.gtp));
    writer.add(ctx.comm.rank(), l.stateDict, ctx.compute);
  });
  writer.commit(dir);
}

// Loads the checkpoint at `topo` and checks every parameter of every rank bitwise.
void loadAndCheck(const Topology& saved, const Topology& topo, const std::string& dir) {
  const CheckpointReader reader(dir);
  onWorld(topo, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, topo, false);
    for (const ShardedEntry& e : l.stateDict) {
      if (const auto* o = std::get_if<ShardedObject>(&e)) {
        reader.checkObject(*o);
        continue;
      }
      const auto& st = std::get<ShardedTensor>(e);
      reader.load(st, l.params.at(st.key)->data, ctx.compute);
    }
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    for (auto& [key, p] : l.params) {
      const Shape s = p->data.shape();
      const Ints shape = dims(s);
      const auto want = expected(key, shape, topo.tp, t, g, saved.dtype, topo.dtype);
      const auto got = testing::valuesOf(ctx.compute, p->data);
      for (std::size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(got[i], want[i]) << key << " on rank " << ctx.comm.rank() << ", mismatch at index " << i;
    }
  });
}

class Reshard : public ::testing::TestWithParam<std::tuple<Topology, Topology>> {};

TEST_P(Reshard, LoadsBitwiseWithZeroPadRows) {
  const auto& [from, to] = GetParam();
  const std::string dir = tempDir("reshard");
  save(from, dir);
  loadAndCheck(from, to, dir);
}

INSTANTIATE_TEST_SUITE_P(
    Topologies, Reshard,
    ::testing::Values(
        std::tuple{Topology{4, 2, 16}, Topology{2, 1, 0}},  // the README's example
        std::tuple{Topology{4, 2, 16}, Topology{4, 2, 16}}, std::tuple{Topology{2, 1, 0}, Topology{4, 2, 16}},
        std::tuple{Topology{1, 1, 0}, Topology{2, 4, 4}}, std::tuple{Topology{2, 2, 8}, Topology{4, 2, 3}},
        std::tuple{Topology{2, 2, 0}, Topology{1, 4, 5}},
        std::tuple{Topology{4, 2, 16, DType::kFloat32}, Topology{2, 2, 8, DType::kBFloat16}},
        std::tuple{Topology{2, 1, 0, DType::kBFloat16}, Topology{4, 2, 16, DType::kFloat32}},
        std::tuple{Topology{2, 2, 16, DType::kFloat16}, Topology{1, 1, 0, DType::kFloat16}}),
    [](const ::testing::TestParamInfo<Reshard::ParamType>& info) {
      auto name = [](const Topology& t) {
        return detail::concat("T", t.tp, "G", t.gtp, "a", t.pad, dtypeName(t.dtype));
      };
      return name(std::get<0>(info.param)) + "_to_" + name(std::get<1>(info.param));
    });

std::vector<char> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void writeFile(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

TEST(CheckpointFiles, SafetensorsLayoutIndexAndNoPadRows) {
  const std::string dir = tempDir("layout");
  save(Topology{4, 2, 16}, dir);
  const auto index = nlohmann::json::parse(readFile(dir + "/index.json"));
  // col.weight: TP-local 6 rows padded to 32 (a multiple of 16·2), 16 rows per shard; only rows
  // [0, 6) of each TP slice are real, all in the g = 0 shard: g = 1's chunks store nothing.
  const auto& col = index["tensors"]["col.weight"];
  EXPECT_EQ(col["dtype"], "F32");
  EXPECT_EQ(col["global_shape"], (Ints{kN, kK}));
  EXPECT_EQ(col["saved_global_shape"], (Ints{4 * 32, kK}));
  ASSERT_EQ(col["chunks"].size(), 8u);
  std::int64_t stored = 0;
  for (const auto& c : col["chunks"]) {
    EXPECT_EQ(c["local_shape"], (Ints{16, kK}));
    EXPECT_EQ(c["gtp_padding"]["pad_length"], 26);
    stored += c["stored_shape"][0].get<std::int64_t>();
  }
  EXPECT_EQ(stored, kN);
  // The row bias is replicated over every rank: one chunk, written by rank 0.
  ASSERT_EQ(index["tensors"]["row.bias"]["chunks"].size(), 1u);
  EXPECT_EQ(index["tensors"]["row.bias"]["chunks"][0]["writer"], 0);
  EXPECT_TRUE(index["objects"].contains("col._extra_state"));
  // The file: 8-byte little-endian length, JSON, data offsets that tile the rest.
  const auto bytes = readFile(dir + "/rank-00000.safetensors");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
  const auto& t = header["col.weight@0,0"];
  EXPECT_EQ(t["dtype"], "F32");
  EXPECT_EQ(t["shape"], (Ints{6, kK}));
  const auto off = t["data_offsets"].get<std::vector<std::uint64_t>>();
  float first;
  std::memcpy(&first, bytes.data() + 8 + n + off[0], 4);
  EXPECT_EQ(first, float(value("col.weight", 0, 0)));
}

TEST(CheckpointFiles, ConsolidatedIsTheLogicalTensor) {
  const std::string dir = tempDir("consolidated");
  save(Topology{2, 2, 16, DType::kBFloat16}, dir);
  const CheckpointReader reader(dir);
  const auto bytes = reader.consolidated("row.weight");
  ASSERT_EQ(bytes.size(), std::size_t(kN * kK * 2));
  for (std::int64_t i = 0; i < kN; ++i)
    for (std::int64_t j = 0; j < kK; ++j)
      ASSERT_EQ(loadAsDouble(DType::kBFloat16, bytes.data() + 2 * (i * kK + j)),
                through(DType::kBFloat16, DType::kBFloat16, value("row.weight", i, j)))
          << "mismatch at (" << i << ", " << j << ")";
}

// A box read alone holds the consolidated tensor's bytes there, wherever it falls against the saved
// chunks and their pad rows: runs of 3 rows, single elements, a box cut on every axis, an empty one.
// So does each read through one cache, from key to key, which then holds the chunks of the last box
// read: none after the empty one.
TEST(CheckpointFiles, ABoxReadAloneHoldsTheConsolidatedBytesThere) {
  const std::string dir = tempDir("boxes");
  save(Topology{4, 2, 16}, dir);
  const CheckpointReader reader(dir);
  CheckpointReader::ChunkCache cache;
  for (const auto& [key, k] : reader.keys()) {
    const std::vector<char> all = reader.consolidated(key);
    const std::vector<std::int64_t>& shape = k.globalShape;
    const std::size_t rank = shape.size(), size = dtypeSize(k.dtype);
    std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> boxes;  // begin, extent
    for (std::int64_t row = 0; row < shape[0]; row += 3) {
      std::vector<std::int64_t> begin(rank, 0), extent = shape;
      begin[0] = row;
      extent[0] = std::min<std::int64_t>(3, shape[0] - row);
      boxes.push_back({begin, extent});
    }
    boxes.push_back({std::vector<std::int64_t>(rank, 0), std::vector<std::int64_t>(rank, 1)});
    std::vector<std::int64_t> inner(rank, 1), innerExtent = shape;
    for (std::size_t a = 0; a < rank; ++a) innerExtent[a] = std::max<std::int64_t>(shape[a] - 2, 0);
    boxes.push_back({inner, innerExtent});
    std::vector<std::int64_t> none = shape;
    none[0] = 0;
    boxes.push_back({std::vector<std::int64_t>(rank, 0), none});
    for (const auto& [begin, extent] : boxes) {
      std::int64_t n = 1;
      for (std::int64_t e : extent) n *= e;
      std::vector<char> got(std::size_t(n) * size), cached(got.size());
      reader.readBox(key, begin, extent, got.data());
      reader.readBox(key, begin, extent, cached.data(), &cache);
      ASSERT_EQ(cache.key, key);
      ASSERT_EQ(cache.chunks.empty(), n == 0) << key << ": box at " << shapeText(begin) << " of " << shapeText(extent);
      ASSERT_EQ(got, cached) << key << ": box at " << shapeText(begin) << " of " << shapeText(extent);
      std::vector<std::int64_t> at(rank, 0);  // within the box
      for (std::int64_t i = 0; i < n; ++i) {
        std::int64_t flat = 0;
        for (std::size_t a = 0; a < rank; ++a) flat = flat * shape[a] + begin[a] + at[a];
        ASSERT_EQ(std::memcmp(got.data() + std::size_t(i) * size, all.data() + std::size_t(flat) * size, size), 0)
            << key << ": box at " << shapeText(begin) << " of " << shapeText(extent) << ", element " << i;
        for (std::size_t a = rank; a-- > 0 && ++at[a] == extent[a];) at[a] = 0;
      }
    }
  }
}

// A reader holds none of the data: it reads each chunk when asked, checked against its checksum
// again. A byte changed in place after the check is refused; a file replaced (as a save replaces
// it) is still read as it was checked, from the file the reader opened.
TEST(CheckpointFiles, AReadAfterTheCheckTakesTheCheckedBytesOrRefuses) {
  const std::string dir = tempDir("changed");
  save(Topology{2, 1, 0}, dir);
  const CheckpointReader reader(dir);
  const std::string key = reader.keys().begin()->first;
  const std::vector<char> before = reader.consolidated(key);
  const CheckpointChunk& chunk = reader.key(key).chunks.front();
  const std::string file = dir + "/" + chunk.file;
  std::ifstream in(file, std::ios::binary);
  const std::string checked((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto replace = [&](const std::string& bytes) {
    std::ofstream(file + ".new", std::ios::binary) << bytes;
    ASSERT_EQ(std::rename((file + ".new").c_str(), file.c_str()), 0);
  };
  std::string other = checked;
  for (char& b : other) b = char(b ^ 0x40);
  replace(other);
  EXPECT_EQ(reader.consolidated(key), before);
  replace(checked);
  const CheckpointReader again(dir);
  std::FILE* f = std::fopen(file.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::uint64_t headerBytes = 0;  // the chunk's first byte follows the 8-byte length and the header
  ASSERT_EQ(std::fread(&headerBytes, 8, 1, f), 1u);
  const long first = long(8 + headerBytes + again.key(key).chunks.front().dataBegin);
  std::fseek(f, first, SEEK_SET);
  const int byte = std::fgetc(f);
  std::fseek(f, first, SEEK_SET);
  std::fputc(byte ^ 0x01, f);
  std::fclose(f);
  const std::string error = testing::errorOf([&] { again.consolidated(key); });
  EXPECT_NE(error.find("expected data checksum"), std::string::npos) << error;
  EXPECT_NE(error.find("the data is corrupt, or changed after it was checked"), std::string::npos) << error;
}

std::string loadError(const std::string& dir, const Topology& topo = {2, 1, 0}) {
  try {
    loadAndCheck(topo, topo, dir);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(CheckpointErrors, ShapeKeyAndDtypeMismatchNameKeyFileAndBothValues) {
  const std::string dir = tempDir("mismatch");
  save(Topology{2, 1, 0}, dir);
  const CheckpointReader reader(dir);
  onWorld(Topology{2, 1, 0}, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, Topology{2, 1, 0}, false);
    auto st = std::get<ShardedTensor>(l.stateDict[0]);  // col.weight
    ShardedTensor wrong = st;
    wrong.globalShape[0] += 2;
    try {
      reader.load(wrong, l.col->weight()->data, ctx.compute);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("key 'col.weight'"));
      EXPECT_THAT(e.what(), HasSubstr("index.json"));
      EXPECT_THAT(e.what(), HasSubstr("(26, 8)"));
      EXPECT_THAT(e.what(), HasSubstr("(24, 8)"));
    }
    wrong = st;
    wrong.key = "col.nothing";
    EXPECT_THROW(reader.load(wrong, l.col->weight()->data, ctx.compute), InvalidArgument);
    Tensor ids = ctx.compute.zeros(st.data.shape(), DType::kInt64);
    wrong = st;
    wrong.dtype = DType::kInt64;
    try {
      reader.load(wrong, ids, ctx.compute);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("expected dtype int64"));
      EXPECT_THAT(e.what(), HasSubstr("got fp32"));
    }
  });
}

TEST(CheckpointErrors, TruncatedCorruptOrMissingFilesAreRefused) {
  const std::string dir = tempDir("corrupt");
  save(Topology{2, 2, 8}, dir);
  const std::string file = dir + "/rank-00001.safetensors";
  const auto good = readFile(file);
  auto expectError = [&](const std::vector<char>& bytes, const std::string& what) {
    writeFile(file, bytes);
    EXPECT_THAT(loadError(dir), HasSubstr(what));
  };
  expectError({good.begin(), good.end() - 3}, "truncated");
  std::vector<char> bad = good;
  bad[2] = 0x7f;  // header length far beyond the file
  expectError(bad, "header length");
  bad = good;
  bad[20] ^= 0x01;
  expectError(bad, "header is corrupt");
  bad = good;
  bad[bad.size() - 1] ^= 0x40;
  expectError(bad, "data is corrupt");
  fs::remove(file);
  EXPECT_THAT(loadError(dir), HasSubstr("no such file"));
  writeFile(file, good);
  EXPECT_EQ(loadError(dir), "no error");
  fs::remove(dir + "/index.json");
  EXPECT_THAT(loadError(dir), HasSubstr("index"));
}

// The index alone gives the keys, their shapes and the files, read before any of the files: what a
// load sizes its work by. The reader made from it reads and checks them.
TEST(CheckpointIndex, ReadsNoFileAndTheReaderMadeFromItChecksThem) {
  const std::string dir = tempDir("index-only");
  save(Topology{2, 2, 8}, dir);
  const std::string file = dir + "/rank-00001.safetensors";
  writeFile(file, std::vector<char>(fs::file_size(file), 0));  // garbage of the index's size
  CheckpointIndex index(dir);
  EXPECT_EQ(index.key("col.weight").globalShape, (Ints{kN, kK}));
  EXPECT_EQ(index.paths().front(), dir + "/index.json");
  EXPECT_NE(std::find(index.paths().begin(), index.paths().end(), file), index.paths().end());
  try {
    const CheckpointReader reader(std::move(index));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank-00001.safetensors: expected header checksum"));
  }
}

// The index records each parameter's placement, and that placement puts every element of every
// rank's shard where expected() (Megatron's layout, written out independently) has it.
TEST(CheckpointFiles, IndexRecordsPlacementsThatAgreeWithTheShards) {
  const Topology topo{4, 2, 16};
  const std::string dir = tempDir("placement");
  save(topo, dir);
  const CheckpointReader reader(dir);
  const auto index = nlohmann::json::parse(readFile(dir + "/index.json"));
  EXPECT_EQ(index["tensors"]["col.weight"]["placement"]["tp"]["kind"], "shard");
  EXPECT_EQ(index["tensors"]["col.weight"]["placement"]["gtp_remat"]["pad_length"], 26);
  EXPECT_EQ(index["tensors"]["row.bias"]["placement"]["tp"]["kind"], "replicate");
  std::mutex mu;
  int checked = 0;
  onWorld(topo, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, topo, false);
    const int t = pg.tp().rank(), g = pg.gtpRemat().rank();
    for (const auto& [key, p] : l.params) {
      const TensorPlacement placement = parameterPlacement(*p, key, topo.tp, topo.gtp);
      EXPECT_EQ(reader.key(key).placement, placementText(placement)) << key;
      const Ints shape = dims(p->data.shape());
      const auto want = expected(key, shape, topo.tp, t, g, topo.dtype, topo.dtype);
      const std::int64_t cols = shape.size() > 1 ? shape[1] : 1;
      std::int64_t real = 0;
      for (const Block& b : blocksOf(placement, t, g)) {
        if (b.pad) continue;
        for (std::int64_t i = 0; i < b.global[0].size(); ++i)
          for (std::int64_t j = 0; j < (shape.size() > 1 ? b.global[1].size() : 1); ++j) {
            const std::int64_t local = (b.local[0] + i) * cols + (shape.size() > 1 ? b.local[1] + j : 0);
            const double v = through(topo.dtype, topo.dtype,
                                     value(key, b.global[0].begin + i, shape.size() > 1 ? b.global[1].begin + j : 0));
            ASSERT_EQ(want[std::size_t(local)], v) << key << " (t=" << t << ", g=" << g << ") local " << local;
            ++real;
          }
      }
      std::lock_guard<std::mutex> lock(mu);
      checked += real > 0;
    }
  });
  EXPECT_GT(checked, 0);
}

TEST(CheckpointErrors, MalformedIndexIsRefused) {
  const std::string dir = tempDir("index");
  save(Topology{2, 1, 0}, dir);
  auto text = readFile(dir + "/index.json");
  text.resize(text.size() / 2);
  writeFile(dir + "/index.json", text);
  EXPECT_THAT(loadError(dir), HasSubstr("expected a well-formed tpsim checkpoint index"));
}

// A world spread over processes saves through process 0's writer, the others' chunks added packed:
// the same files, byte for byte, as one writer's.
TEST(CheckpointSave, PackedWritersOfRankGroupsWriteTheFilesOfOneWriter) {
  const Topology topo{4, 3, 16};
  const std::string whole = tempDir("whole"), spread = tempDir("spread");
  save(topo, whole);
  std::vector<std::unique_ptr<CheckpointWriter>> writers;  // one per block of 4 ranks
  for (int p = 0; p < 3; ++p) writers.push_back(std::make_unique<CheckpointWriter>());
  onWorld(topo, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, topo, true);
    CheckpointWriter& mine = *writers[std::size_t(ctx.comm.rank() / 4)];
    if (ctx.comm.rank() == 0)
      for (const auto& [key, p] : l.params) mine.describe(parameterPlacement(*p, key, topo.tp, topo.gtp));
    mine.add(ctx.comm.rank(), l.stateDict, ctx.compute);
  });
  writers[0]->addPacked(writers[2]->packed());
  writers[0]->addPacked(writers[1]->packed());
  writers[0]->commit(spread);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(whole)) names.push_back(e.path().filename().string());
  ASSERT_EQ(names.size(), 13u);  // a file per rank and the index
  for (const std::string& name : names)
    EXPECT_TRUE(readFile(spread + "/" + name) == readFile(whole + "/" + name)) << name << " differs";
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(spread), std::filesystem::directory_iterator{}), 13);
}

TEST(CheckpointErrors, ChunkWrittenTwiceOrMissingAndTheOldCheckpointSurvives) {
  const std::string dir = tempDir("twice");
  save(Topology{2, 1, 0}, dir);
  // Both ranks claim to be the main replica of the replicated row bias.
  CheckpointWriter twice;
  onWorld(Topology{2, 1, 0}, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, Topology{2, 1, 0}, true);
    for (ShardedEntry& e : l.stateDict)
      if (auto* st = std::get_if<ShardedTensor>(&e); st && st->key == "row.bias") st->replicaId = {0, 0, 0};
    twice.add(ctx.comm.rank(), l.stateDict, ctx.compute);
  });
  try {
    twice.commit(dir);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("key 'row.bias': expected each chunk written once, got ranks 0 and 1"));
  }
  EXPECT_EQ(loadError(dir), "no error");  // nothing was written
  // Rank 1 never contributes: its column chunks are missing.
  CheckpointWriter partial;
  onWorld(Topology{2, 1, 0}, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, Topology{2, 1, 0}, true);
    if (ctx.comm.rank() == 0) partial.add(0, l.stateDict, ctx.compute);
  });
  try {
    partial.commit(dir);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("a chunk is missing"));
  }
  EXPECT_EQ(loadError(dir), "no error");
}

// What a load of `dir` sees: every key's dtype and consolidated bytes, or the load's error.
std::string loadedState(const std::string& dir) {
  try {
    const CheckpointReader reader(dir);
    std::string state;
    for (const auto& [key, k] : reader.keys()) {
      const std::vector<char> bytes = reader.consolidated(key);
      state += key + " " + dtypeName(k.dtype) + " " + std::string(bytes.begin(), bytes.end()) + "\n";
    }
    return state;
  } catch (const InvalidArgument& e) {
    return std::string("error: ") + e.what();
  }
}

// A save over an older, larger checkpoint fails after each of its steps in turn (each file
// written, the old index removed, each file renamed, each stale file removed): a load then sees the
// old checkpoint bitwise before the first rename, no index from then until the new index lands,
// and the new checkpoint afterwards; never a mix, and no temporary is left.
TEST(CheckpointSave, FailingAfterAnyStepLeavesTheOldCheckpointOrNone) {
  const Topology oldTopo{4, 2, 16}, newTopo{2, 1, 0, DType::kBFloat16};
  const std::string old = tempDir("old");
  save(oldTopo, old);
  const std::string newer = tempDir("new");
  CheckpointWriter writer;
  onWorld(newTopo, [&](RankContext& ctx, ProcessGroups& pg, LayerContext& lc) {
    Layers l = build(ctx, pg, lc, newTopo, true);
    writer.add(ctx.comm.rank(), l.stateDict, ctx.compute);
  });
  std::vector<std::pair<tools::OutputFiles::Step, std::string>> steps;
  tools::OutputFiles::setStepHook([&](tools::OutputFiles::Step step, const std::string& path) {
    steps.push_back({step, fs::path(path).filename().string()});
  });
  writer.commit(newer);
  steps.clear();
  const std::string dir = tempDir("interrupted");
  fs::remove_all(dir);
  fs::copy(old, dir);
  writer.commit(dir);  // every step of a save over the old checkpoint, none failing
  tools::OutputFiles::setStepHook({});
  const std::string oldState = loadedState(old), newState = loadedState(newer);
  ASSERT_NE(oldState, newState);
  ASSERT_THAT(oldState, ::testing::Not(::testing::StartsWith("error")));
  EXPECT_EQ(loadedState(dir), newState);
  EXPECT_EQ(steps.size(), 3u + 1 + 3 + 6);  // 2 files and the index written, the old index removed,
                                            // the 3 renamed, 6 stale files of ranks 2-7 removed
  using Step = tools::OutputFiles::Step;
  bool renamed = false, indexLanded = false;
  for (std::size_t failAt = 0; failAt < steps.size(); ++failAt) {
    fs::remove_all(dir);
    fs::copy(old, dir);
    std::size_t step = 0;
    tools::OutputFiles::setStepHook([&](Step, const std::string&) {
      if (step++ == failAt) throw InvalidArgument("interrupted");
    });
    EXPECT_THROW(writer.commit(dir), InvalidArgument);
    tools::OutputFiles::setStepHook({});
    renamed = renamed || steps[failAt].first == Step::kRenamed;
    indexLanded = indexLanded || (steps[failAt].first == Step::kRenamed && steps[failAt].second == "index.json");
    const std::string state = loadedState(dir);
    if (indexLanded) {
      EXPECT_EQ(state, newState) << "failing after step " << failAt;
    } else if (renamed || steps[failAt].first == Step::kRemoved) {
      EXPECT_THAT(state, HasSubstr("index.json: expected a readable index (written last by a complete save), got "
                                   "no such file"))
          << "failing after step " << failAt;
    } else {
      EXPECT_EQ(state, oldState) << "failing after step " << failAt;
    }
    for (const auto& e : fs::directory_iterator(dir))
      EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr(".partial"))) << "failing after step " << failAt;
  }
  EXPECT_TRUE(indexLanded);
}

// ---- Hostile input: the index's checksum, strict fields, chunks against their headers, tiling ----

std::string readError(const std::string& dir) {
  try {
    const CheckpointReader reader(dir);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

// The index of `dir` edited by `edit`, then sealed again: what a user who knows the format writes.
void editIndex(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto index = nlohmann::json::parse(readFile(dir + "/index.json"));
  edit(index);
  const std::string sealed = sealCheckpointIndex(index.dump());
  writeFile(dir + "/index.json", {sealed.begin(), sealed.end()});
}

std::string hex16(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

TEST(CheckpointIndex, ChecksumIsFnv1aOfTheCanonicalContentAndAnyEditIsRefused) {
  const std::string dir = tempDir("checksum");
  save(Topology{2, 2, 8}, dir);
  auto index = nlohmann::json::parse(readFile(dir + "/index.json"));
  const std::string checksum = index["index_fnv1a64"];
  index.erase("index_fnv1a64");
  const std::string canonical = index.dump();  // compact, keys sorted
  EXPECT_EQ(checksum, hex16(fnv1a64(canonical.data(), canonical.size())));
  // Layout is no content: the same index written compactly loads.
  index["index_fnv1a64"] = checksum;
  const std::string compact = index.dump();
  writeFile(dir + "/index.json", {compact.begin(), compact.end()});
  EXPECT_EQ(loadError(dir, {2, 2, 8}), "no error");
  // A field that changes no number still changes the content.
  index["tensors"]["row.bias"]["chunks"][0]["replica_id"] = {0};
  const std::string edited = index.dump();
  writeFile(dir + "/index.json", {edited.begin(), edited.end()});
  EXPECT_THAT(readError(dir), HasSubstr("index.json: expected index checksum " + checksum + " (its index_fnv1a64), got "));
  EXPECT_THAT(readError(dir), HasSubstr("; the index is corrupt or was edited"));
  editIndex(dir, [](nlohmann::json&) {});
  EXPECT_EQ(loadError(dir, {2, 2, 8}), "no error");
}

// Sealed again, an edit is still refused wherever it contradicts the files or the rest of the index.
TEST(CheckpointIndex, ResealedEditsStillContradictTheFilesOrTheIndex) {
  const std::string good = tempDir("resealed-good"), dir = tempDir("resealed");
  save(Topology{4, 2, 16}, good);
  const auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    fs::remove_all(dir);
    fs::copy(good, dir);
    editIndex(dir, edit);
    return readError(dir);
  };
  const auto chunk = [](nlohmann::json& index, const std::string& key, int i) -> nlohmann::json& {
    return index["tensors"][key]["chunks"][i];
  };
  EXPECT_THAT(refused([&](auto& index) { std::swap(chunk(index, "col.bias", 0)["global_offset"], chunk(index, "col.bias", 1)["global_offset"]); }),
              HasSubstr("key 'col.bias' chunk 'col.bias@0' in rank-00000.safetensors: expected tensor name 'col.bias@6' "
                        "(its key and global offset), got 'col.bias@0'"));
  // The last chunk of col.weight holds only pad rows (of TP slice 3): read as one padded block of 104
  // pad rows, it would still leave the logical (24, 8) and store nothing, but contradicts the others.
  EXPECT_THAT(refused([&](auto& index) {
                for (auto& c : index["tensors"]["col.weight"]["chunks"])
                  if (c["global_offset"] == Ints{112, 0}) c["gtp_padding"] = {{"tp_axis", 0}, {"tp_size", 1}, {"pad_length", 104}};
              }),
              HasSubstr("key 'col.weight': expected every chunk to share one padding record, padded_axis 0, gtp_padding "
                        "(tp_axis 0, tp_size 4, pad_length 26), got padded_axis 0, gtp_padding (tp_axis 0, tp_size 1, "
                        "pad_length 104) for the chunk at (112, 0)"));
  const auto rowBias = nlohmann::json::parse(readFile(good + "/index.json"))["tensors"]["row.bias"]["chunks"][0]["data_offsets"];
  const std::uint64_t begin = rowBias[0], end = rowBias[1];
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "row.bias", 0)["data_offsets"][1] = end - 8; }),
              HasSubstr(detail::concat("expected F32 (24,) at data_offsets [", begin, ", ", end - 8, ") (the index's), got F32 "
                                       "(24,) at [", begin, ", ", end, ") in the file")));
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "row.bias", 0)["writer"] = 3; }),
              HasSubstr("expected writer 0 (the writer of 'rank-00000.safetensors'), got 3"));
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "row.bias", 0)["replica_id"] = {0, 1, 0}; }),
              HasSubstr("replica_id: expected a main replica's (all zeros: only they are written), got (0, 1, 0)"));
  EXPECT_THAT(refused([&](auto& index) { index["tensors"]["col.bias"]["chunks"].erase(1); }),
              HasSubstr("key 'col.bias': expected chunks covering all 24 elements of the saved tensor (24,), got 18 with "
                        "element (6,) in none; a chunk is missing"));
  EXPECT_THAT(refused([&](auto& index) { index["tensors"]["col.bias"]["chunks"] = nlohmann::json::array(); }),
              HasSubstr("key 'col.bias': chunks: expected at least one chunk, got none"));
  // Numbers are integers in range: no fraction truncated, nothing wrapped in an int.
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "col.weight", 0)["local_shape"][1] = 8.0; }),
              HasSubstr("local_shape: expected an integer in [0, 281474976710655], got 8.0"));
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "col.weight", 0)["gtp_padding"]["tp_size"] = 4294967300; }),
              HasSubstr("tp_size: expected an integer in [1, 2147483647], got 4294967300"));
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "col.weight", 0)["gtp_padding"]["tp_axis"] = 2; }),
              HasSubstr("tp_axis: expected an integer in [0, 1], got 2"));
  EXPECT_THAT(refused([&](auto& index) { index["files"]["rank-00000.safetensors"]["writer"] = "0"; }),
              HasSubstr("writer: expected an integer in [0, 2147483647], got '0'"));
  EXPECT_THAT(refused([&](auto& index) { chunk(index, "col.weight", 0)["global_offset"] = nlohmann::json::array({0, 0, 0, 0, 0, 0, 0}); }),
              HasSubstr("global_offset: expected an array of at most 6 dims, got an array of 7 elements"));
  EXPECT_THAT(refused([&](auto& index) { index["files"] = nlohmann::json::array(); }),
              HasSubstr("files: expected an object, got an array of 0 elements"));
  EXPECT_THAT(refused([&](auto& index) { index["objects"]["col._extra_state"]["offsets"][0] = {5}; }),
              HasSubstr("offsets: expected cells of the grid (1,), got (5,)"));
}

TEST(CheckpointIndex, DuplicateKeysAndDeepNestingAreRefusedBeforeParsingAndNeverDumped) {
  const std::string dir = tempDir("parse");
  save(Topology{2, 1, 0}, dir);
  const std::string text = sealCheckpointIndex(std::string(readFile(dir + "/index.json").data(), readFile(dir + "/index.json").size()));
  std::string twice = text;
  twice.insert(twice.find("\"format\""), "\"format\": \"tpsim-checkpoint\", ");
  writeFile(dir + "/index.json", {twice.begin(), twice.end()});
  EXPECT_THAT(readError(dir), HasSubstr("index.json: expected a well-formed tpsim checkpoint index with each key once in an "
                                        "object, got 'format' twice"));
  const std::string deep = "{\"format\": " + std::string(1000000, '[') + std::string(1000000, ']') + "}";
  writeFile(dir + "/index.json", {deep.begin(), deep.end()});
  EXPECT_THAT(readError(dir), HasSubstr("nested at most 16 deep, got deeper"));
  EXPECT_THROW(sealCheckpointIndex(deep), InvalidArgument);
  // A long, escaping string is shown as a short excerpt.
  const std::string escape = "{\"format\": \"\\u001b[31m" + std::string(100000, 'x') + "\", \"version\": 2}";
  writeFile(dir + "/index.json", {escape.begin(), escape.end()});
  const std::string error = readError(dir);
  EXPECT_THAT(error, HasSubstr("got '\\x1b[31mxxx"));
  EXPECT_LT(error.size(), 400u);
}

// One key "x" of `shape` in one file, a chunk per (offset, shape), F32 values 0, 1, 2, ... in file
// order, with the index sealed as docs/checkpoints.md defines it (written compactly: a quarter of a
// million chunks fit in the 64 MiB a load reads).
void writeHandMade(const std::string& dir, const Ints& shape, const std::vector<std::pair<Ints, Ints>>& chunks) {
  std::vector<SafetensorsEntry> entries;
  auto records = nlohmann::json::array();
  std::uint64_t at = 0;
  float next = 0;
  for (const auto& [offset, local] : chunks) {
    std::string name = "x@";
    for (std::size_t i = 0; i < offset.size(); ++i) name += (i ? "," : "") + std::to_string(offset[i]);
    std::int64_t n = 1;
    for (std::int64_t d : local) n *= d;
    std::vector<char> bytes(std::size_t(n) * 4);
    for (std::int64_t i = 0; i < n; ++i, ++next) std::memcpy(bytes.data() + 4 * i, &next, 4);
    records.push_back({{"file", "rank-00000.safetensors"}, {"tensor", name}, {"writer", 0}, {"global_offset", offset},
                       {"local_shape", local}, {"stored_shape", local}, {"padded_axis", 0}, {"gtp_padding", nullptr},
                       {"replica_id", {0}}, {"fnv1a64", hex16(fnv1a64(bytes.data(), bytes.size()))},
                       {"data_offsets", {at, at + bytes.size()}}});
    at += bytes.size();
    entries.push_back({name, DType::kFloat32, local, std::move(bytes)});
  }
  const std::string file = safetensorsBytes(entries);
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  nlohmann::json index{{"format", "tpsim-checkpoint"}, {"version", 2}, {"objects", nlohmann::json::object()},
                       {"files", {{"rank-00000.safetensors", {{"writer", 0}, {"size", file.size()},
                                                              {"header_fnv1a64", hex16(fnv1a64(file.data(), 8 + n))}}}}},
                       {"tensors", {{"x", {{"dtype", "F32"}, {"global_shape", shape}, {"saved_global_shape", shape},
                                           {"chunks", records}}}}}};
  const std::string canonical = index.dump();
  index["index_fnv1a64"] = hex16(fnv1a64(canonical.data(), canonical.size()));
  const std::string text = index.dump();
  writeFile(dir + "/rank-00000.safetensors", {file.begin(), file.end()});
  writeFile(dir + "/index.json", {text.begin(), text.end()});
}

// Tilings that are no grid load; an overlap or a hole is named, where the total count would not
// tell (the overlap of (0, 1) and the hole at (1, 1) cancel out).
TEST(CheckpointTiling, AnyExactTilingLoadsAndTheFirstOverlapOrHoleIsNamed) {
  const std::string dir = tempDir("tiling");
  writeHandMade(dir, {2, 4}, {{{0, 0}, {1, 2}}, {{0, 2}, {1, 2}}, {{1, 0}, {1, 1}}, {{1, 1}, {1, 2}}, {{1, 3}, {1, 1}}});
  const CheckpointReader bricks(dir);
  const std::vector<char> all = bricks.consolidated("x");
  const std::vector<float> want = {0, 1, 2, 3, 4, 5, 6, 7};
  ASSERT_EQ(all.size(), want.size() * 4);
  EXPECT_EQ(std::memcmp(all.data(), want.data(), all.size()), 0);
  fs::remove_all(dir);
  fs::create_directories(dir);
  writeHandMade(dir, {2, 2}, {{{0, 0}, {1, 2}}, {{0, 1}, {1, 1}}, {{1, 0}, {1, 1}}});
  EXPECT_THAT(readError(dir), HasSubstr("key 'x': expected each chunk written once, got ranks 0 and 0 both writing "
                                        "offsets (0, 0) and (0, 1) of (2, 2) (two main replicas)"));
  fs::remove_all(dir);
  fs::create_directories(dir);
  writeHandMade(dir, {2, 2}, {{{0, 0}, {1, 2}}, {{1, 1}, {1, 1}}});
  EXPECT_THAT(readError(dir), HasSubstr("key 'x': expected chunks covering all 4 elements of the saved tensor (2, 2), got "
                                        "3 with element (1, 0) in none; a chunk is missing"));
  // A scalar is no parameter of a layer: refused, so that every box read has an axis.
  fs::remove_all(dir);
  fs::create_directories(dir);
  writeHandMade(dir, {}, {{{}, {}}});
  EXPECT_THAT(readError(dir), HasSubstr("key 'x': expected global shapes of one rank >= 1, got () and ()"));
}

// The tiling is sorted and swept, not compared pair by pair: 250,000 chunks, some 31 billion pairs,
// read in seconds.
TEST(CheckpointTiling, AQuarterMillionChunksAreReadInSeconds) {
  const std::string dir = tempDir("many");
  constexpr std::int64_t kChunks = 250000;
  std::vector<std::pair<Ints, Ints>> chunks;
  for (std::int64_t i = 0; i < kChunks; ++i) chunks.push_back({{i}, {1}});
  writeHandMade(dir, {kChunks}, chunks);
  const auto start = std::chrono::steady_clock::now();
  const CheckpointReader reader(dir);
  // So is the chunk cache's bound, which a load sizes its memory by: one chunk of 4 bytes meets
  // each row, so boxes of 1000 rows hold at most two such and those between.
  EXPECT_EQ(CheckpointIndex(dir).chunkCacheBytes(1000), 2 * 4 + 1000 * 4);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(reader.key("x").chunks.size(), std::size_t(kChunks));
  EXPECT_LT(seconds, 60) << "pairwise checks take minutes";
}

// The chunk cache holds the chunks a box of rows meets: those that share a row with the chunk at
// either end of it and those between, at most the key's. Rows cut into chunks: one chunk a row;
// columns cut into chunks: every chunk meets every row, so the whole key.
TEST(CheckpointTiling, TheChunkCacheBoundIsTheChunksABoxOfRowsMeets) {
  const std::string dir = tempDir("cache");
  std::vector<std::pair<Ints, Ints>> rows;
  for (std::int64_t r = 0; r < 8; ++r) rows.push_back({{r, 0}, {1, 4}});  // 16 bytes each
  writeHandMade(dir, {8, 4}, rows);
  EXPECT_EQ(CheckpointIndex(dir).chunkCacheBytes(4), 2 * 16 + 4 * 4);
  EXPECT_EQ(CheckpointIndex(dir).chunkCacheBytes(1000), 8 * 16);
  fs::remove_all(dir);
  fs::create_directories(dir);
  writeHandMade(dir, {8, 4}, {{{0, 0}, {8, 2}}, {{0, 2}, {8, 2}}});  // 64 bytes each
  EXPECT_EQ(CheckpointIndex(dir).chunkCacheBytes(4), 2 * 64);
  EXPECT_EQ(CheckpointIndex(dir).largestChunkBytes(), 64u);
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Rows [0, 4) in two chunks of columns (32 bytes each), then a chunk a row: the rows of the first
  // two meet both, the widest band.
  std::vector<std::pair<Ints, Ints>> mixed = {{{0, 0}, {4, 2}}, {{0, 2}, {4, 2}}};
  for (std::int64_t r = 4; r < 16; ++r) mixed.push_back({{r, 0}, {1, 4}});
  writeHandMade(dir, {16, 4}, mixed);
  EXPECT_EQ(CheckpointIndex(dir).chunkCacheBytes(1), 2 * 64 + 4);
}

// A safetensors header is read as strictly as the index; its data bytes are all indexed.
std::vector<char> withHeader(const std::string& header, std::size_t dataBytes) {
  std::vector<char> bytes(8 + header.size() + dataBytes, 0);
  const std::uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

std::string headerError(const std::string& header, std::size_t dataBytes) {
  try {
    readSafetensorsHeader(withHeader(header, dataBytes), "f.safetensors");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(Safetensors, HeaderReadBackAndEveryHoleOverlapOrLooseFieldRefused) {
  const std::string file = safetensorsBytes({{"b", DType::kBFloat16, {2}, std::vector<char>(4)},
                                             {"a", DType::kFloat32, {1, 2}, std::vector<char>(8)}},
                                            {{"source", "test"}});
  const auto tensors = readSafetensorsHeader({file.begin(), file.end()}, "f");
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[0].name, "b");
  EXPECT_EQ(tensors[0].dtype, DType::kBFloat16);
  EXPECT_EQ(tensors[1].name, "a");
  EXPECT_EQ(tensors[1].shape, (Ints{1, 2}));
  EXPECT_EQ(tensors[1].begin, 4u);
  EXPECT_EQ(tensors[1].end, 12u);
  const std::string a = R"("a": {"dtype": "F32", "shape": [2], "data_offsets": )";
  const std::string b = R"("b": {"dtype": "F32", "shape": [1], "data_offsets": )";
  EXPECT_EQ(headerError("{" + a + "[0, 8]}, " + b + "[8, 12]}}", 12), "no error");
  EXPECT_THAT(headerError("{" + a + "[4, 12]}, " + b + "[12, 16]}}", 16),
              HasSubstr("f.safetensors: tensor 'a': expected data_offsets from byte 0 (the first data byte), got [4, 12): "
                        "a hole of 4 bytes"));
  EXPECT_THAT(headerError("{" + a + "[0, 8]}, " + b + "[12, 16]}}", 16),
              HasSubstr("tensor 'b': expected data_offsets from byte 8 (where tensor 'a' ends), got [12, 16): a hole of 4 bytes"));
  EXPECT_THAT(headerError("{" + a + "[0, 8]}, " + b + "[4, 8]}}", 8),
              HasSubstr("tensor 'b': expected data_offsets from byte 8 (where tensor 'a' ends), got [4, 8): an overlap of 4 bytes"));
  EXPECT_THAT(headerError("{" + a + "[0, 8]}, " + b + "[8, 12]}}", 16),
              HasSubstr("tensor 'b' [8, 12): expected the last tensor to end at the data's end, byte 16, got a hole of 4 bytes after it"));
  EXPECT_THAT(headerError("{}", 4), HasSubstr("expected tensors to end at the data's end, byte 4, got a hole of 4 bytes after the header"));
  // The header alone, against the size of a file's data not read (a sparse 4 GiB, say).
  const std::uint64_t n = file.size() - 8 - 12;  // the 12 data bytes follow the header
  EXPECT_EQ(readSafetensorsHeader(file.data() + 8, n, 12, "f").size(), 2u);
  try {
    readSafetensorsHeader(file.data() + 8, n, std::uint64_t(4) << 30, "f");
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 'a' [4, 12): expected the last tensor to end at the data's end, byte "
                                    "4294967296, got a hole of 4294967284 bytes after it"));
  }
  EXPECT_THAT(headerError("{" + a + "[0, 8]}, " + a + "[0, 8]}}", 8), HasSubstr("with each key once in an object, got 'a' twice"));
  EXPECT_THAT(headerError("{" + a + "[0, 8.0]}}", 8), HasSubstr("tensor 'a': data_offsets: expected an integer in [0, 8], got 8.0"));
  EXPECT_THAT(headerError("{" + a + "[0, 8], \"extra\": 1}}", 8), HasSubstr("tensor 'a': expected dtype, shape and data_offsets"));
  EXPECT_THAT(headerError(R"({"__metadata__": {"n": 1}})", 0), HasSubstr("expected __metadata__ to map names to strings"));
  EXPECT_THAT(headerError(std::string(100, '[') + std::string(100, ']'), 0), HasSubstr("nested at most 16 deep"));
  EXPECT_THAT(headerError(R"({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 8]}})", 8),
              HasSubstr("tensor 'a': expected a known dtype"));
}

TEST(Safetensors, DtypeNamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64,
                  DType::kFloat8E4M3, DType::kFloat8E8M0})
    EXPECT_EQ(parseSafetensorsDtype(safetensorsDtype(d)), d);
  EXPECT_FALSE(parseSafetensorsDtype("F4"));
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);  // the published FNV-1a test vector
}

}  // namespace
}  // namespace tpsim
