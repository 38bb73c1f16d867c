// Runs one layer kind sharded on the simulator, exactly as Megatron would shard it, and puts
// the results back into the unsharded layout: the engine behind `tpsim run` and `tpsim demo`.
//
// Inputs and results are unsharded HostTensors named after Megatron's tensors (reference.h).
// Every rank builds the layers and cuts its parameters, input and output gradient out of the
// unsharded tensors by the layers' own placements (core/placement.h: column weights by output
// rows, row weights by input columns, embeddings by vocab rows, stride-interleaved chunks,
// activations along the sequence under sequence parallelism, GTP_remat's padded second split of
// the weights and the peers' batch blocks); the results go back through the same placements.
// Gradients are what an optimizer would read after Megatron's gradient finalization: main_grad
// under fusion or GTP_remat (stripped of padding), parameters tagged sequence_parallel all-reduced
// over TP on the ranks (finalizeSequenceParallelGrads), replicated parameters reduced over the
// GTP_remat peers (MEAN: the full-batch gradient / G, SUM: the full-batch gradient).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/world.h"
#include "tools/lib/checkpoint_files.h"
#include "core/config.h"
#include "core/layers.h"
#include "core/placement.h"
#include "tools/lib/reference.h"
#include "tools/lib/trace.h"

namespace tpsim::tools {

struct RunConfig {
  LayerKind layer = LayerKind::kColumn;
  int tp = 2;
  bool sequenceParallel = false;
  bool bias = false;
  bool gatherOutput = false;
  bool inputIsParallel = false;
  bool reduceScatterEmbeddings = false;
  bool skipBiasAdd = false;
  // Column: no TP reduction of dX; input.grad is then every rank's partial dY_t·W_t, stacked
  // (T, s, b, K).
  bool disableGradReduce = false;
  int stride = 1;
  DType dtype = DType::kFloat32;
  std::optional<DType> outputDtype;
  bool gradAccumulationFusion = false;
  DType mainGradDtype = DType::kFloat32;
  // GTP_remat (SPEC 4): weights sharded again over G peers, which split the batch b between them.
  int gtpRemat = 1;
  int padForAlignment = 16;
  bool gtpReduceMean = true;  // Megatron's default; false: SUM (calculate_per_token_loss)
  bool fp32AccumReduceScatter = false;
  // The linears' weights as the GEMMs read them (core/mxfp8.h); not for the embedding.
  WeightFormat weightFormat = WeightFormat::kNative;
  std::uint64_t seed = 1234;
  std::string backend = "sim";  // tools/lib/backend.h
  int threads = 0;
  std::vector<Fault> faults;                   // --inject: ranks that misbehave on purpose
  std::chrono::milliseconds timeout{60'000};   // --timeout: the world's collective timeout
  bool record = false;                         // log every op for a trace (RunResult::records)
  // Shapes of generated data (ignored for tensors loaded from files).
  std::int64_t seq = 8, batch = 2, inFeatures = 16, outFeatures = 16, ffnHidden = 64, vocab = 32;

  // Throws InvalidArgument naming the flag for combinations Megatron rejects or cannot express,
  // and for values out of range.
  void validate() const;
  std::string str() const;  // the effective configuration, one line
};

// --sequence-parallel on the embedding means what Megatron's language model does with it:
// reduce_scatter_embeddings (the output reduce-scattered along the sequence).
void applyEmbeddingSequenceParallel(RunConfig& config);

// name -> shape of the unsharded inputs, as TensorMap names them.
using ShapeMap = std::map<std::string, std::vector<std::int64_t>>;
// The shapes of generateInputs' tensors. Throws InvalidArgument naming the flags when a tensor's
// size in bytes (as doubles) does not fit in int64.
ShapeMap generatedShapes(const RunConfig& config);
// Seeded data with the configured shapes, rounded to the configured dtype.
TensorMap generateInputs(const RunConfig& config);
// Checks that loaded tensors have consistent shapes and dtypes; messages name the file.
void checkInputs(const RunConfig& config, const TensorMap& inputs);

// The layers of config's kind as one rank builds them (shapes from config's sizes, parameters not
// initialized): what `tpsim run` runs and `tpsim layout` describes.
struct RankLayers {
  std::unique_ptr<ColumnParallelLinear> column;  // --layer column, or the MLP's fc1
  std::unique_ptr<RowParallelLinear> row;        // --layer row, or the MLP's fc2
  std::unique_ptr<VocabParallelEmbedding> embedding;

