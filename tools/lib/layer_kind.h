// LayerKind: everything the tools know about one kind of layer (column, row, embedding, the MLP
// block), in one descriptor: its sizes and tensors, its shape and divisibility rules with their
// messages, the options it takes, how a rank builds its modules and runs them forward and backward,
// its dense reference and, through the built modules, its placements.
//
// `tpsim run`, `demo`, `layout`, the memory estimate, checkpoints and the property generators read
// descriptors; the table (layerKinds) is the one place that lists the kinds. docs/adding-a-layer.md
// shows what a new kind takes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/checkpoint.h"
#include "core/gtp.h"
#include "core/layers.h"
#include "core/placement.h"
#include "core/process_groups.h"
#include "tools/lib/host_tensor.h"
#include "tools/lib/run_config.h"

namespace tpsim::sim {
class HostPool;  // sim/host_pool.h
}

namespace tpsim::tools {

struct Checked;           // tools/lib/reference.h
struct ReferenceOptions;  // tools/lib/reference.h
class ReferenceSink;      // tools/lib/reference.h

// A size of a layer's problem: the flag that sets it for generated data, and the dim of an input
// file it is read from under --load.
struct SizeSpec {
  std::string symbol;       // as shapes are written: "s", "N"
  std::string flag;         // without dashes: "seq"
  std::int64_t RunConfig::*field;
  std::string description;  // how a file-based message names it: "the sequence length s", "N"
  std::string tensor;       // the input that holds it; "" for a size only its flag gives (--experts)
  int dim;
  // What it must divide by: nothing, T (TP cuts it; the sequence only when split), T·stride, or G
  // (the GTP_remat peers split the batch).
  enum class Divisor { kNone, kTp, kTpStride, kSequenceSplit, kGtpRemat } divisor = Divisor::kNone;
};

// One unsharded tensor a run reads, named as its .npy file: "input", "fc1.weight", "grad_output".
// Every one but the parameters reaches each rank's step as its shard (LayerModules::step).
struct TensorSpec {
  std::string name;
  TensorRole role;                // kParameter, kInput (input, token ids), or kGradient (grad_output)
  std::vector<std::string> dims;  // size symbols: {"s", "b", "K"}
  double sigma = 1.0;             // generated data: normal(0, sigma), rounded to --dtype
  std::string idRange = "";       // token ids: int64 in [0, that size) instead of floats
};

// A weight that GTP_remat shards along its TP-local dim 0.
struct GtpWeightSpec {
  std::string name;         // "weight", "fc1.weight"; "weight<i>" for each of the experts
  std::string symbol;       // the size its dim 0 is
  bool tpCutsDim0 = false;  // its TP-local dim 0 is symbol / T
};

// Options of `tpsim run` that only some kinds take.
enum class LayerOption {
  kSequenceParallel, kBias, kStride, kOutputDtype, kGatherOutput, kDisableGradReduce, kInputIsParallel, kReduceScatterEmbeddings,
  kSkipBiasAdd, kGradAccumulationFusion, kMxfp8Weights,
};

// One rank's forward and backward: the output, and the input's gradient (undefined where the
// input has none: token ids).
struct RankStep {
  Tensor output, inputGrad;
};
// A rank's shards of the run's tensors other than the parameters, by name: "input", "grad_output", ...
using RankInputs = std::map<std::string, Tensor>;

// The modules of one kind as one rank builds them (shapes from the config's sizes, parameters not
// initialized: the run copies its tensors in).
class LayerModules {
 public:
  virtual ~LayerModules() = default;
  // Every parameter, named as the inputs name them ("weight", "fc1.bias").
  virtual std::vector<std::pair<std::string, Parameter*>> parameters() = 0;
  // core/placement.h's description of every tensor, on the config's tokens.
  virtual std::vector<TensorPlacement> placements() = 0;
  // The rank's sharded_state_dict: what a checkpoint saves and loads.
  virtual ShardedStateDict stateDict(ProcessGroups& groups) = 0;
  // Forward on the rank's input, then backward from its grad_output; forwardDone() in between,
  // once the forward's work is issued (a progress display counts the ranks past it).
  virtual RankStep step(Compute& compute, const RankInputs& inputs, const std::function<void()>& forwardDone) = 0;
};

class LayerKind {
 public:
  virtual ~LayerKind() = default;
  virtual const char* name() const = 0;  // --layer's value
  virtual bool takes(LayerOption option) const = 0;
  // Why an option it does not take means nothing here, where that needs saying ("" otherwise).
  virtual std::string whyNot(LayerOption) const { return ""; }
  // Its own rules for combining options (throws InvalidArgument naming the flag).
  virtual void validate(const RunConfig&) const {}
  // applyLayerConventions: flags that mean something else for this kind.
  virtual void applyConventions(RunConfig&) const {}

