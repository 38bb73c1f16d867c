#include "tools/lib/runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "backends/errors.h"
#include "backends/huge_pages.h"
#include "backends/wire.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/process_groups.h"
#include "core/rank_grid.h"
#include "tools/lib/backend.h"
#include "tools/lib/job.h"

namespace tpsim::tools {
namespace {

// Each rank's results, gathered under a lock, as its backend stored them.
struct PerRank {
  std::mutex mu;
  std::vector<std::map<std::string, StoredTensor>> results;
  std::vector<TensorPlacement> placements;  // the first rank's here
  void put(int rank, const std::string& name, StoredTensor t) {
    std::lock_guard<std::mutex> lock(mu);
    results[rank][name] = std::move(t);
  }
};

// A parameter's shard, and the main_grad its wgrad accumulates into under fusion or GTP_remat.
void setShard(Compute& compute, Parameter& p, const StoredTensor& shard, const RunConfig& c) {
  compute.copy(toBackend(compute, shard), p.data);
  if (isGtpShard(p) || (c.gradAccumulationFusion && p.data.shape().rank() == 2))
    p.mainGrad = compute.zeros(p.data.shape(), c.mainGradDtype);
}

// What the optimizer reads: main_grad under fusion (weights), else grad.
StoredTensor gradOf(Compute& compute, const Parameter& p) {
  TPSIM_CHECK(p.mainGrad.defined() || p.grad.defined(), "tpsim run: ", p.name, " received no gradient");
  return storedFromBackend(compute, p.mainGrad.defined() ? ConstView(p.mainGrad) : ConstView(p.grad));
}

// Process groups, the GTP_remat reducer and the modules of config's layer on one rank.
struct RankLayer {
  RankLayer(RankContext& ctx, const LayerGrid& grid, const RunConfig& c, bool asyncReduce)
      : pg(ctx.comm, grid.layout()),
        mp(layerConfig(c)),
        reducer(ctx.compute, GtpReduceOptions::fromConfig(mp, asyncReduce)),
        modules(c.layer->build(c.layer->context(ctx.compute, pg, reducer), mp, c)) {}

