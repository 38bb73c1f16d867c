// Invalid combinations, generated on purpose, each with the text its error must contain: every one
// is rejected with tpsim::InvalidArgument (never another exception, a wrong result or a hang), and
// the message names the flag, argument, file or size at fault with its value:
//   `tpsim run` configurations (RunConfig::validate) name the flag;
//   inputs of the wrong shape, divisibility or ids (tools::runSharded) name the file and the flag;
//   layer constructors, forward and backward (core/) name the argument and both values;
//   topologies (ParallelLayout, gtpRematSize, ProcessGroups) name the size.
#include <memory>
#include <mutex>

#include "core/attributes.h"
#include "core/checkpoint.h"
#include "core/embedding.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/linear.h"
#include "core/mappings.h"
#include "core/process_groups.h"
#include "core/random.h"
#include "props/backends.h"
#include "props/generators.h"
#include "props/harness.h"
#include "tests/sim_test_util.h"

namespace tpsim::props {
namespace {

using testing::tensorOf;

// What `f` throws: "InvalidArgument: <message>", "<other type>: <message>" or "no error".
std::string outcome(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("another exception: ") + e.what();
  }
  return "no error";
}

bool rejectedWith(const std::string& got, const std::string& expected) {
  return got.rfind("InvalidArgument: ", 0) == 0 && got.find(expected) != std::string::npos;
}

// RC_FAILs unless `got` is an InvalidArgument whose message contains `expected`, showing both.
void assertRejected(const std::string& got, const std::string& expected) {
  if (!rejectedWith(got, expected))
    RC_FAIL("expected InvalidArgument containing\n    " + expected + "\n  got\n    " + got);
}

// One invalid use of a layer on `ranks` ranks: every rank runs `use` and must throw.
struct LayerMisuse {
  std::string what;
  int ranks = 1;
  std::function<void(RankContext&)> use;
  std::string expected;
};

void showValue(const LayerMisuse& m, std::ostream& os) {
  os << m.what << " on " << m.ranks << " ranks; expected error containing: " << m.expected;
}

ModelParallelConfig configFor(int T) {
  ModelParallelConfig c;
  c.tensorModelParallelSize = T;
  c.performInitialization = false;
  return c;
}

std::string str(std::int64_t v) { return std::to_string(v); }

rc::Gen<LayerMisuse> genLayerMisuse() {
  return rc::gen::exec([]() -> LayerMisuse {
    const InitMethod init = initMethodNormal(0.02);
    const int T = *genTpAbove1();
    const std::int64_t off = *uniform<std::int64_t>(1, T);  // a remainder in [1, T)
    const std::int64_t q = *pick<std::int64_t>({1, 2, 3});
    switch (*pickIndex(21)) {
      case 0: {
        const std::int64_t n = q * T + off;
        return {"ColumnParallelLinear(K=3, N=" + str(n) + ")", T,
                [=](RankContext& ctx) { ColumnParallelLinear({ctx.compute, ctx.comm}, configFor(T), 3, n, init); },
                "ColumnParallelLinear: output_size by the TP size: " + str(n) + " is not divisible by " + str(T)};
      }
      case 1: {
        const std::int64_t k = q * T + off;
        return {"RowParallelLinear(K=" + str(k) + ", N=3)", T,
                [=](RankContext& ctx) { RowParallelLinear({ctx.compute, ctx.comm}, configFor(T), k, 3, init); },
                "RowParallelLinear: input_size by the TP size: " + str(k) + " is not divisible by " + str(T)};
      }
      case 2: {
        const std::int64_t v = q * T + off;
        return {"VocabParallelEmbedding(V=" + str(v) + ")", T,
                [=](RankContext& ctx) { VocabParallelEmbedding({ctx.compute, ctx.comm}, configFor(T), v, 4, init); },
                "VocabParallelEmbedding: vocab_size " + str(v) + " is not divisible by tp_size " + str(T) +
                    "; pad it to " + str((q + 1) * T)};
      }
      case 3:
        return {"RowParallelLinear with sequence_parallel, input_is_parallel = False", T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.sequenceParallel = true;
                  RowParallelLinear({ctx.compute, ctx.comm}, c, T, 3, init);
                },
                "RowParallelLinear: sequence_parallel needs input_is_parallel = True"};
      case 4: {
        const int kind = *pickIndex(3);
        return {"sequence_parallel with tensor_model_parallel_size 1, layer kind " + str(kind), 1,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(1);
                  c.sequenceParallel = true;
                  RowParallelOptions ro;
                  ro.inputIsParallel = true;
                  if (kind == 0) ColumnParallelLinear({ctx.compute, ctx.comm}, c, 3, 3, init);
                  if (kind == 1) RowParallelLinear({ctx.compute, ctx.comm}, c, 3, 3, init, ro);
                  if (kind == 2) VocabParallelEmbedding({ctx.compute, ctx.comm}, c, 3, 3, init);
                },
                "ModelParallelConfig: sequence_parallel needs tensor_model_parallel_size > 1, got 1"};
      }
      case 5: {
        const int g = *pick<int>({2, 3, 4}), kind = *pickIndex(3);
        const char* name = kind == 0 ? "ColumnParallelLinear" : kind == 1 ? "RowParallelLinear" : "VocabParallelEmbedding";
        return {std::string(name) + " on a GTP_remat group of " + str(g) + " without a gtpReducer", g,
                [=](RankContext& ctx) {
                  std::unique_ptr<Collectives> tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");  // T = 1
                  LayerContext lc{ctx.compute, *tp};
                  lc.gtp = &ctx.comm;
                  if (kind == 0) ColumnParallelLinear(lc, configFor(1), 3, 4, init);
                  if (kind == 1) RowParallelLinear(lc, configFor(1), 4, 3, init);
                  if (kind == 2) VocabParallelEmbedding(lc, configFor(1), 4, 3, init);
                },
                std::string(name) + ": a GTP_remat group of size " + str(g) +
                    " needs LayerContext::gtpReducer to reduce the weight gradient"};
      }
      case 6: {
        const bool missingActivations = *flag();
        return {std::string("deferral without ") + (missingActivations ? "embedding_activation_buffer" : "grad_output_buffer"),
                T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.deferEmbeddingWgradCompute = c.gradientAccumulationFusion = true;
                  c.pipelineModelParallelSize = 2;
                  std::vector<Tensor> buffer;
                  ColumnParallelOptions o;
                  (missingActivations ? o.gradOutputBuffer : o.embeddingActivationBuffer) = &buffer;
                  ColumnParallelLinear({ctx.compute, ctx.comm}, c, 3, T, init, o);
                },
                std::string("ColumnParallelLinear: defer_embedding_wgrad_compute needs both embedding_activation_buffer "
                            "and grad_output_buffer; ") +
                    (missingActivations ? "embedding_activation_buffer" : "grad_output_buffer") + " is missing"};
      }
      case 7: {
        const bool noPipeline = *flag();
        return {noPipeline ? "deferral at pipeline size 1" : "deferral without fusion", T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.deferEmbeddingWgradCompute = true;
                  c.pipelineModelParallelSize = noPipeline ? 1 : 2;
                  c.gradientAccumulationFusion = noPipeline;
                  ColumnParallelLinear({ctx.compute, ctx.comm}, c, 3, T, init);
                },
                noPipeline ? "ModelParallelConfig: defer_embedding_wgrad_compute needs pipeline_model_parallel_size > 1, got 1"
                           : "ModelParallelConfig: defer_embedding_wgrad_compute needs gradient_accumulation_fusion"};
      }
      case 8: {
        const int limit = *pick<int>({-1, -3});
        return {"wgrad_deferral_limit " + str(limit), T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.wgradDeferralLimit = limit;
                  RowParallelLinear({ctx.compute, ctx.comm}, c, T, 3, init);
                },
                "ModelParallelConfig: wgrad_deferral_limit must be >= 0, got " + str(limit)};
      }
      case 9: {
        const bool row = *flag();
        return {std::string(row ? "row" : "column") + " forward under fusion without main_grad", T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.gradientAccumulationFusion = true;
                  Tensor x = ctx.compute.zeros({2, T}, DType::kFloat32);
                  RowParallelOptions ro;
                  ro.inputIsParallel = true;
                  if (row) RowParallelLinear({ctx.compute, ctx.comm}, c, T * T, 3, init, ro).forward(x);
                  else ColumnParallelLinear({ctx.compute, ctx.comm}, c, T, T, init).forward(x);
                },
                std::string("LinearWithGradAccumulation: gradient accumulation fusion needs ") + (row ? "row" : "column") +
                    ".weight.main_grad allocated before forward"};
      }
      case 10: {
        const int which = *pickIndex(3);
        const std::int64_t k = q * T, bad = k + off;
        return {"forward with the wrong K, layer " + str(which), T,
                [=](RankContext& ctx) {
                  Tensor x = ctx.compute.zeros({2, bad}, DType::kFloat32);
                  RowParallelOptions ro;
                  ro.inputIsParallel = which == 2;
                  if (which == 0) ColumnParallelLinear({ctx.compute, ctx.comm}, configFor(T), k, T, init).forward(x);
                  else RowParallelLinear({ctx.compute, ctx.comm}, configFor(T), which == 2 ? k * T : k, 3, init, ro)
                      .forward(x);
                },
                which == 0   ? "ColumnParallelLinear::forward: input must end in K=" + str(k) + ", got fp32 (2, " + str(bad) + ")"
                : which == 1 ? "RowParallelLinear::forward: input must end in K=" + str(k) + ", got fp32 (2, " + str(bad) + ")"
                             : "RowParallelLinear::forward: input must end in K/T=" + str(k) + ", got fp32 (2, " +
                                   str(bad) + ")"};
      }
      case 11: {
        const std::int64_t v = q * 4, id = *pick<std::int64_t>({v, v + 3, -1});
        const std::int64_t at = *pickIndex(6);
        return {"embedding id " + str(id) + " at T = 1", 1,
                [=](RankContext& ctx) {
                  VocabParallelEmbedding emb({ctx.compute, ctx.comm}, configFor(1), v, 2, init);
                  std::vector<double> ids(6, 0.0);
                  ids[std::size_t(at)] = double(id);
                  emb.forward(tensorOf(ctx.compute, DType::kInt64, ids, Shape{2, 3}));
                },
                "VocabParallelEmbedding::forward: ids must lie in [0, V=" + str(v) + "), got id " + str(id) +
                    " at position (" + str(at / 3) + ", " + str(at % 3) + ")"};
      }
      case 12: {
        const std::int64_t s = q * T + off;
        return {"reduce_scatter_embeddings with s = " + str(s), T,
                [=](RankContext& ctx) {
                  VocabParallelEmbeddingOptions o;
                  o.reduceScatterEmbeddings = true;
                  VocabParallelEmbedding emb({ctx.compute, ctx.comm}, configFor(T), T, 2, init, o);
                  emb.forward(ctx.compute.zeros({1, s}, DType::kInt64));
                },
                "VocabParallelEmbedding::forward: reduce_scatter_embeddings needs the sequence length s divisible by "
                "tp_size " + str(T) + ", got s = " + str(s)};
      }
      case 13: {
        const int kind = *pickIndex(3);
        const bool cpu = *flag();
        const char* name = kind == 0 ? "ColumnParallelLinear" : kind == 1 ? "RowParallelLinear" : "VocabParallelEmbedding";
        return {std::string(cpu ? "CPU" : "GPU-style") + " initialization without its generator, " + name, T,
                [=](RankContext& ctx) {
                  ModelParallelConfig c = configFor(T);
                  c.performInitialization = true;
                  c.useCpuInitialization = cpu;
                  if (kind == 0) ColumnParallelLinear({ctx.compute, ctx.comm}, c, 3, T, init);
                  if (kind == 1) RowParallelLinear({ctx.compute, ctx.comm}, c, T, 3, init);
                  if (kind == 2) VocabParallelEmbedding({ctx.compute, ctx.comm}, c, T, 3, init);
                },
                std::string(name) + (cpu ? ": use_cpu_initialization needs LayerContext::cpuGenerator"
                                         : ": GPU-style initialization needs LayerContext::rngTracker")};
      }
      case 14: {
        const bool row = *flag();
        return {std::string(row ? "row" : "column") + " backward before forward", T,
                [=](RankContext& ctx) {
                  Tensor dy = ctx.compute.zeros({2, 3}, DType::kFloat32);
                  if (row) RowParallelLinear({ctx.compute, ctx.comm}, configFor(T), T, 3, init).backward(dy);
                  else ColumnParallelLinear({ctx.compute, ctx.comm}, configFor(T), 3, 3 * T, init).backward(dy);
                },
                std::string(row ? "RowParallelLinear" : "ColumnParallelLinear") + "::backward: called before forward"};
      }
      case 16: {  // SPEC 8 item 14: no default dp_cp_group
        const int kind = *pickIndex(3);
        const char* name = kind == 0 ? "ColumnParallelLinear" : kind == 1 ? "RowParallelLinear" : "VocabParallelEmbedding";
        return {std::string("sharded_state_dict of ") + name + " without dp_cp_group", T,
                [=](RankContext& ctx) {
                  if (kind == 0) {
                    ColumnParallelLinear l({ctx.compute, ctx.comm}, configFor(T), 3, T, init);
                    shardedStateDict(l, "", {}, ctx.comm, nullptr);
                  } else if (kind == 1) {
                    RowParallelLinear l({ctx.compute, ctx.comm}, configFor(T), T, 3, init);
                    shardedStateDict(l, "", {}, ctx.comm, nullptr);
                  } else {
                    VocabParallelEmbedding l({ctx.compute, ctx.comm}, configFor(T), T, 3, init);
                    shardedStateDict(l, "", {}, ctx.comm, nullptr);
                  }
                },
                std::string("shardedStateDict(") + name + "): metadata must provide dp_cp_group, got nullptr"};
      }
      case 17: {  // SPEC 8 item 6: rank without world size, or the reverse
        const bool onlyRank = *flag();
        return {onlyRank ? "CPU init with rank but no world size" : "CPU init with world size but no rank", 1,
                [=](RankContext& ctx) {
                  Parameter w;
                  w.name = "weight";
                  w.data = ctx.compute.zeros({2, 3}, DType::kFloat32);  // (N/T, K)
                  Generator g(1);
                  initializeAffineWeightCpu(ctx.compute, w, 2 * T, 3, 2, 0, init, g, 1, false, DType::kFloat32,
                                            onlyRank ? std::optional<int>(0) : std::nullopt,
                                            onlyRank ? std::nullopt : std::optional<int>(T));
                },
                std::string("initializeAffineWeightCpu: rank and worldSize must be given together, got only ") +
                    (onlyRank ? "rank" : "worldSize")};
      }
      case 18: {  // SPEC 8 item 12: sequence parallelism and the dgrad all-reduce together
        const bool frozen = *flag();
        return {std::string(frozen ? "LinearWithFrozenWeight" : "LinearWithGradAccumulation") +
                    " with sequence_parallel and allreduce_dgrad",
                T,
                [=](RankContext& ctx) {
                  LinearOptions o;
                  o.sequenceParallel = o.allreduceDgrad = true;
                  if (frozen) LinearWithFrozenWeight(ctx.compute, ctx.comm, o);
                  else LinearWithGradAccumulation(ctx.compute, ctx.comm, o);
                },
                frozen ? "LinearWithFrozenWeight: sequence_parallel and allreduce_dgrad together would reduce dX twice"
                       : "LinearWithGradAccumulation: sequence_parallel and allreduce_dgrad are mutually exclusive"};
      }
      case 19:  // SPEC 8 item 9: deferral without fusion
        return {"wgrad deferral without gradient accumulation fusion", T,
                [=](RankContext& ctx) {
                  std::vector<Tensor> buffer;
                  LinearOptions o;
                  o.gradOutputBuffer = &buffer;
                  LinearWithGradAccumulation(ctx.compute, ctx.comm, o);
                },
                "LinearWithGradAccumulation: wgrad deferral (grad_output_buffer) needs gradient accumulation fusion"};
      case 20: {  // SPEC 8 item 5: the six model-parallel attributes are set once
        const int dim = *pick<int>({0, 1});
        return {"set_tensor_model_parallel_attributes on a tagged weight", 1,
                [=](RankContext&) {
                  ParamAttributes a;
                  setTensorModelParallelAttributes(a, true, dim, 1);
                  setTensorModelParallelAttributes(a, true, 1 - dim, 1);
                },
                "setTensorModelParallelAttributes: attribute 'tensor_model_parallel' must be absent, got it already set"};
      }
      default: {
        const bool supplied = *flag();
        return {supplied ? "a supplied weight of the wrong shape" : "skip_weight_param_allocation without a weight", T,
                [=](RankContext& ctx) {
                  ColumnParallelOptions o;
                  o.skipWeightParamAllocation = true;
                  ColumnParallelLinear col({ctx.compute, ctx.comm}, configFor(T), 3, q * T, init, o);
                  Parameter wrong;
                  wrong.data = ctx.compute.zeros({q * T, 3}, DType::kFloat32);  // the unsharded shape
                  Tensor x = ctx.compute.zeros({2, 3}, DType::kFloat32);
                  col.forward(x, supplied ? &wrong : nullptr);
                },
                supplied ? "ColumnParallelLinear::forward: supplied weight must be (" + str(q) + ", 3), got fp32 (" +
                               str(q * T) + ", 3)"
                         : "ColumnParallelLinear::forward: weight was not supplied, and skip_weight_param_allocation "
                           "left the layer without one"};
      }
    }
  });
}

}  // namespace