  // Its sizes, in the order their flags are listed, and its tensors, in the order generated data
  // are drawn.
  virtual const std::vector<SizeSpec>& sizes() const = 0;
  virtual std::vector<TensorSpec> tensors(const RunConfig& config) const = 0;
  virtual const std::vector<GtpWeightSpec>& gtpWeights() const = 0;
  // The run's input and output among its placements ("fc1.input" and "fc2.output" for the MLP).
  virtual std::string inputPlacement() const { return "input"; }
  virtual std::string outputPlacement() const { return "output"; }
  // The placement that says what each rank holds of the run's tensor `name`: inputPlacement() for
  // "input", outputPlacement()'s gradient for "grad_output", the tensor's own name otherwise.
  std::string placementOf(const std::string& name) const;
  // Where a checkpoint keeps a parameter: under its own name, or as entry `index` along the leading
  // axis of another key (the experts' "weight3" is "weight"[3]).
  struct CheckpointSlot {
    std::string key;
    std::int64_t index = -1;  // -1: the whole key
  };
  virtual CheckpointSlot checkpointSlot(const std::string& parameter) const { return {parameter}; }
  // Which checkpoints it loads: those whose index names a kind of the same checkpointKind. A kind's
  // own name, unless kinds are one module with one set of parameters that only TP cuts differently
  // (the grouped experts' column and row modes). Shapes alone do not decide: the column and row
  // layers both hold a weight (N, K), but in a model one is fc1 and the other fc2.
  virtual std::string checkpointKind() const { return name(); }
  // The dtype GTP_remat reduce-scatters a weight gradient in (SPEC 4.5): its main_grad's.
  virtual DType gtpWireDtype(const RunConfig& config) const { return config.mainGradDtype; }
  // The dtype a weight gradient is rounded into where its sum ends, which its bound counts: the
  // wire dtype under GTP_remat, main_grad's under gradient-accumulation fusion (the GEMM adds into
  // it), else the compute dtype (autograd's grad).
  DType wgradDtype(const RunConfig& config) const;
  // Whether small-integer inputs give results every step computes exactly (--verify exact, the
  // property suite's exact mode): not through GeLU.
  virtual bool exactOnSmallIntegers() const { return true; }
  // The most terms any result element sums (bias included): what keeps integer data exact.
  virtual std::int64_t longestSum(const RunConfig& config) const = 0;
  // Per-rank intermediates a step holds beyond its tensors, and what the reference holds at once
  // beyond its results, in elements (the memory estimate's terms; 0 for a single GEMM).
  virtual double stepIntermediates(const RunConfig&, const ShapeMap&) const { return 0; }
  // A part of the reference (ReferencePart) computes `part` of the split dimension (1: all of it).
  virtual double referenceIntermediates(const RunConfig&, const ShapeMap&, double part) const {
    (void)part;
    return 0;
  }
  // Bytes the run holds per element of each rank's input and grad_output: them, their results and
  // the holes freed conversions leave between them (13, measured on the linear kinds).
  virtual double runBytesPerActivation(const RunConfig&) const { return 13; }
  // Bytes an element of a rank's share of the input and of grad_output that the rank holds only
  // while it runs, beyond runBytesPerActivation: ranks that never wait on each other (the grouped
  // experts without GTP_remat) run one a thread, from start to end, and only the threads' ranks hold
  // them at once ({0, 0}: the other kinds' ranks meet at collectives and all hold their working sets).
  struct RunningBytes {
    double input = 0, output = 0;
  };
  virtual RunningBytes runningBytesPerActivation(const RunConfig&) const { return {}; }
  // Under GTP_remat, bytes an element of the weights it shards that its gathers and its wgrads'
  // reduce-scatter hold at once where they batch every weight (the grouped experts: one all-gather
  // and one reduce-scatter for all E, each rank with its own copies); none where they take one
  // weight at a time (memory.cc's term on the largest).
  virtual std::optional<double> gtpBatchedBytes(const RunConfig&) const { return std::nullopt; }
  // Bytes the run holds per parameter element, main_grad aside, with `threads` threads running the
  // ranks: each rank's shard and gradient as backend tensors, the gradient as the run keeps it, and
  // the shards the threads are cutting (14, measured; the column and row, whose one weight is cut
  // whole at T = 1, count the threads cutting). A process of a spread world counts its fraction 1/P
  // of the bytes at P times its threads (estimateRunBytes), so a kind's threads' part is per thread.
  virtual double runBytesPerParameter(const RunConfig&, double threads) const {
    (void)threads;
    return 14;
  }
  // Whether its step and its reference multiply matrices: the packed operands each thread keeps
  // and the reference's float magnitude products.
  virtual bool packsOperands() const { return true; }
  // The share of the parameters that one of its GEMMs packs as its weight (1: the MLP's two weights
  // counted as one, as fitted; the grouped experts': one expert's).
  virtual double gemmWeightShare(const RunConfig&) const { return 1; }
  // Bytes the reference holds per parameter element: the values and bounds of its gradients whole,
  // the magnitudes behind them and the parameter's own (46, measured); or less where it sends the
  // gradients a block at a time (the blocks are its intermediates).
  virtual double referenceBytesPerParameter(const RunConfig&) const { return 46; }
  // Bytes the reference holds per element of the input and of grad_output: each in double, the
  // values and bounds of the results of their shapes, the magnitudes behind them, and the GEMMs'
  // packed copies (42, measured).
  virtual double referenceBytesPerActivation(const RunConfig&) const { return 42; }
  // What one rank holds of the run's input and of its gradient, and of grad_output and the output,
  // as a fraction of the whole: 1 where TP replicates it (the default, the most a rank can hold),
  // 1/T where TP splits it (the memory estimate's rank copies); and what a rank makes of the output
  // as its partial sum before a reduce-scatter leaves it its share (the embedding's lookup: all).
  struct RankShare {
    double input = 1, output = 1, partialOutput = 0;
  };
  virtual RankShare rankShare(const RunConfig&) const { return {}; }

