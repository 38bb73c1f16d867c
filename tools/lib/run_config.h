// RunConfig: one `tpsim run` (or demo, or layout) as its flags describe it, and the one place that
// turns it into text: the configuration line a command prints, the layout's header line, and the
// command line that replays it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backends/dtype.h"
#include "backends/fault.h"
#include "core/config.h"

namespace tpsim::tools {

class LayerKind;  // tools/lib/layer_kind.h

// The most --threads a command takes: worker and GEMM threads beyond the ranks and cores only wait.
inline constexpr int kMaxThreads = 1024;

struct RunConfig {
  RunConfig();

  const LayerKind* layer;  // column unless set: layerKind("row"), ...
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
  // Shapes of generated data (ignored for tensors loaded from files); which of them a layer reads
  // is its kind's (LayerKind::sizes).
  std::int64_t seq = 8, batch = 2, inFeatures = 16, outFeatures = 16, ffnHidden = 64, vocab = 32;
  std::int64_t tokens = 16, experts = 4;  // routed tokens and local experts of the grouped layers

  // Throws InvalidArgument naming the flag for combinations Megatron rejects or cannot express,
  // and for values out of range.
  void validate() const;
  // The effective configuration, one line: "layer=column tp=4 dtype=bf16 sequence-parallel bias seed=1234".
  std::string str() const;
};

// The flags of c's layer kind that mean something else for it: --sequence-parallel on the
// embedding is Megatron's reduce_scatter_embeddings.
void applyLayerConventions(RunConfig& config);

// `tpsim layout`'s header: the layer, topology, options that change a placement, and the shape flags.
std::string layoutLine(const RunConfig& config);

// The shape flags of c's layer in order, as (flag, value): LayerKind::sizes.
std::vector<std::pair<std::string, std::int64_t>> shapeFlags(const RunConfig& config);

// The `tpsim run` command line that runs `config`: "tpsim run --layer row --tp 4 ... --seed 7".
// With loadDir, it ends in "--load <loadDir>" (quoted for a POSIX shell when needed) and leaves out
// the shape flags, which --load ignores; without it, it lists the shape flags of config's layer.
std::string commandLine(const RunConfig& config, const std::string& loadDir = "");

// Megatron's ModelParallelConfig for the layers of `config`'s run (initialization off: the run
// copies its tensors in).
ModelParallelConfig layerConfig(const RunConfig& config);

// Throws InvalidArgument naming the flag when `config` cannot be checkpointed: --stride > 1 or
// --weight-format mxfp8.
void checkCheckpointable(const RunConfig& config);

}  // namespace tpsim::tools