// Every RunConfig with one thing wrong is rejected by validate() with a message naming the flag.
TPSIM_PROP(ErrorLaws, InvalidRunConfigIsRejectedNamingTheFlag, 3000) {
  const InvalidRunConfig bad = *genInvalidRunConfig();
  const std::string got = outcome([&] { bad.config.validate(); });
  assertRejected(got, bad.expected);
}

// Inputs of the wrong shape, divisibility or content are rejected before any rank runs, with a
// message naming the .npy file and the flag.
TPSIM_PROP(ErrorLaws, InvalidInputsAreRejectedNamingTheFileAndTheFlag, 1500) {
  const InvalidRunInputs bad = *genInvalidRunInputs();
  for (const Backend* b : usableBackends()) {
    const std::string got = outcome([&] { b->runLayer(bad.config, bad.inputs); });
    assertRejected(got, bad.expected);
  }
}

// Every misuse of a layer throws InvalidArgument on every rank, naming the argument and its value.
TPSIM_PROP(ErrorLaws, LayerMisuseIsRejectedOnEveryRankNamingTheArgument, 1500) {
  const LayerMisuse misuse = *genLayerMisuse();
  for (const Backend* b : usableBackends()) {
    std::mutex mu;
    std::vector<std::string> got;
    b->runRanks(misuse.ranks, [&](RankContext& ctx) {
      const std::string o = outcome([&] { misuse.use(ctx); });
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(o);
    });
    RC_ASSERT(int(got.size()) == misuse.ranks);
    for (const std::string& g : got) assertRejected(g, misuse.expected);
  }
}

