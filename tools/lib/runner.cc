#include "tools/lib/runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <mutex>

#include "backends/errors.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/process_groups.h"
#include "core/rank_grid.h"
#include "tools/lib/backend.h"
#include "tools/lib/job.h"

namespace tpsim::tools {
namespace {

// Each rank's results, gathered under a lock and reassembled after the run.
struct PerRank {
  std::mutex mu;
  std::vector<TensorMap> results;
  std::vector<TensorPlacement> placements;  // rank 0's
  void put(int rank, const std::string& name, HostTensor t) {
    std::lock_guard<std::mutex> lock(mu);
    results[rank][name] = std::move(t);
  }
};

// A parameter's shard, and the main_grad its wgrad accumulates into under fusion or GTP_remat.
void setShard(Compute& compute, Parameter& p, const HostTensor& shard, const RunConfig& c) {
  compute.copy(toBackend(compute, shard), p.data);
  if (isGtpShard(p) || (c.gradAccumulationFusion && p.data.shape().rank() == 2))
    p.mainGrad = compute.zeros(p.data.shape(), c.mainGradDtype);
}

// What the optimizer reads: main_grad under fusion (weights), else grad.
HostTensor gradOf(Compute& compute, const Parameter& p) {
  TPSIM_CHECK(p.mainGrad.defined() || p.grad.defined(), "tpsim run: ", p.name, " received no gradient");
  return fromBackend(compute, p.mainGrad.defined() ? ConstView(p.mainGrad) : ConstView(p.grad));
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

RunResult runSharded(const RunConfig& config, const TensorMap& in, const CheckpointHooks& hooks, Progress* progress) {
  config.validate();
  checkInputs(config, in);
  if (hooks.load || hooks.save) checkCheckpointable(config);
  ShapeMap shapes;
  for (const auto& [name, t] : in) shapes[name] = t.shape;
  const RunConfig c = withSizesOf(config, shapes);
  const LayerKind& kind = *c.layer;
  const LayerGrid grid(c.tp, c.gtpRemat);
  PerRank per;
  per.results.resize(std::size_t(grid.size()));
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
    if (r == 0) {
      per.placements = placements;
      if (hooks.save)
        for (const TensorPlacement& p : placements)
          if (p.role == TensorRole::kParameter) hooks.save->describe(p);
    }
    auto shardOfInput = [&](const std::string& placement, const std::string& input) {
      return shardOf(placementNamed(placements, placement), in.at(input), t, g);
    };
    const std::vector<std::pair<std::string, Parameter*>> params = layer.modules->parameters();
    for (const auto& [name, param] : params) setShard(compute, *param, shardOfInput(name, name), c);
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
        inputs[spec.name] = toBackend(compute, shardOfInput(kind.placementOf(spec.name), spec.name));
    RankStep step = layer.modules->step(compute, inputs, [progress] {
      if (progress) progress->passed("forward");
    });
    layer.reducer.drain();
    // finalize_model_grads' TP step: the parameters' sequence_parallel tags decide what it sums.
    std::vector<Parameter*> finalized;
    for (const auto& entry : params) finalized.push_back(entry.second);
    finalizeSequenceParallelGrads(finalized, layer.pg.tp(), layer.mp.sequenceParallel);
    per.put(r, "output", fromBackend(compute, step.output));
    if (step.inputGrad.defined()) per.put(r, "input.grad", fromBackend(compute, step.inputGrad));
    for (const auto& [name, param] : params) per.put(r, name + ".grad", gradOf(compute, *param));
    if (progress) progress->passed("backward");
  };
  if (progress) progress->counted({"forward", "backward"}, grid.size());
  runWorld(*world, rankMain);
  // Spread over an MPI job, process 0 assembles every rank's results; the other processes are done.
  std::vector<std::vector<TraceEvent>> trace = world->trace();
  gatherRanks(per.results, trace, c.timeout);
  if (jobProcess() != 0) return {};
  if (progress) progress->phase("assemble");

  // Back to the unsharded layout, each result through its placement.
  RunResult r;
  r.trace = std::move(trace);
  r.records = std::move(records);
  r.placements = std::move(per.placements);
  auto local = [&](const std::string& name) {
    return [&per, &grid, name](int t, int g) -> const HostTensor& {
      return per.results[std::size_t(grid.rank(t, g))].at(name);
    };
  };
  auto placement = [&](const std::string& name) { return placementNamed(r.placements, name); };
  auto put = [&](const std::string& name, const TensorPlacement& p, const auto& copies) {
    r.results[name] = assemble(p, copies);
    if (std::optional<HostTensor> other = farthestCopies(p, r.results[name], copies)) r.otherCopies[name] = *other;
  };
  put("output", placement(kind.outputPlacement()), local("output"));
  if (per.results.front().count("input.grad")) {
    const TensorPlacement dx = placement(kind.inputPlacement() + ".grad");
    if (dx.tp.kind == AxisKind::kPartial && c.disableGradReduce) {
      // Left partial for its caller: every TP rank's partial sum, stacked. A partial sum the layer
      // leaves to its token dispatcher (the experts) the run completes, as the dispatcher would.
      for (TensorMap& rank : per.results) {
        HostTensor& partial = rank.at("input.grad");
        partial.shape.insert(partial.shape.begin(), 1);
      }
      put("input.grad", stackedPartials(dx), local("input.grad"));
    } else {
      put("input.grad", dx, local("input.grad"));
    }
  }
  for (const TensorPlacement& p : r.placements) {
    if (p.role != TensorRole::kParameter) continue;
    TensorPlacement grad = placement(p.name + ".grad");
    // The peers' gradients of a parameter they replicate are data-parallel partial sums: the DP
    // gradient reduction over them (MEAN or SUM, as the shards' reduce-scatter) happens here.
    const bool dataParallel = grad.gtp.kind == AxisKind::kReplicate && grid.gtpRemat() > 1;
    if (dataParallel) grad.gtp.kind = AxisKind::kPartial;
    put(p.name + ".grad", grad, local(p.name + ".grad"));
    if (dataParallel && c.gtpReduceMean)
      for (double& v : r.results[p.name + ".grad"].values) v /= double(grid.gtpRemat());
  }
  std::vector<std::string> names;
  for (const auto& [name, t] : r.results) names.push_back(name);
  std::vector<std::string> expected = resultNames(c);
  std::sort(expected.begin(), expected.end());
  TPSIM_INTERNAL_ASSERT(names == expected, "runSharded: results other than resultNames() lists");
  return r;
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

std::map<std::string, Checked> referenceFor(const RunConfig& c, const TensorMap& inputs,
                                            std::vector<TensorPlacement> placements) {
  auto reference = denseReference(referenceOptions(c, std::move(placements)), inputs);
  if (c.gtpRemat > 1 && c.gtpReduceMean)
    for (auto& [name, ref] : reference)
      if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".grad") == 0 && name != "input.grad") {
        for (double& v : ref.value.values) v /= double(c.gtpRemat);
        for (double& b : ref.bound) b /= double(c.gtpRemat);
      }
  return reference;
}

std::vector<Verdict> verify(const RunConfig& c, const TensorMap& inputs, const RunResult& result, VerifyMode mode) {
  return verify(c, inputs, result.results, mode, result.placements, result.otherCopies);
}

std::vector<Verdict> verify(const RunConfig& c, const TensorMap& inputs, const TensorMap& results, VerifyMode mode,
                            const std::vector<TensorPlacement>& placements,
                            const std::map<std::string, HostTensor>& otherCopies) {
  std::vector<Verdict> out;
  if (mode == VerifyMode::kNone) return out;
  auto reference = referenceFor(c, inputs, placements);
  for (auto& [name, ref] : reference) {
    auto it = results.find(name);
    TPSIM_INTERNAL_ASSERT(it != results.end(), "no sharded result named ", name);
    const HostTensor& got = it->second;
    TPSIM_INTERNAL_ASSERT(got.shape == ref.value.shape, name, ": sharded ", shapeText(got.shape), " vs dense ",
                          shapeText(ref.value.shape));
    if (mode == VerifyMode::kExact) {  // the dense value as the result's storage holds it, no tolerance
      ref.value = makeHost(ref.value.shape, got.dtype, std::move(ref.value.values));
      std::fill(ref.bound.begin(), ref.bound.end(), 0.0);
    }
    const auto other = otherCopies.find(name);
    const HostTensor* copies = other == otherCopies.end() ? nullptr : &other->second;
    Verdict v{name, shapeText(got.shape)};
    if (mode == VerifyMode::kExact) v.slack = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t i = 0; i < got.values.size(); ++i) {
      // An element is as wrong as its worst copy.
      const double value = copies && !(std::fabs(copies->values[i] - ref.value.values[i]) <=
                                       std::fabs(got.values[i] - ref.value.values[i]))
                               ? copies->values[i]
                               : got.values[i];
      const double err = std::fabs(value - ref.value.values[i]);
      if (std::isnan(err) || err > v.maxError) v.maxError = err;  // once NaN, max|err| stays NaN
      v.maxBound = std::max(v.maxBound, ref.bound[i]);
      if (std::isnan(err)) v.slack = err;
      else if (err > 0 && !std::isnan(v.slack)) v.slack = std::min(v.slack, ref.bound[i] / err);
      if (!(err <= ref.bound[i]) && v.outside++ == 0) {
        v.firstOutside = std::int64_t(i);
        v.firstOutsideError = err;
        v.firstOutsideBound = ref.bound[i];
      }
      if (!std::isfinite(value) && v.nonFinite++ == 0) v.firstNonFinite = std::int64_t(i);
    }
    out.push_back(v);
  }
  return out;
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