  ProcessGroups pg;
  ModelParallelConfig mp;
  GtpGradReducer reducer;
  std::unique_ptr<LayerModules> modules;
};

// fn(rank, layer) on each rank of config's layer built on T x G simulated ranks, for what its modules
// describe (placements, state-dict entries), not for any value.
void describeOnRanks(const RunConfig& config, const std::function<void(int, RankLayer&)>& fn) {
  RunConfig c = config;
  c.dtype = DType::kBFloat16;  // only the shapes and attributes are read: the smallest weights
  const LayerGrid grid(c.tp, c.gtpRemat);
  WorldOptions wo;
  wo.size = grid.size();
  runWorld(*makeWorld("sim", wo), [&](RankContext& ctx) {
    RankLayer layer(ctx, grid, c, false);
    fn(ctx.comm.rank(), layer);
  });
}

}  // namespace

std::vector<TensorPlacement> placementsOf(const RunConfig& config) {
  std::vector<TensorPlacement> out;
  describeOnRanks(config, [&](int rank, RankLayer& layer) {
    if (rank == 0) out = layer.modules->placements();
  });
  return out;
}

std::vector<ShardedObject> checkpointObjectsOf(const RunConfig& config) {
  std::vector<std::vector<ShardedObject>> perRank(std::size_t(config.tp * config.gtpRemat));
  describeOnRanks(config, [&](int rank, RankLayer& layer) {
    for (const ShardedEntry& e : layer.modules->stateDict(layer.pg))
      if (const auto* o = std::get_if<ShardedObject>(&e)) perRank[std::size_t(rank)].push_back(*o);
  });
  std::vector<ShardedObject> out;
  for (std::vector<ShardedObject>& objects : perRank) out.insert(out.end(), objects.begin(), objects.end());
  return out;
}

namespace {

// r of the result as assembled() puts it together, with each element's farthest copy
// (assembleRect), both divided by the result's divisor. Returns whether any copy differs.
bool readRect(const ShardedResult& result, const MatrixRect& r, std::vector<double>& value,
              std::vector<double>& farthest) {
  const bool differs = assembleRect(
      result.placement, [&result](int t, int g) -> const StoredTensor& { return result.local(t, g); }, r, value,
      farthest);
  if (result.divisor != 1)
    for (std::size_t i = 0; i < value.size(); ++i) {
      value[i] /= result.divisor;
      farthest[i] /= result.divisor;
    }
  return differs;
}

}  // namespace

HostTensor assembled(const ShardedResult& result) {
  HostTensor out = assemble(result.placement, [&result](int t, int g) -> const StoredTensor& { return result.local(t, g); });
  if (result.divisor != 1)
    for (double& v : out.values) v /= result.divisor;
  return out;
}

namespace {

// Rank (t, g)'s shard of input `name`, cut by `placement`; `rank` is t + T·g.
using ShardSource =
    std::function<StoredTensor(const TensorPlacement& placement, const std::string& name, int rank, int t, int g)>;

// The placement each input is cut by: a parameter's own, the kind's for the others.
std::map<std::string, std::string> inputPlacementNames(const RunConfig& c) {
  std::map<std::string, std::string> out;
  for (const TensorSpec& spec : c.layer->tensors(c))
    out[spec.name] = spec.role == TensorRole::kParameter ? spec.name : c.layer->placementOf(spec.name);
  return out;
}

RunResult runShardedFrom(const RunConfig& config, const ShapeMap& shapes, const ShardSource& shardOfInput,
                         const CheckpointHooks& hooks, Progress* progress, KeptResults kept) {
  if (hooks.load || hooks.save) checkCheckpointable(config);
  const RunConfig c = withSizesOf(config, shapes);
  const std::map<std::string, std::string> inputPlacements = inputPlacementNames(c);
  const LayerKind& kind = *c.layer;
  const LayerGrid grid(c.tp, c.gtpRemat);
  PerRank per;
  per.results.resize(std::size_t(grid.size()));
  int firstHere = 0;
  while (!jobRuns(firstHere, grid.size())) ++firstHere;
  WorldOptions wo;
  wo.size = grid.size();
  wo.threads = c.threads;
  wo.trace = true;
  wo.faults = c.faults;
  wo.timeout = c.timeout;
  const std::unique_ptr<World> world = makeJobWorld(c.backend, wo);
  std::vector<RankRecord> records(c.record ? std::size_t(grid.size()) : 0);
  const TraceClock::time_point t0 = TraceClock::now();
  auto rankMain = [&](RankContext& base) {
    // Under --trace every op goes through a logging decorator; the layers see no difference.
    std::unique_ptr<Compute> loggedCompute;
    std::unique_ptr<Collectives> loggedComm;
    if (c.record) {
      RankRecord& record = records[std::size_t(base.comm.rank())];
      loggedCompute = recordingCompute(base.compute, record, t0);
      loggedComm = recordingCollectives(base.comm, record, t0);
    }
    RankContext ctx{c.record ? *loggedCompute : base.compute, c.record ? *loggedComm : base.comm};
    Compute& compute = ctx.compute;
    const int r = ctx.comm.rank();
    RankLayer layer(ctx, grid, c, true);
    const int t = layer.pg.tp().rank(), g = layer.pg.gtpRemat().rank();
    const std::vector<TensorPlacement> placements = layer.modules->placements();
    if (r == firstHere) per.placements = placements;
    if (r == 0 && hooks.save)
      for (const TensorPlacement& p : placements)
        if (p.role == TensorRole::kParameter) hooks.save->describe(p);
    auto shard = [&](const std::string& input) {
      return shardOfInput(placementNamed(placements, inputPlacements.at(input)), input, r, t, g);
    };
    const std::vector<std::pair<std::string, Parameter*>> params = layer.modules->parameters();
    for (const auto& [name, param] : params) setShard(compute, *param, shard(name), c);
    // Once the parameters are set: this rank's chunks read from, or added to, the checkpoint.
    if (hooks.load || hooks.save) {
      const ShardedStateDict sd = layer.modules->stateDict(layer.pg);
      if (hooks.load)
        for (const ShardedEntry& e : sd) {
          if (const auto* o = std::get_if<ShardedObject>(&e)) {
            hooks.load->checkObject(*o);  // tpsim run checks them before the world (checkpointObjectsOf)
          } else {
            // An entry describes a parameter's own memory.
            const auto& st = std::get<ShardedTensor>(e);
            const auto it = std::find_if(params.begin(), params.end(),
                                         [&](const auto& p) { return p.second->data.data() == st.data.data(); });
            TPSIM_INTERNAL_ASSERT(it != params.end(), "checkpoint key ", st.key, " holds no parameter of the layer");
            hooks.load->load(st, it->second->data, compute);
          }
        }
      if (hooks.save) hooks.save->add(r, sd, compute);
    }
    RankInputs inputs;
    for (const TensorSpec& spec : kind.tensors(c))
      if (spec.role != TensorRole::kParameter)
        inputs[spec.name] = toBackend(compute, shard(spec.name));
    RankStep step = layer.modules->step(compute, inputs, [progress] {
      if (progress) progress->passed("forward");
    });
    layer.reducer.drain();
    // finalize_model_grads' TP step: the parameters' sequence_parallel tags decide what it sums.
    std::vector<Parameter*> finalized;
    for (const auto& entry : params) finalized.push_back(entry.second);
    finalizeSequenceParallelGrads(finalized, layer.pg.tp(), layer.mp.sequenceParallel);
    if (kept != KeptResults::kNone) {
      per.put(r, "output", storedFromBackend(compute, step.output));
      if (step.inputGrad.defined()) per.put(r, "input.grad", storedFromBackend(compute, step.inputGrad));
      for (const auto& [name, param] : params) per.put(r, name + ".grad", gradOf(compute, *param));
    }
    if (progress) progress->passed("backward");
  };
  if (progress) progress->counted({"forward", "backward"}, grid.size());
  // A failure this process's world meets alone once its ranks are done (an injected fault that
  // never fired on its ranks) reaches the others now, as one before the run does (agreeToRun), not
  // at the results' gather's timeout; a collective's failure (WorldError) every process's world met.
  std::exception_ptr failure;
  int failureCode = 0;
  std::string failureText;
  try {
    runWorld(*world, rankMain);
  } catch (const WorldError&) {
    throw;
  } catch (const InvalidArgument& e) {
    failure = std::current_exception(), failureCode = 2, failureText = e.what();
  } catch (const std::exception& e) {
    failure = std::current_exception(), failureCode = 3, failureText = e.what();
  }
  agreeToRun(failure, failureCode, failureText, c.timeout);
#if defined(__GLIBC__)
  // The ranks' freed memory goes back to the system before the other processes' results come in,
  // which would otherwise take their place beside it in the one heap (tools/cli/main.cc keeps it).
  if (jobProcesses() > 1 && kept != KeptResults::kNone) malloc_trim(0);
#endif
  // Spread over an MPI job, process 0 assembles every rank's results but those each process keeps
  // (kPart); the other processes are then done.
  const std::vector<std::string> keptHere =
      kept == KeptResults::kPart ? kind.partResults(c) : std::vector<std::string>{};
  const bool inputGrad = std::any_of(per.results.begin(), per.results.end(),
                                     [](const auto& rank) { return rank.count("input.grad") != 0; });
  std::vector<std::map<std::string, StoredTensor>> here(per.results.size());
  for (std::size_t rank = 0; rank < here.size(); ++rank)
    for (const std::string& name : keptHere)
      if (auto it = per.results[rank].find(name); it != per.results[rank].end()) {
        here[rank][name] = std::move(it->second);
        per.results[rank].erase(it);
      }
  std::vector<std::vector<TraceEvent>> trace = world->trace();
  gatherRanks(per.results, trace, records, hooks.save, c.timeout);
  if (jobProcess() != 0 && keptHere.empty()) return {};
  RunResult r;
  r.trace = std::move(trace);
  r.records = std::move(records);
  r.placements = std::move(per.placements);
  if (kept == KeptResults::kNone) return r;
  if (progress) progress->phase("assemble");

  // Each result with the placement that puts its ranks' tensors together.
  auto placement = [&](const std::string& name) { return placementNamed(r.placements, name); };
  auto put = [&](const std::string& name, const TensorPlacement& p, double divisor = 1) {
    const bool keptThere = std::count(keptHere.begin(), keptHere.end(), name) != 0;
    if (!keptThere && jobProcess() != 0) return;  // process 0's
    ShardedResult& result = r.sharded[name];
    result.placement = p;
    result.divisor = divisor;
    for (int g = 0; g < p.gtp.size; ++g)
      for (int t = 0; t < p.tp.size; ++t) {
        auto& ranks = keptThere ? here : per.results;
        const int rank = grid.rank(t, g);
        auto it = ranks[std::size_t(rank)].find(name);
        TPSIM_INTERNAL_ASSERT(it != ranks[std::size_t(rank)].end() || (keptThere && !jobRuns(rank, grid.size())),
                              "no ", name, " of rank ", rank);
        result.ranks.push_back(it == ranks[std::size_t(rank)].end() ? StoredTensor{} : std::move(it->second));
        if (jobRuns(rank, grid.size()) || !keptThere) result.dtype = result.ranks.back().dtype;
      }
  };
  put("output", placement(kind.outputPlacement()));
  if (inputGrad) {
    const TensorPlacement dx = placement(kind.inputPlacement() + ".grad");
    if (dx.tp.kind == AxisKind::kPartial && c.disableGradReduce) {
      // Left partial for its caller: every TP rank's partial sum, stacked. A partial sum the layer
      // leaves to its token dispatcher (the experts) the run completes, as the dispatcher would.
      for (auto& rank : per.results) {
        StoredTensor& partial = rank.at("input.grad");
        partial.shape.insert(partial.shape.begin(), 1);
      }
      put("input.grad", stackedPartials(dx));
    } else {
      put("input.grad", dx);
    }
  }
  for (const TensorPlacement& p : r.placements) {
    if (p.role != TensorRole::kParameter) continue;
    TensorPlacement grad = placement(p.name + ".grad");
    // The peers' gradients of a parameter they replicate are data-parallel partial sums: the DP
    // gradient reduction over them (MEAN or SUM, as the shards' reduce-scatter) happens here.
    const bool dataParallel = grad.gtp.kind == AxisKind::kReplicate && grid.gtpRemat() > 1;
    if (dataParallel) grad.gtp.kind = AxisKind::kPartial;
    put(p.name + ".grad", grad, dataParallel && c.gtpReduceMean ? double(grid.gtpRemat()) : 1.0);
  }
  per.results.clear();
  if (kept == KeptResults::kAssembled)
    for (const auto& [name, result] : r.sharded) {
      HostTensor whole{result.placement.shape, result.dtype, {}};
      std::vector<double> farthest;
      const bool differs = readRect(result, MatrixRect{0, 0, whole.numel() / whole.shape.back(), whole.shape.back()},
                                    whole.values, farthest);
      if (differs) r.otherCopies[name] = HostTensor{whole.shape, whole.dtype, std::move(farthest)};
      r.results[name] = std::move(whole);
    }
  std::vector<std::string> names;
  for (const auto& [name, t] : r.sharded) names.push_back(name);
  std::vector<std::string> expected = jobProcess() == 0 ? resultNames(c) : keptHere;
  std::sort(expected.begin(), expected.end());
  TPSIM_INTERNAL_ASSERT(names == expected, "runSharded: results other than resultNames() lists");
  return r;
}

}  // namespace

RunResult runSharded(const RunConfig& config, const InputMap& in, const CheckpointHooks& hooks, Progress* progress,
                     KeptResults kept) {
  config.validate();
  checkInputs(config, in);
  ShapeMap shapes;
  for (const auto& [name, t] : in) shapes[name] = t.shape;
  return runShardedFrom(
      config, shapes,
      [&in](const TensorPlacement& placement, const std::string& name, int, int t, int g) {
        return shardOf(placement, in.at(name), t, g);
      },
      hooks, progress, kept);
}

ShardedInputs::ShardedInputs(const RunConfig& c, std::vector<TensorPlacement> placements)
    : config_(c), placements_(std::move(placements)) {
  shards_.ranks.resize(std::size_t(c.tp * c.gtpRemat));
}

void ShardedInputs::begin(const std::string& name, const TensorHeader& header) {
  const LayerGrid grid(config_.tp, config_.gtpRemat);
  shards_.shapes[name] = header.shape;
  const TensorPlacement& placement = placementNamed(placements_, inputPlacementNames(config_).at(name));
  TPSIM_INTERNAL_ASSERT(placement.shape == header.shape, name, ": placement of ", shapeText(placement.shape),
                        " for a tensor ", shapeText(header.shape));
  cuts_.clear();
  for (int g = 0; g < grid.gtpRemat(); ++g)
    for (int t = 0; t < grid.tp(); ++t)
      if (const int rank = grid.rank(t, g); jobRuns(rank, grid.size())) {
        StoredTensor& shard = shards_.ranks[std::size_t(rank)][name];
        shard = StoredTensor{localShape(placement, t, g), header.dtype, {}};
        resizeFresh(shard.bytes, std::size_t(shard.numel()) * dtypeSize(header.dtype));  // pad rows: +0
        cuts_.push_back({&shard, shardRuns(placement, t, g)});
      }
}

bool ShardedInputs::wants(std::int64_t offset, std::int64_t count) const {
  for (const Cut& cut : cuts_) {
    auto run = std::partition_point(cut.runs.begin(), cut.runs.end(),
                                    [&](const ShardRun& r) { return r.from + r.n <= offset; });
    if (run != cut.runs.end() && run->from < offset + count) return true;
  }
  return false;
}

void ShardedInputs::piece(std::int64_t offset, std::int64_t count, const char* bytes) {
  const std::int64_t end = offset + count;
  for (Cut& cut : cuts_) {
    const std::size_t size = dtypeSize(cut.shard->dtype);
    // The first run that ends past the piece's start, then each that begins before its end.
    auto run = std::partition_point(cut.runs.begin(), cut.runs.end(),
                                    [&](const ShardRun& r) { return r.from + r.n <= offset; });
    for (; run != cut.runs.end() && run->from < end; ++run) {
      const std::int64_t from = std::max(run->from, offset), to = std::min(run->from + run->n, end);
      std::memcpy(cut.shard->bytes.data() + std::size_t(run->to + (from - run->from)) * size,
                  bytes + std::size_t(from - offset) * size, std::size_t(to - from) * size);
    }
  }
}

void ShardedInputs::end() { cuts_.clear(); }

RunResult runSharded(const RunConfig& config, InputShards in, const CheckpointHooks& hooks, Progress* progress,
                     KeptResults kept) {
  config.validate();
  // Each shard is read once, by its rank, which moves it out and frees it once its backend holds it.
  return runShardedFrom(
      config, in.shapes,
      [&in](const TensorPlacement&, const std::string& name, int rank, int, int) {
        InputMap& mine = in.ranks.at(std::size_t(rank));
        auto it = mine.find(name);
        TPSIM_INTERNAL_ASSERT(it != mine.end(), "no shard of ", name, " for rank ", rank);
        StoredTensor shard = std::move(it->second);
        return shard;
      },
      hooks, progress, kept);
}

std::vector<std::string> resultNames(const RunConfig& c) {
  std::vector<std::string> names{"output"};
  for (const TensorSpec& t : c.layer->tensors(c)) {
    if (t.name == "input" && t.idRange.empty()) names.push_back("input.grad");
    if (t.role == TensorRole::kParameter) names.push_back(t.name + ".grad");
  }
  return names;
}

ReferenceOptions referenceOptions(const RunConfig& c, std::vector<TensorPlacement> placements) {
  ReferenceOptions o;
  o.layer = c.layer;
  o.placements = placements.empty() ? placementsOf(c) : std::move(placements);
  o.reduceScatterEmbeddings = c.reduceScatterEmbeddings;
  o.tp = c.tp;
  o.computeDtype = c.dtype;
  o.outputDtype = c.outputDtype.value_or(c.dtype);
  o.wgradDtype = c.layer->wgradDtype(c);
  o.gtpRemat = c.gtpRemat;
  o.gtpWireDtype = c.layer->gtpWireDtype(c);
  o.weightFormat = c.weightFormat;
  o.accumulationUnit = gemmAccumulationUnit(c.backend);
  o.disableGradReduce = c.disableGradReduce;
  return o;
}

namespace {

// What verify divides a reference result by: under GTP_remat MEAN every parameter gradient (and its
// bound) is 1/G of the full batch's.
double referenceDivisor(const RunConfig& c, const std::string& name) {
  const bool parameterGrad =
      name.size() >= 5 && name.compare(name.size() - 5, 5, ".grad") == 0 && name != "input.grad";
  return c.gtpRemat > 1 && c.gtpReduceMean && parameterGrad ? double(c.gtpRemat) : 1.0;
}

// A result as verify reads it: its shape, and rectangles of its values with each element's copy
// farthest from it (assembleRect).
struct VerifiedResult {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::function<void(const MatrixRect&, std::vector<double>& value, std::vector<double>& farthest)> read;
};

// Checks the reference block by block, as it arrives, against the results.
// A part (ReferencePart) checks only the results it has: announced others are not its own.
class VerifySink final : public ReferenceSink {
 public:
  VerifySink(const RunConfig& c, std::map<std::string, VerifiedResult> results, VerifyMode mode, bool part = false)
      : c_(c), results_(std::move(results)), mode_(mode), part_(part) {}