// Sizes that do not tile the world are rejected naming the size and the product.
TPSIM_PROP(ErrorLaws, InvalidTopologiesAreRejectedNamingTheSize, 1500) {
  const Topology t = *genTopology(64);
  ParallelSizes s = sizesOf(t);
  std::string expected;
  switch (*pickIndex(6)) {
    case 0:  // the dense product T·P·C does not divide W
      s.world = t.world() + *uniform<int>(1, t.tp * t.cp * t.pp + 1);
      RC_PRE(s.world % (t.tp * t.cp * t.pp) != 0);
      expected = "ParallelLayout: dense data-parallel size D = W/(T·P·C·G) must be an integer, got W = " +
                 std::to_string(s.world);
      break;
    case 1:  // the expert product ET·E·P does not divide W
      s.expertTp = t.expertTp * *pick<int>({3, 5, 7});
      RC_PRE(s.world % (s.expertTp * t.ep * t.pp) != 0);
      expected = "ParallelLayout: expert data-parallel size ED = W/(ET·E·P·EG) must be an integer, got W = " +
                 std::to_string(s.world);
      break;
    case 2: {  // a size below 1
      const int which = *pickIndex(4), v = *pick<int>({0, -1});
      int* fields[] = {&s.world, &s.tp, &s.pp, &s.cp};
      const char* names[] = {"world size", "tp (T)", "pp (P)", "cp (C)"};
      *fields[which] = v;
      expected = std::string("ParallelLayout: ") + names[which] + " must be >= 1, got " + std::to_string(v);
      break;
    }
    case 3: {  // tensor_parallel_num_weight_shards not a multiple of T
      const int shards = t.tp * *pick<int>({1, 2, 3}) + *uniform<int>(1, std::max(2, t.tp));
      RC_PRE(shards % t.tp != 0);
      const std::string got = outcome([&] { gtpRematSize(shards, t.tp); });
      assertRejected(got, "gtpRematSize: tensor_parallel_num_weight_shards must be a multiple of "
                                  "tensor_model_parallel_size (" + std::to_string(t.tp) + "), got " +
                                  std::to_string(shards));
      return;
    }
    case 4:  // more distributed-optimizer instances than data-parallel ranks
      s.distOptInstances = t.dp * t.cp + *uniform<int>(1, 4);
      expected = "ParallelLayout: num_distributed_optimizer_instances (" + std::to_string(s.distOptInstances) +
                 ") must divide the data-parallel size with context parallelism D·C = " + std::to_string(t.dp) +
                 "·" + std::to_string(t.cp);
      break;
    default: {  // a world communicator of another size
      const ParallelLayout layout(s);
      const int ranks = layout.world() + *pick<int>({1, 2});
      std::mutex mu;
      std::vector<std::string> got;
      backendNamed("sim").runRanks(ranks, [&](RankContext& ctx) {
        const std::string o = outcome([&] { ProcessGroups(ctx.comm, layout); });
        std::lock_guard<std::mutex> lock(mu);
        got.push_back(o);
      });
      for (const std::string& g : got)
        assertRejected(g, "ProcessGroups: world communicator 'world' must have the layout's world size " +
                                      std::to_string(layout.world()) + ", got " + std::to_string(ranks));
      return;
    }
  }
  const std::string got = outcome([&] { ParallelLayout{s}; });
  assertRejected(got, expected);
}

