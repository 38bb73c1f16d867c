// Runs one layer sharded on a world of T x G ranks, exactly as Megatron would shard it, and puts
// the results back into the unsharded layout: the engine behind `tpsim run` and `tpsim demo`.
//
// Nothing here knows a layer kind: the run's LayerKind (tools/lib/layer_kind.h) builds each rank's
// modules and runs them, and their placements (core/placement.h) say what every rank holds. Every
// rank cuts its parameters, input and output gradient out of the unsharded tensors by those
// placements, and the results go back through the same placements. Gradients are what an optimizer
// would read after Megatron's gradient finalization: main_grad under fusion or GTP_remat (stripped
// of padding), parameters tagged sequence_parallel all-reduced over TP on the ranks
// (finalizeSequenceParallelGrads), replicated parameters reduced over the GTP_remat peers (MEAN: the
// full-batch gradient / G, SUM: the full-batch gradient).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "backends/world.h"
#include "core/placement.h"
#include "tools/lib/checkpoint_files.h"
#include "tools/lib/layer_kind.h"
#include "tools/lib/progress.h"
#include "tools/lib/reference.h"
#include "tools/lib/run_config.h"
#include "tools/lib/trace.h"

namespace tpsim::tools {

// A result as the ranks hold it, read in place (assembleRect) or put together (assembled): rank
// (t, g)'s tensor is ranks[g · T + t], T = placement.tp.size, and the assembled sum is divided by
// `divisor` (G for the GTP_remat peers' MEAN over a parameter they replicate, else 1). A rank another
// process runs holds an empty tensor (KeptResults::kPart).
struct ShardedResult {
  TensorPlacement placement;
  std::vector<StoredTensor> ranks;
  DType dtype = DType::kFloat32;  // the ranks'
  double divisor = 1;

  const StoredTensor& local(int t, int g) const { return ranks[std::size_t(g * placement.tp.size + t)]; }
};
HostTensor assembled(const ShardedResult& result);

struct RunResult {
  // The results as the ranks hold them: output, input.grad, <parameter>.grad.
  std::map<std::string, ShardedResult> sharded;
  // The same unsharded, unless the run was told not to assemble them (runSharded).
  TensorMap results;
  std::vector<TensorPlacement> placements;    // of every tensor of the layer (LayerModules::placements)
  std::vector<std::vector<TraceEvent>> trace; // per rank: every collective it issued
  std::vector<RankRecord> records;            // per rank, with RunConfig::record: its ops in order
  // Results whose ranks' copies disagree, each with the copy of every element farthest from the
  // result (assembleRect): verify checks them as well, so no rank's wrong copy goes unseen.
  std::map<std::string, HostTensor> otherCopies;
};

// A run's checkpoint hooks. Every rank builds its modules' sharded state dict (keys as the inputs
// are named: weight, bias; mlp: fc1.weight, ...) once its parameters are set; with `load` it then
// reads its own chunks of them from the checkpoint (over the inputs' values, which must hold the
// same tensors for the dense reference), with `save` it adds them to the writer.
struct CheckpointHooks {
  const CheckpointReader* load = nullptr;
  CheckpointWriter* save = nullptr;
};

// What runSharded keeps of the results: put together (RunResult::results and otherCopies) besides
// as the ranks hold them (RunResult::sharded); only the latter, what verify and saving read in
// place; or none, where nothing reads them (the trace and records are kept): a world spread over
// processes then moves none of them to process 0; or, spread over processes whose reference splits
// (LayerKind::partResults), those results where their ranks are, in every process, and the others
// as kSharded in process 0.
enum class KeptResults { kAssembled, kSharded, kNone, kPart };

// Checks the configuration and the inputs (checkInputs), and checkCheckpointable with a hook, then
// runs forward and backward on every rank. With `progress`, its phases are forward and backward
// (counting the ranks past each), then assemble.
RunResult runSharded(const RunConfig& config, const InputMap& inputs, const CheckpointHooks& hooks = {},
                     Progress* progress = nullptr, KeptResults kept = KeptResults::kAssembled);

// A process's part of a run's inputs where nothing it does needs them whole (in a world spread over
// processes, all but the one that verifies or saves): the shards its own ranks read, and the whole
// tensors' shapes.
struct InputShards {
  ShapeMap shapes;
  std::vector<InputMap> ranks;  // by global rank: input name -> its shard; empty for other processes' ranks
};
// Takes the inputs a piece at a time and copies each piece's elements into the shards of this
// process's ranks (every rank's in one process) that hold them, cut by `placements` (placementsOf
// config, with its sizes): no input is held whole.
class ShardedInputs : public InputSink {
 public:
  ShardedInputs(const RunConfig& config, std::vector<TensorPlacement> placements);
  void begin(const std::string& name, const TensorHeader& header) override;
  bool wants(std::int64_t offset, std::int64_t count) const override;
  void piece(std::int64_t offset, std::int64_t count, const char* bytes) override;
  void end() override;
  InputShards release() { return std::move(shards_); }