  void result(const std::string& name, const std::vector<std::int64_t>& shape, DType) override {
    auto it = results_.find(name);
    if (part_ && it == results_.end()) return;
    TPSIM_INTERNAL_ASSERT(it != results_.end(), "no sharded result named ", name);
    TPSIM_INTERNAL_ASSERT(it->second.shape == shape, name, ": sharded ", shapeText(it->second.shape), " vs dense ",
                          shapeText(shape));
    Verdict v{name, shapeText(shape)};
    if (mode_ == VerifyMode::kExact) v.slack = std::numeric_limits<double>::quiet_NaN();
    verdicts_[name] = v;
  }

  void block(const std::string& name, const ReferenceBlock& b) override {
    // A few rows at a time, so that the values read stay a small fraction of a whole result.
    const std::int64_t step = std::max<std::int64_t>(1, (std::int64_t(1) << 20) / std::max<std::int64_t>(b.cols, 1));
    for (std::int64_t r = 0; r < b.rows; r += step) {
      const std::int64_t rows = std::min(step, b.rows - r);
      check(name, {b.row + r, b.col, rows, b.cols, b.ld, b.value + r * b.ld, b.bound + r * b.ld});
    }
  }

  std::vector<Verdict> verdicts() const {
    std::vector<Verdict> out;
    for (const auto& [name, v] : verdicts_) out.push_back(v);
    return out;
  }