  // The groups a rank's modules run on: the dense TP, GTP_remat and DP-CP groups (the experts: the
  // expert grid's).
  virtual LayerContext context(Compute& compute, ProcessGroups& groups, GtpGradReducer& reducer) const {
    return {compute, groups.tp(), nullptr, nullptr, &groups.gtpRemat(), &groups.dpCp(), &reducer};
  }
  virtual std::unique_ptr<LayerModules> build(const LayerContext& context, const ModelParallelConfig& mp,
                                              const RunConfig& config) const = 0;
  // Where the reference splits (ReferencePart) for config: the results that each part checks where
  // their ranks hold them, each element on one rank; none where it does not split. The parts' rows
  // are those of the parameters TP splits; the other inputs each part holds whole.
  virtual std::vector<std::string> partResults(const RunConfig&) const { return {}; }
  // The dense results and their relative bounds, sent to `sink` (tools/lib/reference.h).
  virtual void reference(const ReferenceOptions& options, const InputMap& inputs, ReferenceSink& sink) const = 0;
};

// The table: every kind, in the order --help lists them.
const std::vector<const LayerKind*>& layerKinds();
// The kind named `name`, or nullptr.
const LayerKind* findLayerKind(const std::string& name);
// The kind named `name`; throws InvalidArgument listing the kinds for any other name.
const LayerKind* layerKind(const std::string& name);
// "column, row, embedding or mlp": every kind, or those taking `option`, for messages.
std::string layerKindNames();
std::string layerKindsTaking(LayerOption option);
// The same for the kinds whose shapes have the size of flag `flag` (without dashes: "vocab").
std::string layerKindsSizedBy(const std::string& flag);

// The spec of config's GTP_remat-sharded weights that tensor `name` is ("weight<i>" stands for
// weight0, weight1, ...), or nullptr.
const GtpWeightSpec* gtpWeightOf(const RunConfig& config, const std::string& name);

// The size named `symbol` of config's layer (its value in config).
const SizeSpec& sizeNamed(const RunConfig& config, const std::string& symbol);
std::int64_t sizeValue(const RunConfig& config, const std::string& symbol);

// The shapes of config's tensors from its sizes. Throws InvalidArgument naming the flags when a
// tensor's size in bytes (as doubles) does not fit in int64.
ShapeMap tensorShapes(const RunConfig& config);
// A tensor's shape and dtype without its values: what a file's header or the generator says of it.
struct TensorHeader {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
};
using HeaderMap = std::map<std::string, TensorHeader>;

// The most elements in a piece of an input tensor as the generator and --load hand them over.
constexpr std::int64_t kInputPieceElements = std::int64_t(1) << 20;
// Takes a run's input tensors one at a time, each in pieces: begin, then its elements
// [offset, offset + count) in its dtype, in order and each once, then end. A taker that keeps only
// parts of them (a process's shards) never holds a tensor whole, and a source that can skip a
// piece (a file, a checkpoint) asks it first: a piece it does not want is not read, nor handed over.
class InputSink {
 public:
  virtual ~InputSink() = default;
  virtual void begin(const std::string& name, const TensorHeader& header) = 0;
  // Whether it keeps any of the elements [offset, offset + count) of the tensor begun.
  virtual bool wants(std::int64_t /*offset*/, std::int64_t /*count*/) const { return true; }
  virtual void piece(std::int64_t offset, std::int64_t count, const char* bytes) = 0;
  virtual void end() = 0;
};
// Hands each tensor it takes to `take` whole, as soon as its last piece is in.
class WholeInputs : public InputSink {
 public:
  explicit WholeInputs(std::function<void(const std::string&, StoredTensor)> take) : take_(std::move(take)) {}
  void begin(const std::string& name, const TensorHeader& header) override;
  void piece(std::int64_t offset, std::int64_t count, const char* bytes) override;
  void end() override;