  // Every parameter, named as the inputs name them ("weight", "bias"; "fc1.weight", ...).
  std::vector<std::pair<std::string, Parameter*>> parameters() const;
  // core/placement.h's description of every tensor on (seq, batch) tokens; the MLP's are fc1's
  // then fc2's, prefixed "fc1." and "fc2.".
  std::vector<TensorPlacement> placements(std::int64_t seq, std::int64_t batch) const;
  // The rank's sharded_state_dict: what a checkpoint saves and loads.
  ShardedStateDict stateDict(Collectives& tp, Collectives* dpCp) const;
};
ModelParallelConfig layerConfig(const RunConfig& config);
RankLayers buildLayers(const LayerContext& context, const ModelParallelConfig& mp, const RunConfig& config);

struct RunResult {
  TensorMap results;                       // unsharded, named as in reference.h
  std::vector<TensorPlacement> placements;  // of every tensor of the layers (RankLayers::placements)
  std::vector<std::vector<TraceEvent>> trace; // per rank: every collective it issued
  std::vector<RankRecord> records;             // per rank, with RunConfig::record: its ops in order
};

// A run's checkpoint hooks. Every rank builds its layers' sharded state dict (keys as the inputs
// are named: weight, bias; mlp: fc1.weight, ...) once its parameters are set; with `load` it then
// reads its own chunks of them from the checkpoint (over the inputs' values, which must hold the
// same tensors for the dense reference), with `save` it adds them to the writer.
struct CheckpointHooks {
  const CheckpointReader* load = nullptr;
  CheckpointWriter* save = nullptr;
};

// Throws InvalidArgument naming the flag when `config` cannot be checkpointed: --stride > 1 or
// --weight-format mxfp8. runSharded checks it too whenever a hook is set.
void checkCheckpointable(const RunConfig& config);
RunResult runSharded(const RunConfig& config, const TensorMap& inputs, const CheckpointHooks& hooks = {});

// A row of the verification table: max |sharded - dense| against the largest allowed.
struct Verdict {
  std::string name;
  std::string shape;
  double maxError = 0;
  double maxBound = 0;
  std::int64_t outside = 0;  // elements beyond their bound
  // NaN or Inf in the sharded result, counted apart.
  std::int64_t nonFinite = 0;
  std::int64_t firstNonFinite = -1;  // flat index
};
// How results are checked against the dense reference. kBound: |sharded - dense| within the
// data-derived bound (reference.h). kExact: every element equal to the dense result rounded once to
// the result's dtype (max|err| = 0); it holds where each step of the sharded run is exact, e.g. on
// small-integer data without GeLU (the property suite's exact mode), and is the check that the
// sharding moves every element to the right place with nothing lost. kNone: nothing is checked.
enum class VerifyMode { kBound, kExact, kNone };
// One verdict per result; none for kNone (the reference is not computed).
std::vector<Verdict> verify(const RunConfig& config, const TensorMap& inputs, const TensorMap& results,
                            VerifyMode mode = VerifyMode::kBound);
// The table's result column ("OK", "FAIL", "NON-FINITE"), and for a result holding NaN or Inf the
// line that says how many and where the first is ("" otherwise).
std::string verdictResult(const Verdict& v);
std::string nonFiniteNote(const Verdict& v);

// The reference options of `config`'s run, and its dense reference as verify() checks it: under
// GTP_remat MEAN every parameter gradient (and its bound) is 1/G of the full batch's.
ReferenceOptions referenceOptions(const RunConfig& config);
std::map<std::string, Checked> referenceFor(const RunConfig& config, const TensorMap& inputs);

// The shape flags of c's layer in order, as (flag, value): seq, batch, then in-features and
// out-features, out-features and vocab, or in-features and ffn-hidden.
std::vector<std::pair<std::string, std::int64_t>> shapeFlags(const RunConfig& c);

// The `tpsim run` command line that runs `config`: "tpsim run --layer row --tp 4 ... --seed 7".
// With loadDir, it ends in "--load <loadDir>" (quoted for a POSIX shell when needed) and leaves out
// the shape flags, which --load ignores; without it, it lists the shape flags of config's layer.
std::string commandLine(const RunConfig& config, const std::string& loadDir = "");

}  // namespace tpsim::tools