 private:
  void check(const std::string& name, const ReferenceBlock& b) {
    const VerifiedResult& got = results_.at(name);
    got.read(MatrixRect{b.row, b.col, b.rows, b.cols}, value_, farthest_);
    const double divisor = referenceDivisor(c_, name);
    const std::int64_t cols = got.shape.back();
    Verdict& v = verdicts_.at(name);
    for (std::int64_t r = 0; r < b.rows; ++r)
      for (std::int64_t col = 0; col < b.cols; ++col) {
        double ref = b.value[r * b.ld + col], bound = b.bound[r * b.ld + col];
        if (divisor != 1) ref /= divisor, bound /= divisor;
        if (mode_ == VerifyMode::kExact) {  // the dense value as the result's storage holds it, no tolerance
          ref = roundedTo(got.dtype, ref);
          bound = 0;
        }
        // An element is as wrong as its worst copy.
        const std::size_t at = std::size_t(r * b.cols + col);
        const double mine = value_[at], other = farthest_[at];
        checkElement(v, (b.row + r) * cols + b.col + col,
                     !(std::fabs(other - ref) <= std::fabs(mine - ref)) ? other : mine, ref, bound);
      }
  }

  // Blocks arrive in any order: the first element outside (or non-finite) is the least flat index.
  static void checkElement(Verdict& v, std::int64_t i, double value, double ref, double bound) {
    const double err = std::fabs(value - ref);
    if (std::isnan(err) || err > v.maxError) v.maxError = err;  // once NaN, max|err| stays NaN
    v.maxBound = std::max(v.maxBound, bound);
    if (std::isnan(err)) v.slack = err;
    else if (err > 0 && !std::isnan(v.slack)) v.slack = std::min(v.slack, bound / err);
    if (!(err <= bound) && (v.outside++ == 0 || i < v.firstOutside)) {
      v.firstOutside = i;
      v.firstOutsideError = err;
      v.firstOutsideBound = bound;
    }
    if (!std::isfinite(value) && (v.nonFinite++ == 0 || i < v.firstNonFinite)) v.firstNonFinite = i;
  }