 private:
  struct Cut {
    StoredTensor* shard;
    std::vector<ShardRun> runs;
  };
  RunConfig config_;
  std::vector<TensorPlacement> placements_;
  InputShards shards_;
  std::vector<Cut> cuts_;  // of the tensor being taken, one per rank of this process
};
// runSharded on inputs already cut, checked by the caller (checkInputHeaders, and CheckedInputs on
// the pieces they were cut from). Each rank moves its shards out as it reads them.
RunResult runSharded(const RunConfig& config, InputShards inputs, const CheckpointHooks& hooks = {},
                     Progress* progress = nullptr, KeptResults kept = KeptResults::kAssembled);

// The names of runSharded's results for config: output, input.grad (unless the input is token ids)
// and <parameter>.grad for each parameter; what `tpsim run --save` writes, known before the run.
std::vector<std::string> resultNames(const RunConfig& config);

// The placements of config's layer as its modules, built on T x G simulated ranks, describe
// themselves (rank (0, 0)'s view; the description is the same on every rank), on config's sizes.
// Runs no forward or backward and reads no tensor values.
std::vector<TensorPlacement> placementsOf(const RunConfig& config);
// The `_extra_state` entries of every rank's sharded state dict for config's layer, rank by rank,
// from its modules built as placementsOf builds them: what a checkpoint it loads must hold, known
// before a world runs it (CheckpointReader::checkObject).
std::vector<ShardedObject> checkpointObjectsOf(const RunConfig& config);

// A row of the verification table: max |sharded - dense| against the largest allowed.
struct Verdict {
  std::string name;
  std::string shape;
  double maxError = 0;
  double maxBound = 0;
  // The least bound/|err| over the elements: how many times their errors could grow before one
  // leaves its bound. Inf where every element is exact; NaN under kExact (no tolerance) or once an
  // error is NaN.
  double slack = std::numeric_limits<double>::infinity();
  std::int64_t outside = 0;  // elements beyond their bound
  std::int64_t firstOutside = -1;  // flat index of the first, with its error and bound
  double firstOutsideError = 0, firstOutsideBound = 0;
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
// One verdict per result; none for kNone (the reference is not computed). `placements` are the
// run's (RunResult::placements); without them they are built again (placementsOf). An element whose
// copy in `otherCopies` (RunResult::otherCopies) is outside its bound is outside.
std::vector<Verdict> verify(const RunConfig& config, const InputMap& inputs, const TensorMap& results,
                            VerifyMode mode = VerifyMode::kBound, const std::vector<TensorPlacement>& placements = {},
                            const std::map<std::string, HostTensor>& otherCopies = {});
// The same for a run's result, read from the ranks' tensors in place (RunResult::sharded).
std::vector<Verdict> verify(const RunConfig& config, const InputMap& inputs, const RunResult& result,
                            VerifyMode mode = VerifyMode::kBound);
// What a process of a spread world whose reference splits (LayerKind::partResults) holds for its part
// of the reference: the inputs it reads, each parameter TP splits as this process's ranks' shards
// joined (rows [begin, end) of the split dimension, of `whole`), the others whole.
struct PartInputs {
  InputMap inputs;
  std::int64_t begin = 0, end = 0, whole = 0;
  std::map<std::string, int> split;  // the parameters held in part, each with the dimension it cuts
};
// The names of config's inputs that such a process holds whole (`placements`: placementsOf config).
std::vector<std::string> partWholeInputs(const RunConfig& config, const std::vector<TensorPlacement>& placements);
// Its part, from its ranks' shards of the split parameters (before they run) and the whole others.
PartInputs partInputs(const RunConfig& config, const std::vector<TensorPlacement>& placements,
                      const InputShards& shards, InputMap whole);
// verify() in each process of such a world, its results kept as KeptResults::kPart: this process's
// part of the reference, checked where the results are; process 0 returns every process's verdicts
// merged (the table one process prints), the others none.
std::vector<Verdict> verifyPart(const RunConfig& config, const PartInputs& inputs, const RunResult& result,
                                VerifyMode mode);
// v's counts and extremes added to `into`'s: verdicts of disjoint elements of one result as one.
void mergeVerdict(Verdict& into, const Verdict& v);

// The verification table as `tpsim run` prints it: a header line, then a row per verdict (tensor,
// shape, max|err|, bound, slack, #outside, result).
std::string verificationTable(const std::vector<Verdict>& verdicts);
// The table's slack column: %.3g, "inf" where every element is exact, "-" where there is none.
std::string slackText(const Verdict& v);
// The table's result column ("OK", "FAIL", "NON-FINITE"), and the lines under the table: for a
// result outside its bound, how many elements and where the first is; for one holding NaN or Inf,
// how many and where the first is ("" otherwise).
std::string verdictResult(const Verdict& v);
std::string outsideNote(const Verdict& v);
std::string nonFiniteNote(const Verdict& v);

// The reference options of `config`'s run, and its dense reference as verify() checks it: under
// GTP_remat MEAN every parameter gradient (and its bound) is 1/G of the full batch's. Without
// placements they are built (placementsOf).
ReferenceOptions referenceOptions(const RunConfig& config, std::vector<TensorPlacement> placements = {});
std::map<std::string, Checked> referenceFor(const RunConfig& config, const InputMap& inputs,
                                            std::vector<TensorPlacement> placements = {});

}  // namespace tpsim::tools