// Megatron's tracker seeds collide when 100·ep_rank + etp_rank − tp_rank = 1694 (SPEC 8 item 4):
// the second add is rejected naming the seed, as Megatron's raises.
TPSIM_PROP(ErrorLaws, CollidingRngSeedsAreRejectedNamingTheSeed, 300) {
  const std::uint64_t seed = *genSeed();
  RankSeeds s;
  s.epRank = *pick<int>({17, 18, 19});
  s.etpRank = *uniform<int>(0, 10);
  s.tpRank = 100 * s.epRank + s.etpRank - 1694;  // >= 6
  const int tpRank = s.tpRank;
  RngTracker tracker;
  assertRejected(outcome([&] { modelParallelManualSeed(tracker, seed, s); }),
                 "RngTracker::add: seed must be unused, got " + std::to_string(seed + 2718 + tpRank) +
                     " for 'expert-parallel-rng'");
}

// A split along a dim the group size does not divide names the dim, the group and the shape.
TPSIM_PROP(ErrorLaws, IndivisibleSplitsAreRejectedNamingTheGroupAndTheShape, 800) {
  const int n = *genTpAbove1();
  const std::int64_t extent = n * *pick<std::int64_t>({1, 2}) + *uniform<std::int64_t>(1, n);
  const bool lastDim = *flag();
  std::mutex mu;
  std::vector<std::string> got;
  backendNamed("sim").runRanks(n, [&](RankContext& ctx) {
    Tensor x = ctx.compute.zeros(lastDim ? Shape{2, extent} : Shape{extent, 2}, DType::kFloat32);
    const std::string o = outcome([&] {
      if (lastDim) scatterToTpRegionForward(ctx.compute, ctx.comm, x);
      else scatterToSpRegionForward(ctx.compute, ctx.comm, x);
    });
    std::lock_guard<std::mutex> lock(mu);
    got.push_back(o);
  });
  const std::string shape = lastDim ? "(2, " + std::to_string(extent) + ")" : "(" + std::to_string(extent) + ", 2)";
  for (const std::string& g : got)
    assertRejected(g, std::string(lastDim ? "the last dim" : "dim 0") + " of x must be divisible by the size " +
                                  std::to_string(n) + " of group 'world', got x " + shape);
}

}  // namespace tpsim::props