  const RunConfig& c_;
  const std::map<std::string, VerifiedResult> results_;
  const VerifyMode mode_;
  const bool part_;
  std::map<std::string, Verdict> verdicts_;
  std::vector<double> value_, farthest_;  // the block being checked
};

// Readers of the results as the ranks here hold them.
std::map<std::string, VerifiedResult> readersOf(const RunResult& result) {
  std::map<std::string, VerifiedResult> results;
  for (const auto& [name, sharded] : result.sharded)
    results[name] = {sharded.placement.shape, sharded.dtype,
                     [&sharded = sharded](const MatrixRect& rect, std::vector<double>& value,
                                          std::vector<double>& farthest) { readRect(sharded, rect, value, farthest); }};
  return results;
}

void putVerdict(std::string& out, const Verdict& v) {
  wire::putString(out, v.name);
  wire::putString(out, v.shape);
  for (double x : {v.maxError, v.maxBound, v.slack, v.firstOutsideError, v.firstOutsideBound}) wire::put(out, x);
  for (std::int64_t x : {v.outside, v.firstOutside, v.nonFinite, v.firstNonFinite}) wire::put(out, x);
}

Verdict getVerdict(wire::Reader& in) {
  Verdict v;
  v.name = in.getString();
  v.shape = in.getString();
  for (double* x : {&v.maxError, &v.maxBound, &v.slack, &v.firstOutsideError, &v.firstOutsideBound})
    *x = in.get<double>();
  for (std::int64_t* x : {&v.outside, &v.firstOutside, &v.nonFinite, &v.firstNonFinite}) *x = in.get<std::int64_t>();
  return v;
}

std::vector<Verdict> verifyResults(const RunConfig& c, const InputMap& inputs, VerifyMode mode,
                                   const std::vector<TensorPlacement>& placements,
                                   std::map<std::string, VerifiedResult> results) {
  if (mode == VerifyMode::kNone) return {};
  VerifySink sink(c, std::move(results), mode);
  streamReference(referenceOptions(c, placements), inputs, sink);
  return sink.verdicts();
}

}  // namespace

std::map<std::string, Checked> referenceFor(const RunConfig& c, const InputMap& inputs,
                                            std::vector<TensorPlacement> placements) {
  auto reference = denseReference(referenceOptions(c, std::move(placements)), inputs);
  for (auto& [name, ref] : reference)
    if (const double divisor = referenceDivisor(c, name); divisor != 1) {
      for (double& v : ref.value.values) v /= divisor;
      for (double& b : ref.bound) b /= divisor;
    }
  return reference;
}

std::vector<Verdict> verify(const RunConfig& c, const InputMap& inputs, const RunResult& result, VerifyMode mode) {
  return verifyResults(c, inputs, mode, result.placements, readersOf(result));
}

std::vector<std::string> partWholeInputs(const RunConfig& c, const std::vector<TensorPlacement>& placements) {
  std::vector<std::string> names;
  for (const TensorSpec& t : c.layer->tensors(c))
    if (t.role != TensorRole::kParameter || placementNamed(placements, t.name).tp.kind != AxisKind::kShard)
      names.push_back(t.name);
  return names;
}

PartInputs partInputs(const RunConfig& c, const std::vector<TensorPlacement>& placements, const InputShards& shards,
                      InputMap whole) {
  PartInputs out;
  out.inputs = std::move(whole);
  const LayerGrid grid(c.tp, c.gtpRemat);
  TPSIM_INTERNAL_ASSERT(grid.gtpRemat() == 1, "partInputs: GTP_remat cuts the ranks' rows");
  for (const TensorSpec& spec : c.layer->tensors(c)) {
    if (out.inputs.count(spec.name)) continue;
    const TensorPlacement& p = placementNamed(placements, spec.name);
    const int dim = p.tp.dim;
    // The ranks here hold consecutive slices along dim, in rank order (stride 1: one block each).
    std::int64_t begin = -1, end = -1;
    std::vector<std::pair<const StoredTensor*, Range>> slices;
    for (int t = 0; t < grid.tp(); ++t) {
      if (!jobRuns(grid.rank(t, 0), grid.size())) continue;
      const std::vector<Block> blocks = blocksOf(p, t, 0);
      TPSIM_INTERNAL_ASSERT(blocks.size() == 1, spec.name, ": ", blocks.size(), " blocks on TP rank ", t);
      const Range along = blocks.front().global[std::size_t(dim)];
      TPSIM_INTERNAL_ASSERT(begin < 0 || along.begin == end, spec.name, ": the ranks here hold rows apart");
      if (begin < 0) begin = along.begin;
      end = along.end;
      slices.emplace_back(&shards.ranks.at(std::size_t(grid.rank(t, 0))).at(spec.name), along);
    }
    TPSIM_INTERNAL_ASSERT(out.split.empty() || (begin == out.begin && end == out.end), spec.name, ": rows [", begin,
                          ", ", end, ") apart from [", out.begin, ", ", out.end, ")");
    out.begin = begin, out.end = end, out.whole = p.shape[std::size_t(dim)];
    out.split[spec.name] = dim;
    // Each slice's rows along dim for every index of the dims before it.
    std::vector<std::int64_t> shape = p.shape;
    shape[std::size_t(dim)] = end - begin;
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; ++d) outer *= shape[std::size_t(d)];
    for (int d = dim + 1; d < int(shape.size()); ++d) inner *= shape[std::size_t(d)];
    const std::size_t size = dtypeSize(slices.front().first->dtype);
    StoredTensor joined{shape, slices.front().first->dtype, {}};
    resizeFresh(joined.bytes, std::size_t(joined.numel()) * size);
    for (const auto& [slice, along] : slices) {
      const std::size_t run = std::size_t(along.size() * inner) * size;
      for (std::int64_t o = 0; o < outer; ++o) {
        const std::size_t at = std::size_t((o * (end - begin) + along.begin - begin) * inner) * size;
        std::memcpy(joined.bytes.data() + at, slice->bytes.data() + std::size_t(o) * run, run);
      }
    }
    out.inputs[spec.name] = std::move(joined);
  }
  return out;
}

