// Weight initialization of the tensor-parallel layers (SPEC 3.10, 3.11): Megatron's
// _initialize_affine_weight_gpu and _initialize_affine_weight_cpu.
//
// Values are drawn in fp32 on the host from an explicit generator (a tracker fork, or the caller's
// CPU generator) and reach the weight through Compute::upload/copy with one rounding into its
// dtype. Nothing here communicates and there is no global state: the TP rank and size of the CPU
// path are arguments, and a GTP shard's group comes from its own attributes.
#pragma once

#include <cstdint>
#include <optional>

#include "backends/compute.h"
#include "backends/dtype.h"
#include "backends/tensor.h"
#include "core/parameter.h"
#include "core/random.h"

namespace tpsim {

// SPEC 3.10. Tags `weight` with setTensorModelParallelAttributes(true, partitionDim, stride), then
// fills the LOCAL shard (its own shape, row-major) with initMethod inside a fork of
// "model-parallel-rng" ("expert-parallel-rng" when isExpert). The shard is an independent draw
// from this rank's stream, not a slice of a master: `stride` is only recorded. Ranks whose trackers
// hold the same state for that name get bitwise-equal weights (SPEC 6 item 6). Throws
// InvalidArgument if the attributes are already present or the tracker lacks the name; on error
// the weight and the tracker are unchanged.
void initializeAffineWeightGpu(Compute& compute, Parameter& weight, const InitMethod& initMethod,
                               int partitionDim, int stride, bool isExpert, RngTracker& tracker);

// SPEC 3.11. Builds the full master M (outputSize, inputSize) in fp32 with initMethod drawing from
// cpuGenerator (never a tracker), casts it to paramsDtype, cuts it along partitionDim into chunks
// of c = perPartitionSize / stride, and keeps chunks rank, rank + worldSize, rank + 2·worldSize, …
// concatenated along partitionDim: the TP-local chunk X. Unless skipSetTensorParallelAttributes,
// tags `weight` as initializeAffineWeightGpu does.
//
// A GTP shard (attrs.isGtpWeightRemat true; group (size G, rank g) and padLength from its attrs)
// receives rows [g·S, (g+1)·S) of X zero-padded by padLength rows at the tail of dim 0, where
// S = weight rows, whatever partitionDim is. A shard already carries the TP attributes, so the
// caller must pass skipSetTensorParallelAttributes = true.
//
// rank and worldSize must be given together (SPEC 8 item 6). There is no global TP group to
// default to, so they may be omitted only when one partition spans the whole partitionDim
// (perPartitionSize == its size), which means rank 0 of 1.
//
// Returns M in paramsDtype when returnMasterWeight, else an undefined Tensor. Throws
// InvalidArgument on any bad argument, before touching the weight or drawing.
Tensor initializeAffineWeightCpu(Compute& compute, Parameter& weight, std::int64_t outputSize,
                                 std::int64_t inputSize, std::int64_t perPartitionSize, int partitionDim,
                                 const InitMethod& initMethod, Generator& cpuGenerator, int stride = 1,
                                 bool returnMasterWeight = false, DType paramsDtype = DType::kFloat32,
                                 std::optional<int> rank = std::nullopt,
                                 std::optional<int> worldSize = std::nullopt,
                                 bool skipSetTensorParallelAttributes = false);

}  // namespace tpsim
