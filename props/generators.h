// rapidcheck generators for the property suite: layer cases (every layer kind and option `tpsim run`
// offers, with awkward shapes), the data they run on in exact and real mode, process-group
// topologies of up to 64 ranks, and invalid configurations paired with the text their error must
// contain. Every generator shrinks towards the smallest, most ordinary case (T = 1 or 2, fp32, no
// options, extent 1, GTP_remat off). Generators only describe cases: running them is the properties'
// job. GTP_remat (G > 1) is drawn only where a caller asks for it (GtpMode, genTopology's withGtp).
#pragma once

#include <rapidcheck.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "core/rank_grid.h"
#include "tools/lib/layer_kind.h"
#include "tools/lib/runner.h"

namespace tpsim::props {

using tools::GtpWeightSpec;
using tools::LayerKind;
using tools::layerKind;
using tools::LayerOption;
using tools::RunConfig;
using tools::ShapeMap;
using tools::SizeSpec;
using tools::TensorMap;
using tools::TensorSpec;

// One of `elements`, uniformly whatever rapidcheck's size, shrinking towards the first one
// (rapidcheck's gen::element and gen::weightedElement do not shrink). Repeat an element to weight it.
template <typename T>
rc::Gen<T> pick(std::vector<T> elements) {
  return [elements](const rc::Random& random, int /*size*/) {
    const std::size_t i = std::size_t(rc::Random(random).next() % elements.size());
    return rc::shrinkable::map(
        rc::shrinkable::shrinkRecur(i, [](std::size_t x) { return rc::shrink::towards<std::size_t>(x, 0); }),
        [elements](std::size_t x) { return elements[x]; });
  };
}
// An integer in [low, high), uniformly whatever rapidcheck's size, shrinking towards low.
// (gen::inRange scales its range with the size: at size 0 it always gives low.)
template <typename T>
rc::Gen<T> uniform(T low, T high) {
  return [low, high](const rc::Random& random, int /*size*/) {
    const T v = T(low + T(rc::Random(random).next() % std::uint64_t(high - low)));
    return rc::shrinkable::shrinkRecur(v, [low](T x) { return rc::shrink::towards<T>(x, low); });
  };
}
// A seed for seeded data, uniform over [0, 2^30).
inline rc::Gen<std::uint64_t> genSeed() { return uniform<std::uint64_t>(0, std::uint64_t(1) << 30); }

// false or true, shrinking towards false.
inline rc::Gen<bool> flag() { return pick<bool>({false, true}); }
// 0, 1, ..., n − 1, uniformly, shrinking towards 0.
rc::Gen<int> pickIndex(int n);

// `count` integers in [-amplitude, amplitude] from a seeded engine: bulk data for rank code whose
// exact values do not need shrinking (the properties draw the seed).
std::vector<double> seededIntegers(std::uint64_t seed, std::int64_t count, int amplitude);

// ---- Layer cases --------------------------------------------------------------------------------

// How a case's data are drawn. kExact: small integers, sized so that every product and every
// partial sum of every GEMM, reduction and collective is an integer the dtype holds exactly, so
// results are bitwise predictable. kReal: normal draws (tools::generateInputs), checked against
// the float64 reference within its data-derived bound.
enum class Numerics { kExact, kReal };
const char* numericsName(Numerics numerics);

// T for layer cases: 1..8 (the primes 3, 5, 7 included) and 16; small ones most often.
rc::Gen<int> genTp();
// The same without T = 1, for what needs a real TP group (sequence parallelism).
rc::Gen<int> genTpAbove1();
rc::Gen<DType> genFloatDtype();  // fp32, bf16, fp16

// The kinds with an exact mode (LayerKind::exactOnSmallIntegers): every kind but the MLP block.
std::vector<const LayerKind*> exactKinds();

// Whether genRunConfig draws GTP_remat: kOff keeps G = 1; kSometimes turns it on in about one case
// in three; kAlways in every case (G >= 2).
enum class GtpMode { kOff, kSometimes, kAlways };

// A valid configuration of one of `kinds`: T, dtype, every option valid for the kind (sequence
// parallelism, bias, gather_output, input_is_parallel, skip_bias_add, stride, output_dtype,
// gradient-accumulation fusion and main_grad dtype, reduce_scatter_embeddings) and shapes that
// divide where the layer needs it (N by T·stride for column, K for row, s by T under SP, V and F
// by T) and are anything else elsewhere: 1, primes, powers of two. config.seed seeds real data.
// With GTP_remat (gtp): G in 2..8 (T·G <= 32), pad_for_alignment a in {16, 1, 32} and 0 when every
// GTP weight's TP-local dim 0 divides by G (half the cases scale those extents by G so that it
// does), MEAN or SUM, the fp32-accumulation reduce-scatter on or off, and the batch b = G·b0 split
// over the peers. numerics kExact keeps the GTP cases exact: MEAN (the 1/G pre-scale) only with G a
// power of two.
rc::Gen<RunConfig> genRunConfig(const std::vector<const LayerKind*>& kinds, rc::Gen<int> tp = genTp(),
                                GtpMode gtp = GtpMode::kOff, Numerics numerics = Numerics::kReal);

// `base` with GTP_remat drawn as genRunConfig draws it, G from `gtpSizes` (1 allowed: then only the
// flags and b = b0 change), capped so that T·G <= 32.
rc::Gen<RunConfig> genWithGtp(RunConfig base, std::vector<int> gtpSizes, Numerics numerics = Numerics::kReal);

// The TP-local dim 0 (Dlog, SPEC 4.2) of each weight `config` shards over GTP_remat: column N/T,
// row N, embedding V/T, mlp F/T (fc1) and h (fc2).
std::vector<std::int64_t> gtpDims(const RunConfig& config);
// "GTP_remat G=4 a=16 MEAN: weight Dlog=6 -> S=16 rows per peer, pad 58; each peer takes b/G = 2 of
// the b = 8 samples", or "" when G = 1: what a failing GTP case prints besides its configuration.
std::string gtpSummary(const RunConfig& config);

// The largest |integer| an exact case's tensors may hold: every GEMM output element is a sum of at
// most L = max(K, N, s·b) + 1 products (bias included) and every reduction sums at most that many
// terms, so amplitude a with L·a² <= exactLimit keeps every partial sum exact.
int exactAmplitude(const RunConfig& config);
// The largest integer n such that all integers in [-n, n] are exact in `dtype` (256 for bf16, 2048
// for fp16, 2^24 for fp32); for a case, the smallest over its dtype, output_dtype and main_grad
// dtype.
std::int64_t exactLimit(DType dtype);
std::int64_t exactLimit(const RunConfig& config);

// Small-integer inputs for `config` (not mlp: GeLU has no exact mode), named and shaped as
// tools::generateInputs names them; ids of the embedding cover the whole vocabulary range.
rc::Gen<TensorMap> genExactInputs(const RunConfig& config);
// The same with a given amplitude (|value| <= amplitude): for data that will be repeated, e.g. on
// every GTP_remat peer, and must stay exact in the larger run.
rc::Gen<TensorMap> genExactInputs(const RunConfig& config, int amplitude);
// Real-valued inputs: tools::generateInputs(config), i.e. seeded by config.seed.
TensorMap realInputs(const RunConfig& config);

// Shapes of a config in one line: "s=8 b=2 K=16 N=16".
std::string shapesOf(const RunConfig& config);

// ---- Topologies -----------------------------------------------------------------------------

// A dense grid (T, G, C, P, D) and the expert grid over the same world (ET, E, EG; ED follows),
// with world = T·G·C·P·D <= maxWorld, in a random user order of tp, cp, ep and dp with pp last (the
// two grids must agree on the pipeline groups; ParallelLayout inserts gtp_remat). G and EG stay 1
// unless withGtp, which draws G in 1..4 and EG among what the expert grid leaves. Without GTP_remat
// the distributed optimizer may have several instances (a common divisor of D·C and ED).
struct Topology {
  int tp = 1, cp = 1, pp = 1, dp = 1, gtp = 1;
  int expertTp = 1, ep = 1, expertGtp = 1;
  int distOptInstances = 1;
  std::string order = "tp-cp-ep-dp-pp";
  int world() const { return tp * gtp * cp * pp * dp; }
};
rc::Gen<Topology> genTopology(int maxWorld = 64, bool withGtp = false);
ParallelSizes sizesOf(const Topology& topology);

// ---- Invalid configurations -----------------------------------------------------------------

// A `tpsim run` configuration with exactly one thing wrong, and the text the InvalidArgument
// from RunConfig::validate must contain (the flag it names).
struct InvalidRunConfig {
  RunConfig config;
  std::string expected;
};
rc::Gen<InvalidRunConfig> genInvalidRunConfig();

// A valid configuration with inputs whose shapes or ids are wrong in exactly one way, and the
// text the InvalidArgument from tools::runSharded must contain (the file and the flag).
struct InvalidRunInputs {
  RunConfig config;
  TensorMap inputs;
  std::string expected;
};
rc::Gen<InvalidRunInputs> genInvalidRunInputs();

// rapidcheck prints generated values through these (found by argument-dependent lookup).
void showValue(const Topology& topology, std::ostream& os);
void showValue(const InvalidRunConfig& invalid, std::ostream& os);
void showValue(const InvalidRunInputs& invalid, std::ostream& os);

}  // namespace tpsim::props

// rapidcheck's showValue lookup also needs these in the types' own namespaces.
namespace tpsim::tools {
void showValue(const RunConfig& config, std::ostream& os);
void showValue(const TensorMap& tensors, std::ostream& os);
}  // namespace tpsim::tools
namespace tpsim {
void showValue(DType dtype, std::ostream& os);
}  // namespace tpsim