std::vector<Verdict> verifyPart(const RunConfig& c, const PartInputs& in, const RunResult& result, VerifyMode mode) {
  if (mode == VerifyMode::kNone) return {};
  ReferencePart part;
  part.index = jobProcess(), part.count = jobProcesses();
  part.begin = in.begin, part.end = in.end, part.whole = in.whole, part.split = in.split;
  auto bytesOf = [](const std::vector<double>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
  };
  auto doublesOf = [](const std::string& bytes, std::vector<double>& out) {
    const std::size_t at = out.size();
    out.resize(at + bytes.size() / sizeof(double));
    std::memcpy(out.data() + at, bytes.data(), bytes.size() / sizeof(double) * sizeof(double));
  };
  part.allGather = [&](const std::vector<double>& mine) {
    std::vector<double> all;
    for (const std::string& theirs : allGatherJob(bytesOf(mine), c.timeout)) doublesOf(theirs, all);
    return all;
  };
  // One vector at a time, when the first part asks for it: not every part's at once in its memory.
  part.send = [&](const std::vector<double>& sums) {
    receiveFromProcess(0, c.timeout);
    sendToProcess(0, bytesOf(sums));
  };
  part.receive = [&](int from, std::vector<double>& sums) {
    sendToProcess(from, "");
    sums.clear();
    doublesOf(receiveFromProcess(from, c.timeout), sums);
  };
  ReferenceOptions o = referenceOptions(c, result.placements);
  o.part = &part;
  VerifySink sink(c, readersOf(result), mode, true);
  streamReference(o, in.inputs, sink);
  std::string mine;
  for (const Verdict& v : sink.verdicts()) putVerdict(mine, v);
  const std::vector<std::string> parts = gatherJob(std::move(mine), c.timeout);
  std::map<std::string, Verdict> merged;
  for (const std::string& theirs : parts) {
    wire::Reader reader(theirs, "a process's verdicts");
    while (reader.at() < theirs.size()) {
      const Verdict v = getVerdict(reader);
      auto [it, first] = merged.emplace(v.name, v);
      if (!first) mergeVerdict(it->second, v);
    }
  }
  std::vector<Verdict> out;
  for (const auto& [name, v] : merged) out.push_back(v);
  return out;
}