 private:
  std::function<void(const std::string&, StoredTensor)> take_;
  std::string name_;
  StoredTensor tensor_;
};
// Hands `tensor` to `sink` as one piece (a tensor held whole: checkInputValues checks one so).
void sendWhole(const std::string& name, const StoredTensor& tensor, InputSink& sink);

// Seeded data with those shapes, drawn in the kind's order and rounded to the configured dtype.
// Obeys the calling thread's stop flag (backends/stop.h).
InputMap generateInputs(const RunConfig& config);
// The same to `sink`, each tensor in pieces of kInputPieceElements as they are drawn.
void generateInputs(const RunConfig& config, InputSink& sink);
// n draws of std::normal_distribution<double>(0, sigma) from rng, as libstdc++'s makes them (a new
// distribution's first n: the polar method, each pair of uniforms inside the unit disc giving two
// normals), each rounded to dtype and handed to `piece` (offset, count, bytes) in order, up to
// kInputPieceElements at a time: bit for bit that loop, and rng left as it leaves it. Only the
// uniforms and the disc test run in order, on the calling thread; logarithms, roots and stores run
// on `pool` (on the calling thread after each block's draws when it is null) beside the next block's
// draws, and only for the pieces `wants` (offset, count) wants, when it is given: the others are
// drawn, to keep the stream, but neither computed nor handed over.
void drawNormals(std::mt19937_64& rng, double sigma, DType dtype, std::int64_t n, sim::HostPool* pool,
                 const std::function<void(std::int64_t, std::int64_t, const char*)>& piece,
                 const std::function<bool(std::int64_t, std::int64_t)>& wants = {});
// config with its sizes read from `shapes` (loaded files or a checkpoint's tensors): each size from
// its own tensor's dim, where `shapes` has that tensor.
RunConfig withSizesOf(RunConfig config, const ShapeMap& shapes);

// Where a run's sizes come from, as messages name them: the shape flags (generated data, tpsim
// layout) or the tensors' .npy files (--load, or a caller's tensors); the parameters' from the
// checkpoint when one is named (--load-checkpoint DIR: "K (checkpoint DIR: key 'weight' dim 1)").
struct SizeSources {
  enum class Inputs { kFlags, kFiles } inputs = Inputs::kFiles;
  std::string checkpoint;
};
// Checks the sizes against the kind's divisibility rules (sequence and batch splits, TP cuts,
// GTP_remat's split of each weight's TP-local rows when --pad-for-alignment is 0).
void checkSizes(const RunConfig& config, const SizeSources& sources);
// A size flag given beside the files that fix that size (--load's, the checkpoint's) must agree
// with them, or the files would overrule it unsaid: `given` holds the flags' values, `givenFlags`
// the flags given (without dashes), `sized` the sizes the files give (checkInputHeaders).
void checkGivenSizes(const RunConfig& given, const std::set<std::string>& givenFlags, const RunConfig& sized,
                     const SizeSources& sources);
HeaderMap headersOf(const InputMap& inputs);
// Checks a run's tensors: every dim >= 1, each tensor present with the kind's rank, dtype and the
// shape its sizes give, then checkSizes (checkInputHeaders); then each tensor's values: finite, token
// ids in range (checkInputValues, on the config with the sizes read from the headers, which
// checkInputHeaders returns). Messages name the file, or the checkpoint and key a parameter is read
// from (sources.checkpoint). A run that holds one whole tensor at a time checks the headers first,
// then each tensor as it comes.
void checkInputs(const RunConfig& config, const InputMap& inputs, const SizeSources& sources = {});
RunConfig checkInputHeaders(const RunConfig& config, const HeaderMap& inputs, const SizeSources& sources = {});
void checkInputValues(const RunConfig& sized, const std::string& name, const StoredTensor& tensor,
                      const SizeSources& sources = {});
// checkInputValues on the tensors an InputSink takes, a piece at a time, before handing each piece
// on to `next`: the same checks and messages (a tensor's count of non-finite values at its end), of
// the pieces `next` wants (a process of several checks what its ranks read; tpsim run then agrees
// on the first failure among them, agreeToRun).
// Each tensor's header must be the one its sizes in `sized` give (a file may change after its
// header sized the run).
class CheckedInputs : public InputSink {
 public:
  CheckedInputs(const RunConfig& sized, const SizeSources& sources, InputSink& next)
      : sized_(sized), sources_(sources), next_(next) {}
  void begin(const std::string& name, const TensorHeader& header) override;
  bool wants(std::int64_t offset, std::int64_t count) const override { return next_.wants(offset, count); }
  void piece(std::int64_t offset, std::int64_t count, const char* bytes) override;
  void end() override;

 private:
  RunConfig sized_;
  SizeSources sources_;
  InputSink& next_;
  std::string name_;
  DType dtype_ = DType::kFloat32;
  std::int64_t idRange_ = 0;  // the ids' range; 0 for values
  std::string idSymbol_;
  std::int64_t nonFinite_ = 0, firstNonFinite_ = -1;
};

}  // namespace tpsim::tools
