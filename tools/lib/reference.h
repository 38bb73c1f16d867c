// The unsharded computation in double precision: what every sharded run is checked against.
//
// One dense forward and backward per layer kind, on the same (already dtype-rounded) inputs the
// sharded run received, plus an error bound per element: |sharded - dense| <= bound. The bound
// is first-order: ((reduction length + 2) · u_acc + Σ storage roundings, each u of the dtype it
// rounds into) · magnitude, where the magnitude is the same computation on absolute values
// (|X|·|W|ᵀ + |b|, ...; its products in float or bf16, rounded so that they only err upwards:
// magnitudeProduct), plus an allowance for gradual underflow ((T + 3)·δ·(1 + 1.13·S), δ half the
// smallest subnormal, S the largest ℓ1 norm of an input; it matters for fp16 only). A weight
// gradient rounds into the dtype it lands in (wgradDtype: main_grad's under fusion, the wire
// dtype under GTP_remat). It is a tool's tolerance, derived from the data, not a proof;
// docs/bounds.md gives it per layer kind, with the tests that pin it and show how tight it is.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/mxfp8.h"
#include "core/placement.h"
#include "tools/lib/host_tensor.h"

namespace tpsim::tools {

class LayerKind;  // tools/lib/layer_kind.h

struct Checked {
  HostTensor value;  // the dense result
  std::vector<double> bound;
};

// A part of a reference that splits: in a world spread over processes, each process computes the
// blocks of the split dimension (the MLP's F, a column's N, a row's K) that its ranks hold, with
// that dimension's rows of the weights only, and checks the results of those rows where they are
// (docs/distributed.md, "Verification"). The parts run at once; each sums its own blocks over the
// split dimension, and the first part (rows [0, ...)) adds the others' sums to its own, in part
// order, and alone sends those results: their values differ from one process's in the last bits of
// a double.
struct ReferencePart {
  int index = 0, count = 1;
  std::int64_t begin = 0, end = 0;  // the rows of the split dimension this part computes
  std::int64_t whole = 0;           // the split dimension's size
  // The inputs this part holds only the rows of, each with the dimension it cuts (the weights'
  // blocks; the other inputs it holds whole).
  std::map<std::string, int> split;
  // Every part's `mine`, in part order, to every part (each calls it at the same points): the whole
  // weights' largest magnitudes and the inputs' ℓ1 norms, summed in part order.
  std::function<std::vector<double>(const std::vector<double>& mine)> allGather;
  // A part's sums over the split dimension, one vector at a time, from the others to the first.
  std::function<void(const std::vector<double>& sums)> send;
  std::function<void(int from, std::vector<double>& sums)> receive;
};

struct ReferenceOptions {
  const LayerKind* layer = nullptr;  // whose reference: LayerKind::reference
  // The layer's placements (LayerModules::placements). A reference that needs what each TP rank
  // holds (MXFP8's per-rank quantization, disable_grad_reduce's per-rank partial sums) reads it here.
  std::vector<TensorPlacement> placements;
  bool reduceScatterEmbeddings = false;  // output and grad_output are (s, b, h)
  int tp = 1;                            // number of partial sums a reduction adds
  DType computeDtype = DType::kFloat32;  // the activations' dtype
  DType outputDtype = DType::kFloat32;
  // The dtype a weight gradient is rounded into where its sum ends (LayerKind::wgradDtype): the
  // compute dtype, main_grad's under gradient-accumulation fusion, the wire dtype under GTP_remat.
  DType wgradDtype = DType::kFloat32;
  // GTP_remat: a weight gradient also goes through a reduce-scatter in its wire dtype (up to G
  // roundings: G − 1 partial sums and MEAN's 1/G pre-scale).
  int gtpRemat = 1;
  DType gtpWireDtype = DType::kFloat32;
  // MXFP8 weights: outputs use each linear's rowwise copy, input gradients its columnwise copy
  // (mxfp8Weight); weight gradients are unchanged.
  WeightFormat weightFormat = WeightFormat::kNative;
  // u_acc: the relative error of one step of a GEMM's fp32 accumulation (tools/lib/backend.h).
  double accumulationUnit = 0x1p-24;
  // Column with disable_grad_reduce: input.grad is each TP rank's own partial dY_t·W_t (its output
  // rows, as the weight's placement gives them), stacked (T, …, K), with no reduction among them.
  bool disableGradReduce = false;
  // The references that take their weights a block at a time (a multiple of 256 of F or of the
  // weight's rows) make blocks of about this many elements: the MLP of each (tokens, F)
  // intermediate, a linear of its weight. With it the MLP's values change only by double rounding
  // and its bounds by their float rounding; a linear's results change no bit.
  std::int64_t blockElements = std::int64_t(1) << 21;
  // The part this reference computes (LayerKind::partResults says which kinds split); null: all.
  const ReferencePart* part = nullptr;
};

// A rectangle of one result's reference, the result seen as a (numel / last dim, last dim) matrix:
// rows [row, row + rows) and columns [col, col + cols), the values and bounds row-major with leading
// dimension ld. A sink may change them in place: they are the sender's scratch.
struct ReferenceBlock {
  std::int64_t row = 0, col = 0, rows = 0, cols = 0, ld = 0;
  double* value = nullptr;
  double* bound = nullptr;
};

// Takes a reference block by block, so that no result need be held whole: the MLP's weight
// gradients arrive a block of F at a time. Every result is announced before its blocks; blocks of
// different results may interleave, and each element arrives exactly once.
class ReferenceSink {
 public:
  virtual ~ReferenceSink() = default;
  virtual void result(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype) = 0;
  virtual void block(const std::string& name, const ReferenceBlock& block) = 0;
};

// Sends each of `results` whole, as one block (which the sink may change): announced first, or
// (sendBlocks) announced already.
void sendWhole(std::map<std::string, Checked>& results, ReferenceSink& sink);
void sendBlocks(std::map<std::string, Checked>& results, ReferenceSink& sink);

// The layer kind's reference (options.layer), with what every kind shares added to its bounds:
// gradual underflow, the GTP_remat reduce-scatter's on weight gradients included. The streamed form
// holds at most the kind's own working set; the dense one collects every result whole.
void streamReference(const ReferenceOptions& options, const InputMap& inputs, ReferenceSink& sink);
std::map<std::string, Checked> denseReference(const ReferenceOptions& options, const InputMap& inputs);

// The kinds' references, as their descriptors name them. linearReference: one linear layer
// (input, weight, bias, grad_output; with MXFP8 weights or disable_grad_reduce the placement of
// "weight"); embeddingReference: the lookup (ids input, weight, grad_output); mlpReference: fc1,
// exact GeLU, fc2 (with MXFP8 weights the placements of "fc1.weight" and "fc2.weight").
// linearReference and embeddingReference send their weight gradients a block of rows at a time,
// mlpReference its weight gradients a block of F at a time (ReferenceOptions::blockElements).
void linearReference(const ReferenceOptions& options, const InputMap& inputs, ReferenceSink& sink);
// The rows in each block of an (n, k) matrix that a reference takes a block of rows at a time: a
// multiple of 256, about blockElements elements, all n where that is fewer. A linear's and the
// embedding's weight (n, k), the MLP's F of its (tokens, F) intermediates (n = F, k = tokens).
std::int64_t blockRows(const ReferenceOptions& options, std::int64_t n, std::int64_t k);
void embeddingReference(const ReferenceOptions& options, const InputMap& inputs, ReferenceSink& sink);
void mlpReference(const ReferenceOptions& options, const InputMap& inputs, ReferenceSink& sink);
// The experts' grouped linear: token i (input, grad_output rows) goes through expert
// expert_ids[i]'s weight<e> and bias<e>, one expert at a time, each expert's weight gradient sent a
// block of rows at a time as linearReference sends it; output and input.grad are sent whole. A part
// (options.part) takes every expert's rows or columns that it holds, as linearReference its one.
void groupedReference(const ReferenceOptions& options, const InputMap& inputs, std::int64_t experts,
                      ReferenceSink& sink);

// deq(Q(w)) of an MXFP8 weight as the ranks quantize it: w (N, K) unsharded, cut over the TP ranks
// as `placement` says, each rank's TP-local weight quantized on its own with blocks of 32 along
// `axis` (1: rowwise for fprop, 0: columnwise for dgrad), the values rounded to `dtype`. GTP_remat
// shards quantize to the same values (core/mxfp8.h). The scale rule is compute.h's quantizeMxfp8.
HostTensor mxfp8Weight(const HostTensor& w, const TensorPlacement& placement, int axis, DType dtype);

// The arithmetic of the bounds' magnitude products: float, or (where the core has AVX512-BF16,
// about twice as fast) bf16 operands rounded up, summed in float (sim::upperGemmBf16).
enum class MagnitudeGemm { kFloat, kBf16 };
MagnitudeGemm bestMagnitudeGemm();

// Σ_k a_ik·b_kj for nonnegative a: (M, K) and b: (K, N), row-major, as the bounds compute their
// magnitudes (the same computation on |values|): never below the exact product nor below the
// product computed in double, at most about (2K + 6)·2^-24 relative above in float, and (1 +
// 2^-7)^2 times that in bf16 (each operand rounded up to 8 significant bits).
std::vector<double> magnitudeProduct(const std::vector<double>& a, const std::vector<double>& b, std::int64_t m,
                                     std::int64_t k, std::int64_t n, MagnitudeGemm gemm = bestMagnitudeGemm());

// Exact (erf) GeLU and its derivative, in double.
double gelu(double x);
double geluGrad(double x);

}  // namespace tpsim::tools