void mergeVerdict(Verdict& into, const Verdict& v) {
  if (!std::isnan(into.maxError) && (std::isnan(v.maxError) || v.maxError > into.maxError)) into.maxError = v.maxError;
  into.maxBound = std::max(into.maxBound, v.maxBound);
  into.slack = std::isnan(into.slack) || std::isnan(v.slack) ? std::numeric_limits<double>::quiet_NaN()
                                                              : std::min(into.slack, v.slack);
  if (v.outside > 0 && (into.outside == 0 || v.firstOutside < into.firstOutside)) {
    into.firstOutside = v.firstOutside;
    into.firstOutsideError = v.firstOutsideError;
    into.firstOutsideBound = v.firstOutsideBound;
  }
  into.outside += v.outside;
  if (v.nonFinite > 0 && (into.nonFinite == 0 || v.firstNonFinite < into.firstNonFinite))
    into.firstNonFinite = v.firstNonFinite;
  into.nonFinite += v.nonFinite;
}

std::vector<Verdict> verify(const RunConfig& c, const InputMap& inputs, const TensorMap& results, VerifyMode mode,
                            const std::vector<TensorPlacement>& placements,
                            const std::map<std::string, HostTensor>& otherCopies) {
  std::map<std::string, VerifiedResult> read;
  for (const auto& [name, t] : results) {
    const auto other = otherCopies.find(name);
    const HostTensor& copies = other == otherCopies.end() ? t : other->second;
    read[name] = {t.shape, t.dtype, [&t = t, &copies](const MatrixRect& rect, std::vector<double>& value,
                                                  std::vector<double>& farthest) {
                    const std::int64_t cols = t.shape.back();
                    value.clear();
                    farthest.clear();
                    for (std::int64_t r = rect.row; r < rect.row + rect.rows; ++r) {
                      const auto from = std::size_t(r * cols + rect.col), to = from + std::size_t(rect.cols);
                      value.insert(value.end(), t.values.begin() + from, t.values.begin() + to);
                      farthest.insert(farthest.end(), copies.values.begin() + from, copies.values.begin() + to);
                    }
                  }};
  }
  return verifyResults(c, inputs, mode, placements, std::move(read));
}

