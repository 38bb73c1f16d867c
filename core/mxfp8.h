// The weight operand of a linear's GEMMs, natively stored or as MXFP8 (OCP microscaling).
//
// Transformer Engine's "mxfp8" recipe with fp8 params keeps a weight W (N, K) as E4M3 data with one
// E8M0 scale per block of 32 elements along the GEMM's reduction dim: rowwise blocks (along K) for
// fprop y = x·Wᵀ, columnwise blocks (along N) for dgrad dX = dY·W. gemmWeight is the one place the
// linear functions get that operand. It is not an fp8 GEMM: the simulator dequantizes the weight to
// the compute dtype and multiplies in it, which gives the values an fp8 tensor-core GEMM multiplies;
// the activations and the wgrad stay in high precision.
#pragma once

#include <cstdint>
#include <string>

#include "backends/compute.h"
#include "core/parameter.h"

namespace tpsim {

enum class WeightFormat : std::uint8_t { kNative, kMxfp8 };
const char* weightFormatName(WeightFormat format);    // "native", "mxfp8"
WeightFormat parseWeightFormat(const std::string& name);  // inverse of weightFormatName; throws InvalidArgument

// Which GEMM reads the weight, hence the block direction of its MXFP8 copy.
enum class GemmUse : std::uint8_t {
  kFprop,  // y = x·Wᵀ reduces over K: rowwise blocks, scales (N, ceil(K/32))
  kDgrad,  // dX = dY·W reduces over N: columnwise blocks, scales (ceil(N/32), K)
};

inline constexpr std::int64_t kMxfp8BlockSize = 32;

// What a GEMM multiplies by: `weight` views `storage` (the gathered or dequantized copy, dropped
// with this object) or, for a native weight that is not a GTP_remat shard, the parameter itself.
struct GemmWeight {
  SharedTensor storage;  // what weight points into, when not the parameter itself
  ConstView weight;  // (dLog, K): the TP-local logical weight, pad rows stripped
};

// kNative: materialize(compute, weight) for a GTP_remat shard (SPEC 4.4), weight.data otherwise;
// computeDtype is not used (the GEMM checks the dtypes). kMxfp8: Q_use(W) dequantized to
// computeDtype, rounded once. For a GTP_remat shard every rank quantizes its own shard (S, K) and
// the group all-gathers the E4M3 data and E8M0 scales in GTP-rank order (half the wire bytes of
// bf16), then dequantizes the first dLog rows. The pad rows are zero and S is a multiple of 32, so
// no columnwise block straddles two shards, and no block's amax changes: the result is bitwise the
// quantization of the unpadded TP-local weight, and GTP_remat on and off agree.
GemmWeight gemmWeight(Compute& compute, const Parameter& weight, WeightFormat format, GemmUse use,
                      DType computeDtype);

// What a checkpoint saves of an MXFP8 weight (SPEC 4.11.1): this rank's own data (a GTP_remat
// shard is not gathered) quantized rowwise, the copy the fp8 parameter holds, dequantized to bf16.
// Same shape as weight.data; rowwise blocks never cross rows, so a shard's rows are those of the
// whole weight's quantization.
Tensor mxfp8CheckpointValue(Compute& compute, const Parameter& weight);

// A layer's construction-time check: an MXFP8 weight sharded by GTP_remat (gtpSize > 1) needs
// pad_for_alignment to be a positive multiple of 32, so that every shard holds whole columnwise
// blocks (the recipe's a = 32, SPEC 4.2).
void checkMxfp8Alignment(WeightFormat format, int gtpSize, int padForAlignment, const char* where);

}  // namespace tpsim