std::string slackText(const Verdict& v) {
  if (std::isnan(v.slack)) return "-";
  if (std::isinf(v.slack)) return "inf";
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", v.slack);
  return text;
}

std::string verificationTable(const std::vector<Verdict>& verdicts) {
  char line[512];
  std::snprintf(line, sizeof line, "%-18s %-16s %12s %12s %9s %9s  %s\n", "tensor", "shape", "max|err|", "bound",
                "slack", "#outside", "result");
  std::string table = line;
  for (const Verdict& v : verdicts) {
    std::snprintf(line, sizeof line, "%-18s %-16s %12.3e %12.3e %9s %9lld  %s\n", v.name.c_str(), v.shape.c_str(),
                  v.maxError, v.maxBound, slackText(v).c_str(), (long long)v.outside, verdictResult(v).c_str());
    table += line;
  }
  return table;
}

std::string verdictResult(const Verdict& v) { return v.nonFinite ? "NON-FINITE" : v.outside == 0 ? "OK" : "FAIL"; }

std::string outsideNote(const Verdict& v) {
  if (v.outside == 0) return "";
  char numbers[96];
  std::snprintf(numbers, sizeof numbers, "|err| %.3e > bound %.3e", v.firstOutsideError, v.firstOutsideBound);
  return detail::concat(v.name, ": ", v.outside, " element", v.outside == 1 ? "" : "s", " outside the bound, the first "
                        "at flat index ", v.firstOutside, " (", numbers, ")\n");
}

std::string nonFiniteNote(const Verdict& v) {
  if (v.nonFinite == 0) return "";
  return detail::concat(v.name, ": ", v.nonFinite, " NaN or Inf values, the first at flat index ", v.firstNonFinite,
                        "\n");
}

}  // namespace tpsim::tools
